"""The dispatch loop of a run: the samples still to run go to the executor as its slots free up,
the records coming back are committed, and the loop decides when to stop starting rows.

It stops starting rows at the first of: the dataset exhausted, a stop requested (Ctrl-C, a
provider that refuses the run, an endpoint lost or unusable, first replies cut at --max_tokens,
workers that keep dying), the cost budget. What stopped it is kept in the run's StopState
(runner/outcome.py), from which the run's outcome is decided at the end.
"""

from __future__ import annotations

import re
import sys
import time
from typing import Any, Callable

from agent.types import REFUSING_CLASSES
from runner.console import Log, plural
from runner.input.secrets import redact

FIRST_ROWS = 3  # finished rows that, all discarded by the no-reasoning filter, warrant a warning


class Dispatcher:
    """Hands the run's tasks to the executor and commits what comes back, through the store."""

    def __init__(self, config, store, executor, monitor, *, stops, log: Log, rows: Callable, failed_images: dict,
                 to_run: int):
        self.config = config
        self.store = store
        self.executor = executor
        self.monitor = monitor  # runner.output.status.RunMonitor: live spend, budget, status.json
        self.stops = stops  # runner.outcome.StopState, shared with the signal handler
        self.log = log
        self.rows = rows  # scanned key_to_index -> the dataset's valid rows, read again in order
        self.failed_images = failed_images  # image -> why it cannot be used (the backend's check)
        self.to_run = to_run
        self.passed = store.view.passed_by_row()  # row key -> passing samples; --stop_after_passing holds across resume
        self.streaks: dict[str, int] = {}  # failure class -> rows in a row that failed with it
        self.same_failure: tuple[str | None, int] = (None, 0)  # every_request_failed_as, rows in a row
        self.first_finished: list[str] | None = []  # outcomes of the first rows to finish (None: decided)

    def run(self, scan) -> int:
        """Dispatch until no row is left to start and none is in flight; returns the rows committed."""
        from runner.console import progress
        from runner.execution.worker import failed_record

        config, executor, monitor, store = self.config, self.executor, self.monitor, self.store
        counts = {"ok": 0, "failed": 0, "discarded": 0, "retries": 0}
        print(f"\n🚀 Running {plural(self.to_run, 'prompt')}: {executor.describe()}\n")
        tasks = self.tasks(scan)
        exhausted = False
        committed = 0
        grace_deadline = None
        bar = self.log.bar = progress(self.to_run, waiting=monitor.oldest_wait)  # a bar on a terminal; plain lines in a log
        try:
            while True:
                immediate = []
                while not self.stops.requested and not exhausted and executor.free_slots() > 0 and len(immediate) < 500:
                    if not monitor.may_start():  # the cost budget (runner/execution/budget.py)
                        break
                    task = next(tasks, None)
                    if task is None:
                        exhausted = True
                    elif unusable := self.failed_images.get(task.image or config.tools.docker_image or ""):
                        # Known before dispatch: the row fails here, no worker sees it.
                        immediate.append(failed_record(task, config, f"environment: {unusable}", "environment"))
                    else:
                        executor.submit(task)
                        monitor.on_start(task)
                if executor.in_flight() == 0 and not immediate and (exhausted or self.stops.requested
                                                                    or monitor.budget_reached):
                    break
                if monitor.cancel_now():  # --max_cost_hard
                    self.log(f"💸 Budget reached: cancelling {executor.in_flight()} in-flight prompt(s)")
                    executor.shutdown(abandon=True)
                    committed += self.commit_abandoned("cancelled in flight: the cost budget was reached "
                                                       "(--max_cost_hard)", "budget")
                    break
                if self.stops.requested and grace_deadline is None:
                    grace_deadline = time.monotonic() + config.grace_period
                if grace_deadline is not None and time.monotonic() > grace_deadline and executor.in_flight():
                    self.log(f"⏹️  Grace period over: abandoning {executor.in_flight()} in-flight prompt(s)")
                    executor.shutdown(abandon=True)  # stop paying for them now, not after the merge
                    committed += self.commit_abandoned("abandoned in flight: the run was interrupted and the "
                                                       "grace period ended", "interrupted")
                    break
                records = immediate + (executor.poll(0.2) if executor.in_flight() else [])
                if executor.stop_reason and not self.stops.requested:
                    self.stops.request("crash_loop", executor.stop_reason)
                    self.log(f"⛔ {executor.stop_reason}: no new prompts will be started.")
                if records:
                    store.commit(records)
                    committed += len(records)
                    monitor.on_commit(records)
                    self._after_commit(records, counts)
                else:
                    store.save_checkpoint()
                    if hasattr(bar, "tick"):
                        bar.tick()
                monitor.tick(executor.in_flight())
        finally:
            bar.close()
            self.log.bar = None
        return committed

    def tasks(self, scan):
        """The samples still to run, each as the task of its next attempt. Samples run in rounds
        (every row's sample 0, then every row's sample 1, ...), so the samples of a row that
        --stop_after_passing spares are the ones not started yet when its row has passed enough.
        A dataset rewritten under the run ends them (with a message): reading on could start a
        row a second time."""
        from runner.execution.task import Task
        from runner.input.dataset import DatasetChanged
        from runner.input.samples import sample_key

        config, store = self.config, self.store
        try:
            for sample in range(config.samples_per_prompt):
                for row in self.rows(scan.key_to_index):
                    key = sample_key(row.key, sample)
                    if not store.is_committed(key) and not self._row_has_passed_enough(row.key):
                        yield Task.of(row, attempt=store.failures(key) + 1, run_id=config.tools.run_id, seed=config.seed,
                                      sample=sample, samples=config.samples_per_prompt)
        except DatasetChanged as err:
            self.log(f"⚠️  {err}: no more rows are read from it. The rows in flight finish; "
                     "run again with --resume for the rest.")

    def _row_has_passed_enough(self, row_key: str) -> bool:
        """--stop_after_passing: this row has that many passing samples committed."""
        wanted = self.config.stop_after_passing
        return wanted is not None and self.passed.get(row_key, 0) >= wanted

    def commit_abandoned(self, error: str, error_class: str) -> int:
        """The rows given up in flight: what they spent is committed (as failed attempts, run again
        on resume), so every request sent is in the figures."""
        records = self.executor.abandoned(error, error_class)
        self.monitor.on_abandoned()
        if records:
            self.store.commit(records)
            self.monitor.on_commit(records)
        return len(records)

    def commit_at_quit(self) -> None:
        """Quitting at once: the rows in flight are committed as failed attempts with what their
        workers last reported spending (one append and fsync, no waiting for a worker), and
        status.json says the run was interrupted, so every request already sent is counted."""
        if self.store.writing:  # a commit cut mid-line: leave the file whole
            return
        try:
            records = self.executor.abandoned("quit at once: the run was interrupted a second time", "interrupted")
            if records:
                self.store.commit(records)
                self.monitor.on_commit(records)
            self.monitor.close("interrupted")
        except Exception as err:  # quitting at once must still quit: what was fsynced stays committed
            print(f"⚠️  Could not record the rows in flight: {err}", file=sys.stderr, flush=True)

    def _after_commit(self, records: list[dict], counts: dict) -> None:
        from runner.input.samples import row_key_of
        from runner.storage.records import fields_of
        from runner.storage.runview import Selection, quality_outcome
        from runner.storage.scores import judge_refusal, primary_score
        from runner.storage.store import record_outcome

        selection = Selection.of(self.config)
        for record in records:
            fields = fields_of(record)
            outcome = quality_outcome(record, record_outcome(record), selection)
            counts[outcome] += 1
            counts["retries"] += fields.usage.retries
            self._warn_if_all_discarded(outcome)
            primary = primary_score(fields.meta.scores) if outcome != "failed" else None
            if primary is not None and primary.passed:
                row = row_key_of(fields.key)
                self.passed[row] = self.passed.get(row, 0) + 1
            index = record["prompt_index"]
            repeated = self._repeated_failure(record.get("error_class") if outcome == "failed" else None,
                                              record.get("error") or "", fields.usage)
            if outcome == "failed":
                cls = record.get("error_class")
                self.log(f"   ❌ Prompt {index} failed ({cls}): {record['error']}")  # the cause whole
                if cls in REFUSING_CLASSES and not repeated:
                    repeated = ("fatal_provider", f"the provider refused the request ({cls}): {record['error']}")
            else:
                if self.config.verbose:
                    self.log(f"   {'✅' if outcome == 'ok' else '🚫'} Prompt {index} {outcome}: {self._preview(record)}")
                if refused := judge_refusal(fields.meta.scores):
                    # The sample is kept (its agent was paid for); every later grade would be refused.
                    repeated = ("fatal_provider", f"{refused}; the samples committed with this error keep their "
                                "trajectories: once the key works, `--rescore --scorer=judge` grades them")
            if repeated and not self.stops.requested:
                # The cause quotes a provider's error, and some echo the key they refused: it
                # reaches statistics.json and report.html, which no other redaction passes.
                repeated = (repeated[0], redact(repeated[1]))
                self.stops.request(*repeated)
                self.log(f"⛔ {repeated[1]}\n   No new prompts will be started.")
        self.log.bar.set_postfix(counts, refresh=False)
        self.log.bar.update(len(records))

    def _repeated_failure(self, cls: str | None, error: str, usage: Any = None) -> tuple[str, str] | None:
        """The stop (kind, cause) when the same failure comes back row after row, else None: every
        row of a recent window failed to connect, had its first reply cut at --max_tokens, or had
        every request fail the same way (the endpoint is not the API it should be)."""
        streaks = self.streaks
        for name in ("connection", "truncated"):
            streaks[name] = streaks.get(name, 0) + 1 if cls == name else 0
        window = max(3, min(self.config.num_workers, 8))
        if cls == "connection" and streaks[cls] >= window:
            return "endpoint_lost", (f"the model endpoint cannot be reached: the last {streaks[cls]} rows all failed "
                                     f"to connect ({error})")
        if cls == "truncated" and streaks[cls] >= 3:
            limit = (f"--max_tokens={self.config.max_tokens} is too small for this model (raise it or leave it unset)"
                     if self.config.max_tokens else "the server's default output limit is too small for this model "
                     "(pass a larger --max_tokens)")
            return "bad_max_tokens", (f"configuration error: the first reply of the last {streaks[cls]} rows was cut "
                                      f"at the output length limit; {limit}")
        same = every_request_failed_as(error) if cls == "provider" and _no_request_succeeded(usage) else None
        before, count = self.same_failure
        self.same_failure = (same, count + 1 if same and same == before else 1)
        if same and self.same_failure[1] >= window:
            return "endpoint_unusable", (f"the model endpoint {same}: every request of the last "
                                         f"{self.same_failure[1]} rows failed that way ({error})")
        return None

    def _warn_if_all_discarded(self, outcome: str) -> None:
        """Say it early: when the first rows that finish are all discarded for no reasoning (a
        model that gives none), every row will be; name the flag that keeps them."""
        if self.first_finished is None:
            return
        if outcome == "failed":
            self.to_run -= 1  # a failed row tells nothing about the filter
            return
        self.first_finished.append(outcome)
        if outcome == "ok":
            self.first_finished = None  # a row was kept: the filter is not discarding everything
        elif len(self.first_finished) >= min(FIRST_ROWS, self.to_run):
            finished = len(self.first_finished)
            self.first_finished = None
            self.log(f"⚠️  The first {plural(finished, 'row')} to finish were all discarded for no reasoning "
                     "(this model gives none?): pass --keep_no_reasoning to keep them (--resume "
                     "--keep_no_reasoning keeps the rows already made, with no new request)")

    def _preview(self, record: dict) -> str:
        """The row's prompt, cut at --log_prefix_chars."""
        prompt = record.get("prompt")
        if prompt is None:
            prompt = next((t["value"] for t in record.get("conversations") or () if t.get("from") == "human"), "")
        limit = self.config.log_prefix_chars
        text = " ".join(str(prompt).split())
        return repr(text[:limit] + ("..." if len(text) > limit else ""))


def every_request_failed_as(error: str) -> str | None:
    """The failure a row's error names, as one name for all rows that failed the same way ("HTTP
    500 to every request"), or None for a failure that is not the endpoint's answer."""
    from agent.model_client import ANSWERS_HTML, REDIRECT_LOOP

    if ANSWERS_HTML in error:
        return ANSWERS_HTML.removeprefix("the endpoint ")
    status = re.match(r"HTTP (\d{3})\b", error)
    if status and status.group(1) not in ("400", "413", "422"):  # those refuse a row's own request (too long, ...)
        return f"gives HTTP {status.group(1)} to every request"
    if error.startswith("malformed response"):
        return "gives a malformed reply to every request"
    if error.startswith("request timed out"):
        return "answers no request within --request_timeout"
    if error.startswith("the reply is larger than"):
        return "sends replies larger than a model reply may be"
    if error.startswith(REDIRECT_LOOP):
        return "redirects every request in a loop"
    return None


def _no_request_succeeded(usage: Any) -> bool:
    """Every request of the attempt (an agent.usage.Usage) failed: all but the first were retries
    (a failed row whose model answered some request says nothing about the endpoint as a whole)."""
    return usage is not None and usage.requests - usage.retries <= 1
