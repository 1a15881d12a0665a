#!/usr/bin/env python3
"""Run every prompt of a JSONL dataset through a tool-using agent and collect trajectories.

    python batch_runner.py --dataset_file=data/example_prompts.jsonl --batch_size=5 \\
                           --run_name=demo --model=mock

Outputs go to <output_dir>/<run_name>/: batch_N.jsonl (committed rows), checkpoint.json,
config.json, trajectories.jsonl and statistics.json. See docs/flags.md for every flag.

Exit codes: 0 every row done; 1 bad input or configuration; 2 finished with failed or unrun rows
(run again with --resume); 3 stopped early: the provider cannot serve the run (auth, quota, an
unreachable endpoint, --max_tokens too small for every first reply);
4 stopped at the cost budget (--max_cost); 5 stopped on a storage error (disk full: committed rows are
safe); 130 interrupted (Ctrl-C / SIGTERM).
"""

from __future__ import annotations

import os
import signal
import sys


def _interrupted_before_the_run(signum, frame):
    """Ctrl-C / SIGTERM before the run's own handlers are in place (imports, flag checks, the
    re-exec that takes the keys out): no row was started yet, so leave at once, without a
    traceback (worker processes started by then notice that their parent is gone). Not by
    raising: an exception raised inside a C extension's import (orjson) crashes the interpreter;
    nor by print(), which may have been interrupted in the middle of a write."""
    try:
        sys.stdout.flush()
    except BaseException:  # reentrant: the signal came in the middle of a write
        pass
    os.write(2, "\n⏹️  Interrupted.\n".encode())
    os._exit(130)  # EXIT_INTERRUPTED, defined below: a signal may come before that line


if __name__ == "__main__":  # first thing, before the heavy imports; never when imported as a library
    for _signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(_signum, _interrupted_before_the_run)
    # The re-exec (runner/input/secrets.py) blocks both signals across execve, so one sent while the new
    # interpreter starts waits here instead of killing it or raising KeyboardInterrupt in its imports.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, (signal.SIGINT, signal.SIGTERM))
    if sys.argv[1:] == ["--list_distributions"]:  # the catalogue alone needs no flag, configuration or run code
        from toolset_distributions import format_distribution_catalogue

        try:
            print(format_distribution_catalogue(), flush=True)
        except BrokenPipeError:  # `| head`: the reader has seen what it wanted
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(0)
    # The keys leave our environment and argv now, before the imports below: the re-exec that takes
    # them out (when there are any) would make the new interpreter import all of it a second time.
    from runner.input.secrets import protect_process_secrets

    protect_process_secrets()

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runner import commands
from runner.configure import (UsageError, build_config, print_reasoning, recorded_config, with_new_run_id,
                              with_recorded_flags, with_recorded_seed)
from runner.console import Log, plural
from runner.storage.errors import StorageError
from runner.input.config import Commands
from runner.input.flags import flag_named, main_signature
from toolset_distributions import format_distribution_catalogue
from runner.timestamps import now_iso

from runner.outcome import (EXIT_BUDGET, EXIT_ERROR, EXIT_FATAL_PROVIDER, EXIT_INCOMPLETE,  # noqa: F401 (exit codes of the API)
                            EXIT_INTERRUPTED, EXIT_OK, EXIT_STORAGE, StopState, decide)


if TYPE_CHECKING:  # (the executors are imported when a run starts, never for --help)
    from runner.execution.executor import Executor


