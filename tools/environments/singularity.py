"""Apptainer / Singularity backend: one instance per prompt, driven through the CLI.

Untested here: no apptainer on the CI machine. The unit tests check the exact command lines this
class runs (through an injected runner), and the contract suite runs it against a stand-in
`apptainer` that executes on the host; neither proves that a real instance behaves the same.

An instance is started with `--containall --no-home --writable-tmpfs` and a per-prompt host
directory bound at the working directory (`/workspace` unless the row names `cwd`), so files there
are read and written directly on the host; other paths go through `exec`. Images without a scheme
become `docker://<image>`. With no network configured the instance gets `--net --network none`,
which unprivileged Apptainer may refuse (use `--fakeroot`, or a network such as `host`).
Timeouts work as in the Docker backend: the command's environment carries a marker, and a second
`exec` SIGKILLs every process holding it.
"""

from __future__ import annotations

import os
import posixpath
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from typing import Callable


from .base import (EXEC_MARK, ContainerBackend, ExecResult, FileTooLargeError, OutputCapture, SandboxError,
                   kill_marked_processes_script, read_at_most, truncate_output)
from tools.settings import MAX_READ_BYTES, CommandOptions, ContainerOptions, WorkdirOptions

DEFAULT_CWD = "/workspace"

# runner(argv, input=bytes | None, timeout=seconds | None, limit=bytes kept | None) -> (exit code,
# stdout+stderr). Raises subprocess.TimeoutExpired (partial output in .output) when time runs out.
Runner = Callable[..., "tuple[int, bytes]"]


