"""Docker backend: one container per prompt, every command a `docker exec` into it.

The container runs a tiny keep-alive loop under Docker's init (which reaps orphaned processes), is
labelled with the run and its owner process (so `images.reap_stale_containers` can remove leaks),
has no network unless asked, and is force-removed at cleanup.

Working directory: the row's `cwd`, else `/workspace`, created at start in both cases. Not `/root`
(missing from minimal images, not writable for images with a non-root USER) and not the image's
WORKDIR (often `/`, shared with the image's own files): a fresh, empty, writable directory that is
the same in every image keeps prompts and trajectories comparable. Rows that want the image's
project directory (e.g. `/testbed`) name it in `cwd`.

Timeouts: each exec carries a random marker in its environment (`ABR_EXEC_ID`). When the deadline
passes, a second exec kills (SIGKILL) every process in the container whose environment holds that
marker, which catches the command, its children and anything it put in the background, and needs
only `sh`, `cat` and `/proc` in the image (no `timeout`, `ps` or `pkill`).
"""

from __future__ import annotations

import errno
import io
import logging
import os
import posixpath
import re
import socket
import tarfile
import threading
import time
import uuid

import docker
from docker.errors import APIError, DockerException, ImageNotFound, NotFound
from pydantic import Field

from .base import (EXEC_MARK, ContainerBackend, ExecResult, FileTooLargeError, OutputCapture, SandboxError,
                   kill_marked_processes_script, truncate_output)
from tools.settings import MAX_READ_BYTES, CommandOptions, ContainerOptions

log = logging.getLogger(__name__)

DEFAULT_CWD = "/workspace"
# Keeps the container alive with nothing but a POSIX shell and `sleep`; exits promptly on TERM.
KEEP_ALIVE = "trap 'exit 0' TERM INT; while :; do sleep 3600 & wait $!; done"
# Set up the working directory (as root) and hand it to the image's user, if it has one.
MAKE_WORKDIR = 'mkdir -p "$1" && { [ -z "$2" ] || chown "$2" "$1"; }'
# Setup, chown and kills run as uid 0, not the user name "root": an image without /etc/passwd
# (scratch, distroless, many busybox builds) cannot resolve a name, and uid 0 is root everywhere.
ROOT = "0"
# Runs the command with `sh -c`, its stderr sent into stdout so that the two stay in order.
MERGED_SH = 'exec sh -c "$1" 2>&1'


# The archive of one file: a 512-byte header (more for long names) and padding to 10 KiB records.
_TAR_OVERHEAD = 64 * 1024


def _join_at_most(chunks, path: str, limit: int) -> bytes:
    """The archive stream's bytes, or FileTooLargeError once they pass `limit` (then the rest is
    never read)."""
    data = bytearray()
    for chunk in chunks:
        data += chunk
        if len(data) > limit:
            raise FileTooLargeError(path, MAX_READ_BYTES)
    return bytes(data)


def exec_failure(code: int | None, output: bytes, command: list[str]) -> str:
    """What a failed exec said, or, when it printed nothing, its exit code and what was run."""
    said = output.decode(errors="replace").strip()
    return said or f"exit code {code} from {' '.join(command)!r}, no output"


class DockerConfig(ContainerOptions, CommandOptions):
    """container_memory: swap is disabled so the limit is real; container_network None: no network
    at all, else a Docker network mode or name."""

    image: str
    task_id: str
    cwd: str | None = None  # None: /workspace (see the module docstring)
    labels: dict[str, str] = Field(default_factory=dict)  # e.g. abr.run_name, abr.run_id


