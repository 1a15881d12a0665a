"""The object a scorer is given (`Sample`) and what it may return (`Score`, or a number).

A Python scorer (`--scorer=path/to/file.py:function` or `package.module:function`) is called as
`function(sample)`, sync or async, and returns a number (a bool counts as 1.0 / 0.0), a `Score`,
or anything with a `value` (and optionally an `explanation`) attribute or key:

    from runner.scoring import Score

    def has_tests(sample):
        result = sample.exec("test -f tests/test_app.py")   # in the sample's own environment
        return Score(1.0 if result.exit_code == 0 else 0.0, result.output[-200:])

    async def short_enough(sample):
        return len(sample.final_answer) < 500
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import orjson

_THINK = re.compile(r"<think>.*?</think>", re.DOTALL)
_TOOL_CALL = re.compile(r"<tool_call>.*?</tool_call>", re.DOTALL)


@dataclass
class Score:
    """A scorer's verdict: a finite number (1.0 passes at the default --pass_threshold) and why."""

    value: float
    explanation: str = ""


class NoEnvironment(RuntimeError):
    """`Sample.exec` where the sample has no environment any more (`--rescore`)."""


def final_answer(conversation: list[dict]) -> str:
    """The text of the last model turn, without its reasoning and tool-call blocks ("" when the
    conversation has no model turn)."""
    for turn in reversed(conversation):
        if turn.get("from") == "gpt":
            return _TOOL_CALL.sub("", _THINK.sub("", str(turn.get("value") or ""))).strip()
    return ""


@dataclass
class Sample:
    """One sample as the scorers see it.

    - `row`: the dataset row (its JSON object, every field as written);
    - `prompt`, `target` (the row's `target`: a string, a list of strings, or None), `targets`
      (the same as a tuple, empty when none), `verify`, `rubric`: the fields scorers read;
    - `final_answer`: the text of the last model turn, reasoning and tool calls left out;
    - `conversation`: the ShareGPT turns (`from`, `value`) of the sample's trajectory;
    - `metadata`: the sample's record metadata (model, usage, seed, ...), without its scores;
    - `exec(command, timeout=None)`: runs a shell command in the sample's own environment and
      returns its result (`output`, `exit_code`, `timed_out`); call it from a sync scorer, await
      it in an async one. Not available under `--rescore` (the environment is gone by then).
    """

    prompt: str
    conversation: list[dict]
    metadata: dict
    targets: tuple[str, ...] = ()
    verify: str | None = None
    rubric: str | None = None
    row_line: bytes = b""
    run_command: Callable[[str, float | None], Any] | None = field(default=None, repr=False)  # blocking
    _row: dict | None = field(default=None, repr=False)

    @property
    def row(self) -> dict:
        if self._row is None:
            self._row = orjson.loads(self.row_line) if self.row_line else {"prompt": self.prompt}
        return self._row

    @property
    def target(self) -> str | list[str] | None:
        return self.row.get("target")

    @property
    def final_answer(self) -> str:
        return final_answer(self.conversation)

    def exec(self, command: str, timeout: float | None = None) -> Any | Awaitable[Any]:
        """The command's ExecResult; an awaitable of it when called from a running event loop."""
        if self.run_command is None:
            raise NoEnvironment("this sample has no environment to run a command in")
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # a sync scorer, in its own thread
            return self.run_command(command, timeout)
        return asyncio.to_thread(self.run_command, command, timeout)
