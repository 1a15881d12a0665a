"""The end of every run: trajectories.jsonl and statistics.json, rebuilt from the batch files.

Both are derived from the committed lines only (never from memory), so an interrupted, resumed
or already-finished run gets the same files. For each dataset row the best outcome wins
(ok > discarded > failed); trajectories.jsonl holds exactly one line per row whose outcome is ok,
re-serialised and ordered by prompt_index, and is written atomically.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import orjson

from runner.store import OUTCOME_RANK, atomic_write_json, batch_files, iter_records, keep_mode, record_outcome
from tools.registry import ALL_TOOL_NAMES

_KNOWN_TOOLS = set(ALL_TOOL_NAMES)
_USAGE_KEYS = ("prompt_tokens", "completion_tokens", "reasoning_tokens", "cached_tokens", "total_tokens")


@dataclass
class _Winner:
    rank: int
    file_no: int
    offset: int
    length: int
    error_class: str | None
    same_index: bool  # the line's prompt_index is the row's index in the current dataset


@dataclass
class MergeResult:
    files: int = 0
    kept: int = 0
    completed: int = 0
    partial: int = 0
    discarded: int = 0
    failed: int = 0
    failed_by_class: dict[str, int] = field(default_factory=dict)
    not_run: int = 0
    filtered: int = 0  # ok rows dropped because they name tools outside the known list
    unreadable: int = 0  # lines that are not a JSON object with a row key
    stale: int = 0  # rows of an earlier dataset version that the current dataset no longer has
    tool_stats: dict[str, dict[str, int]] = field(default_factory=dict)
    reasoning: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("total_assistant_turns", "turns_with_reasoning", "turns_without_reasoning"), 0))
    usage: dict[str, float] = field(default_factory=lambda: {**dict.fromkeys(_USAGE_KEYS, 0), "cost": 0.0})
    retries: int = 0
    api_calls: int = 0


def _invalid_tool(record: dict) -> str | None:
    stats = record.get("tool_stats")
    if not isinstance(stats, dict) or not isinstance(record.get("conversations"), list):
        return "<malformed row>"
    return next((name for name in stats if name not in _KNOWN_TOOLS), None)


def merge_run(run_dir: Path, key_to_index: dict[str, int], log=print) -> MergeResult:
    result = MergeResult()
    files = batch_files(run_dir)
    result.files = len(files)
    winners: dict[str, _Winner] = {}
    stale: set[str] = set()
    for file_no, path in enumerate(files):
        for offset, line, record, key in iter_records(path):
            if key is None:
                result.unreadable += 1
                log(f"   ⚠️  {path.name}: skipping an unreadable line at byte {offset}")
                continue
            if key not in key_to_index:
                stale.add(key)
                continue
            outcome = record_outcome(record)
            if outcome == "ok" and (bad := _invalid_tool(record)):
                result.filtered += 1
                log(f"   ⚠️  Filtering a row of {path.name}: invalid tool '{bad[:50]}'")
                continue
            rank = OUTCOME_RANK[outcome]
            best = winners.get(key)
            if best is None or rank > best.rank:
                same_index = record.get("prompt_index") == key_to_index[key]
                winners[key] = _Winner(rank, file_no, offset, len(line), record.get("error_class"), same_index)
                if outcome == "ok":  # nothing outranks ok: this line is final, count it now
                    _accumulate(record, result)
    result.stale = len(stale)

    ok_rows = []
    for key, winner in winners.items():
        if winner.rank == OUTCOME_RANK["ok"]:
            ok_rows.append((key_to_index[key], winner))
        elif winner.rank == OUTCOME_RANK["discarded"]:
            result.discarded += 1
        else:
            result.failed += 1
            cls = winner.error_class or "agent"
            result.failed_by_class[cls] = result.failed_by_class.get(cls, 0) + 1
    result.not_run = len(key_to_index) - len(winners)
    ok_rows.sort(key=lambda item: item[0])
    _write_trajectories(run_dir, files, ok_rows)
    return result


def _write_trajectories(run_dir: Path, files: list[Path], ok_rows: list) -> None:
    target = run_dir / "trajectories.jsonl"
    fd, tmp = tempfile.mkstemp(prefix=".trajectories_", suffix=".tmp", dir=run_dir)
    handles = {}
    try:
        with os.fdopen(fd, "wb") as out:
            for index, winner in ok_rows:
                handle = handles.get(winner.file_no) or handles.setdefault(winner.file_no, open(files[winner.file_no], "rb"))
                handle.seek(winner.offset)
                line = handle.read(winner.length)
                if not winner.same_index:  # the dataset was edited: give the row its current position
                    record = orjson.loads(line)
                    record["prompt_index"] = index
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


def _accumulate(record: dict, result: MergeResult) -> None:
    result.kept += 1
    result.completed += bool(record.get("completed"))
    result.partial += bool(record.get("partial"))
    result.api_calls += int(record.get("api_calls") or 0)
    for name, stats in record["tool_stats"].items():
        if stats.get("count") or stats.get("success") or stats.get("failure"):
            total = result.tool_stats.setdefault(name, {"count": 0, "success": 0, "failure": 0})
            for k in total:
                total[k] += int(stats.get(k) or 0)
    for k, v in (record.get("reasoning_stats") or {}).items():
        if k in result.reasoning:
            result.reasoning[k] += int(v)
    metadata = record.get("metadata") or {}
    usage = metadata.get("usage") or {}
    for k in result.usage:
        result.usage[k] += usage.get(k) or 0
    result.retries += int(usage.get("retries") or 0)


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


def write_statistics(run_dir: Path, merged: MergeResult, *, run_name: str, distribution: str, total_prompts: int,
                     batch_size: int, model: str, duration: float, rows_this_run: int, fingerprint: str) -> dict:
    stats = {
        "run_name": run_name,
        "distribution": distribution,
        "total_prompts": total_prompts,
        "total_batches": merged.files,
        "batch_size": batch_size,
        "model": model,
        "completed_at": datetime.now().isoformat(),
        "duration_seconds": round(duration, 2),
        "tool_statistics": tool_statistics(merged.tool_stats),
        "reasoning_statistics": merged.reasoning,
        "discarded_no_reasoning": merged.discarded,
        "outcomes": {
            "ok": merged.kept,
            "completed": merged.completed,
            "partial": merged.partial,
            "discarded": merged.discarded,
            "failed": merged.failed,
            "not_run": merged.not_run,
            "filtered": merged.filtered,
        },
        "failed_by_class": dict(sorted(merged.failed_by_class.items())),
        "tokens": {k: int(merged.usage[k]) for k in _USAGE_KEYS},
        "cost": round(merged.usage["cost"], 6),
        "retries": merged.retries,
        "api_calls": merged.api_calls,
        "rows_this_run": rows_this_run,
        "stale_rows": merged.stale,
        "unreadable_lines": merged.unreadable,
        "fingerprint": fingerprint,
    }
    atomic_write_json(run_dir / "statistics.json", stats)
    return stats


def print_summary(stats: dict, run_dir: Path, out=print, headline: str = "BATCH PROCESSING COMPLETE") -> None:
    rule = "=" * 70
    outcomes = stats["outcomes"]
    out(f"\n{rule}\n📊 {headline}\n{rule}")
    out(f"✅ Prompts processed this run: {stats['rows_this_run']}")
    out(f"✅ Total trajectories in merged file: {outcomes['ok']} "
        f"(completed {outcomes['completed']}, partial {outcomes['partial']})")
    out(f"🚫 Discarded (no reasoning): {outcomes['discarded']}")
    failed = ", ".join(f"{k} {v}" for k, v in stats["failed_by_class"].items())
    out(f"❌ Failed (retried on --resume): {outcomes['failed']}" + (f" ({failed})" if failed else ""))
    if outcomes["not_run"]:
        out(f"⏸️  Not run yet: {outcomes['not_run']}")
    if outcomes["filtered"]:
        out(f"⚠️  Filtered (unknown tools): {outcomes['filtered']}")
    out(f"✅ Total batch files merged: {stats['total_batches']}")
    out(f"⏱️  Total duration: {stats['duration_seconds']}s")
    tokens = stats["tokens"]
    out(f"🔢 Tokens: {tokens['prompt_tokens']:,} prompt, {tokens['completion_tokens']:,} completion; "
        f"cost {stats['cost']}; retries {stats['retries']}")
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