class DockerEnvironment(ContainerBackend):
    config_class = DockerConfig
    rows_need_image = True

    def __init__(self, config: DockerConfig, *, client: docker.DockerClient | None = None):
        self.config = config
        self.workdir = config.cwd or DEFAULT_CWD
        self.name = f"abr-{re.sub(r'[^a-zA-Z0-9_.-]+', '-', config.task_id)[:60]}-{uuid.uuid4().hex[:8]}"
        self._client = client
        self._owns_client = client is None
        self._container = None
        self._user = ""

    @classmethod
    def session_options(cls, settings, image: str | None) -> dict:
        # The container itself adds abr.task_id and its owner (os.getpid() and host) at start.
        return {**super().session_options(settings, image),
                "labels": {"abr.run_name": settings.run_name, "abr.run_id": settings.run_id}}

    @classmethod
    def prepare_run(cls, settings, images, *, say, log) -> dict[str, str]:
        """Remove the containers earlier, dead runners on this host left, then check (and pull)
        every distinct image once."""
        from .images import prepare_images, reap_stale_containers

        try:
            reap_stale_containers(log=log)
        except Exception as err:  # no daemon: every row will fail as environment
            return {image: f"Docker is not available: {err}" for image in images}
        if not images:
            return {}
        say(f"🐳 Checking {len(images)} container image(s)...")
        status = prepare_images(images, progress=lambda image, state: log(f"   {image}: {state}"))
        return {image: error for image, error in status.items() if error}

    @classmethod
    def clean_task_leftovers(cls, settings, task_ids, *, log) -> None:
        """A dead worker's containers have a dead owner: reap them (and any other dead runner's)."""
        from .images import reap_stale_containers

        reap_stale_containers(log=log)

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        if self._container is not None:
            return
        config = self.config
        try:
            if self._client is None:
                self._client = docker.from_env()
        except DockerException as exc:
            raise SandboxError(f"cannot reach the Docker engine: {exc}") from exc
        labels = {
            **config.labels,
            "abr.task_id": config.task_id,
            "abr.owner_pid": str(os.getpid()),
            "abr.owner_host": socket.gethostname(),
        }
        try:
            self._container = self._client.containers.create(
                config.image,
                entrypoint=["sh", "-c", KEEP_ALIVE],
                name=self.name,
                labels=labels,
                init=True,
                detach=True,
                network_mode=config.container_network or "none",
                mem_limit=config.container_memory,
                memswap_limit=config.container_memory,
                nano_cpus=int(config.container_cpus * 1e9) if config.container_cpus else None,
            )
        except ImageNotFound as exc:
            raise SandboxError(
                f"docker image '{config.image}' is not available locally "
                f"(images are checked and pulled once before the run): {exc.explanation or exc}"
            ) from exc
        except DockerException as exc:
            raise SandboxError(f"could not create a container from '{config.image}': {exc}") from exc
        try:
            self._container.start()
            self._user = (self._container.attrs.get("Config") or {}).get("User") or ""
            setup = ["sh", "-c", MAKE_WORKDIR, "sh", self.workdir, self._user]
            code, out = self._container.exec_run(setup, user=ROOT)
            if code != 0:
                raise SandboxError(f"could not create {self.workdir} in '{config.image}': {exec_failure(code, out, setup)}")
        except DockerException as exc:
            self.cleanup()
            raise SandboxError(f"could not start a container from '{config.image}': {exc}") from exc
        except SandboxError:
            self.cleanup()
            raise

    def cleanup(self) -> None:
        container, self._container = self._container, None
        if container is not None:
            try:
                container.remove(force=True)
            except NotFound:
                pass
            except DockerException as exc:  # labels let reap_stale_containers find it later
                log.warning("could not remove container %s: %s", self.name, exc)
        if self._owns_client and self._client is not None:
            self._client.close()
            self._client = None

    # -- commands ---------------------------------------------------------------------------

    def execute(self, command: str, *, cwd: str | None = None, timeout: float | None = None) -> ExecResult:
        container = self._require()
        timeout = self.config.command_timeout if timeout is None else timeout
        api = self._client.api
        token = uuid.uuid4().hex
        try:
            exec_id = api.exec_create(
                container.id,
                ["sh", "-c", MERGED_SH, "sh", command],
                workdir=self._path(cwd or "."),
                environment={EXEC_MARK: token},
            )["Id"]
            stream = api.exec_start(exec_id, stream=True)
        except DockerException as exc:
            raise self._failure(exc) from exc

        output = OutputCapture(self.config.max_output_chars * 4)  # 4: worst-case UTF-8 bytes per char
        errors: list[Exception] = []

        def drain() -> None:
            try:
                for chunk in stream:
                    output.add(chunk)
            except Exception as exc:  # noqa: BLE001 - reported below, after the join
                errors.append(exc)

        reader = threading.Thread(target=drain, name=f"{self.name}-exec", daemon=True)
        reader.start()
        reader.join(timeout)
        timed_out = reader.is_alive()
        if timed_out:
            self._kill(token)
            reader.join(2)
            if reader.is_alive():  # a process cleared its environment, escaped the marker, holds stdout
                stream.close()
                reader.join(2)

        exit_code = self._exit_code(exec_id)
        if errors or exit_code is None or (exit_code == 137 and not timed_out):  # 137: SIGKILL...
            self._check_alive(settle=1.0)  # ...maybe of the whole container
        text = output.text()
        if timed_out:
            text += f"\n[command timed out after {timeout:g} s and was killed]"
            exit_code = 124
        exit_code = -1 if exit_code is None else exit_code
        return ExecResult(truncate_output(text, self.config.max_output_chars), exit_code, timed_out)

    def _exit_code(self, exec_id: str) -> int | None:
        for _ in range(20):  # the exec may report Running for a moment after its output closes
            try:
                info = self._client.api.exec_inspect(exec_id)
            except DockerException as exc:
                raise self._failure(exc) from exc
            if not info.get("Running"):
                return info.get("ExitCode")
            time.sleep(0.05)
        return None

    def _kill(self, token: str) -> None:
        try:
            self._container.exec_run(["sh", "-c", kill_marked_processes_script(token)], user=ROOT)
        except DockerException as exc:
            log.warning("could not kill a timed-out command in %s: %s", self.name, exc)

    # -- files ------------------------------------------------------------------------------

    def read_file(self, path: str) -> bytes:
        container = self._require()
        full = self._path(path)
        for _ in range(8):  # follow symlinks, which the archive API returns as links
            try:
                chunks, info = container.get_archive(full)
                if info.get("size", 0) > MAX_READ_BYTES:  # known before a byte is read
                    raise FileTooLargeError(full, MAX_READ_BYTES)
                data = _join_at_most(chunks, full, MAX_READ_BYTES + _TAR_OVERHEAD)
            except NotFound as exc:
                self._check_alive()
                raise FileNotFoundError(f"{full}: no such file in the container") from exc
            except DockerException as exc:
                raise self._failure(exc) from exc
            with tarfile.open(fileobj=io.BytesIO(data)) as tar:
                member = tar.next()
                if member is None:
                    raise FileNotFoundError(full)
                if member.isdir():
                    raise IsADirectoryError(f"{full} is a directory")
                if member.issym():
                    full = posixpath.normpath(posixpath.join(posixpath.dirname(full), member.linkname))
                    continue
                if not member.isfile():  # a device or a pipe: the archive holds no content
                    raise OSError(errno.EINVAL, "not a regular file", full)
                if member.size > MAX_READ_BYTES:
                    raise FileTooLargeError(full, MAX_READ_BYTES)
                return tar.extractfile(member).read()
        raise OSError(f"{path}: too many levels of symbolic links")

    def write_file(self, path: str, data: bytes) -> None:
        container = self._require()
        full = self._path(path)
        parent, name = posixpath.split(full)
        archive = io.BytesIO()
        with tarfile.open(fileobj=archive, mode="w") as tar:
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, int(time.time())
            tar.addfile(info, io.BytesIO(data))
        try:
            mkdir = ["mkdir", "-p", parent]
            code, out = container.exec_run(mkdir)
            if code != 0:
                raise OSError(f"cannot create directory {parent}: {exec_failure(code, out, mkdir)}")
            container.put_archive(parent, archive.getvalue())
            if self._user:  # put_archive writes as root; give the file to the image's user
                container.exec_run(["chown", self._user, full], user=ROOT)
        except APIError as exc:
            self._check_alive()
            raise OSError(f"cannot write {full}: {exc.explanation or exc}") from exc
        except DockerException as exc:
            raise self._failure(exc) from exc

    # -- helpers ----------------------------------------------------------------------------

    def _path(self, path: str) -> str:
        return posixpath.normpath(posixpath.join(self.workdir, path))

    def _require(self):
        if self._container is None:
            raise SandboxError("the docker environment is not started (or was cleaned up)")
        return self._container

    def _check_alive(self, settle: float = 0.0) -> None:
        """Raise SandboxError when the container has stopped or disappeared.

        A container killed a moment ago still reads "running" for some tens of milliseconds, so a
        caller that suspects a death may give it `settle` seconds to show.
        """
        deadline = time.monotonic() + settle
        while True:
            try:
                self._container.reload()
                status = self._container.status
            except NotFound:
                status = "removed"
            except DockerException as exc:
                raise SandboxError(f"lost contact with the Docker engine: {exc}") from exc
            if status != "running":
                raise SandboxError(f"container {self.name} ({self.config.image}) died mid-prompt: it is {status}")
            if time.monotonic() >= deadline:
                return
            time.sleep(0.05)

    def _failure(self, exc: Exception) -> SandboxError:
        self._check_alive()
        return SandboxError(f"docker exec failed in {self.name}: {exc}")
