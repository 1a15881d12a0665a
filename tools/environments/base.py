"""The one sandbox interface every backend implements, and the helpers backends share.

A backend is a pydantic config plus a class with `start()`, `execute()`, file access and
`cleanup()` (the mini-swe-agent shape), derived from `Backend` so that it can build itself from the
run's ToolSettings and prepare a run. Everything here is synchronous: the agent loop runs it in a
worker thread (`asyncio.to_thread`) so a slow container never blocks other sessions.

Backends import only this module, never one another (the registry is tools/environments/__init__.py).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Protocol, runtime_checkable

if TYPE_CHECKING:
    from tools.settings import ToolSettings


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


class Backend:
    """What the registry needs of a backend class, with defaults for backends that need nothing."""

    # True: without a default image (--docker_image), a row naming no image is an invalid line,
    # found before the run (docker). The other container backends fail such a row when it starts.
    rows_need_image = False

    @classmethod
    def from_settings(cls, settings: ToolSettings, *, task_id: str, image: str | None, cwd: str | None) -> Environment:
        """Build (not start) the environment of one session: `image` and `cwd` are the row's."""
        raise NotImplementedError

    @classmethod
    def prepare_run(cls, settings: ToolSettings, images: set[str], *, say: Callable[[str], None],
                    log: Callable[[str], None]) -> dict[str, str]:
        """Once per run (under Ray: once per node and image), before any model call: get `images`
        (the distinct row images and the run's default) ready. Returns image -> why it cannot be
        used, for those that cannot; their rows fail as `environment` without a model call. `say`
        prints to the console, `log` only with --verbose."""
        return {}

    @classmethod
    def clean_task_leftovers(cls, settings: ToolSettings, task_ids: list[str], *, log: Callable[[str], None]) -> None:
        """After a worker died: remove what the sessions of these tasks left (it could not)."""


def container_image(settings: ToolSettings, image: str | None) -> str:
    """The row's image, else the run's default; a container backend cannot start without one."""
    image = image or settings.docker_image
    if not image:
        raise SandboxError(
            f"terminal_env={settings.terminal_env} needs a container image: give the row an 'image' (or "
            "'docker_image') field, or set a default image for the run (docker_image)"
        )
    return image


# -- timeouts in containers: every command carries a marker; a second command kills its holders --

EXEC_MARK = "ABR_EXEC_ID"


def kill_marked_processes_script(token: str) -> str:
    """A POSIX sh script that SIGKILLs every process whose environment holds EXEC_MARK=token."""
    # Three passes catch children forked while the first pass ran. Bash warns about the NUL bytes
    # of /proc/*/environ in command substitutions, hence the silenced stderr.
    return (
        "exec 2>/dev/null; for i in 1 2 3; do for d in /proc/[0-9]*; do "
        f'case "$(cat "$d/environ")" in *"{EXEC_MARK}={token}"*) kill -9 "${{d#/proc/}}";; esac; '
        "done; done; exit 0"
    )


class OutputCapture:
    """Collects command output; beyond `cap` bytes keeps only the head and the tail (cap each), so a
    flood of output cannot eat memory. `cap=None` keeps everything."""

    def __init__(self, cap: int | None = None):
        self.cap = cap
        self.head = bytearray()
        self.tail = bytearray()
        self.dropped = 0

    def add(self, chunk: bytes) -> None:
        if self.cap is None:
            self.head += chunk
            return
        room = self.cap - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        self.tail += chunk
        if len(self.tail) > self.cap:
            excess = len(self.tail) - self.cap
            del self.tail[:excess]
            self.dropped += excess

    def drain(self, stream) -> None:
        """Read a binary stream (a pipe) to its end, then close it."""
        with stream:
            while chunk := stream.read1(65536):
                self.add(chunk)

    def data(self) -> bytes:
        middle = f"\n\n... [{self.dropped} bytes omitted] ...\n\n".encode() if self.dropped else b""
        return bytes(self.head) + middle + bytes(self.tail)

    def text(self) -> str:
        return self.data().decode("utf-8", errors="replace")
