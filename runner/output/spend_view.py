"""The report's spend figures: over time, by outcome, by model, the cache hit ratio and the
forecast each invocation ended with.

The run view (runner/storage/runview.py) sums spend by what became of each line; it also hands each line
to a `SpendTally`, which adds what the view does not keep: spend by model (`usage.by_model`:
the run's model and the models tools call), the part of the failed attempts whose row a later
attempt finished ("retried"), and cumulative spend over time. `read_invocations` gives the
forecast each invocation ended with (status_history.jsonl).
"""

from __future__ import annotations

import bisect
from array import array
from datetime import datetime
from pathlib import Path

import orjson

from runner.storage.records import known_cost, model_entries

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
    cost = known_cost(usage)
    if cost is not None:
        bucket["cost"] += cost
    elif usage.get("requests"):
        bucket["unpriced_attempts"] += 1


def _merge(into: dict, other: dict) -> None:
    for key, value in other.items():
        into[key] += value


def _public(bucket: dict) -> dict:
    """Rounded; cost null (unknown) when any attempt had no known cost, as runner.storage.runview.Spend."""
    out = dict(bucket)
    out["cost"] = None if bucket["unpriced_attempts"] else round(bucket["cost"], 6)
    return out


class SpendTally:
    """Fed by the run view with the spend bucket it gave each line (kept, discarded, failed, other)."""

    def __init__(self) -> None:
        self.by_model: dict[str, dict] = {}
        self.failed_by_row: dict[str, dict] = {}  # row key -> spend of its failed lines, settled at the end
        self.times = array("d")  # commit time of each line with a known cost, and that cost
        self.costs = array("d")

    def add(self, bucket: str, row_key: str, timestamp: str | None, usage: dict) -> None:
        if bucket == "failed":
            _add(self.failed_by_row.setdefault(row_key, _bucket()), usage)
        for entry in model_entries(usage):  # attempts here: committed lines that used the model
            _add(self.by_model.setdefault(str(entry["model"]), _bucket()), entry)
        cost = known_cost(usage)
        if cost is not None and timestamp:
            try:
                when = datetime.fromisoformat(timestamp).timestamp()
            except ValueError:
                return
            self.times.append(when)
            self.costs.append(float(cost))

    def retried(self, finished) -> dict:
        """Spend of the failed attempts whose row a later attempt finished (`finished(key)`)."""
        total = _bucket()
        for key, bucket in self.failed_by_row.items():
            if finished(key):
                _merge(total, bucket)
        return _public(total)

    def models(self) -> dict:
        return {model: _public(entry) for model, entry in sorted(self.by_model.items())}

    def curve(self) -> dict | None:
        """Cumulative spend of the lines with a known cost, at up to TIME_POINTS even time steps."""
        if not self.times:
            return None
        start = min(self.times)
        return {"start": datetime.fromtimestamp(start).isoformat(timespec="seconds"), "start_epoch": start,
                "points": spend_curve(self.times, self.costs)}


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
