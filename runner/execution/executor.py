"""What the runner needs from an executor: the interface ProcessExecutor and RayExecutor share.

BatchRunner drives either through these methods only (tests/runner/execution/test_executor_protocol.py checks that
both classes have each one with the same signature). An executor owns where rows run; the runner
owns which rows run, and commits what `poll` returns.
"""

from __future__ import annotations

from typing import Protocol

from runner.execution.task import Task


class SpendWatcher(Protocol):
    """Who decides on the run's spend (the runner's live status and budget), told per request."""

    def on_usage(self, key: str, usage: dict) -> None:
        """A row in flight changed its usage: `usage` is its whole usage so far (a record's `usage`
        form, with `pending`: requests sent whose reply has not come yet)."""

    def may_send(self) -> bool:
        """May a worker send one more model request now (the cost budget)?"""


SHUTDOWN_WAIT = 15.0  # seconds the end of a run waits for its workers to stop (their last clean-ups)


class Executor(Protocol):
    # Why the run should stop starting rows (workers keep dying), or None.
    stop_reason: str | None

    def describe(self) -> str:
        """Where the rows run, in plain words, for the start line ("4 sessions on 2 processes")."""

    def start(self) -> None:
        """Start the workers (they import and connect while the parent reads the dataset)."""

    def free_slots(self) -> int:
        """How many more tasks `submit` may take now."""

    def in_flight(self) -> int:
        """Tasks submitted whose record `poll` has not returned yet."""

    def submit(self, task: Task) -> None:
        """Run one task; its record comes back from a later `poll`, whatever happens to the worker."""

    def poll(self, timeout: float) -> list[dict]:
        """The records finished since the last call, waiting up to `timeout` seconds for the first."""

    def watch(self, watcher: SpendWatcher) -> None:
        """Report each request's usage to `watcher` as it completes, and let it admit requests."""

    def abandoned(self, error: str, error_class: str) -> list[dict]:
        """After `shutdown`: records that came in meanwhile, and a failed record (`error`,
        `error_class`) of each row that sent requests and did not finish, so that what it spent
        is committed."""

    def shutdown(self, abandon: bool = False, timeout: float | None = None) -> None:
        """Stop the workers (once); abandon=True cancels the sessions in flight and removes their sandboxes."""

    def terminate(self) -> None:
        """Tell every worker to cancel its sessions and clean up, without waiting (a second Ctrl-C)."""
