"""The one sandbox interface every backend implements, and the helpers backends share.

A backend is a pydantic config plus a class with `start()`, `execute()`, file access and
`cleanup()` (the mini-swe-agent shape), derived from `Backend` so that it can build itself from the
run's ToolSettings and prepare a run. Everything here is synchronous: the agent loop runs it in a
worker thread (`asyncio.to_thread`) so a slow container never blocks other sessions.

Backends import only this module, never one another (the registry is tools/environments/__init__.py).
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import os
import shlex
import signal
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Protocol, runtime_checkable

from runner.input.secrets import redact

if TYPE_CHECKING:
    from tools.settings import ToolSettings


class SandboxError(Exception):
    """The sandbox could not be started or died. The row fails with error_class 'environment'."""


class FileTooLargeError(OSError):
    """A file tool asked for more than MAX_READ_BYTES (an endless device reads as too large)."""

    def __init__(self, path: str, limit: int):
        reason = (f"it is larger than the {limit / 2**20:g} MiB the file tools read; "
                  "look at part of it with the terminal (head, tail, grep)")
        super().__init__(errno.EFBIG, reason, path)


def read_at_most(stream, path: str, limit: int) -> bytes:
    """Read `stream` to its end, or raise FileTooLargeError past `limit` bytes."""
    data = stream.read(limit + 1)
    if len(data) > limit:
        raise FileTooLargeError(path, limit)
    return data


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

    async def run(self, command: str, *, cwd: str | None = None, timeout: float | None = None) -> ExecResult:
        """execute() for a coroutine: the event loop goes on while the command runs."""

    def read_file(self, path: str) -> bytes:
        """Return the bytes of `path` (relative paths are relative to workdir). FileNotFoundError if
        absent, FileTooLargeError beyond MAX_READ_BYTES (never more is held in memory)."""

    def write_file(self, path: str, data: bytes) -> None:
        """Write `path`, creating parent directories."""

    def cleanup(self) -> None:
        """Stop and remove the sandbox. Safe to call twice, and after a failed start."""


def quote(path: str) -> str:
    return shlex.quote(path)


def truncate_output(text: str, limit: int) -> str:
    """Keep the head and the tail of very long output: errors are usually at the end. Known keys are
    redacted first: a key the cut went through would leave a piece no later redaction recognises."""
    if len(text) <= limit:
        return text
    text = redact(text)
    head = limit * 2 // 5
    tail = limit - head
    omitted = len(text) - head - tail
    return f"{text[:head]}\n\n... [{omitted} characters omitted] ...\n\n{text[-tail:]}"


class Backend:
    """What the registry needs of a backend class, with defaults for backends that need nothing."""

    # True: without a default image (--docker_image), a row naming no image is an invalid line,
    # found before the run (docker). The other container backends fail such a row when it starts.
    rows_need_image = False

    # True: start() only makes a directory or two (no process, no network), so the session calls
    # it where it runs instead of in a thread (a hand-off to a thread costs twice the work).
    quick_start = False

    # The backend's pydantic config. It derives from the sections of tools/settings.py whose
    # options the backend takes (CommandOptions, ContainerOptions, ...): from_settings copies them
    # from the run's settings by name, so an option is declared once, in its section.
    config_class: type

    @classmethod
    def from_settings(cls, settings: ToolSettings, *, task_id: str, image: str | None, cwd: str | None) -> Environment:
        """Build (not start) the environment of one session: `image` and `cwd` are the row's."""
        options = {name: getattr(settings, name) for name in cls.config_class.model_fields
                   if name in type(settings).model_fields}
        return cls(cls.config_class(**options, **cls.session_options(settings, image), task_id=task_id, cwd=cwd))

    @classmethod
    def session_options(cls, settings: ToolSettings, image: str | None) -> dict[str, Any]:
        """The config fields of one session that are not run options (the image of a container backend)."""
        return {}

    @classmethod
    def cwd_error(cls, cwd: str, settings: ToolSettings) -> str | None:
        """Why this backend cannot use a row's `cwd` (the line is then invalid, found before the
        run), or None. Container backends: it must be an absolute path inside the container."""
        return absolute_cwd_error(cwd, f"--terminal_env={settings.terminal_env}", "a path inside the container")

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

    @classmethod
    def clean_run_leftovers(cls, settings: ToolSettings, *, log: Callable[[str], None]) -> None:
        """At the end of a run whose workers were killed: remove what any session of it left."""
        cls.clean_task_leftovers(settings, [], log=log)

    async def run(self, command: str, *, cwd: str | None = None, timeout: float | None = None) -> ExecResult:
        """execute() in a thread. A backend that can wait for its commands in the event loop itself
        overrides it: a hand-off to a thread and back costs more than a short command's own work."""
        return await asyncio.to_thread(self.execute, command, cwd=cwd, timeout=timeout)

    def quick_cleanup(self) -> bool:
        """Do the whole cleanup now, in the event loop, when it is only a few system calls; False
        when it is more (then nothing was done, and cleanup() is called in a thread)."""
        return False


def absolute_cwd_error(cwd: str, where: str, meaning: str) -> str | None:
    """The rule of a cwd that is used as a path as is: absolute, without '~' (no shell expands it)."""
    if cwd.startswith("/"):
        return None
    return f"'cwd' must be an absolute path under {where} ({meaning}), got {cwd!r}"


class ContainerBackend(Backend):
    """A backend that runs each session in a container made from the row's image or the run's default."""

    @classmethod
    def session_options(cls, settings: ToolSettings, image: str | None) -> dict[str, Any]:
        return {"image": container_image(settings, image)}


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


