"""The outcome of an invocation: one value, decided in one place (`decide`), from which the
console's headline, the exit code, status.json's last state and statistics.json's `outcome` are
all read.

During the run, whatever stops it early is recorded as a `Stop` (the first one wins: a later
reason is only logged). At the end, `decide` turns the stop (or none), whether the budget stopped
new rows, and the rows left undone into the Outcome. Imports nothing: every stage may use it.
"""

from __future__ import annotations

from dataclasses import dataclass

EXIT_OK, EXIT_ERROR, EXIT_INCOMPLETE, EXIT_FATAL_PROVIDER, EXIT_BUDGET, EXIT_STORAGE, EXIT_INTERRUPTED = (
    0, 1, 2, 3, 4, 5, 130)

# kind -> (exit code, status.json state)
_KINDS = {
    "done": (EXIT_OK, "done"),  # every row done
    "failed_rows": (EXIT_INCOMPLETE, "incomplete"),  # finished, with failed or unrun rows
    "budget": (EXIT_BUDGET, "stopped_budget"),  # --max_cost stopped new rows
    "interrupted": (EXIT_INTERRUPTED, "interrupted"),  # Ctrl-C / SIGTERM
    "fatal_provider": (EXIT_FATAL_PROVIDER, "stopped_provider"),  # auth or quota refused
    "endpoint_lost": (EXIT_FATAL_PROVIDER, "stopped_provider"),  # every recent row failed to connect
    "bad_max_tokens": (EXIT_FATAL_PROVIDER, "stopped_provider"),  # first replies cut at the output limit
    "endpoint_unusable": (EXIT_FATAL_PROVIDER, "stopped_provider"),  # every request failed the same way
    "crash_loop": (EXIT_INCOMPLETE, "stopped_workers"),  # worker processes kept dying
}
STOP_KINDS = tuple(kind for kind in _KINDS if kind not in ("done", "failed_rows", "budget"))


@dataclass(frozen=True)
class Stop:
    """Why no new row is started: one of STOP_KINDS, and the cause in words."""

    kind: str
    message: str = ""

    def __post_init__(self):
        if self.kind not in STOP_KINDS:
            raise ValueError(f"unknown stop kind {self.kind!r}")


class StopState:
    """The invocation's stop, shared by the dispatch loop and the signal handler: the first reason
    given is kept (a later one is only logged by whoever found it)."""

    def __init__(self):
        self.stop: Stop | None = None

    @property
    def requested(self) -> bool:
        return self.stop is not None

    def request(self, kind: str, message: str = "") -> None:
        if self.stop is None:
            self.stop = Stop(kind, message)


@dataclass(frozen=True)
class Outcome:
    kind: str
    message: str | None = None  # the cause, for a run stopped early
    failed: int = 0
    not_run: int = 0

    @property
    def exit_code(self) -> int:
        return _KINDS[self.kind][0]

    @property
    def state(self) -> str:
        """status.json's last state."""
        return _KINDS[self.kind][1]

    @property
    def headline(self) -> str:
        """The summary's title: what happened to the run."""
        if self.kind == "done":
            return "BATCH PROCESSING COMPLETE"
        if self.kind == "failed_rows":
            return f"FINISHED WITH {_rows_left(self.failed, self.not_run)} (retry with --resume)"
        if self.kind == "interrupted":
            return "BATCH PROCESSING INTERRUPTED (committed rows are safe; --resume finishes the run)"
        if self.kind == "budget":
            return "BATCH PROCESSING STOPPED AT THE COST BUDGET"
        return "BATCH PROCESSING STOPPED EARLY"

    def as_dict(self) -> dict:
        """statistics.json's `outcome`."""
        return {"kind": self.kind, "exit_code": self.exit_code, "message": self.message}


def _rows_left(failed: int, not_run: int) -> str:
    def rows(n: int) -> str:
        return "ROW" if n == 1 else "ROWS"

    if failed and not_run:
        return f"{failed:,} FAILED AND {not_run:,} UNRUN {rows(failed + not_run)}"
    return f"{failed:,} FAILED {rows(failed)}" if failed else f"{not_run:,} {rows(not_run)} NOT RUN"


def decide(stop: Stop | None, *, budget_reached: bool, failed: int, not_run: int) -> Outcome:
    """The run's one outcome. A stop (the first reason the run stopped early) decides it; else the
    budget, if it left rows undone; else whether any row is left."""
    if stop is not None:
        return Outcome(stop.kind, stop.message or None, failed, not_run)
    if budget_reached and failed + not_run:
        return Outcome("budget", None, failed, not_run)
    return Outcome("failed_rows" if failed + not_run else "done", None, failed, not_run)
