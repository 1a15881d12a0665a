"""The end of a run: the merge and statistics over every committed line, then what the run
leaves for people once its outcome is decided (statistics.json, the summary, the exports,
status.json's last state, report.html) and the last lines that say what to do next.

`merge` comes first, `publish` once the outcome is decided from the merge's counts (by the
caller, runner/outcome.py's `decide`): the outcome is written in statistics.json and shown.
"""

from __future__ import annotations

import sys
from pathlib import Path


def merge(run_dir: Path, config, units: dict[str, int], unit_ids: dict[str, str], *, total_prompts: int,
          rows_this_run: int, log):
    """trajectories.jsonl from the batch files, and the run's statistics (not written yet)."""
    from runner.output.finalize import build_statistics, merge_run, record_invocation_end, run_time
    from runner.output.report import report_details
    from runner.storage.runview import Selection

    view = merge_run(run_dir, units, log, ids=unit_ids, detail=report_details(), selection=Selection.of(config))
    run_id = config.tools.run_id
    stats = build_statistics(
        view, run_name=config.run_name, distribution=config.distribution, total_prompts=total_prompts,
        batch_size=config.batch_size, model=config.model, rows_this_run=rows_this_run,
        run_time=run_time(record_invocation_end(run_dir, run_id), view, run_id),
        fingerprint=config.fingerprint(), samples_per_prompt=config.samples_per_prompt,
    )
    return view, stats


def publish(run_dir: Path, config, view, stats: dict, outcome, monitor) -> None:
    """statistics.json with the outcome, the summary, the exports, status.json's last state, the
    report, and the closing lines."""
    from runner.output.finalize import print_summary, write_statistics

    stats["outcome"] = outcome.as_dict()
    write_statistics(run_dir, stats)
    print_summary(stats, run_dir, headline=outcome.headline)
    _write_exports(run_dir, config, view)
    monitor.close(outcome.state)  # before the report, which shows it
    _write_report(run_dir, config, view, stats)
    _say_outcome(outcome, monitor, config)


def _write_exports(run_dir: Path, config, view) -> None:
    """--export with a run: the exports of what the run now holds, after the merge."""
    if not config.export:
        return
    from runner.output.export import ExportError, export_run
    from runner.output.finalize import kept_lines

    try:
        export_run(run_dir, lambda: kept_lines(view), config.export, ok_lines=lambda: kept_lines(view, selected_only=False))
    except ExportError as err:
        print(f"⚠️  Not exported: {err}")


def _write_report(run_dir: Path, config, view, stats: dict) -> None:
    try:
        from runner.output.report import write_report

        path = write_report(run_dir, max_full_conversations=config.report_samples, view=view, statistics=stats)
        print(f"   - Report: {path.name} (open it in a browser)")
    except Exception as err:  # the report is a view: never let it fail a finished run
        print(f"⚠️  Could not write report.html: {type(err).__name__}: {err}")


def _say_outcome(outcome, monitor, config) -> None:
    """The last lines: the spend, and what to do next when the run is not done."""
    if outcome.state == "stopped_provider":
        print(f"\n❌ Stopped early: {outcome.message}", file=sys.stderr)
        return
    if outcome.kind == "interrupted":
        print("\n⏸️  Interrupted: committed rows are safe; run again with --resume to finish.", file=sys.stderr)
        return
    snapshot = monitor.snapshot("done")
    print(f"\n{monitor.spend_line(snapshot)}")
    if outcome.kind == "budget":
        outlook = snapshot["forecast"] or {}
        high = outlook.get("total_high_usd") or outlook.get("total_usd")
        print(f"\n{monitor.budget.stop_message(config.max_cost_scope, high)}", file=sys.stderr)
    elif outcome.kind == "crash_loop":
        print(f"\n❌ Stopped early: {outcome.message}. Committed rows are safe; run again with --resume "
              "to finish.", file=sys.stderr)
    elif outcome.kind == "failed_rows":
        print(f"\n⚠️  {outcome.failed + outcome.not_run} row(s) not done; run again with --resume to retry them.")