def main(**flags: Any):
    """Run a JSONL dataset of prompts through the agent (docs/flags.md lists every flag).

    The parameters are the declared flags (runner/input/flags.py; `main.__signature__`, which fire
    reads). A flag left out is None here: its default is defined once, on its field, which also
    checks the value.
    """
    unknown = set(flags) - set(main.__signature__.parameters)
    if unknown:  # (the CLI checked argv already; this is for a caller in Python)
        raise TypeError(f"main() got unexpected keyword argument(s): {', '.join(sorted(unknown))}")
    given = {name: flags.pop(name) for name in list(flags) if flag_named(name).section == "command"}
    command = {name: given.get(name) for name in Commands.model_fields}
    if command["list_distributions"]:
        print(format_distribution_catalogue())
        raise SystemExit(EXIT_OK)
    try:
        if command["report"]:
            raise SystemExit(commands.report_only(
                flags.get("output_dir"), flags.get("run_name"), flags.get("report_samples"),
                keep_no_reasoning=flags.get("keep_no_reasoning"), keep=flags.get("keep")))
        if command["rescore"]:
            rescore_flags = ("output_dir", "report_samples", "api_key", "scorer", "pass_threshold", "verify_command",
                             "verify_timeout", "judge_model", "judge_base_url", "judge_rubric")
            raise SystemExit(commands.rescore_only(run_name=flags.get("run_name") or "",
                                                   **{name: flags.get(name) for name in rescore_flags}))
        if flags.get("export") is not None and flags.get("dataset_file") is None:
            raise SystemExit(commands.export_only(flags.get("output_dir"), flags.get("run_name"), flags["export"]))
        recorded = recorded_config(flags) if command["resume"] else {}
        config = build_config(**with_recorded_flags(flags, recorded), recorded=recorded)
        print_reasoning(config)
        code = BatchRunner(config, resume=bool(command["resume"]), overwrite=bool(command["overwrite"]),
                           allow_config_change=bool(command["allow_config_change"])).run()
    except UsageError as err:
        print(f"❌ Error: {err}", file=sys.stderr)
        code = EXIT_ERROR
    except StorageError as err:
        print(f"\n❌ Stopped: {err}.\n   The committed rows are safe; free some space (or fix the disk), "
              "then run again with --resume to finish.", file=sys.stderr)
        code = EXIT_STORAGE
    except KeyboardInterrupt:  # Ctrl-C before the run's own handler was in place
        print("\n⏹️  Interrupted.", file=sys.stderr)
        code = EXIT_INTERRUPTED
    except Exception as err:  # our bug or an OS error: one clear line, the traceback with --verbose
        print(f"\n❌ Fatal error: {type(err).__name__}: {err}", file=sys.stderr)
        if flags.get("verbose"):
            import traceback

            traceback.print_exc()
        code = EXIT_ERROR
    raise SystemExit(code)


main.__signature__ = main_signature()  # what fire binds and --help lists: the declared flags


def _count_lines(path: str, stop_at: int) -> int:
    """Lines in the file, counting only until `stop_at` (a bound, read in a moment even for a huge
    file); a missing file counts as `stop_at` (the dataset scan reports it)."""
    lines, last = 0, b"\n"
    try:
        with open(path, "rb") as handle:
            while lines < stop_at and (chunk := handle.read(1 << 20)):
                lines, last = lines + chunk.count(b"\n"), chunk[-1:]
    except OSError:
        return stop_at
    return lines + (last != b"\n")


def _refuse_run_while_a_worker_imports_the_script() -> None:
    """A script that calls run() without `if __name__ == "__main__":` calls it again in every
    process multiprocessing starts (forkserver and spawn import the script as `__mp_main__`);
    say so here instead of leaving rows "worker process died"."""
    import multiprocessing

    main_module = getattr(sys.modules.get("__main__"), "__name__", "__main__")
    if (multiprocessing.parent_process() is not None or multiprocessing.current_process().name != "MainProcess"
            or main_module == "__mp_main__"):
        raise RuntimeError(
            'BatchRunner.run() was called while a worker process imported your script: start the run under '
            '`if __name__ == "__main__":` (the workers import the script again; see docs/python-api.md)'
        )


