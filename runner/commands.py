"""The commands that run no prompt, each on a finished (or stopped) run's files and under its lock:
`--report` (the end-of-run outputs rebuilt), `--rescore` (the committed samples scored again) and
`--export` given without a dataset. Like batch_runner.py, this driver's module may import every
stage. Each returns the exit code, or raises UsageError with one line.
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path
from typing import Any

from runner.configure import api_key_from, check_scoring, checked, export_formats, validated
from runner.console import plural
from runner.input.errors import UsageError
from runner.outcome import EXIT_OK


def report_only(output_dir: Any, run_name: Any, report_samples: Any, **selection: Any) -> int:
    """`--report --run_name=NAME`: the end-of-run outputs rebuilt from the run's files (report.html,
    statistics.json, trajectories.jsonl, so they always agree); nothing run. `selection`
    (--keep_no_reasoning, --keep) given here replaces the run's for this rebuild."""
    from runner.input.config import ReportOptions
    from runner.output.finalize import RebuildError, rebuild_outputs
    from runner.output.statistics import dataset_of
    from runner.storage.journal import record_journaled_spend_of_run

    options = validated(ReportOptions, output_dir=output_dir, run_name=run_name or "", report_samples=report_samples,
                        **selection)
    run_dir = _existing_run(options)
    with _locked(run_dir), _as_usage_error(RebuildError):  # a live run rewrites these files itself when it ends
        # what a killed runner's rows in flight spent (of the dataset's rows only)
        record_journaled_spend_of_run(run_dir, lambda config: dataset_of(config)[0])
        path = rebuild_outputs(run_dir, max_full_conversations=options.report_samples,
                               selection=options.model_dump(include={"keep_no_reasoning", "keep"}, exclude_none=True))
    print(f"📄 Report written to {path} (statistics.json and trajectories.jsonl rebuilt with it)")
    return EXIT_OK


def rescore_only(*, output_dir: Any, run_name: Any, api_key: Any, scorer: Any, **flags: Any) -> int:
    """`--rescore --run_name=NAME --scorer=...`: the committed samples scored again (the judge's
    requests only) into rescores.jsonl, then the outputs rebuilt. The endpoint, timeout, pacing and
    prices are the run's own (config.json) unless given."""
    from runner.input.config import ReportOptions, RescoreOptions
    from runner.input.secrets import register
    from runner.output.finalize import RebuildError, rebuild_outputs
    from runner.scoring.rescore import check_scorers, rescore_run
    from runner.scoring.scorers import scorer_names
    from runner.storage.runfiles import ConfigFile, read_config

    run_dir = _existing_run(validated(ReportOptions, output_dir=output_dir, run_name=run_name))
    saved = (read_config(run_dir) or ConfigFile()).config
    flags["judge_base_url"] = flags.get("judge_base_url") or saved.get("base_url")
    options = validated(
        RescoreOptions, output_dir=output_dir, run_name=run_name, scorer=checked(scorer_names, scorer),
        api_key=api_key_from(api_key), base_url=saved.get("base_url"), request_timeout=saved.get("request_timeout"),
        max_requests_per_minute=saved.get("max_requests_per_minute"), prices=saved.get("prices"), **flags)
    register(options.api_key.get_secret_value() if options.api_key else None)  # redacted from every line
    checked(check_scorers, options.scorer)
    make_judge = None
    if "judge" in options.scorer:
        checked(check_scoring, options)
        make_judge = functools.partial(_judge_client, options)
    # A live run's samples are not all committed yet; RescoreError or a scorer that cannot be used is a ValueError.
    with _locked(run_dir), _as_usage_error(RebuildError, ValueError):
        scored = rescore_run(run_dir, options, make_judge=make_judge, log=print)
        path = rebuild_outputs(run_dir, max_full_conversations=options.report_samples)
    print(f"🎯 Rescored {plural(scored, 'sample')} with {', '.join(options.scorer)} (rescores.jsonl); "
          f"{path.name}, statistics.json and trajectories.jsonl rebuilt")
    return EXIT_OK


def export_only(output_dir: Any, run_name: Any, export: Any) -> int:
    """`--export=FORMATS --run_name=NAME`: the run's exports written from its files; nothing run."""
    from runner.input.config import ReportOptions
    from runner.output.export import ExportError
    from runner.output.finalize import export_run_dir

    formats = checked(export_formats, export)
    run_dir = _existing_run(validated(ReportOptions, output_dir=output_dir, run_name=run_name or ""))
    with _locked(run_dir), _as_usage_error(ExportError):
        print(f"📤 Exporting {run_dir}:")
        export_run_dir(run_dir, formats)
    return EXIT_OK


def _judge_client(options):
    from agent.model_client import ModelClient, RetryPolicy
    from runner.scoring.rescore import CONCURRENT

    return ModelClient(options.judge_base_url, options.api_key.get_secret_value() if options.api_key else None,
                       max_in_flight=CONCURRENT, requests_per_minute=options.max_requests_per_minute,
                       policy=RetryPolicy(request_timeout=options.request_timeout))


def _existing_run(options) -> Path:
    from runner.storage.runfiles import has_config

    run_dir = Path(options.output_dir) / options.run_name
    if not has_config(run_dir):
        raise UsageError(f"{run_dir} holds no run (no config.json)")
    return run_dir


@contextlib.contextmanager
def _locked(run_dir: Path):
    """The run's lock for the command: a run still writing there refuses it (one line, exit 1)."""
    from runner.storage.lock import RunLock, RunLockBusy

    lock = RunLock(run_dir)
    try:
        lock.acquire(print)
    except RunLockBusy as err:
        raise UsageError(str(err)) from None
    try:
        yield
    finally:
        lock.release()


@contextlib.contextmanager
def _as_usage_error(*errors: type[Exception]):
    try:
        yield
    except errors as err:
        raise UsageError(str(err)) from None
