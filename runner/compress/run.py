"""One compression over its files, for trajectory_compressor.py and for the runner's
--compress_to_tokens: the progress, the metrics JSON and the console's summary."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from runner.compress import metrics as m
from runner.compress.compressor import Compressor, FileResult
from runner.console import plural, progress
from runner.storage.atomic import atomic_write_bytes


@dataclass
class Outcome:
    results: list[FileResult] = field(default_factory=list)
    usage: dict = field(default_factory=dict)  # metrics.sum_usage of every summary request
    summary: dict | None = None  # the metrics JSON; None when stopped
    stopped: str = ""  # "", interrupted or fatal
    message: str = ""


def compress_files(compressor: Compressor, pairs: list[tuple[Path, Path]]) -> Outcome:
    """Each (input, output) in turn; the metrics JSON written once every file is."""
    started = time.monotonic()
    outcome = Outcome()
    bar = progress(0, unit="row", every=5.0)
    try:
        for source, target in pairs:
            result = compressor.compress_file(source, target, bar)
            outcome.results.append(result)
            if result.stopped:
                outcome.stopped, outcome.message = result.stopped, result.message
                break
    finally:
        bar.close()
    outcome.usage = m.sum_usage([u for result in outcome.results for u in result.usage])
    if outcome.stopped:
        for result in outcome.results:  # the files written whole keep their journal for --resume
            if result.journal is not None:
                result.journal.close()
        return outcome
    counter = compressor.counter
    outcome.summary = m.run_metrics([r.tally for r in outcome.results], outcome.usage, tokenizer=counter.name,
                                    estimated=counter.estimated, options=compressor.options.model_dump(mode="json"),
                                    duration=time.monotonic() - started, summarising=compressor.summarising_seconds)
    path = compressor.metrics_path
    atomic_write_bytes(path, (json.dumps(outcome.summary, indent=2) + "\n").encode("utf-8"))
    for result in outcome.results:  # what --resume needs is now in the outputs and the metrics JSON
        result.journal.remove()
    return outcome


def stopped_message(outcome: Outcome) -> str:
    spent = f"{plural(outcome.usage['requests'], 'summary request')} so far"
    if outcome.stopped == "fatal":
        return (f"\n⛔ Stopped: {outcome.message}.\n   The rows already summarised are kept ({spent}); fix the cause, "
                "then run again with --resume to finish.")
    return f"\n⏹️  Interrupted: the rows already summarised are kept ({spent}). Run again with --resume to finish."


def summary_lines(summary: dict, metrics_path: Path) -> list[str]:
    """The one-screen summary of a compression."""
    out = [f"\n📦 Compressed {summary['rows_compressed']:,} of {plural(summary['rows'], 'row')} into --target_max_tokens="
           f"{summary['options']['target_max_tokens']:,}"]
    for tally in summary["files"]:
        out.append(f"   {tally['input']} -> {tally['output']}")
    out.append(f"   compressed: {summary['rows_compressed']:,}; under the limit: {summary['rows_under_limit']:,}; "
               f"without conversations: {summary['rows_without_conversations']:,}; nothing to compress: "
               f"{summary['rows_nothing_to_compress']:,}; resumed: {summary['rows_resumed']:,}")
    estimate = " (estimated)" if summary["tokens_estimated"] else ""
    out.append(f"   tokens{estimate}: {summary['tokens_before']:,} -> {summary['tokens_after']:,} "
               f"(ratio {summary['compression_ratio']:.2f}; {summary['tokenizer']})")
    if summary["rows_over_limit"]:
        out.append(f"   ⚠️  still over the limit: {plural(summary['rows_over_limit'], 'row')} (marked over_limit)")
    if summary["rows_failed"]:
        reasons = ", ".join(f"{k} {v}" for k, v in summary["failures"].items())
        out.append(f"   ❌ summary failed: {plural(summary['rows_failed'], 'row')} ({reasons}), written uncompressed; "
                   "run again with --resume to retry them")
    usage = summary["summariser"]
    cost = f"${usage['cost']:.4f}" if usage["cost_known"] else (
        f"at least ${usage['cost']:.4f} (no cost reported for {plural(usage['unpriced_requests'], 'request')})")
    out.append(f"   summariser: {plural(usage['requests'], 'request')} ({usage['retries']:,} retries), "
               f"{usage['prompt_tokens']:,} prompt + {usage['completion_tokens']:,} completion tokens, {cost}")
    out.append(f"   {summary['duration_seconds']:.1f}s ({summary['rows_per_second']:.1f} rows/s); metrics: {metrics_path}")
    return out
