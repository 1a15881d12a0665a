"""The end of every run: trajectories.jsonl and statistics.json, from the run view.

Both are derived from the committed lines only (never from memory), so an interrupted, resumed
or already-finished run gets the same files. `merge_run` reads the batch files once into a
`RunView` (runner/storage/runview.py: the one rule that picks each row's winning line, the spend of every
line); trajectories.jsonl holds exactly one line per dataset row whose outcome is ok, ordered by
its current prompt_index, and is written atomically. Winning lines are copied as they are, unless
the dataset changed what the row carries besides its identity (its position, its id): those few
lines are re-serialised with the current values. statistics.py turns the same view into
statistics.json, which report.html embeds, so the two always show the same counts.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from runner.console import plural
from runner.output.report import report_details, write_report
from runner.output.statistics import build_statistics, dataset_of, run_time, statistics_of, tool_statistics  # noqa: F401
from runner.output.status import THROUGHPUT_DEFINITION, rows_per_minute, settle_status, throughput_text
from runner.storage import runfiles
from runner.storage.atomic import atomic_write_lines
from runner.storage.records import relocated_line
from runner.storage.runfiles import Invocation, write_statistics  # noqa: F401 (callers take them from here)
from runner.storage.runview import OK_RANK, Detail, RunView, Selection, read_run
from runner.storage.store import batch_files
from runner.timestamps import now_iso


def merge_run(run_dir: Path, key_to_index: Mapping[str, int], log=print, *, ids: Mapping[str, str] | None = None,
              detail: Detail | None = None, on_line=None, selection: Selection = Selection()) -> RunView:
    """Read the run into a view of the dataset `key_to_index` (sample key -> its row's index, with
    their current `ids`) and write trajectories.jsonl from it: the ok samples the quality filters
    and --keep (`selection`) keep. `detail` and `on_line` are the report's hooks (see RunView)."""
    view = read_run(batch_files(run_dir), RunView(key_to_index, ids=ids, detail=detail, on_line=on_line, log=log,
                                                  selection=selection))
    _write_trajectories(run_dir, kept_lines(view))
    return view


def kept_lines(view: RunView, *, selected_only: bool = True) -> Iterator[bytes]:
    """The kept samples' winning lines in trajectories.jsonl's order (by current prompt_index, then
    sample), each with the row's current position and id: the lines of trajectories.jsonl, and
    what exports read. Kept: ok once the quality filters are applied, and selected by --keep
    (`selected_only=False`: whatever --keep selected, as preference pairs need every sample)."""
    ok_rows = ((index, entry.sample, row_id, entry) for key, entry in view.rows.items()
               if entry.rank == OK_RANK and (entry.selected or not selected_only)
               for index, row_id in (view.current(key),))
    if not (view.rows.ordered and view.rows.units is view.dataset):
        ok_rows = iter(sorted(ok_rows))  # else the view's rows come in dataset order already: no list of them
    handles = {}
    try:
        for index, _sample, row_id, winner in ok_rows:
            handle = handles.get(winner.file_no) or handles.setdefault(winner.file_no, open(view.files[winner.file_no], "rb"))
            handle.seek(winner.offset)
            line = handle.read(winner.length)
            if winner.prompt_index != index or winner.row_id != row_id or winner.rescored is not None:
                # The dataset was edited: the row keeps its identity but gets its current
                # position and id (a row appended or moved, an id changed alone); or the
                # sample was rescored: it gets its latest scores.
                line = relocated_line(line, index, row_id, winner.rescored)
            yield line  # committed lines were serialised by the store: copied as they are
    finally:
        for handle in handles.values():
            handle.close()


class RebuildError(ValueError):
    """`--report` cannot rebuild the run's outputs (its dataset cannot be read)."""


