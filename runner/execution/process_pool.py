"""Runs rows on a pool of worker processes, each running many sessions at once.

The parent hands each worker at most as many rows as it has session slots, so it always knows
which rows are in flight where: when a worker dies, its rows come back as failed records (retried
on resume) instead of vanishing. Results return in completion order; scheduling is per row, so a
slow prompt holds one slot, never a batch.

Each worker has its own pipe to the parent, used for nothing else: tasks go down it, records and
log lines come back, and so does each row's usage as every request is sent and ends, so the parent
knows the spend per request (the watcher: the live status and the budget, which under --max_cost
answers the worker's ask before each request). A row given up in flight is committed with the usage
its worker last reported, so every request sent is counted. A shared queue would let a worker killed halfway through a large message
leave the reader waiting forever for the rest; on a pipe of its own, a dead worker's half-sent
message ends in end-of-file, which reads as that worker's death. The same pipe tells the worker
that the parent died: its end reads end-of-file too, whatever killed the parent.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import signal
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import wait

from runner.input.config import RunConfig
from runner.console import plural
from runner.execution.group_signals import CANCEL_SIGNAL, spawning_shielded
from runner.execution.executor import SHUTDOWN_WAIT, SpendWatcher
from runner.execution.task import Task
from runner.execution.worker import WorkerRuntime, failed_record, send_message, worker_main
from runner.storage.records import row_key_of
from agent.usage import Usage


@dataclass
class _Worker:
    slot: int
    process: mp.Process
    conn: object  # multiprocessing Connection: tasks down, ("result" | "log", payload) up
    slots: int
    in_flight: dict[str, Task] = field(default_factory=dict)  # row key -> task
    usage: dict[str, dict] = field(default_factory=dict)  # row key -> its usage so far, as last reported
    broken: bool = False  # its pipe ended (EOF, or a message cut short): the worker is dead or dying
    retired: bool = False  # its slot died too often in a short time and is not restarted


class DeathWindow:
    """The deaths of one worker slot in a sliding time window.

    Deaths spread over hours (an OOM kill now and then) are part of a long run; many deaths in a
    short time are a crash loop, and restarting the worker again would only spin.
    """

    def __init__(self, limit: int, window: float, clock=time.monotonic):
        self.limit, self.window, self.clock = limit, window, clock
        self.deaths: deque[float] = deque()

    def record(self) -> bool:
        """Note one death; True when `limit` deaths fell within the last `window` seconds."""
        now = self.clock()
        self.deaths.append(now)
        while self.deaths and now - self.deaths[0] > self.window:
            self.deaths.popleft()
        return len(self.deaths) >= self.limit


# A second Ctrl-C quits at once, yet reads for up to this long what the workers report while they
# stop (the requests their sessions sent last), so that every request sent is committed.
QUIT_REPORT_WAIT = 1.0
REAPER_WAIT = 60.0  # seconds the end of a run waits for the removal of what dead workers left


class ProcessExecutor:
    """An Executor (runner/execution/executor.py) on a pool of worker processes on this machine."""

    CRASH_LOOP_DEATHS = 5  # deaths of one worker slot ...
    CRASH_LOOP_WINDOW = 60.0  # ... within this many seconds stop the run instead of spinning
    DRAIN_LIMIT = 2000  # messages read from one worker per poll, so one busy worker cannot starve the rest

    def __init__(self, config: RunConfig, unavailable: dict[str, str], sessions: int, processes: int, log=print):
        self.config = config
        self.unavailable = unavailable
        self.log = log
        processes = max(1, min(processes, sessions))
        base, extra = divmod(sessions, processes)
        self.slot_plan = [base + (1 if i < extra else 0) for i in range(processes)]
        # forkserver: a clean server process (no inherited threads or locks from the parent)
        # imports the worker code once, then forks every worker ready to run: one import of the
        # model SDK per run instead of one per process, and workers ready sooner.
        self._ctx = mp.get_context("forkserver")
        # shielded first: the fork server and its workers ignore a signal sent to the whole group.
        # The SDK only when a worker will use it (an https endpoint, a proxy: agent/model_client.py),
        # with httpcore2 and truststore, what it imports when a worker builds its HTTP client
        # (about 50 ms a worker otherwise, each time, before its first row); a module missing
        # from an SDK version is skipped by the fork server.
        sdk = ["agent.sdk_transport", "httpcore2", "truststore"] if WorkerRuntime.needs_sdk(config) else []
        self._ctx.set_forkserver_preload(["runner.execution.shielded", "runner.execution.worker", *sdk])
        self.workers: list[_Worker] = []
        self._reading = False  # a pipe is being read (see _drain)
        self._deaths = [DeathWindow(self.CRASH_LOOP_DEATHS, self.CRASH_LOOP_WINDOW) for _ in self.slot_plan]
        self.stop_reason: str | None = None  # set when workers keep dying: the run should stop
        self.watcher: SpendWatcher | None = None  # told each request's usage; admits requests (the budget)
        self._late: list[dict] = []  # records that arrived while the workers stopped
        self._reapers: list[threading.Thread] = []  # removing what dead workers left (shutdown waits)
        self._closed = False

    def watch(self, watcher: SpendWatcher) -> None:
        self.watcher = watcher

    def describe(self) -> str:
        return f"{plural(sum(self.slot_plan), 'session')} on {plural(len(self.slot_plan), 'process', 'processes')}"

    def start(self) -> None:
        with spawning_shielded():  # the fork server starts with the first worker
            for slot, sessions in enumerate(self.slot_plan):
                self.workers.append(self._spawn(slot, sessions))

    def _spawn(self, slot: int, sessions: int) -> _Worker:
        ours, theirs = self._ctx.Pipe(duplex=True)
        process = self._ctx.Process(
            target=worker_main,
            args=(slot, self.config, self.unavailable, sessions, theirs),
            name=f"abr-worker-{slot}",
            daemon=True,
        )
        process.start()
        theirs.close()  # only the worker holds its end now, so its death reads as end-of-file here
        return _Worker(slot, process, ours, sessions)

    def _live(self) -> list[_Worker]:
        return [w for w in self.workers if not w.retired]

    def free_slots(self) -> int:
        return sum(w.slots - len(w.in_flight) for w in self._live() if not w.broken)

    def in_flight(self) -> int:
        return sum(len(w.in_flight) for w in self.workers)

    def submit(self, task: Task) -> None:
        worker = max((w for w in self._live() if not w.broken), key=lambda w: w.slots - len(w.in_flight))
        worker.in_flight[task.key] = task  # before sending: if the worker is dead, the row fails below
        try:
            send_message(worker.conn, task)
        except OSError:
            worker.broken = True  # the next poll reaps it and fails its rows

    def poll(self, timeout: float) -> list[dict]:
        """Records that finished since the last call (waits up to `timeout` for the first)."""
        live = [w for w in self._live() if not w.broken]
        records: list[dict] = []
        ready = set(wait([w.conn for w in live] + [w.process.sentinel for w in live], timeout))
        for worker in live:
            if worker.conn in ready:
                self._drain(worker, records)
        records.extend(self._reap_dead_workers())
        return records

    def _drain(self, worker: _Worker, records: list[dict] | None) -> None:
        """Read the worker's complete messages; end-of-file or a message cut short marks it broken."""
        # A second Ctrl-C's handler runs on this thread, between any two steps of a read: it reads
        # the pipes itself only when no read was cut in the middle (a pipe holds whole messages).
        self._reading = True
        try:
            self._read_messages(worker, records)
        finally:
            self._reading = False

    def _read_messages(self, worker: _Worker, records: list[dict] | None) -> None:
        for _ in range(self.DRAIN_LIMIT):
            try:
                if not worker.conn.poll():
                    return
                kind, payload = worker.conn.recv()
            except (EOFError, OSError, pickle.UnpicklingError):
                worker.broken = True
                return
            if kind == "result":
                key = row_key_of(payload)
                worker.in_flight.pop(key, None)
                worker.usage.pop(key, None)
                (self._late if records is None else records).append(payload)
            elif kind == "usage":  # the newest usage of each row that changed, in one message
                for key, usage in payload:
                    if key in worker.in_flight:
                        worker.usage[key] = usage
                        if self.watcher is not None:
                            self.watcher.on_usage(key, usage)
            elif kind == "ask":
                allowed = self.watcher is None or self.watcher.may_send()
                try:
                    send_message(worker.conn, ("admit", payload, allowed))
                except OSError:
                    worker.broken = True
                    return
            elif kind == "log":
                self.log(payload)

    def _reap_dead_workers(self) -> list[dict]:
        lost: list[dict] = []
        for worker in self._live():
            if not worker.broken and worker.process.is_alive():
                continue
            if worker.process.is_alive():  # its pipe broke under it: whatever it still does is lost
                worker.process.kill()
            worker.process.join(5.0)
            if not worker.broken:  # it died with whole messages still in the pipe: take them first
                self._drain(worker, lost)
            code = worker.process.exitcode
            tasks = list(worker.in_flight.values())
            lost.extend(self._unfinished(worker, f"worker process died (exit code {code})", "agent"))
            worker.conn.close()
            self._reapers.append(_clean_after_worker(self.config, tasks, self.log))
            if self._deaths[worker.slot].record():
                worker.retired = True
                self.stop_reason = (
                    f"worker process {worker.slot} died {self.CRASH_LOOP_DEATHS} times within "
                    f"{self.CRASH_LOOP_WINDOW:g}s (last exit code {code})"
                )
                self.log(f"⚠️  Worker {worker.slot} died (exit code {code}); {len(tasks)} row(s) failed; "
                         f"it keeps dying, so it is not restarted")
                continue
            self.log(f"⚠️  Worker {worker.slot} died (exit code {code}); {len(tasks)} row(s) failed, restarting it")
            self.workers[self.workers.index(worker)] = self._spawn(worker.slot, worker.slots)
        return lost

    def _unfinished(self, worker: _Worker, error: str, error_class: str, *, spent_only: bool = False) -> list[dict]:
        """Failed records of the rows the worker will not finish, with what they spent as it
        reported (a request without its reply counts at an unknown cost); `spent_only`: only the
        rows that sent a request (the others spent nothing and are simply run again)."""
        records = []
        for key, task in worker.in_flight.items():
            usage = Usage.read(worker.usage.get(key))
            if usage.requests or not spent_only:
                records.append(failed_record(task, self.config, error, error_class, usage=usage))
        worker.in_flight.clear()
        worker.usage.clear()
        return records

    def abandoned(self, error: str, error_class: str) -> list[dict]:
        """After `shutdown`: the records that came in while the workers stopped, and a failed
        record of each row that spent money and did not finish, to be committed."""
        for worker in self.workers:  # what they reported before they stopped (a quit at once does not wait)
            if not worker.broken and not worker.conn.closed and not self._reading:
                self._drain(worker, None)
        records, self._late = self._late, []
        for worker in self.workers:
            records.extend(self._unfinished(worker, error, error_class, spent_only=True))
        return records

    def shutdown(self, abandon: bool = False, timeout: float | None = None) -> None:
        """Stop the workers (once). abandon=True cancels in-flight sessions (their sandboxes are removed).
        Workers still alive after `timeout` (SHUTDOWN_WAIT) are killed, and what any session of the
        run left is removed here: a worker may have been killed in the middle of a clean-up (a
        working directory of 300,000 folders takes longer than that)."""
        timeout = SHUTDOWN_WAIT if timeout is None else timeout
        if self._closed:
            return
        self._closed = True
        workers = [w for w in self.workers if w.process.is_alive()]
        for worker in workers:
            if abandon:
                _cancel(worker)  # the worker cancels its sessions and cleans up
            else:
                try:
                    worker.conn.send(None)
                except OSError:
                    _cancel(worker)
        deadline = time.monotonic() + timeout
        while any(w.process.is_alive() for w in workers) and time.monotonic() < deadline:
            # Keep reading while they stop, so none waits on a full pipe (what comes now is not committed).
            pipes = [w.conn for w in workers if not w.broken and not w.conn.closed]
            ready = set(wait(pipes + [w.process.sentinel for w in workers], min(0.5, max(0.0, deadline - time.monotonic()))))
            for worker in workers:
                if worker.conn in ready:
                    self._drain(worker, None)
        killed = 0
        for worker in self.workers:
            if worker.process.is_alive():
                worker.process.kill()
                killed += 1
            worker.process.join(1.0)
            if not worker.conn.closed:
                worker.conn.close()
        _stop_fork_server()
        if killed:
            self.log(f"⚠️  {plural(killed, 'worker')} still busy after {timeout:g}s (cleaning up after its sessions?) "
                     "stopped; removing what the sessions left")
            self._reapers.append(_clean_after_worker(self.config, None, self.log))
        self._wait_for_reapers()

    def _wait_for_reapers(self) -> None:
        """What dead workers left (their commands, working directories, containers) is removed
        before the run ends: a large directory takes seconds, and an exit would cut it short."""
        deadline = time.monotonic() + REAPER_WAIT
        for reaper in self._reapers:
            reaper.join(max(0.0, deadline - time.monotonic()))
        if any(reaper.is_alive() for reaper in self._reapers):
            self.log(f"⚠️  Still removing what dead workers left after {REAPER_WAIT:g}s; the next start of "
                     "this run removes the rest")

    def terminate(self) -> None:
        """Signal every worker to cancel its sessions and remove their sandboxes; do not wait for
        that, only (at most QUIT_REPORT_WAIT) for what they report while they stop: a request a
        session sent just before may reach the endpoint before its worker's report of it reaches
        the pipe, and the rows in flight are committed with what was reported."""
        for worker in self.workers:
            if worker.process.is_alive():
                _cancel(worker)
        deadline = time.monotonic() + QUIT_REPORT_WAIT
        while time.monotonic() < deadline and not self._reading:
            reporting = [w for w in self.workers if not w.broken and not w.conn.closed and w.process.is_alive()]
            if not reporting:
                return
            ready = set(wait([w.conn for w in reporting], max(0.0, deadline - time.monotonic())))
            for worker in reporting:
                if worker.conn in ready:
                    self._drain(worker, None)