class BatchRunner:
    """One invocation of a run, its stages in order: the configuration (validated and frozen by
    runner/configure.py), the preflight checks (runner/preflight.py), the run directory
    (runner/storage/run_dir.py), the dispatch (runner/execution/dispatch.py), the end of the run
    (runner/output/closing.py) and its one outcome (runner/outcome.py).

    Two ways to build one: `BatchRunner(config)` with a RunConfig (as main() does), or the
    original's keywords, `BatchRunner(dataset_file=..., batch_size=..., run_name=...,
    max_iterations=..., ...)` then `.run(resume=...)` (see runner/original_api.py).
    """

    def __init__(self, config=None, *, resume: bool = False, overwrite: bool = False, allow_config_change: bool = False,
                 **original_keywords: Any):
        self._keywords = original_keywords if config is None else None  # built by the Python API
        if config is None:
            from runner.original_api import config_from_original

            config = config_from_original(original_keywords)  # bad keywords raise here, as the original's did
            print_reasoning(config)
        elif original_keywords:
            raise TypeError("BatchRunner() takes a RunConfig or the original's keywords, not both")
        self.config = config
        self.resume = resume
        self.overwrite = overwrite
        self.allow_config_change = allow_config_change
        self.run_dir = Path(config.output_dir) / config.run_name
        self.stops = StopState()  # why no new prompt is started (the first reason)
        self.log = Log()
        self._interrupts = 0
        self._phase = "starting"  # starting -> dispatch -> finishing: what a Ctrl-C interrupts
        self._dispatcher = None  # runner.execution.dispatch.Dispatcher once the run directory is ready
        self._invocations = 0  # calls of run(): each one is an invocation of its own
        self.started_at = now_iso()
        self._started_clock = time.monotonic()  # the same instant, for the live rate

    @property
    def stopping(self) -> bool:
        return self.stops.requested

    def run(self, resume: bool | None = None) -> int:
        """Run (or, with resume=True, continue) the run; returns the exit code (0 every row done).
        Bad input raises UsageError; built from keywords, its message names keywords, not flags."""
        try:
            if resume is not None:
                self.resume = bool(resume)
            if self.resume:
                # What the resumed run recorded: its drawn seed, above all (and, from keywords, the rest).
                recorded = recorded_config(self.config.model_dump())
                if self._keywords is not None:
                    from runner.original_api import config_from_original

                    self.config = config_from_original(self._keywords, recorded)
                else:
                    self.config = with_recorded_seed(self.config, recorded)
            self._begin_invocation()
            return self._run()
        except UsageError as err:
            if self._keywords is None:
                raise
            from runner.original_api import keyword_message

            raise UsageError(keyword_message(str(err), self._keywords)) from None

    def _begin_invocation(self) -> None:
        """Each call of run() is an invocation of its own: its start, its stops and Ctrl-Cs, and from
        the second call on a new run id (config.json times each invocation by its run id)."""
        if self._invocations:
            self.config = with_new_run_id(self.config)
        self._invocations += 1
        self.stops = StopState()
        self._interrupts = 0
        self._phase = "starting"
        self._dispatcher = None
        self.started_at = now_iso()
        self._started_clock = time.monotonic()

    def _run(self) -> int:
        _refuse_run_while_a_worker_imports_the_script()
        from runner.input.secrets import environment_without_keys, register_config
        from runner.preflight import Preflight
        from runner.storage.lock import RunLock, RunLockBusy
        from runner.storage.run_dir import RunDirectory
        from runner.storage.runview import Selection
        from runner.storage.store import STORAGE_ERRNOS, RunStore
        from tools.registry import unavailable_tools

        config = self.config
        register_config(config)  # every key is redacted from records and console lines
        run_dir = RunDirectory(config, resume=self.resume, overwrite=self.overwrite,
                               allow_config_change=self.allow_config_change, started_at=self.started_at)
        run_dir.refuse_dataset_among_outputs()
        checks = Preflight(config, self.log)
        unavailable = unavailable_tools(config.tools)
        # Workers start now, so their imports overlap with reading the dataset and the run directory.
        with environment_without_keys():  # workers, and every command they start, never see a key
            executor = self._make_executor(unavailable)
            executor.start()
        previous_handlers = self._install_signal_handlers(executor)
        try:
            scan = checks.scan()
            checks.warn_if_not_isolated()
            failed_images = checks.prepare_images(scan)
            checks.probe_endpoint()
            self.run_dir.mkdir(parents=True, exist_ok=True)
            lock = RunLock(self.run_dir)
            try:
                lock.acquire(self.log)
            except RunLockBusy as err:
                raise UsageError(str(err)) from None
            try:
                from runner.storage.leftovers import clean_run_leftovers

                clean_run_leftovers(self.run_dir, self.log)  # what a killed invocation left behind
                run_dir.prepare()
                if self.resume:
                    run_dir.check_resumed_configuration()
                self._print_header(scan)  # after every check that can stop the run at its start
                run_dir.write_config()
                store = RunStore(self.run_dir, config.run_name, config.batch_size, Selection.of(config))
                checks.warn_unavailable(unavailable)
                return self._run_locked(checks, scan, store, executor, failed_images)
            except OSError as err:  # a write of the merge, statistics, config...: name the path
                if err.errno in STORAGE_ERRNOS:
                    raise StorageError(err.filename or self.run_dir, err) from err
                raise
            finally:
                lock.release()
        finally:
            # SIGTERM to the workers: an idle one exits at once (even mid-import, after a bad
            # dataset); one with sessions left cancels them, which removes their sandboxes.
            executor.shutdown(abandon=True)
            for signum, handler in previous_handlers.items():
                signal.signal(signum, handler)

    def _run_locked(self, checks, scan, store, executor, failed_images: dict[str, str]) -> int:
        """The run once its directory is ready: dispatch what is left, then the end of the run."""
        from runner.compress.after_run import compress_after_run
        from runner.execution.dispatch import Dispatcher
        from runner.output import closing

        config = self.config
        store.repair_torn_tails(self.log)
        units = self._units(scan)[0]
        store.load(self.log, units=units)  # the view's columns sized by the dataset
        from runner.storage.journal import record_journaled_spend

        # what the rows in flight spent when an earlier invocation's runner was killed
        record_journaled_spend(self.run_dir, store, skip_run_id=config.tools.run_id, units=units, log=self.log)
        done = sum(1 for key in units if store.is_committed(key))
        remaining = len(units) - done
        if self.resume or done:
            what = "rows" if config.samples_per_prompt == 1 else "samples"
            print(f"📂 Resuming: {done:,} of {len(units):,} {what} already committed; {remaining:,} to run")

        monitor = self._make_monitor(units, store, done, remaining)
        executor.watch(monitor)  # each request's usage as it completes; the budget admits requests
        self._dispatcher = Dispatcher(config, store, executor, monitor, stops=self.stops, log=self.log,
                                      rows=checks.read_rows, failed_images=failed_images, to_run=remaining)
        rows_this_run = 0
        if remaining and not self.stopping:
            self._phase = "dispatch"
            rows_this_run = self._dispatcher.run(scan)
        elif not remaining:
            print("✅ All prompts have already been processed; rebuilding the merged outputs.")
        self._phase = "finishing"
        executor.shutdown()  # nothing is in flight now: the workers are not needed for the merge
        record_journaled_spend(self.run_dir, store, own_run_id=config.tools.run_id, units=units,
                               log=self.log)  # retired
        store.close()

        print("\n📦 Combining all batch files into trajectories.jsonl...")
        scan = checks.rescan(scan)
        units, unit_ids = self._units(scan)
        view, stats = closing.merge(self.run_dir, config, units, unit_ids, total_prompts=scan.rows,
                                    rows_this_run=rows_this_run, log=self.log)
        outcomes = stats["outcomes"]
        outcome = decide(self.stops.stop, budget_reached=monitor.budget_reached, failed=outcomes["failed"],
                         not_run=outcomes["not_run"])
        closing.publish(self.run_dir, config, view, stats, outcome, monitor)
        code = outcome.exit_code
        if config.compress_to_tokens and outcome.kind == "budget":  # summaries would spend past it
            print("\n🗜️  Not compressed: the run stopped at its cost budget; --resume with a higher --max_cost "
                  "compresses once the rows are done.")
        elif config.compress_to_tokens and not self.stopping:
            code = compress_after_run(self.run_dir, config, code)
        return code

    def _make_executor(self, unavailable: dict[str, str]) -> Executor:
        config = self.config
        if config.executor == "ray":
            from runner.execution.ray_pool import RayExecutor

            return RayExecutor(config, unavailable, log=self.log)
        from runner.execution.process_pool import ProcessExecutor

        processes = config.num_processes or os.cpu_count() or 1
        return ProcessExecutor(config, unavailable, self._sessions(), processes, log=self.log)

    def _sessions(self) -> int:
        """--num_workers, but never more sessions than the dataset can have rows (2 prompts: 2 sessions)."""
        config = self.config
        wanted = config.num_workers
        rows = _count_lines(config.dataset_file, stop_at=wanted)
        if config.max_samples:
            rows = min(rows, config.max_samples)
        return max(1, min(wanted, rows))

    def _units(self, scan) -> tuple[dict[str, int], dict[str, str]]:
        """The units of work of the dataset: every sample key -> its row's index, and their ids."""
        from runner.input.samples import sample_ids, sample_units

        samples = self.config.samples_per_prompt
        if samples == 1:
            return scan.key_to_index, scan.ids
        return sample_units(scan.key_to_index, samples), sample_ids(scan.ids, samples)

    def _print_header(self, scan) -> None:
        c = self.config
        print("📊 Batch Runner Initialized")
        print(f"   Dataset: {c.dataset_file} ({plural(scan.rows, 'prompt')})")
        print(f"   Batch size: {c.batch_size}")
        print(f"   Run name: {c.run_name}")
        print(f"   Distribution: {c.distribution}")
        print(f"   Model: {c.model}" + (f" @ {c.base_url}" if c.base_url else " (built-in offline model)"))
        print(f"   Output directory: {self.run_dir}")
        if c.executor == "ray":
            print(f"   Workers: Ray cluster {c.ray_address or '(local)'}, {plural(c.sessions_per_node or c.num_workers, 'session')} per node")
        else:
            print(f"   Workers: {plural(self._sessions(), 'concurrent session')}")
        if c.ephemeral_system_prompt:
            text = c.ephemeral_system_prompt
            print(f"   🔒 Ephemeral system prompt: '{text[:60]}{'...' if len(text) > 60 else ''}'")

    def _make_monitor(self, units: dict[str, int], store, done: int, remaining: int):
        """Live spend, forecast and status.json for this invocation, with the budget if one is set."""
        from runner.execution.budget import Budget
        from runner.output.status import FORECAST_MIN_ROWS, LiveSpend, RunMonitor
        from runner.storage.runview import Selection

        config = self.config
        # the scope decides what the budget counts; only a budget counts unknown costs at the mean
        spend = LiveSpend(scope=config.max_cost_scope, estimate_unknown=config.max_cost is not None,
                          prices_given=config.prices is not None, before=store.spent())  # what earlier invocations committed, kept by the run view
        kept = sum(1 for key in units if store.outcome(key) == "ok")
        budget = Budget(config.max_cost, config.max_cost_hard, spend) if config.max_cost is not None else None
        monitor = RunMonitor(self.run_dir, config.run_name, total_rows=len(units), finished_before=done,
                             kept_before=kept, to_run=remaining, spend=spend, budget=budget,
                             budget_limit=config.max_cost, log=self.log,
                             forecast_after=max(FORECAST_MIN_ROWS, self._sessions()), t0=self._started_clock)
        monitor.selection = Selection.of(config)
        return monitor

    def _install_signal_handlers(self, executor) -> dict:
        """Ctrl-C / SIGTERM, from the start of the run to its end; returns the handlers they replace.

        The first signal stops the run the gentle way: no new prompts, in-flight ones get the grace
        period, then the merge, statistics and report as usual (exit 130). A second one quits at
        once, wherever the run is (the merge included): the rows in flight are committed as failed
        attempts with what they spent; every committed line is already fsynced, and every output
        file is replaced atomically, so each is either its old or its new version; the next start
        removes the temp files this leaves.
        """
        def on_signal(signum, frame):
            self._interrupts += 1
            if self._interrupts == 1:
                self.stops.request("interrupted")
                if self._phase == "dispatch":
                    self.log(
                        f"\n⏸️  Stopping: no new prompts; waiting up to {self.config.grace_period:g}s for "
                        f"{executor.in_flight()} in-flight prompt(s). Press Ctrl-C again to quit at once."
                    )
                elif self._phase == "finishing":
                    self.log("\n⏸️  Stopping: writing the merged outputs first. Press Ctrl-C again to quit at once.")
                else:
                    self.log("\n⏸️  Stopping: no prompt will be started. Press Ctrl-C again to quit at once.")
                return
            executor.terminate()
            if self._dispatcher is not None:
                self._dispatcher.commit_at_quit()
            print("\n⏹️  Quit at once; committed rows are safe. Run again with --resume.", file=sys.stderr, flush=True)
            os._exit(EXIT_INTERRUPTED)

        return {signum: signal.signal(signum, on_signal) for signum in (signal.SIGINT, signal.SIGTERM)}


def cli(argv: list[str] | None = None) -> None:
    if argv is None:  # the real command line: keys leave our environment and argv first (may re-exec)
        from runner.input.secrets import protect_process_secrets

        protect_process_secrets()
    from runner.input.flags import FlagError, bool_flags, check_argv, format_help, text_flags, wants_help

    argv = sys.argv[1:] if argv is None else list(argv)
    if wants_help(argv):
        print(format_help())
        raise SystemExit(EXIT_OK)
    strings = text_flags()
    try:
        argv = check_argv(argv, strings, bool_flags())  # before fire: main() exits before fire would see a leftover flag
    except FlagError as err:
        print(f"❌ Error: {err}", file=sys.stderr)
        raise SystemExit(EXIT_ERROR) from None
    import fire  # (after --help, which needs none of it)

    fire.Fire(fire.decorators.SetParseFns(**{name: str for name in strings})(main), command=argv)


if __name__ == "__main__":
    cli()
