"""Console wording and progress shared by the runner's messages."""

from __future__ import annotations

import sys
import time


def plural(count: int, noun: str, many: str | None = None) -> str:
    """'1 prompt', '2 prompts', '1 process', '3 processes' (pass `many` when 's' is not it)."""
    return f"{count:,} {noun if count == 1 else (many or noun + 's')}"


class PlainProgress:
    """Progress for a log file or a pipe: full lines, never a bar.

    tqdm redraws its bar with carriage returns; where stderr is not a terminal those fragments
    end up glued to the log lines around them. This has the same four methods the runner uses.
    A line is due every `every` seconds but printed only when the counts changed; while they do
    not, one line every `quiet_every` seconds says the run is alive and how long the oldest
    request in flight has waited (`waiting()`: seconds, or None when nothing is in flight).
    """

    def __init__(self, total: int, every: float = 10.0, out=None, clock=time.monotonic, unit: str = "prompt",
                 waiting=None, quiet_every: float = 60.0):
        self.total, self.every, self.clock, self.unit = total, every, clock, unit
        self.quiet_every = quiet_every
        self.waiting = waiting or (lambda: None)
        self.out = out or sys.stderr
        self.done = 0
        self.postfix: dict = {}
        self.started = self._last = self._printed_at = clock()
        self._printed: tuple | None = None  # the counts of the last line printed

    def write(self, text: str) -> None:
        print(text, flush=True)

    def set_postfix(self, values: dict, refresh: bool = False) -> None:
        self.postfix = dict(values)

    def update(self, count: int) -> None:
        self.done += count
        self.tick()

    def tick(self) -> None:
        now = self.clock()
        if now - self._last < self.every:
            return
        self._last = now
        if self._counts() != self._printed or now - self._printed_at >= self.quiet_every:
            self._line()

    def close(self) -> None:
        if self.done and self._counts() != self._printed:
            self._line()

    def _counts(self) -> tuple:
        return self.done, tuple(self.postfix.items())

    def _line(self) -> None:
        self._printed, self._printed_at = self._counts(), self.clock()
        counts = ", ".join(f"{k} {v:,}" for k, v in self.postfix.items())
        share = f" ({self.done / self.total:.0%})" if self.total else ""
        elapsed = self.clock() - self.started
        wait = self.waiting()
        print(f"⏳ {self.done:,} of {plural(self.total, self.unit)} finished{share}"
              + (f": {counts}" if counts else "") + f"; {elapsed:,.0f}s elapsed"
              + (f"; oldest request in flight waiting {wait:,.0f}s" if wait is not None else ""),
              file=self.out, flush=True)


def progress(total: int, unit: str = "prompt", every: float = 10.0, waiting=None):
    """A tqdm bar on a terminal, plain lines (when the counts change, checked every `every`
    seconds) anywhere else; `waiting` tells them how long the oldest request in flight waited."""
    if sys.stderr.isatty():
        from tqdm import tqdm

        return tqdm(total=total, unit=unit, dynamic_ncols=True, mininterval=0.5, file=sys.stderr)
    return PlainProgress(total, every=every, unit=unit, waiting=waiting)


class Log:
    """The run's console lines. While a progress bar is shown they go through it, so they never
    tear it; otherwise they are printed at once."""

    def __init__(self):
        self.bar = None  # the progress bar of the dispatch, while it runs

    def __call__(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)
