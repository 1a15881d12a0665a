"""Local backend: a fresh working directory per prompt on this machine, optionally inside bubblewrap.

Without a sandbox, commands run as the runner's own user with full access to the host: fast, and
fine for trusted prompts. With `sandbox="bwrap"` each session gets one bubblewrap sandbox that
behaves like a small container: only the host's system folders (/usr, /etc, ...) read-only, the
session's working folder writable, a private /tmp and /run, no unix socket (socket_filter.py: the
commands cannot create one, so no host socket is reachable), no network (only `lo`), its own PID, IPC,
UTS and cgroup namespaces, and no capabilities. A long-lived `cat` keeps the sandbox alive and every
command joins its namespaces with `nsenter`, then drops every capability, sets no_new_privs and, for
a runner as root, becomes nobody with `setpriv` (nsenter alone would hand it all of the runner's),
so background processes and files in /tmp survive from one command to the next, as they do in a
Docker container.

The worker process is a child subreaper (base.become_subreaper): what a command detaches from its
session (`env -i setsid daemon &` drops the session marker) reparents to the worker rather than to
init, so cleanup() still kills it (base.kill_orphans), and so does the worker when it exits. A
worker killed with SIGKILL can do neither: under bwrap its sandboxes die with it (their PID
namespaces end), but without a sandbox a process that dropped its marker and left its session is
reparented to init and keeps running.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import json
import os
import pwd
import re
import select
import shutil
import signal
import stat
import subprocess
import tempfile
import time
import uuid


from tools.environments.base import (
    Backend, ExecResult, FileTooLargeError, OutputCapture, SandboxError, absolute_cwd_error, command_finished, forget_marked_processes,
    commands_left_nothing, environ_of, keep_processes_marked, kill_orphans, own_descendants, quote, read_at_most, start_command,
    truncate_output,
)  # fmt: skip
from tools.environments import socket_filter
from tools.environments.tree import clear_set_id_bits, remove_tree
from tools.settings import MAX_READ_BYTES, CommandOptions, LocalOptions

BWRAP_MISSING = "--sandbox=bwrap needs bubblewrap: apt-get install bubblewrap"
# Variables that look like credentials never reach commands: a model that runs `env` would
# otherwise copy the runner's API keys into its trajectory.
_SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|CREDENTIAL", re.IGNORECASE)
# Every process a session starts inherits this marker, so cleanup() finds them all, even ones that
# left our process group (setsid, daemons), without ever touching another session's processes.
_MARKER_VAR = "ABR_LOCAL_SESSION"
# ... and the task it runs for ("<run id>-p<row>-a<attempt>"), so that what a dead worker or a killed
# run left running can be found after the fact (runner/storage/leftovers.py) by task or by run.
_TASK_VAR = "ABR_TASK_ID"
# What commands see of the host, read-only: its programs, libraries and configuration, never the
# whole of `/`. A read-only mount does not stop connect(), so a host unix socket anywhere else (the
# runner's forkserver listener under $TMPDIR, a service's under /run, /var or /home) must simply
# not be there; one that lives in these folders is covered with /dev/null (host_sockets_in).
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/opt")
# Files of /proc that root could write without any capability (file mode only): read-only inside.
_READ_ONLY_PROC = ("/proc/sys", "/proc/sysrq-trigger", "/proc/irq", "/proc/bus", "/proc/fs")
# A runner as root runs sandboxed commands as nobody: what they create on the host is not root's,
# and files only root may read (/etc/shadow) stay unreadable. Unprivileged, bubblewrap's user
# namespace keeps the runner's own uid (a user cannot switch to another).
_SANDBOX_USER = "nobody"
_DROP_CAPABILITIES = ["--no-new-privs", "--inh-caps=-all", "--ambient-caps=-all", "--bounding-set=-all"]


class LocalConfig(LocalOptions, CommandOptions):
    task_id: str
    cwd: str | None = None  # the row's own working directory: used as is and never deleted


class LocalEnvironment(Backend):
    config_class = LocalConfig

    def __init__(self, config: LocalConfig):
        self.config = config
        self.workdir = ""
        self._owns_workdir = False
        self._workdir_root = ""  # the folder made for this session (workdir, or its parent under bwrap)
        self._sandbox_dir = ""  # bwrap: the folder inside it that the sandbox may write
        self._marker = uuid.uuid4().hex
        self._holder: subprocess.Popen | None = None  # bwrap: keeps the sandbox alive
        self._sandbox_pid = 0  # bwrap: host pid of the sandbox's init process
        self._sandbox_ns: tuple[int, int] | None = None  # its pid namespace, to never kill a recycled pid
        self._groups: list[int] = []  # the process group of each command run (its pid)

    @classmethod
    def cwd_error(cls, cwd: str, settings) -> str | None:
        """Under --sandbox=bwrap the row's cwd is bind-mounted writable: an absolute path ("/") would
        make the host writable, so it must be a folder inside the sandbox's own working directory.
        Without a sandbox it is a host folder used as is: it must be absolute, since a relative
        one would mean a different folder depending on where the runner is started."""
        if settings.sandbox == "bwrap":
            if cwd.startswith("/") or ".." in cwd.split("/"):
                return (f"'cwd' must be a relative path without '..' under --sandbox=bwrap (a folder in the "
                        f"sandbox's own workdir), got {cwd!r}")
            return None
        return absolute_cwd_error(cwd, "--terminal_env=local", "a folder of this machine")

    @classmethod
    def clean_task_leftovers(cls, settings, task_ids: list[str], *, log) -> None:
        """Stop the tasks' commands and remove their working directories (kept ones: cleared of
        setuid and setgid bits, as a session's own cleanup would have done)."""
        wanted = set(task_ids)
        if wanted:
            kill_task_processes(lambda task: task in wanted)
        for task_id in task_ids:
            _clean_workdirs(settings, workdir_prefix(task_id))

    @classmethod
    def clean_run_leftovers(cls, settings, *, log) -> None:
        kill_task_processes(lambda task: task.startswith(f"{settings.run_id}-"))
        _clean_workdirs(settings, f"{settings.run_id}-p")

    @property
    def quick_start(self) -> bool:  # type: ignore[override]
        return not self.config.sandbox  # bwrap starts a sandbox process

    def start(self) -> None:
        cfg = self.config
        if cfg.sandbox not in (None, "bwrap"):
            raise SandboxError(f"unknown sandbox {cfg.sandbox!r}: the local backend supports only 'bwrap'")
        if cfg.sandbox and shutil.which("bwrap") is None:
            raise SandboxError(BWRAP_MISSING)
        if cfg.sandbox and shutil.which("nsenter") is None:
            raise SandboxError("--sandbox=bwrap needs nsenter: apt-get install util-linux")
        if cfg.sandbox and shutil.which("setpriv") is None:
            raise SandboxError("--sandbox=bwrap needs setpriv: apt-get install util-linux")
        if cfg.sandbox and not socket_filter.supported():
            raise SandboxError(socket_filter.UNSUPPORTED)
        keep_processes_marked(self._marker_entry())
        try:
            if cfg.cwd and not cfg.sandbox:
                if not os.path.isdir(cfg.cwd):
                    raise SandboxError(f"working directory {cfg.cwd!r} does not exist")
                self.workdir = os.path.realpath(cfg.cwd)
            else:
                root = os.path.realpath(cfg.workdir_root or tempfile.gettempdir())
                os.makedirs(root, exist_ok=True)
                self.workdir = self._workdir_root = tempfile.mkdtemp(prefix=workdir_prefix(cfg.task_id), dir=root)
                self._owns_workdir = True
                if cfg.sandbox:
                    self.workdir = self._make_sandbox_dir()
            if cfg.sandbox:
                self._start_sandbox()
        except (OSError, ValueError, KeyError) as exc:  # ValueError/KeyError: bwrap's info made no sense
            raise SandboxError(f"cannot prepare the local environment: {exc}") from exc

    def _make_sandbox_dir(self) -> str:
        """The folder the sandbox may write, inside the session's folder (mode 0700, the runner's):
        as root it belongs to the sandbox's user, and no other host user can reach what the
        commands leave in it. The row's cwd is a folder inside it."""
        cwd = self.config.cwd
        if cwd and (os.path.isabs(cwd) or ".." in cwd.split("/")):
            raise SandboxError(f"under --sandbox=bwrap a row's cwd must be a relative path (got {cwd!r})")
        top = self._sandbox_dir = os.path.join(self._workdir_root, "work")
        workdir = os.path.join(top, cwd) if cwd else top
        os.makedirs(workdir)
        if os.geteuid() == 0:
            uid, gid = sandbox_ids()
            for folder, _dirs, _files in os.walk(top):
                os.chown(folder, uid, gid)
        return workdir

    def _start_sandbox(self) -> None:
        top = self._sandbox_dir
        # As root, a fresh minimal /dev. Unprivileged, `--dev` makes bwrap nest a second user
        # namespace that nsenter cannot join, so bind the host's /dev (its file permissions still
        # apply: an ordinary user can open /dev/null, not the disks) with a private /dev/shm.
        if os.geteuid() == 0:
            dev, seen = ["--dev", "/dev"], _SYSTEM_DIRS
        else:
            dev, seen = ["--dev-bind", "/dev", "/dev", "--tmpfs", "/dev/shm"], (*_SYSTEM_DIRS, "/dev")
        covered = [arg for path in host_sockets_in(seen) for arg in ("--ro-bind", "/dev/null", path)]
        read_only_proc = [arg for path in _READ_ONLY_PROC for arg in ("--ro-bind-try", path, path)]
        info_r, info_w = os.pipe()
        filter_fd = _filter_for_bwrap()
        bwrap_args = [
            "--info-fd", str(info_w), "--seccomp", str(filter_fd),
            "--unshare-pid", "--unshare-ipc", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
            "--hostname", "sandbox", "--die-with-parent",
            *_system_mounts(), *dev, "--proc", "/proc", *read_only_proc, *covered,
            "--perms", "1777", "--tmpfs", "/tmp", "--dir", "/var", "--perms", "1777", "--tmpfs", "/var/tmp",
            "--dir", "/run", *_hide_host_folders_above(top), *_folders_leading_to(top), "--bind", top, top,
            "--clearenv", *(arg for name, value in _sandbox_env().items() for arg in ("--setenv", name, value)),
            # The holder keeps the runner's uid (without capabilities), so that a command, which
            # runs as nobody when the runner is root, cannot signal it.
            "--", "setpriv", *_DROP_CAPABILITIES, "--", "sh", "-c", "echo ready; exec cat",
        ]  # fmt: skip
        try:
            # A plain sh sits between us and bwrap because --die-with-parent fires when the *thread*
            # that forked bwrap ends, and start() may run in a short-lived worker thread. If the
            # runner dies, `cat` reads EOF, bwrap exits and the kernel kills the whole sandbox.
            self._holder = subprocess.Popen(
                ["sh", "-c", 'bwrap "$@"; exit $?', "sh", *bwrap_args],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                pass_fds=(info_w, filter_fd), env=_sandbox_env(),
            )  # fmt: skip
        finally:
            os.close(info_w)
            os.close(filter_fd)
        with os.fdopen(info_r, "rb", buffering=0) as info:
            if self._holder.stdout.readline() != b"ready\n":  # the mounts are in place once it answers
                err = self._holder.communicate(timeout=10)[1].decode(errors="replace").strip()
                self._holder = None
                raise SandboxError(f"bubblewrap could not start the sandbox: {err or 'no reason given'}")
            self._sandbox_pid = json.loads(info.read(65536))["child-pid"]
        ns = os.stat(f"/proc/{self._sandbox_pid}/ns/pid")
        self._sandbox_ns = (ns.st_dev, ns.st_ino)

    @staticmethod
    def _drop_privileges() -> list[str]:
        """setpriv: no capability, no_new_privs and, for a runner as root, the sandbox's user."""
        if os.geteuid() != 0:
            return ["setpriv", *_DROP_CAPABILITIES, "--"]
        uid, gid = sandbox_ids()
        return ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", *_DROP_CAPABILITIES, "--"]

    def _command_argv(self, script: str) -> list[str]:
        if not self._holder:
            return ["sh", "-c", script]
        return [*self._enter_sandbox(), "sh", "-c", script]

    def _enter_sandbox(self) -> list[str]:
        """nsenter into every namespace of the sandbox, then setpriv: without it the process would
        keep every capability of the runner (root: remount / read-write, write the host)."""
        enter = ["nsenter", "-t", str(self._sandbox_pid), "-m", "-n", "-p", "-i", "-u", "-r"]
        if os.readlink(f"/proc/{self._sandbox_pid}/ns/cgroup") != os.readlink("/proc/self/ns/cgroup"):
            enter.append("-C")  # --unshare-cgroup-try made one (the kernel supports them)
        if os.geteuid() != 0:  # unprivileged bwrap made a user namespace: join it first
            enter += ["-U", "--preserve-credentials"]
        return [*enter, *self._drop_privileges()]

    def _before_exec(self):
        """What a sandboxed command's process does between fork and exec: refuse itself unix sockets
        (no host socket is then reachable, wherever it lives). Without a sandbox: nothing, which
        keeps Popen's faster vfork path."""
        return _socket_filter().install if self._holder else None

    def _command_env(self) -> dict[str, str]:
        if self._holder:  # the sandbox gets a clean environment, nothing of the runner's
            env = _sandbox_env()
        else:
            env = {k: v for k, v in os.environ.items() if not _SECRET_NAME.search(k)}
        env[_MARKER_VAR] = self._marker
        env[_TASK_VAR] = self.config.task_id
        return env

    def execute(self, command: str, *, cwd: str | None = None, timeout: float | None = None) -> ExecResult:
        if self._holder and self._holder.poll() is not None:
            raise SandboxError("the bubblewrap sandbox of this session has died")
        timeout = self.config.command_timeout if timeout is None else timeout
        proc = self._spawn(command, cwd)
        capture = OutputCapture(self.config.max_output_chars * 4)  # 4: worst-case UTF-8 bytes per char
        try:
            with proc.stdout, _killed_if_left(proc):
                exit_code, timed_out = _collect_output(proc, capture, timeout)
        finally:
            command_finished(proc.pid)
        return self._result(capture, exit_code, timed_out)

    async def run(self, command: str, *, cwd: str | None = None, timeout: float | None = None) -> ExecResult:
        """Without a sandbox, the command is started and waited for in the event loop (its pipe and
        a pidfd watched by the loop): no thread hand-off. Under bwrap in a thread."""
        if self._holder:
            return await super().run(command, cwd=cwd, timeout=timeout)
        timeout = self.config.command_timeout if timeout is None else timeout
        proc = self._spawn(command, cwd)
        capture = OutputCapture(self.config.max_output_chars * 4)
        try:
            with proc.stdout, _killed_if_left(proc):  # also when the session is cancelled meanwhile
                exit_code, timed_out = await _collect_output_in_loop(proc, capture, timeout)
        finally:
            command_finished(proc.pid)
        return self._result(capture, exit_code, timed_out)

    def _spawn(self, command: str, cwd: str | None) -> subprocess.Popen:
        where = os.path.join(self.workdir, cwd) if cwd else self.workdir
        # `cd` inside the shell: a missing directory is then an ordinary shell error, and the path
        # means the same thing inside the sandbox as outside.
        script = f"cd {quote(where)} || exit 1\n{command}"
        proc = start_command(lambda: subprocess.Popen(
            self._command_argv(script), cwd="/", env=self._command_env(), preexec_fn=self._before_exec(),
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, so a timeout can kill all of it
        ))  # fmt: skip
        self._groups.append(proc.pid)
        return proc

    def _result(self, capture: OutputCapture, exit_code: int, timed_out: bool) -> ExecResult:
        if exit_code < 0:  # killed by a signal: report it the way a shell does
            exit_code = 128 - exit_code
        output = truncate_output(capture.text(), self.config.max_output_chars)
        return ExecResult(output=output, exit_code=exit_code, timed_out=timed_out)

    def read_file(self, path: str) -> bytes:
        full = os.path.normpath(os.path.join(self.workdir, path))
        if self._holder:
            data = self._file_in_sandbox(_READ_SCRIPT, full, limit=MAX_READ_BYTES)
            if len(data) > MAX_READ_BYTES:
                raise FileTooLargeError(full, MAX_READ_BYTES)
            return data
        with open(full, "rb") as f:
            return read_at_most(f, full, MAX_READ_BYTES)

    def write_file(self, path: str, data: bytes) -> None:
        full = os.path.normpath(os.path.join(self.workdir, path))
        if self._holder:
            self._file_in_sandbox(_WRITE_SCRIPT, full, data)
            return
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "wb") as f:
            f.write(data)

    def _file_in_sandbox(self, script: str, path: str, data: bytes | None = None, limit: int = 0) -> bytes:
        """Read or write `path` with a process inside the sandbox, so every symlink resolves as the
        sandbox sees it (a link to / is the sandbox's read-only /, never the host's)."""
        if self._holder.poll() is not None:
            raise SandboxError("the bubblewrap sandbox of this session has died")
        try:
            proc = subprocess.run(
                [*self._enter_sandbox(), "sh", "-c", script, "sh", path, str(limit + 1)], input=data or b"",
                capture_output=True, preexec_fn=self._before_exec(),
                cwd="/", env=self._command_env(), timeout=self.config.command_timeout,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            raise OSError(errno.ETIMEDOUT, "the sandbox did not answer in time", path) from None
        if proc.returncode == 0:
            return proc.stdout
        if proc.returncode == _NOT_FOUND:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
        if proc.returncode == _IS_DIR:
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
        message = proc.stderr.decode(errors="replace").strip().rpartition(": ")[2]
        raise OSError(errno.EIO, message or f"failed with exit code {proc.returncode}", path)

    def quick_cleanup(self) -> bool:
        """The common end of a session without a sandbox: nothing of its commands is left (no
        sweep of the process table needed) and its working directory is empty (one rmdir)."""
        if self.config.sandbox or not commands_left_nothing(self._groups):
            return False
        if self._owns_workdir and not self.config.keep_workdirs:
            try:
                os.rmdir(self._workdir_root)
            except OSError:  # it holds files: removed by cleanup(), in a thread
                return False
            self._owns_workdir = False
        forget_marked_processes(self._marker_entry())
        return True

    def cleanup(self) -> None:
        if not self._holder and commands_left_nothing(self._groups):  # no sweep of the process table
            forget_marked_processes(self._marker_entry())
        else:
            self._sweep_processes()
        if self._holder:
            if self._sandbox_ns and _namespace_of(self._sandbox_pid) == self._sandbox_ns:
                _signal(self._sandbox_pid)  # its init dies, so the kernel kills everything inside
            self._holder.kill()
            self._holder.communicate()
            self._holder = None
        if self._owns_workdir and not self.config.keep_workdirs:
            remove_tree(self._workdir_root)
            self._owns_workdir = False
        elif self._sandbox_dir:  # kept: nothing the sandbox made stays setuid or setgid on the host
            clear_set_id_bits(self._sandbox_dir)

    def _sweep_processes(self) -> None:
        """Kill what carries the session's marker, then the orphans its commands detached from it
        and from the marker. One read of the process table serves both sweeps when the first finds
        nothing: reading every process's stat or environ is what this costs."""
        known = own_descendants()
        clean = self._kill_session_processes(None if known is None else known[1])
        forget_marked_processes(self._marker_entry())
        kill_orphans(table=known[0] if known is not None and clean else None)

    def _marker_entry(self) -> bytes:
        return f"{_MARKER_VAR}={self._marker}".encode()

    def _kill_session_processes(self, candidates: set[int] | None = None) -> bool:
        """SIGKILL every process carrying this session's marker; True when there was none. In a
        subreaper the `candidates` (its descendants) are all that can carry it; else every process."""
        marker = self._marker_entry()
        for attempt in range(10):  # repeat: a process may fork while we are killing its parent
            pids = candidates if attempt == 0 and candidates is not None else _all_pids()
            found = [pid for pid in pids if marker in environ_of(pid)]
            if not found:
                return attempt == 0
            for pid in found:
                _signal(pid)
            time.sleep(0.05)
        return False


# File tools under bwrap: small scripts run inside the sandbox, the path as $1 (and for a read, how
# many bytes at most as $2: one more than the limit, to tell a file at the limit from a larger one).
_NOT_FOUND, _IS_DIR = 3, 4
_READ_SCRIPT = f'[ -d "$1" ] && exit {_IS_DIR}; [ -e "$1" ] || exit {_NOT_FOUND}; exec head -c "$2" -- "$1"'
_WRITE_SCRIPT = f'[ -d "$1" ] && exit {_IS_DIR}; mkdir -p -- "$(dirname -- "$1")" && exec cat > "$1"'


# After a command exits, output still written to its pipe (a background child holding it open) is
# read for this long, then the result is returned without waiting for that child.
LINGER_AFTER_EXIT = 0.5
LINGER_AFTER_KILL = 2.0  # the same after a timeout killed the command's process group
POLL_STEP = 3600.0  # the longest single wait of the poll (seconds); the loop then looks again


def _collect_output(proc: subprocess.Popen, capture: OutputCapture, timeout: float) -> tuple[int, bool]:
    """(exit code, timed out) of `proc`, its output read into `capture` meanwhile, all in this
    thread: one poll over the pipe and a pidfd of the process (no reader thread per command). On
    a kernel without pidfds (before 5.3) the poll wakes every 50 ms to look at the process, and
    once the pipe is closed Popen's own wait takes over."""
    fd = proc.stdout.fileno()
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    try:
        pidfd: int | None = os.pidfd_open(proc.pid)
        poller.register(pidfd, select.POLLIN)
    except OSError:
        pidfd = None
    code: int | None = None
    timed_out, reading = False, True
    end = time.monotonic() + timeout
    try:
        while reading or code is None:
            if code is None and proc.poll() is not None:
                code, end = proc.returncode, time.monotonic() + LINGER_AFTER_EXIT
                if pidfd is not None:
                    poller.unregister(pidfd)
                continue
            now = time.monotonic()
            if now >= end:
                if code is not None:
                    break  # it exited; whoever still holds the pipe does not hold the result back
                timed_out = True
                _kill_group(proc.pid)  # before wait(): the pid, hence the group id, cannot be recycled yet
                proc.wait()
                code, end = 124, time.monotonic() + LINGER_AFTER_KILL
                if pidfd is not None:
                    poller.unregister(pidfd)
                continue
            wait = min(end - now, POLL_STEP)  # poll() takes 24.8 days at most: a longer timeout waits in steps
            if not reading and pidfd is None:  # only its exit is left to wait for, and no pidfd to poll
                try:
                    proc.wait(wait)
                except subprocess.TimeoutExpired:
                    pass
                continue
            if pidfd is None and code is None:
                wait = min(wait, 0.05)
            for ready, _events in poller.poll(wait * 1000):
                if ready == fd:
                    chunk = os.read(fd, 65536)
                    if chunk:
                        capture.add(chunk)
                    else:  # end of file: every writer has closed it
                        reading = False
                        poller.unregister(fd)
    finally:
        if pidfd is not None:
            os.close(pidfd)
    return code, timed_out


@contextlib.contextmanager
def _killed_if_left(proc: subprocess.Popen):
    """No command goes on unwatched: if waiting for it fails (or the session is cancelled), its
    process group is killed and it is reaped."""
    try:
        yield
    except BaseException:
        if proc.returncode is None:  # not reaped yet, so its group id is no one else's
            _kill_group(proc.pid)
            proc.wait()
        raise


async def _collect_output_in_loop(proc: subprocess.Popen, capture: OutputCapture, timeout: float) -> tuple[int, bool]:
    """What _collect_output does, with the event loop watching the pipe and a pidfd of the process
    instead of a thread polling them: the same timeout, the same linger after the exit or the kill.
    On a kernel without pidfds (before 5.3), _collect_output in a thread."""
    try:
        pidfd = os.pidfd_open(proc.pid)
    except (OSError, AttributeError):  # AttributeError: not Linux
        return await asyncio.to_thread(_collect_output, proc, capture, timeout)
    loop = asyncio.get_running_loop()
    fd = proc.stdout.fileno()
    os.set_blocking(fd, False)
    exited, closed = loop.create_future(), loop.create_future()

    def on_exit() -> None:
        loop.remove_reader(pidfd)
        if not exited.done():
            exited.set_result(None)

    def on_output() -> None:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return
        if chunk:
            capture.add(chunk)
            return
        loop.remove_reader(fd)  # end of file: every writer has closed it
        if not closed.done():
            closed.set_result(None)

    loop.add_reader(pidfd, on_exit)
    loop.add_reader(fd, on_output)
    try:
        timed_out = False
        try:
            # A timeout of days or more: asyncio waits that long (poll() would need steps).
            await asyncio.wait_for(asyncio.shield(exited), timeout)
            code = proc.wait()  # it has exited: this only reaps it
            linger = LINGER_AFTER_EXIT
        except asyncio.TimeoutError:
            timed_out = True
            _kill_group(proc.pid)  # before wait(): the pid, hence the group id, cannot be recycled yet
            proc.wait()
            code, linger = 124, LINGER_AFTER_KILL
        try:  # whoever still holds the pipe after that does not hold the result back
            await asyncio.wait_for(asyncio.shield(closed), linger)
        except asyncio.TimeoutError:
            pass
    finally:
        loop.remove_reader(fd)
        loop.remove_reader(pidfd)
        os.close(pidfd)
    return code, timed_out


@functools.cache
def _socket_filter() -> socket_filter.SocketFilter:
    return socket_filter.SocketFilter()


def _filter_for_bwrap() -> int:
    """A pipe's read end holding the socket filter, for bwrap's --seccomp: the sandbox's first
    process (the holder) gets it too, so that a command running as the same user cannot make that
    process open a unix socket for it."""
    read_end, write_end = os.pipe()
    try:
        os.write(write_end, _socket_filter().program)  # a few hundred bytes: the pipe holds them
    finally:
        os.close(write_end)
    return read_end


def _sandbox_env() -> dict[str, str]:
    """The whole environment of a sandbox: what commands need, nothing of the runner's."""
    env = {"PATH": os.environ.get("PATH") or "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp"}
    for name in ("LANG", "LC_ALL", "TERM", "TZ"):
        if os.environ.get(name):
            env[name] = os.environ[name]
    return env


def sandbox_ids() -> tuple[int, int]:
    """The uid and gid a runner as root gives sandboxed commands."""
    try:
        user = pwd.getpwnam(_SANDBOX_USER)
        return user.pw_uid, user.pw_gid
    except KeyError:
        return 65534, 65534  # nobody's ids nearly everywhere


def _system_mounts() -> list[str]:
    """bwrap arguments that show the host's system folders read-only (symlinks stay symlinks)."""
    args = []
    for path in _SYSTEM_DIRS:
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    return args


def _hide_host_folders_above(path: str) -> list[str]:
    """bwrap arguments that put an empty tmpfs over the first folder below a system folder on the
    way to `path` (TMPDIR in /opt, say): else the host's folders there, the session's own 0700
    one among them, would show through the read-only bind, closed to the sandbox's user."""
    for system in _SYSTEM_DIRS:
        if not os.path.islink(system) and path.startswith(system + "/"):
            first = os.path.join(system, path[len(system) + 1:].split("/", 1)[0])
            return ["--perms", "0755", "--tmpfs", first]
    return []


def _folders_leading_to(path: str) -> list[str]:
    """bwrap arguments that create the folders above `path` traversable (0755): left to bwrap they
    would be made 0700 root, closed to the sandbox's user. Folders that exist are left as they are."""
    parents = []
    while (path := os.path.dirname(path)) != "/":
        parents.insert(0, path)
    return [arg for parent in parents for arg in ("--perms", "0755", "--dir", parent)]


def host_sockets_in(folders: tuple[str, ...]) -> list[str]:
    """The unix sockets bound on this host (the kernel's list, /proc/net/unix) whose path lies in
    one of `folders`: the sandbox sees them covered by /dev/null."""
    try:
        with open("/proc/net/unix", "rb") as f:
            lines = f.read().decode(errors="replace").splitlines()[1:]
    except OSError:
        return []
    found = set()
    for line in lines:
        fields = line.split(None, 7)
        path = fields[7] if len(fields) == 8 else ""
        if path.startswith("/") and any(path.startswith(folder + "/") for folder in folders):
            if os.path.exists(path) and stat.S_ISSOCK(os.lstat(path).st_mode):
                found.add(path)
    return sorted(found)


def workdir_prefix(task_id: str) -> str:
    """How the working directories of a task's sessions are named (then a random suffix)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", task_id)[:80] + "-"


def kill_task_processes(belongs) -> int:
    """SIGKILL every process of ours whose task marker satisfies `belongs(task_id)`: what sessions
    left running when their worker or their run was killed. Returns how many were killed."""
    key = _TASK_VAR.encode() + b"="
    killed: set[int] = set()
    for _ in range(10):  # repeat: a process may fork while we are killing its parent
        found = []
        for pid in _all_pids():
            task = next((e[len(key):] for e in environ_of(pid).split(b"\0") if e.startswith(key)), None)
            if task is not None and pid != os.getpid() and belongs(task.decode(errors="replace")):
                found.append(pid)
        if not found:
            break
        for pid in found:
            _signal(pid)
            killed.add(pid)
        time.sleep(0.05)
    return len(killed)


def _clean_workdirs(settings, prefix: str) -> None:
    """Remove the working directories named `prefix*` (kept ones: clear their set-id bits), as a
    session's own cleanup would have."""
    if not settings.keep_workdirs:
        remove_workdirs(settings.workdir_root, prefix)
    elif settings.sandbox == "bwrap":
        for folder in task_workdirs(settings.workdir_root, prefix):
            clear_set_id_bits(folder)


def _own_entries(root: str | None, prefix: str) -> list[os.DirEntry]:
    """The entries of `root` (default: the temp dir) named `prefix*` that are the runner's own:
    anyone can read a run id from those names in /tmp and plant an entry so named."""
    root = os.path.realpath(root or tempfile.gettempdir())
    me = os.geteuid()
    try:
        entries = [entry for entry in os.scandir(root) if entry.name.startswith(prefix)]
    except OSError:
        return []
    own = []
    for entry in entries:
        try:
            if entry.stat(follow_symlinks=False).st_uid == me:
                own.append(entry)
        except OSError:
            pass
    return own


def task_workdirs(root: str | None, prefix: str) -> list[str]:
    """The runner's per-prompt working directories in `root` named `prefix*`."""
    return [entry.path for entry in _own_entries(root, prefix) if entry.is_dir(follow_symlinks=False)]


def remove_workdirs(root: str | None, prefix: str) -> int:
    """Remove the runner's per-prompt working directories in `root` named `prefix*` (or whatever
    entry a command left in the place of one); returns how many."""
    entries = _own_entries(root, prefix)
    for entry in entries:
        remove_tree(entry.path)
    return len(entries)


def _signal(pid: int, sig: int = signal.SIGKILL) -> None:
    try:
        os.kill(pid, sig)
    except OSError:
        pass


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass


def _all_pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def _namespace_of(pid: int) -> tuple[int, int] | None:
    try:
        ns = os.stat(f"/proc/{pid}/ns/pid")
    except OSError:
        return None
    return ns.st_dev, ns.st_ino
