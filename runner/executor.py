"""Runs rows on a pool of worker processes, each running many sessions at once.

The parent hands each worker at most as many rows as it has session slots, so it always knows
which rows are in flight where: when a worker dies, its rows come back as failed records (retried
on resume) instead of vanishing. Results return in completion order; scheduling is per row, so a
slow prompt holds one slot, never a batch.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
from dataclasses import dataclass, field

from runner.config import RunConfig
from runner.worker import failed_record, worker_main


@dataclass
class _Worker:
    process: mp.Process
    tasks: object  # mp.Queue
    slots: int
    restarts: int = 0
    in_flight: dict[str, dict] = field(default_factory=dict)  # row key -> task


def lost_row_record(task: dict, config: RunConfig, error: str, error_class: str = "agent") -> dict:
    """The failed record of a row that got no answer (its worker vanished, or it never started)."""
    return failed_record(task, config, error, error_class)


class ProcessExecutor:
    MAX_RESTARTS = 5  # per worker slot: past this a crash loop stops the run instead of spinning
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
        self._ctx.set_forkserver_preload(["runner.worker", "agent.model_client", "openai"])
        self.results = self._ctx.Queue()
        self.workers: list[_Worker] = []
        self._closed = False

    def describe(self) -> str:
        return f"{sum(self.slot_plan)} sessions on {len(self.slot_plan)} process(es)"

    def start(self) -> None:
        for worker_id, slots in enumerate(self.slot_plan):
            self.workers.append(self._spawn(worker_id, slots))

    def _spawn(self, worker_id: int, slots: int) -> _Worker:
        tasks = self._ctx.Queue()
        process = self._ctx.Process(
            target=worker_main,
            args=(worker_id, self.config, self.unavailable, slots, tasks, self.results),
            name=f"abr-worker-{worker_id}",
            daemon=True,
        )
        process.start()
        return _Worker(process, tasks, slots)

    def free_slots(self) -> int:
        return sum(w.slots - len(w.in_flight) for w in self.workers)

    def in_flight(self) -> int:
        return sum(len(w.in_flight) for w in self.workers)

    def submit(self, task: dict) -> None:
        worker = max(self.workers, key=lambda w: w.slots - len(w.in_flight))
        worker.in_flight[task["key"]] = task
        worker.tasks.put(task)

    def poll(self, timeout: float) -> list[dict]:
        """Records that finished since the last call (waits up to `timeout` for the first)."""
        records: list[dict] = []
        deadline = time.monotonic() + timeout
        while True:
            wait = 0.0 if records else max(0.0, deadline - time.monotonic())
            try:
                kind, worker_id, payload = self.results.get(timeout=wait) if wait else self.results.get_nowait()
            except queue.Empty:
                break
            if kind == "result":
                self.workers[worker_id].in_flight.pop(payload["metadata"]["row_key"], None)
                records.append(payload)
            elif kind == "log":
                self.log(payload)
        records.extend(self._reap_dead_workers())
        return records

    def _reap_dead_workers(self) -> list[dict]:
        lost: list[dict] = []
        for worker_id, worker in enumerate(self.workers):
            if worker.process.is_alive():
                continue
            code = worker.process.exitcode
            for task in worker.in_flight.values():
                lost.append(lost_row_record(task, self.config, f"worker process died (exit code {code})"))
            self.log(f"⚠️  Worker {worker_id} died (exit code {code}); {len(worker.in_flight)} row(s) failed, restarting it")
            if worker.restarts >= self.MAX_RESTARTS:
                raise RuntimeError(f"worker {worker_id} died {worker.restarts + 1} times (last exit code {code})")
            replacement = self._spawn(worker_id, worker.slots)
            replacement.restarts = worker.restarts + 1
            self.workers[worker_id] = replacement
        return lost

    def shutdown(self, abandon: bool = False, timeout: float = 15.0) -> None:
        """Stop the workers (once). abandon=True cancels in-flight sessions (their sandboxes are removed)."""
        if self._closed:
            return
        self._closed = True
        for worker in self.workers:
            if abandon and worker.process.is_alive():
                worker.process.terminate()  # SIGTERM: the worker cancels its sessions and cleans up
            else:
                worker.tasks.put(None)
        deadline = time.monotonic() + timeout
        for worker in self.workers:
            worker.process.join(max(0.1, deadline - time.monotonic()))
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join(1.0)
        _stop_fork_server()

    def terminate(self) -> None:
        """Signal every worker to cancel its sessions and remove their sandboxes; do not wait."""
        for worker in self.workers:
            if worker.process.is_alive():
                worker.process.terminate()


def _stop_fork_server() -> None:
    """Stop and reap the fork server, so no process of the run outlives it (and the workers' CPU
    time, which the fork server collected when it reaped them, is accounted to the runner)."""
    from multiprocessing import forkserver

    stop = getattr(getattr(forkserver, "_forkserver", None), "_stop", None)  # private, hence guarded
    if stop is not None:
        stop()
