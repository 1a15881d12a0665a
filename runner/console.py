"""Console wording and progress shared by the runner's messages."""

from __future__ import annotations

import sys
import time


def plural(count: int, noun: str, many: str | None = None) -> str:
    """'1 prompt', '2 prompts', '1 process', '3 processes' (pass `many` when 's' is not it)."""
    return f"{count:,} {noun if count == 1 else (many or noun + 's')}"


class PlainProgress:
    """Progress for a log file or a pipe: a full line every `every` seconds, never a bar.

    tqdm redraws its bar with carriage returns; where stderr is not a terminal those fragments
    end up glued to the log lines around them. This has the same four methods the runner uses.
    """

    def __init__(self, total: int, every: float = 10.0, out=None, clock=time.monotonic, unit: str = "prompt"):
        self.total, self.every, self.clock, self.unit = total, every, clock, unit
        self.out = out or sys.stderr
        self.done = 0
        self.postfix: dict = {}
        self.started = self._last = clock()

    def write(self, text: str) -> None:
        print(text, flush=True)

    def set_postfix(self, values: dict, refresh: bool = False) -> None:
        self.postfix = dict(values)

    def update(self, count: int) -> None:
        self.done += count
        self.tick()

    def tick(self) -> None:
        if self.clock() - self._last >= self.every:
            self._line()

    def close(self) -> None:
        if self.done:
            self._line()

    def _line(self) -> None:
        self._last = self.clock()
        counts = ", ".join(f"{k} {v}" for k, v in self.postfix.items())
        share = f" ({self.done / self.total:.0%})" if self.total else ""
        elapsed = self.clock() - self.started
        print(f"⏳ {self.done:,} of {plural(self.total, self.unit)} finished{share}"
              + (f": {counts}" if counts else "") + f"; {elapsed:.0f}s elapsed", file=self.out, flush=True)


def progress(total: int, unit: str = "prompt", every: float = 10.0):
    """A tqdm bar on a terminal, plain periodic lines (every `every` seconds) anywhere else."""
    if sys.stderr.isatty():
        from tqdm import tqdm

        return tqdm(total=total, unit=unit, dynamic_ncols=True, mininterval=0.5, file=sys.stderr)
    return PlainProgress(total, every=every, unit=unit)
