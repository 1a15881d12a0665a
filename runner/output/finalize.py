"""The end of every run: trajectories.jsonl and statistics.json, from the run view.

Both are derived from the committed lines only (never from memory), so an interrupted, resumed
or already-finished run gets the same files. `merge_run` reads the batch files once into a
`RunView` (runner/storage/runview.py: the one rule that picks each row's winning line, the spend of every
line); trajectories.jsonl holds exactly one line per dataset row whose outcome is ok, ordered by
its current prompt_index, and is written atomically. Winning lines are copied as they are, unless
the dataset changed what the row carries besides its identity (its position, its id): those few
lines are re-serialised with the current values. `build_statistics` turns the same view into
statistics.json, which report.html embeds, so the two always show the same counts.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import orjson

from runner.storage.records import SCHEMA_VERSION
from runner.storage.runview import OK_RANK, TOKEN_KEYS, Detail, RunView, parse_time, read_run
from runner.storage.store import atomic_write_json, batch_files, keep_mode


def merge_run(run_dir: Path, key_to_index: Mapping[str, int], log=print, *, ids: Mapping[str, str] | None = None,
              detail: Detail | None = None, on_line=None) -> RunView:
    """Read the run into a view of the dataset `key_to_index` (with its current `ids`) and write
    trajectories.jsonl from it. `detail` and `on_line` are the report's hooks (see RunView)."""
    view = read_run(batch_files(run_dir), RunView(key_to_index, ids=ids, detail=detail, on_line=on_line, log=log))
    ok_rows = sorted(
        (*view.current(key), entry) for key, entry in view.rows.items() if entry.rank == OK_RANK
    )
    _write_trajectories(run_dir, view.files, ok_rows)
    return view


class RebuildError(ValueError):
    """`--report` cannot rebuild the run's outputs (its dataset cannot be read)."""


def rebuild_outputs(run_dir: Path, *, max_full_conversations: int, log=print) -> Path:
    """`--report`: the end of a run again, nothing run. trajectories.jsonl, statistics.json and
    report.html are rebuilt together from the batch files and the dataset config.json names, so
    they agree with each other and with the dataset as it is now. The caller holds the run lock."""
    from runner.output.report import dataset_of, report_details, run_config, statistics_of, write_report

    config = run_config(run_dir)[1]
    dataset, ids = dataset_of(config)
    if dataset is None:
        raise RebuildError(
            f"--report rebuilds the run's outputs against its dataset, and {config.get('dataset_file')!r} "
            f"(dataset_file in {run_dir / 'config.json'}) cannot be read; put it back and run --report again")
    view = merge_run(run_dir, dataset, log, ids=ids, detail=report_details())
    stats = write_statistics(run_dir, statistics_of(run_dir, view))
    return write_report(run_dir, max_full_conversations=max_full_conversations, view=view, statistics=stats, log=log)


def _write_trajectories(run_dir: Path, files: list[Path], ok_rows: list) -> None:
    target = run_dir / "trajectories.jsonl"
    fd, tmp = tempfile.mkstemp(prefix=".trajectories_", suffix=".tmp", dir=run_dir)
    handles = {}
    try:
        with os.fdopen(fd, "wb") as out:
            for index, row_id, winner in ok_rows:
                handle = handles.get(winner.file_no) or handles.setdefault(winner.file_no, open(files[winner.file_no], "rb"))
                handle.seek(winner.offset)
                line = handle.read(winner.length)
                if winner.prompt_index != index or winner.row_id != row_id:
                    # The dataset was edited: the row keeps its identity but gets its current
                    # position and id (a row appended or moved, an id changed alone).
                    record = orjson.loads(line)
                    record["prompt_index"] = index
                    record["metadata"]["id"] = row_id
                    line = orjson.dumps(record) + b"\n"
                out.write(line)  # committed lines were serialised by the store: copy them as they are
            out.flush()
            os.fsync(out.fileno())
        keep_mode(tmp, target)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    finally:
        for handle in handles.values():
            handle.close()


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


