"""The report's spend figures: over time, by outcome, by model, the cache hit ratio and the
forecast each invocation ended with.

Fed one committed line at a time by the run view's reader (so the batch files are still read
once), then `summary()` turns the sums into the JSON the report draws. Every committed attempt
counts, kept or not: its line's spend goes to `kept`, `discarded`, `failed` (failed attempts of
rows that are still not done) or `retried` (failed attempts of rows a later attempt finished).
"""

from __future__ import annotations

import bisect
from array import array
from pathlib import Path

import orjson

OUTCOMES = ("kept", "discarded", "failed", "retried")
TIME_POINTS = 120  # points of the cumulative spend curve


def _bucket() -> dict:
    return {"attempts": 0, "requests": 0, "prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0,
            "cost": 0.0, "unpriced_attempts": 0}


def _add(bucket: dict, usage: dict) -> None:
    bucket["attempts"] += 1
    for key in ("requests", "prompt_tokens", "completion_tokens", "cached_tokens"):
        value = usage.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            bucket[key] += value
    cost = usage.get("cost")
    if isinstance(cost, (int, float)) and not isinstance(cost, bool):
        bucket["cost"] += cost
    elif usage.get("requests"):
        bucket["unpriced_attempts"] += 1


def _merge(into: dict, other: dict) -> None:
    for key, value in other.items():
        into[key] += value


def _public(bucket: dict) -> dict:
    """Rounded; cost null (unknown) when no attempt of the bucket had a known cost."""
    out = dict(bucket)
    priced = bucket["attempts"] - bucket["unpriced_attempts"]
    out["cost"] = None if bucket["unpriced_attempts"] and not priced else round(bucket["cost"], 6)
    return out


class SpendTally:
    def __init__(self) -> None:
        self.buckets = {name: _bucket() for name in ("kept", "discarded", "unsettled")}
        self.by_model: dict[str, dict] = {}
        self.failed_by_row: dict[str, dict] = {}  # row key -> spend of its failed lines, settled at the end
        self.times = array("d")  # commit time of each line with a known cost, and that cost
        self.costs = array("d")

    def add(self, row_key: str, outcome: str, timestamp: float | None, usage: dict) -> None:
        """One committed line: outcome is the line's own (ok / discarded / failed)."""
        if not isinstance(usage, dict):
            usage = {}
        if outcome == "failed":
            _add(self.failed_by_row.setdefault(row_key, _bucket()), usage)
        else:
            # an ok line that is not the row's winner (a duplicate) is rare; it counts as kept spend
            _add(self.buckets["kept" if outcome == "ok" else "discarded"], usage)
        for model, figures in (usage.get("by_model") or {}).items():
            if isinstance(figures, dict):  # attempts here: committed lines that used the model
                _add(self.by_model.setdefault(model, _bucket()), figures)
        cost = usage.get("cost")
        if timestamp is not None and isinstance(cost, (int, float)) and not isinstance(cost, bool):
            self.times.append(timestamp)
            self.costs.append(float(cost))

    def summary(self, finished, invocations: list[dict] | None = None) -> dict:
        """`finished(row_key)`: whether the row ended ok or discarded (its failed lines were retried)."""
        outcomes = {name: _bucket() for name in OUTCOMES}
        _merge(outcomes["kept"], self.buckets["kept"])
        _merge(outcomes["discarded"], self.buckets["discarded"])
        for key, bucket in self.failed_by_row.items():
            _merge(outcomes["retried" if finished(key) else "failed"], bucket)
        total = _bucket()
        for bucket in outcomes.values():
            _merge(total, bucket)
        prompt = total["prompt_tokens"]
        return {
            "total": _public(total),
            "by_outcome": {name: _public(bucket) for name, bucket in outcomes.items()},
            "by_model": {model: _public(entry) for model, entry in sorted(self.by_model.items())},
            "cache_hit_ratio": round(total["cached_tokens"] / prompt, 4) if prompt else None,
            "over_time": spend_curve(self.times, self.costs),
            "invocations": invocations or [],
        }


def spend_curve(times, costs, points: int = TIME_POINTS) -> list[list[float]]:
    """[[seconds since the first commit, cumulative USD], ...] at up to `points` even steps."""
    if not times:
        return []
    order = sorted(range(len(times)), key=times.__getitem__)
    sorted_times = [times[i] for i in order]
    cumulative, running = [], 0.0
    for i in order:
        running += costs[i]
        cumulative.append(running)
    start, end = sorted_times[0], sorted_times[-1]
    if end <= start:
        return [[0.0, round(cumulative[-1], 6)]]
    curve = []
    for step in range(points + 1):
        t = start + (end - start) * step / points
        position = bisect.bisect_right(sorted_times, t) - 1
        curve.append([round(t - start, 3), round(cumulative[position], 6)])
    return curve


def read_invocations(run_dir: Path) -> list[dict]:
    """The last status of each invocation (status_history.jsonl), reduced to what the report shows."""
    path = run_dir / "status_history.jsonl"
    out = []
    try:
        lines = path.read_bytes().splitlines()
    except OSError:
        return out
    for line in lines:
        try:
            status = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue  # a torn last line after a crash: the others still count
        if not isinstance(status, dict):
            continue
        spend = status.get("spend") or {}
        rows = status.get("rows") or {}
        forecast = status.get("forecast") or {}
        out.append({
            "started_at": status.get("started_at"),
            "ended_at": status.get("updated_at"),
            "state": status.get("state"),
            "rows_done": rows.get("done"),
            "rows_total": rows.get("total"),
            "spent_usd": spend.get("total_usd"),
            "this_invocation_usd": spend.get("this_invocation_usd"),
            "per_kept_row_usd": spend.get("per_kept_row_usd"),
            "forecast_total_usd": forecast.get("total_usd"),
            "forecast_low_usd": forecast.get("total_low_usd"),
            "forecast_high_usd": forecast.get("total_high_usd"),
            "max_cost_usd": (status.get("budget") or {}).get("max_cost_usd"),
        })
    return out
