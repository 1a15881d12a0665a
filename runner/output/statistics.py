"""statistics.json: the figures of a run, from its run view.

`build_statistics` turns a run view into statistics.json (the original's keys first, then ours),
which report.html embeds, so the two always show the same counts; `statistics_of` does it for a
view read outside a run, with the settings config.json records.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Any

from runner.storage.records import SCHEMA_VERSION
from runner.storage.runfiles import ConfigFile, Invocation, StatisticsFile, read_config, read_statistics
from runner.storage.runview import TOKEN_KEYS, RunView, parse_time
from runner.timestamps import iso_of, now_iso


def tool_statistics(tool_stats: dict[str, dict[str, int]]) -> dict[str, dict]:
    out = {}
    for name in sorted(tool_stats):
        s = tool_stats[name]
        answered = s["success"] + s["failure"]
        out[name] = {
            **s,
            "success_rate": round(s["success"] / answered * 100, 2) if answered else 0.0,
            "failure_rate": round(s["failure"] / answered * 100, 2) if answered else 0.0,
        }
    return out


def run_time(invocations: list[Invocation], view: RunView, current_run_id: str | None = None) -> dict:
    """Time the run spent running, over every invocation: each invocation's recorded start to its
    recorded end; one that never recorded its end (it was killed) ends at its last committed line;
    the current one ends now. Runs older than the invocations list fall back on line timestamps."""
    now = datetime.now().timestamp()
    spans = []
    for item in invocations:
        start = parse_time(item.started_at)
        if start is None:
            continue
        end = parse_time(item.ended_at)
        if item.run_id == current_run_id:
            end = now
        elif end is None:
            last = view.spans.get(item.run_id)
            end = max(start, last[1]) if last else start
        spans.append((start, end))
    known = {item.run_id for item in invocations}
    spans += [(s, e) for run_id, (s, e, _n) in view.spans.items() if run_id not in known]
    if not spans:
        return {"running_seconds": 0.0, "first_started_at": None, "last_ended_at": None, "invocations": 0}
    return {
        "running_seconds": round(sum(e - s for s, e in spans), 2),
        "first_started_at": iso_of(min(s for s, _ in spans), "seconds"),
        "last_ended_at": iso_of(max(e for _, e in spans), "seconds"),
        "invocations": len(spans),
    }


def build_statistics(view: RunView, *, run_name: str, distribution: str, total_prompts: int, batch_size: int,
                     model: str, run_time: dict, rows_this_run: int, fingerprint: str,
                     samples_per_prompt: int = 1) -> dict:
    """statistics.json: the original's keys first (tool and reasoning figures over the kept rows,
    as it counts them), then ours. Every count comes from the view; report.html embeds this dict."""
    counts = view.counts()
    spend = {name: bucket.as_dict() for name, bucket in view.spend.items()}
    total = view.total_spend().as_dict()
    stats = {
        "run_name": run_name,
        "distribution": distribution,
        "total_prompts": total_prompts,
        "total_batches": len(view.files),
        "batch_size": batch_size,
        "model": model,
        "completed_at": now_iso(),
        "duration_seconds": run_time["running_seconds"],
        "tool_statistics": tool_statistics(view.kept.tool_stats),
        "reasoning_statistics": view.kept.reasoning,
        "discarded_no_reasoning": counts["outcomes"]["discarded"],
        "schema_version": SCHEMA_VERSION,
        "outcomes": counts["outcomes"],
        "failed_by_class": counts["failed_by_class"],
        "retried_rows": counts["retried_rows"],
        # Spend of every committed attempt (kept, discarded, failed), all invocations.
        "tokens": {k: total[k] for k in TOKEN_KEYS},
        "cost": total["cost"],  # null: unknown (an endpoint reported no cost), never a guessed 0
        "cache_hit_ratio": total["cache_hit_ratio"],  # cached / prompt tokens
        "requests": total["requests"],
        "retries": total["retries"],
        "api_calls": view.kept.api_calls,  # model calls in the kept trajectories (the rows' api_calls)
        "spend": {"all": total, **spend},
        # Not parts of "spend" (they overlap it): spend by model (the run's and the tools' models),
        # and the part of "failed" spent on attempts whose row a later attempt finished.
        "spend_by_model": view.cost.models() if view.cost is not None else {},
        "spend_retried": view.cost.retried(view.is_committed) if view.cost is not None else None,
        "run_time": run_time,
        "rows_this_run": rows_this_run,
        "stale_rows": len(view.stale),
        "unreadable_lines": view.unreadable,
        "fingerprint": fingerprint,
    }
    if samples_per_prompt > 1:
        stats["samples_per_prompt"] = samples_per_prompt
    if counts["outcomes"]["discarded"]:
        # What the discarded rows did (the figures above are over the kept rows, as the original's)
        stats["discarded_statistics"] = {"rows": counts["outcomes"]["discarded"],
                                         "tool_statistics": tool_statistics(view.discarded_work.tool_stats),
                                         "reasoning_statistics": view.discarded_work.reasoning,
                                         "api_calls": view.discarded_work.api_calls}
    if view.scores.samples:
        stats["scoring"] = view.scores.as_dict(samples_per_prompt)
    return stats


def statistics_of(run_dir: Path, view: RunView) -> dict:
    """statistics.json for a view read outside a run (`--report`), with the settings config.json
    (or else the last statistics.json) names; rows_this_run stays the last invocation's."""
    config_file = read_config(run_dir) or ConfigFile()
    config = config_file.config
    saved = read_statistics(run_dir) or StatisticsFile()
    dataset = view.dataset
    stats = build_statistics(
        view, run_name=str(config.get("run_name") or saved.run_name or run_dir.name),
        distribution=str(config.get("distribution") or saved.distribution or ""),
        total_prompts=len(dataset) if dataset is not None else len(view.rows),
        batch_size=_int(config.get("batch_size") or saved.batch_size),
        model=str(config.get("model") or saved.model or ""),
        run_time=run_time(config_file.invocations, view),
        rows_this_run=_int(saved.rows_this_run), fingerprint=config_file.fingerprint,
        samples_per_prompt=_int(config.get("samples_per_prompt")) or 1,
    )
    if saved.outcome is not None:  # nothing ran: the last invocation's outcome stands
        stats["outcome"] = saved.outcome
    if dataset is None:
        stats["total_prompts"] = None
        stats["outcomes"]["not_run"] = None
    return stats


def dataset_of(config: dict) -> tuple[dict[str, int] | None, dict[str, str]]:
    """The rows of the dataset config.json names, as it is now (None, {} when it cannot be read)."""
    from runner.input.dataset import DatasetError, scan_dataset
    from runner.input.samples import sample_ids, sample_units

    name = config.get("dataset_file")
    if not isinstance(name, str) or not Path(name).is_file():
        return None, {}
    try:
        scan = scan_dataset(name, config.get("max_samples"))
    except (OSError, DatasetError):
        return None, {}
    samples = _int(config.get("samples_per_prompt")) or 1
    if samples == 1:
        return scan.key_to_index, scan.ids
    return sample_units(scan.key_to_index, samples), sample_ids(scan.ids, samples)


def _int(value: Any) -> int:
    try:
        return int(value or 0)
    except (TypeError, ValueError):
        return 0