def _cancel(worker: _Worker) -> None:
    """Ask one worker to cancel its sessions (removing their sandboxes) and exit. Not SIGTERM: the
    workers ignore that one, since it also comes to the whole group from `timeout` or systemd."""
    try:
        os.kill(worker.process.pid, CANCEL_SIGNAL)
    except ProcessLookupError:
        pass


def _clean_after_worker(config: RunConfig, tasks: list[Task] | None, log) -> threading.Thread:
    """A dead worker could not clean up after its sessions (tasks None: workers killed at the end
    of the run, so after any session of it): do it here, off the dispatch loop, in a thread the
    shutdown waits for."""
    from runner.storage.leftovers import clean_task_leftovers

    task_ids = None if tasks is None else [t.task_id for t in tasks]
    reaper = threading.Thread(target=clean_task_leftovers, args=(config.tools, task_ids, log), name="abr-reaper",
                              daemon=True)
    reaper.start()
    return reaper


def _stop_fork_server() -> None:
    """Stop and reap the fork server, so no process of the run outlives it (and the workers' CPU
    time, which the fork server collected when it reaped them, is accounted to the runner).

    SIGKILL, not only the end of its "alive" pipe: asked that way it exits through the interpreter's
    whole finalization (it has imported the model SDK), which cost every run about 0.13 s and as
    much CPU at its end. Nothing is lost: the workers it forked are reaped already (a worker's
    exit code comes from the fork server's wait for it) and it holds no file of the run."""
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    pid = getattr(server, "_forkserver_pid", None)  # private, hence guarded
    if isinstance(pid, int):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    stop = getattr(server, "_stop", None)
    if stop is not None:
        stop()  # closes its pipe and reaps it
