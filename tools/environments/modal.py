"""Modal backend: one Modal Sandbox per prompt, commands through `Sandbox.exec`.

Untested here: the machines that build this project cannot reach Modal and `modal` is not
installed. It is written against Modal's public SDK (`App.lookup`, `Image.from_registry`,
`Sandbox.create`, `Sandbox.exec`, `Sandbox.open`, `Sandbox.terminate`); the unit tests check, with
a fake `modal` module, which calls it makes, and the contract suite runs it against a fake sandbox
that executes on the host. Needs `pip install modal` and Modal credentials (`modal setup` or
MODAL_TOKEN_ID / MODAL_TOKEN_SECRET).

Timeouts are Modal's own: `exec(..., timeout=...)` has the process killed server-side. A command
still running at the deadline is reported as timed out with exit code 124.
"""

from __future__ import annotations

import math
import posixpath
import re
import time

from .base import ContainerBackend, ExecResult, FileTooLargeError, SandboxError, truncate_output
from tools.settings import MAX_READ_BYTES, CommandOptions, ContainerOptions

DEFAULT_CWD = "/workspace"
KEEP_ALIVE = "trap 'exit 0' TERM INT; while :; do sleep 3600 & wait $!; done"
# Runs the command with `sh -c` in a directory, stderr merged into stdout so they stay in order.
IN_DIR = 'cd "$1" || exit 1; exec sh -c "$2" 2>&1'
# Exit 1: missing, 2: a directory.
PROBE = '[ -d "$1" ] && exit 2; [ -e "$1" ] || exit 1; exit 0'


def _import_modal():
    try:
        import modal
    except ImportError as exc:
        raise SandboxError("terminal_env=modal needs the Modal SDK: pip install modal (then `modal setup`)") from exc
    return modal


def _mebibytes(size: str) -> int:
    """'2g' -> 2048, '512m' -> 512, '1073741824' (bytes) -> 1024."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*", size.lower())
    if not match:
        raise ValueError(f"cannot read memory size {size!r} (expected e.g. 512m or 2g)")
    number, unit = float(match[1]), match[2]
    factor = {"": 1 / 2**20, "k": 1 / 2**10, "m": 1, "g": 2**10, "t": 2**20}[unit]
    return max(1, int(number * factor))


class ModalConfig(ContainerOptions, CommandOptions):
    """container_memory is given to Modal in MiB; container_network None: block_network=True, any
    value: network allowed."""

    image: str  # a registry image, e.g. "python:3.11-slim"
    task_id: str
    cwd: str | None = None  # None: /workspace
    app_name: str = "agent-batch-runner"
    sandbox_lifetime: int = 3600  # seconds before Modal ends the sandbox (its `timeout`)


class ModalEnvironment(ContainerBackend):
    config_class = ModalConfig
    def __init__(self, config: ModalConfig):
        self.config = config
        self.workdir = config.cwd or DEFAULT_CWD
        self._sandbox = None

    def start(self) -> None:
        if self._sandbox is not None:
            return
        modal = _import_modal()
        config = self.config
        options = {"timeout": config.sandbox_lifetime, "workdir": self.workdir, "block_network": config.container_network is None}
        if config.container_cpus:
            options["cpu"] = config.container_cpus
        if config.container_memory:
            options["memory"] = _mebibytes(config.container_memory)
        try:
            app = modal.App.lookup(config.app_name, create_if_missing=True)
            image = modal.Image.from_registry(config.image)
            self._sandbox = modal.Sandbox.create("sh", "-c", KEEP_ALIVE, app=app, image=image, **options)
        except Exception as exc:  # noqa: BLE001 - Modal raises many kinds; all mean "no sandbox"
            raise SandboxError(f"could not create a Modal sandbox from '{config.image}': {exc}") from exc

    def execute(self, command: str, *, cwd: str | None = None, timeout: float | None = None) -> ExecResult:
        timeout = self.config.command_timeout if timeout is None else timeout
        started = time.monotonic()
        try:
            output, code = self._exec(IN_DIR, self._path(cwd or "."), command, timeout=timeout)
        except SandboxError:
            raise
        except Exception as exc:  # noqa: BLE001
            if type(exc).__name__ != "ExecTimeoutError":  # modal.exception.ExecTimeoutError
                raise SandboxError(f"the Modal sandbox failed or ended: {exc}") from exc
            output, code = "", None
        timed_out = code is None or (code != 0 and time.monotonic() - started >= timeout)
        if timed_out:
            output += f"\n[command timed out after {timeout:g} s and was killed]"
            code = 124
        return ExecResult(truncate_output(output, self.config.max_output_chars), code, timed_out)

    def read_file(self, path: str) -> bytes:
        full = self._path(path)
        _, code = self._call(self._exec, PROBE, full, timeout=60)
        if code == 1:
            raise FileNotFoundError(f"{full}: no such file in the sandbox")
        if code == 2:
            raise IsADirectoryError(f"{full} is a directory")
        data = self._call(self._transfer, full, "rb")
        if len(data) > MAX_READ_BYTES:
            raise FileTooLargeError(full, MAX_READ_BYTES)
        return data

    def write_file(self, path: str, data: bytes) -> None:
        full = self._path(path)
        output, code = self._call(self._exec, 'mkdir -p "$(dirname "$1")"', full, timeout=60)
        if code != 0:
            raise OSError(f"cannot create the directory of {full}: {output.strip()}")
        self._call(self._transfer, full, "wb", data)

    def cleanup(self) -> None:
        sandbox, self._sandbox = self._sandbox, None
        if sandbox is not None:
            try:
                sandbox.terminate()
            except Exception:  # noqa: BLE001 - already gone; Modal ends it at its lifetime anyway
                pass

    # -- helpers ----------------------------------------------------------------------------

    def _exec(self, script: str, *args: str, timeout: float) -> tuple[str, int | None]:
        process = self._require().exec("sh", "-c", script, "sh", *args, timeout=max(1, math.ceil(timeout)))
        output = process.stdout.read()
        code = process.wait()
        return output, process.returncode if code is None else code

    def _transfer(self, path: str, mode: str, data: bytes = b"") -> bytes | None:
        handle = self._require().open(path, mode)
        try:
            return handle.read(MAX_READ_BYTES + 1) if mode == "rb" else handle.write(data)
        finally:
            handle.close()

    def _call(self, function, *args, **kwargs):
        """Call into Modal; any failure of Modal itself becomes a SandboxError."""
        try:
            return function(*args, **kwargs)
        except SandboxError:
            raise
        except Exception as exc:  # noqa: BLE001 - Modal raises many kinds; all mean "sandbox lost"
            raise SandboxError(f"the Modal sandbox failed or ended: {exc}") from exc

    def _path(self, path: str) -> str:
        return posixpath.normpath(posixpath.join(self.workdir, path))

    def _require(self):
        if self._sandbox is None:
            raise SandboxError("the modal environment is not started (or was cleaned up)")
        return self._sandbox
