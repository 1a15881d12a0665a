"""The one sandbox interface every backend implements.

A backend is a pydantic config plus a class with `start()`, `execute()`, file access and
`cleanup()` (the mini-swe-agent shape). Everything here is synchronous: the agent loop runs it in
a worker thread (`asyncio.to_thread`) so a slow container never blocks other sessions.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import Protocol, runtime_checkable


class SandboxError(Exception):
    """The sandbox could not be started or died. The row fails with error_class 'environment'."""


@dataclass
class ExecResult:
    output: str  # stdout and stderr interleaved, already truncated if huge
    exit_code: int  # 124 when the command was killed by its timeout
    timed_out: bool = False


@runtime_checkable
class Environment(Protocol):
    """Where a session's tools run. `workdir` is the session's working directory *inside* it."""

    workdir: str

    def start(self) -> None:
        """Create the sandbox. Raise SandboxError when it cannot be had."""

    def execute(self, command: str, *, cwd: str | None = None, timeout: float | None = None) -> ExecResult:
        """Run `command` with `sh -c` in `cwd` (default: workdir). The timeout really stops it."""

    def read_file(self, path: str) -> bytes:
        """Return the bytes of `path` (relative paths are relative to workdir). FileNotFoundError if absent."""

    def write_file(self, path: str, data: bytes) -> None:
        """Write `path`, creating parent directories."""

    def cleanup(self) -> None:
        """Stop and remove the sandbox. Safe to call twice, and after a failed start."""


def quote(path: str) -> str:
    return shlex.quote(path)


def truncate_output(text: str, limit: int) -> str:
    """Keep the head and the tail of very long output: errors are usually at the end."""
    if len(text) <= limit:
        return text
    head = limit * 2 // 5
    tail = limit - head
    omitted = len(text) - head - tail
    return f"{text[:head]}\n\n... [{omitted} characters omitted] ...\n\n{text[-tail:]}"