def rebuild_outputs(run_dir: Path, *, max_full_conversations: int, log=print, selection: Mapping | None = None) -> Path:
    """`--report`: the end of a run again, nothing run. trajectories.jsonl, statistics.json and
    report.html are rebuilt together from the batch files and the dataset config.json names, so
    they agree with each other and with the dataset as it is now. `selection` (keep_no_reasoning,
    keep) replaces what config.json records. The caller holds the run lock."""
    config = (runfiles.read_config(run_dir) or runfiles.ConfigFile()).config
    dataset, ids = dataset_of(config)
    if dataset is None:
        raise RebuildError(
            f"--report rebuilds the run's outputs against its dataset, and {config.get('dataset_file')!r} "
            f"(dataset_file in {run_dir / 'config.json'}) cannot be read; put it back and run --report again")
    chosen = Selection.of({**config, **(selection or {})})
    if chosen.keep != "all" and not config.get("scorer"):
        raise RebuildError(f"--keep={chosen.keep} selects samples by their score, and the run has no --scorer")
    view = merge_run(run_dir, dataset, log, ids=ids, detail=report_details(), selection=chosen)
    stats = write_statistics(run_dir, statistics_of(run_dir, view))
    settle_status(run_dir, view, stats, config, log)  # a killed runner's "running" status agrees with it
    return write_report(run_dir, max_full_conversations=max_full_conversations, view=view, statistics=stats, log=log)


def export_run_dir(run_dir: Path, formats: list[str], log=print) -> dict[str, int]:
    """`--export` alone: the exports from the run's files, against its dataset as it is now (the
    same rows as trajectories.jsonl). The caller holds the run lock."""
    from runner.output.export import ExportError, export_run

    config = (runfiles.read_config(run_dir) or runfiles.ConfigFile()).config
    dataset, ids = dataset_of(config)
    if dataset is None:
        raise ExportError(
            f"--export selects the rows of the run's dataset, and {config.get('dataset_file')!r} "
            f"(dataset_file in {run_dir / 'config.json'}) cannot be read; put it back and run --export again")
    view = read_run(batch_files(run_dir), RunView(dataset, ids=ids, tally=False, log=log, selection=Selection.of(config)))
    return export_run(run_dir, lambda: kept_lines(view), formats, log=log,
                      ok_lines=lambda: kept_lines(view, selected_only=False))


def _write_trajectories(run_dir: Path, lines: Iterator[bytes]) -> None:
    atomic_write_lines(run_dir / "trajectories.jsonl", lines)


def record_invocation_end(run_dir: Path, run_id: str) -> list[Invocation]:
    """Stamp the end of this invocation in config.json; returns every invocation recorded there."""
    return runfiles.record_invocation_end(run_dir, run_id, now_iso())