def run_command(argv: list[str], *, input: bytes | None = None, timeout: float | None = None,
                limit: int | None = None) -> tuple[int, bytes]:
    """Run argv with stdout and stderr merged; kill its whole process group on timeout."""
    process = subprocess.Popen(
        argv, stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )
    output = OutputCapture(limit)
    reader = threading.Thread(target=output.drain, args=(process.stdout,), daemon=True)
    reader.start()
    if input is not None:
        try:
            process.stdin.write(input)
            process.stdin.close()
        except BrokenPipeError:
            pass
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        code = process.wait(timeout)
        # A background process may still hold the output pipe open: it shares the deadline.
        reader.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if reader.is_alive():
            raise subprocess.TimeoutExpired(argv, timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()
        reader.join(2)
        raise subprocess.TimeoutExpired(argv, timeout, output=output.data()) from None
    return code, output.data()


class SingularityConfig(ContainerOptions, WorkdirOptions, CommandOptions):
    """workdir_root: host parent of the per-prompt directories (None: system temp);
    container_network None: no network, "host": share the host's."""

    image: str
    task_id: str
    cwd: str | None = None  # inside the instance; None: /workspace
    executable: str | None = None  # None: apptainer, else singularity, whichever is on PATH


class SingularityEnvironment(ContainerBackend):
    config_class = SingularityConfig

    def __init__(self, config: SingularityConfig, *, runner: Runner = run_command):
        self.config = config
        self.workdir = config.cwd or DEFAULT_CWD
        self.name = f"abr-{re.sub(r'[^a-zA-Z0-9_-]+', '-', config.task_id)[:50]}-{uuid.uuid4().hex[:8]}"
        self.host_dir: str | None = None
        self._run = runner
        self._exe = config.executable
        self._started = False

    @property
    def image_uri(self) -> str:
        image = self.config.image
        if "://" in image or image.endswith(".sif") or os.path.exists(image):
            return image
        return f"docker://{image}"

    def start(self) -> None:
        if self._started:
            return
        self._exe = self._exe or shutil.which("apptainer") or shutil.which("singularity")
        if not self._exe:
            raise SandboxError("terminal_env=singularity needs apptainer or singularity on PATH")
        if self.config.workdir_root:
            os.makedirs(self.config.workdir_root, exist_ok=True)
        self.host_dir = tempfile.mkdtemp(prefix=f"{self.name}-", dir=self.config.workdir_root)
        argv = [self._exe, "instance", "start", "--containall", "--no-home", "--writable-tmpfs",
                "--bind", f"{self.host_dir}:{self.workdir}"]
        if self.config.container_memory:
            argv += ["--memory", self.config.container_memory]
        if self.config.container_cpus:
            argv += ["--cpus", f"{self.config.container_cpus:g}"]
        if self.config.container_network is None:
            argv += ["--net", "--network", "none"]
        elif self.config.container_network != "host":
            argv += ["--net", "--network", self.config.container_network]
        argv += [self.image_uri, self.name]
        code, output = self._run(argv, timeout=1800)  # the first start may build the image
        if code != 0:
            self.cleanup()
            message = output.decode(errors="replace").strip()
            raise SandboxError(f"could not start an instance of {self.image_uri}: {message}")
        self._started = True

    def execute(self, command: str, *, cwd: str | None = None, timeout: float | None = None) -> ExecResult:
        self._require()
        timeout = self.config.command_timeout if timeout is None else timeout
        token = uuid.uuid4().hex
        argv = [self._exe, "exec", "--pwd", self._path(cwd or "."), "--env", f"{EXEC_MARK}={token}",
                f"instance://{self.name}", "sh", "-c", command]
        try:
            code, output = self._run(argv, timeout=timeout, limit=self.config.max_output_chars * 4)
        except subprocess.TimeoutExpired as exc:
            self._run(self._exec_argv("sh", "-c", kill_marked_processes_script(token)), timeout=30)
            text = (exc.output or b"").decode(errors="replace")
            text += f"\n[command timed out after {timeout:g} s and was killed]"
            return ExecResult(truncate_output(text, self.config.max_output_chars), 124, True)
        text = output.decode(errors="replace")
        if code == 255 and not self._instance_running():
            raise SandboxError(f"instance {self.name} died mid-prompt: {text.strip()}")
        return ExecResult(truncate_output(text, self.config.max_output_chars), code)

    def read_file(self, path: str) -> bytes:
        self._require()
        host = self._host_path(path)
        if host is not None:
            with open(host, "rb") as file:
                return read_at_most(file, host, MAX_READ_BYTES)
        full = self._path(path)
        code, output = self._run(self._exec_argv("head", "-c", str(MAX_READ_BYTES + 1), full), timeout=60)
        if code != 0:
            raise FileNotFoundError(f"{full}: {output.decode(errors='replace').strip()}")
        if len(output) > MAX_READ_BYTES:
            raise FileTooLargeError(full, MAX_READ_BYTES)
        return output

    def write_file(self, path: str, data: bytes) -> None:
        self._require()
        host = self._host_path(path)
        if host is not None:
            os.makedirs(os.path.dirname(host), exist_ok=True)
            with open(host, "wb") as file:
                file.write(data)
            return
        full = self._path(path)
        script = 'mkdir -p "$(dirname "$1")" && cat > "$1"'
        code, output = self._run(self._exec_argv("sh", "-c", script, "sh", full), input=data, timeout=60)
        if code != 0:
            raise OSError(f"cannot write {full}: {output.decode(errors='replace').strip()}")

    def cleanup(self) -> None:
        if self._started:
            self._started = False
            try:
                self._run([self._exe, "instance", "stop", self.name], timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                pass
        if self.host_dir and not self.config.keep_workdirs:
            shutil.rmtree(self.host_dir, ignore_errors=True)
            self.host_dir = None

    # -- helpers ----------------------------------------------------------------------------

    def _exec_argv(self, *command: str) -> list[str]:
        return [self._exe, "exec", f"instance://{self.name}", *command]

    def _path(self, path: str) -> str:
        return posixpath.normpath(posixpath.join(self.workdir, path))

    def _host_path(self, path: str) -> str | None:
        """The host file behind `path` when it lies in the bound working directory, else None."""
        relative = posixpath.relpath(self._path(path), self.workdir)
        if relative == ".." or relative.startswith("../"):
            return None
        host = os.path.join(self.host_dir, *relative.split("/"))
        # A symlink the command made (say to /etc/passwd) must resolve inside the instance, never on
        # the host: anything that leaves the bound directory goes through `exec` instead.
        root = os.path.realpath(self.host_dir)
        if os.path.commonpath([root, os.path.realpath(host)]) != root:
            return None
        return host

    def _instance_running(self) -> bool:
        code, output = self._run([self._exe, "instance", "list", self.name], timeout=30)
        return code == 0 and self.name in output.decode(errors="replace")

    def _require(self) -> None:
        if not self._started:
            raise SandboxError("the singularity environment is not started (or was cleaned up)")