def record_invocation_end(run_dir: Path, run_id: str) -> list[dict]:
    """Stamp the end of this invocation in config.json; returns every invocation recorded there."""
    path = run_dir / "config.json"
    try:
        saved = orjson.loads(path.read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return []
    invocations = saved.get("invocations") if isinstance(saved, dict) else None
    if not isinstance(invocations, list):
        return []
    for item in invocations:
        if isinstance(item, dict) and item.get("run_id") == run_id:
            item["ended_at"] = datetime.now().isoformat()
    atomic_write_json(path, saved)
    return [item for item in invocations if isinstance(item, dict)]


def run_time(invocations: list[dict], view: RunView, current_run_id: str | None = None) -> dict:
    """Time the run spent running, over every invocation: each invocation's recorded start to its
    recorded end; one that never recorded its end (it was killed) ends at its last committed line;
    the current one ends now. Runs older than the invocations list fall back on line timestamps."""
    now = datetime.now().timestamp()
    spans = []
    for item in invocations:
        start = parse_time(item.get("started_at"))
        if start is None:
            continue
        end = parse_time(item.get("ended_at"))
        if item.get("run_id") == current_run_id:
            end = now
        elif end is None:
            last = view.spans.get(item.get("run_id"))
            end = max(start, last[1]) if last else start
        spans.append((start, end))
    known = {item.get("run_id") for item in invocations}
    spans += [(s, e) for run_id, (s, e, _n) in view.spans.items() if run_id not in known]
    if not spans:
        return {"running_seconds": 0.0, "first_started_at": None, "last_ended_at": None, "invocations": 0}
    return {
        "running_seconds": round(sum(e - s for s, e in spans), 2),
        "first_started_at": datetime.fromtimestamp(min(s for s, _ in spans)).isoformat(timespec="seconds"),
        "last_ended_at": datetime.fromtimestamp(max(e for _, e in spans)).isoformat(timespec="seconds"),
        "invocations": len(spans),
    }


def build_statistics(view: RunView, *, run_name: str, distribution: str, total_prompts: int, batch_size: int,
                     model: str, run_time: dict, rows_this_run: int, fingerprint: str) -> dict:
    """statistics.json: the original's keys first (tool and reasoning figures over the kept rows,
    as it counts them), then ours. Every count comes from the view; report.html embeds this dict."""
    counts = view.counts()
    spend = {name: bucket.as_dict() for name, bucket in view.spend.items()}
    total = view.total_spend().as_dict()
    return {
        "run_name": run_name,
        "distribution": distribution,
        "total_prompts": total_prompts,
        "total_batches": len(view.files),
        "batch_size": batch_size,
        "model": model,
        "completed_at": datetime.now().isoformat(),
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


def write_statistics(run_dir: Path, stats: dict) -> dict:
    atomic_write_json(run_dir / "statistics.json", stats)
    return stats


def print_summary(stats: dict, run_dir: Path, out=print, headline: str = "BATCH PROCESSING COMPLETE") -> None:
    rule = "=" * 70
    outcomes = stats["outcomes"]
    out(f"\n{rule}\n📊 {headline}\n{rule}")
    out(f"✅ Prompts processed this run: {stats['rows_this_run']}")
    out(f"✅ Total trajectories in merged file: {outcomes['ok']} "
        f"(completed {outcomes['completed']}, partial {outcomes['partial']}, turn limit {outcomes['turn_limit']})")
    out(f"🚫 Discarded (no reasoning): {outcomes['discarded']}")
    failed = ", ".join(f"{k} {v}" for k, v in stats["failed_by_class"].items())
    out(f"❌ Failed (retried on --resume): {outcomes['failed']}" + (f" ({failed})" if failed else ""))
    if outcomes["not_run"]:
        out(f"⏸️  Not run yet: {outcomes['not_run']}")
    if outcomes["filtered"]:
        out(f"⚠️  Filtered (unknown tools): {outcomes['filtered']}")
    out(f"✅ Total batch files merged: {stats['total_batches']}")
    run = stats["run_time"]
    out(f"⏱️  Total duration: {stats['duration_seconds']}s"
        + (f" over {run['invocations']} invocations" if run["invocations"] > 1 else ""))
    out(_spend_line("🔢 Spent (every attempt)", stats["spend"]["all"]) + f"; retries {stats['retries']:,}")
    for bucket, label in (("kept", "kept rows"), ("discarded", "discarded rows"), ("failed", "failed attempts"),
                          ("other", "other lines")):
        if stats["spend"][bucket]["attempts"]:
            out(_spend_line(f"     on {label}", stats["spend"][bucket]))
    models = stats.get("spend_by_model") or {}
    if len(models) > 1:  # tools called other models: what each cost
        out("     by model: " + "; ".join(f"{name} {m['requests']:,} requests, {_cost_text(m['cost'])}"
                                        for name, m in models.items()))
    out("\n📈 Tool Usage Statistics:\n" + "-" * 70)
    tools = stats["tool_statistics"]
    if tools:
        out(f"{'Tool Name':<25}{'Count':<10}{'Success':<10}{'Failure':<10}{'Success Rate':<12}\n" + "-" * 70)
        for name, s in sorted(tools.items(), key=lambda kv: -kv[1]["count"]):
            out(f"{name:<25}{s['count']:<10}{s['success']:<10}{s['failure']:<10}{s['success_rate']:.1f}%")
    else:
        out("No tool calls were made during this run.")
    reasoning = stats["reasoning_statistics"]
    out("\n🧠 Reasoning Coverage:\n" + "-" * 70)
    total = reasoning["total_assistant_turns"]
    if total:
        with_r = reasoning["turns_with_reasoning"]
        out(f"   Total assistant turns:    {total:,}")
        out(f"   With reasoning:           {with_r:,} ({with_r / total * 100:.1f}%)")
        out(f"   Without reasoning:        {total - with_r:,} ({(total - with_r) / total * 100:.1f}%)")
    else:
        out("   No assistant turns recorded.")
    if outcomes["discarded"]:
        out(f"   🚫 Samples discarded (zero reasoning): {outcomes['discarded']:,}")
    out(f"\n💾 Results saved to: {run_dir}")
    out("   - Trajectories: trajectories.jsonl (combined)")
    out("   - Individual batches: batch_*.jsonl (for debugging)")
    out("   - Statistics: statistics.json")
    out("   - Checkpoint: checkpoint.json")


def _cost_text(cost: float | None) -> str:
    return "unknown" if cost is None else f"${cost:,.4f}"


def _spend_line(label: str, spend: dict) -> str:
    ratio = spend["cache_hit_ratio"]
    cache = f" ({ratio * 100:.1f}% cached)" if ratio else ""
    return (f"{label}: {spend['requests']:,} requests, {spend['prompt_tokens']:,} prompt tokens{cache}, "
            f"{spend['completion_tokens']:,} completion tokens; cost {_cost_text(spend['cost'])}")