# Orphans. A worker is a child subreaper, so what a command detaches (`setsid x &`, `env -i x &`:
# no session marker left) reparents to the worker instead of init and can still be killed. An
# orphan is told from the worker's own children by its session: every command starts a session of
# its own, so its descendants never share the worker's (the sandbox holder and the browser do).
_PR_SET_CHILD_SUBREAPER = 36
_kept_markers: set[bytes] = set()  # "NAME=value" environment entries of the sessions still running
_running_commands: set[int] = set()  # commands whose exit status a Popen has yet to collect
_children_lock = threading.Lock()  # a command is registered before a sweep can see it


_subreaper = False  # this process is a child subreaper: every descendant stays one


def become_subreaper() -> None:
    """Make orphaned descendants of this process reparent to it rather than to init (Linux)."""
    global _subreaper
    try:
        _subreaper = ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        pass


def own_descendants() -> tuple[dict[int, tuple[int, str, int]], set[int]] | None:
    """In a subreaper: the process table and this process's descendants, which then include
    everything its commands started, detached or not (a session's cleanup need not read the
    environment of every process of the machine). None elsewhere (an orphan escapes to init)."""
    if not _subreaper:
        return None
    table = process_table()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _state, _session) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, stack = set(), [os.getpid()]
    while stack:
        for child in children.get(stack.pop(), ()):
            if child not in found:
                found.add(child)
                stack.append(child)
    return table, found


def commands_left_nothing(groups: Iterable[int]) -> bool:
    """In a subreaper: True when nothing the commands of these process groups started can be
    alive, so a session's cleanup need not read the process table (about 6 µs a process of the
    machine). Every command was its own session and group (start_new_session) and was waited for.
    A descendant still in its group keeps the group alive. One that left its group (setsid,
    setpgid) has an ancestor line broken where a process died, and the topmost survivor of that
    line was reparented to this subreaper (to its first live thread, the event loop's; every
    thread is read all the same): it is then a child of ours that no running command and no
    process of our own session explains. Zombies are children too. False means "look"."""
    if not _subreaper:
        return False
    for pgid in groups:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            continue
        except OSError:  # EPERM: a member is there (it changed its user)
            return False
        return False
    try:
        threads = os.listdir("/proc/self/task")
        children = []
        for tid in threads:
            with open(f"/proc/self/task/{tid}/children", "rb") as f:
                children += f.read().split()
    except OSError:  # a kernel without CONFIG_PROC_CHILDREN
        return False
    my_session = os.getsid(0)
    for child in map(int, children):
        if child in _running_commands:
            continue
        try:
            if os.getsid(child) == my_session:  # the sandbox holder, the browser: ours, not a session's
                continue
        except OSError:  # gone since the read, or a zombie: the full sweep reaps it
            pass
        return False
    return True


def keep_processes_marked(entry: bytes) -> None:
    """kill_orphans() spares processes whose environment holds `entry` (a live session's marker)."""
    _kept_markers.add(entry)


def forget_marked_processes(entry: bytes) -> None:
    _kept_markers.discard(entry)


def start_command(popen: Callable[[], Any]) -> Any:
    """Run `popen()` (a command in a session of its own) so that no sweep mistakes it for an
    orphan, nor reaps it before its Popen does; call command_finished(pid) once it is waited for."""
    with _children_lock:
        proc = popen()
        _running_commands.add(proc.pid)
    return proc


def command_finished(pid: int) -> None:
    _running_commands.discard(pid)


def kill_orphans(everything: bool = False, table: dict[int, tuple[int, str, int]] | None = None) -> int:
    """SIGKILL and reap the orphans that reparented to this process: children in a session other
    than ours that are no running command and carry no live session's marker (zombies among them
    are only reaped). `everything`: the worker is exiting, every child it still has goes. Returns
    how many were killed."""
    me, my_session = os.getpid(), os.getsid(0)
    killed = 0
    for _ in range(10):  # repeat: an orphan's own children reparent to us when it dies
        with _children_lock:
            kept = list(_kept_markers)
            children = _children_of(me, table)
            table = None  # a table given by the caller serves the first pass only
            found = [(pid, state) for pid, state, session in children
                     if everything or (session != my_session and pid not in _running_commands
                                       and (state == "Z" or not any(m in environ_of(pid) for m in kept)))]
        if not found:
            break
        for pid, state in found:
            if state != "Z":
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed += 1
                except OSError:
                    pass
        for pid, _ in found:
            try:
                os.waitpid(pid, 0)
            except OSError:  # reaped elsewhere (a Popen, asyncio's child watcher)
                pass
    return killed


def process_table() -> dict[int, tuple[int, str, int]]:
    """pid -> (parent pid, state, session id) of every process, from /proc/<pid>/stat."""
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()  # after the command name, which may hold spaces
            table[int(name)] = (int(fields[1]), fields[0].decode(), int(fields[3]))
        except (OSError, IndexError, ValueError):
            continue
    return table


def _children_of(parent: int, table: dict[int, tuple[int, str, int]] | None = None) -> list[tuple[int, str, int]]:
    """(pid, state, session id) of every child of `parent`."""
    table = process_table() if table is None else table
    return [(pid, state, session) for pid, (ppid, state, session) in table.items() if ppid == parent]


def environ_of(pid: int) -> bytes:
    """The raw environment block of `pid` (b"" when it is gone or unreadable); a marker entry is
    unique, so a substring test on it is exact."""
    try:
        with open(f"/proc/{pid}/environ", "rb", buffering=0) as f:
            return f.read()
    except OSError:
        return b""