def print_summary(stats: dict, run_dir: Path, out=print, headline: str = "BATCH PROCESSING COMPLETE") -> None:
    rule = "=" * 70
    outcomes = stats["outcomes"]
    out(f"\n{rule}\n📊 {headline}\n{rule}")
    out(f"✅ Prompts processed this run: {stats['rows_this_run']:,}")
    out(f"✅ Total trajectories in merged file: {outcomes['ok']:,} "
        f"(completed {outcomes['completed']:,}, partial {outcomes['partial']:,}, turn limit {outcomes['turn_limit']:,})")
    out(f"🚫 Discarded (no reasoning): {outcomes['discarded']:,}")
    if outcomes.get("unselected"):
        out(f"🚫 Not selected (--keep): {outcomes['unselected']:,} (kept in the batch files)")
    if outcomes.get("spared"):
        out(f"⏭️  Not run (--stop_after_passing, their row passed enough): {outcomes['spared']:,}")
    if outcomes["discarded"] and not outcomes["ok"]:
        out(f"⚠️  0 of {outcomes['discarded'] + outcomes.get('unselected', 0):,} kept: all discarded for no reasoning "
            "(pass --keep_no_reasoning; with --resume it keeps these rows, with no new request)")
    failed = ", ".join(f"{k} {v:,}" for k, v in stats["failed_by_class"].items())
    if outcomes["failed"]:  # (a clean run has no failure line)
        out(f"❌ Failed (retried on --resume): {outcomes['failed']:,}" + (f" ({failed})" if failed else ""))
    if outcomes["not_run"]:
        out(f"⏸️  Not run yet: {outcomes['not_run']:,}")
    if outcomes["filtered"]:
        out(f"⚠️  Filtered (unknown tools): {outcomes['filtered']:,}")
    scoring = stats.get("scoring")
    if scoring:
        at_k = ", ".join(f"pass@{k} {v:.3f}" for k, v in scoring["pass_at_k"].items() if v is not None)
        out(f"🎯 Scored samples: {scoring['samples']:,} ({', '.join(scoring['scorers'])}), passed {scoring['passed']:,}, "
            f"mean {scoring['mean']:.3f}" + (f"; {at_k}" if at_k else "")
            + (f"; scorer errors {scoring['errors']:,}" if scoring["errors"] else ""))
    out(f"✅ Total batch files merged: {stats['total_batches']:,}")
    run = stats["run_time"]
    with_outcome = outcomes["ok"] + outcomes["discarded"] + outcomes["failed"]
    rate = rows_per_minute(with_outcome, run["running_seconds"])
    out(f"⏱️  Total duration: {stats['duration_seconds']:,}s"
        + (f" over {run['invocations']:,} invocations" if run["invocations"] > 1 else "")
        + (f"; throughput {throughput_text(rate)} ({THROUGHPUT_DEFINITION})" if rate is not None else ""))
    out(_spend_line("🔢 Spent (every attempt)", stats["spend"]["all"]) + f"; retries {stats['retries']:,}")
    for bucket, label in (("kept", "kept rows"), ("discarded", "discarded rows"), ("unselected", "samples not selected"),
                          ("failed", "failed attempts"), ("other", "other lines"), ("rescoring", "rescoring (--rescore)")):
        if stats["spend"].get(bucket, {}).get("attempts"):
            out(_spend_line(f"     on {label}", stats["spend"][bucket]))
    models = stats.get("spend_by_model") or {}
    if len(models) > 1:  # tools called other models: what each cost
        out("     by model: " + "; ".join(f"{name} {m['requests']:,} requests, {_cost_text(m['cost'])}"
                                        for name, m in models.items()))
    discarded = stats.get("discarded_statistics")
    out("\n📈 Tool Usage Statistics:\n" + "-" * 70)
    tools = stats["tool_statistics"]
    if tools:
        _tool_table(tools, out)
    elif discarded and discarded["tool_statistics"]:
        out(f"No tool calls in the kept rows; the {plural(discarded['rows'], 'discarded row')} made these:")
        _tool_table(discarded["tool_statistics"], out)
    else:
        out("No tool calls were made during this run.")
    reasoning = stats["reasoning_statistics"]
    out("\n🧠 Reasoning Coverage:\n" + "-" * 70)
    if reasoning["total_assistant_turns"]:
        _reasoning_lines(reasoning, out)
    elif discarded and discarded["reasoning_statistics"]["total_assistant_turns"]:
        out(f"   No assistant turns in the kept rows; in the {plural(discarded['rows'], 'discarded row')}:")
        _reasoning_lines(discarded["reasoning_statistics"], out)
    else:
        out("   No assistant turns recorded.")
    if outcomes["discarded"]:
        out(f"   🚫 Samples discarded (zero reasoning): {outcomes['discarded']:,}")
    out(f"\n💾 Results saved to: {run_dir}")
    out("   - Trajectories: trajectories.jsonl (combined)")
    out("   - Individual batches: batch_*.jsonl (for debugging)")
    out("   - Statistics: statistics.json")
    out("   - Checkpoint: checkpoint.json")


def _tool_table(tools: dict, out) -> None:
    out(f"{'Tool Name':<25}{'Count':<10}{'Success':<10}{'Failure':<10}{'Success Rate':<12}\n" + "-" * 70)
    for name, s in sorted(tools.items(), key=lambda kv: -kv[1]["count"]):
        out(f"{name:<25}{s['count']:<10,}{s['success']:<10,}{s['failure']:<10,}{s['success_rate']:.1f}%")


def _reasoning_lines(reasoning: dict, out) -> None:
    total, with_r = reasoning["total_assistant_turns"], reasoning["turns_with_reasoning"]
    out(f"   Total assistant turns:    {total:,}")
    out(f"   With reasoning:           {with_r:,} ({with_r / total * 100:.1f}%)")
    out(f"   Without reasoning:        {total - with_r:,} ({(total - with_r) / total * 100:.1f}%)")


def _cost_text(cost: float | None) -> str:
    return "unknown" if cost is None else f"${cost:,.4f}"


def _spend_line(label: str, spend: dict) -> str:
    ratio = spend["cache_hit_ratio"]
    cache = f" ({ratio * 100:.1f}% cached)" if ratio else ""
    return (f"{label}: {spend['requests']:,} requests, {spend['prompt_tokens']:,} prompt tokens{cache}, "
            f"{spend['completion_tokens']:,} completion tokens; cost {_cost_text(spend['cost'])}")
