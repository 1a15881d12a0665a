"""Container images and leaked containers, handled once per run rather than once per prompt.

`prepare_images` runs before any tokens are spent: each distinct image is inspected once and the
missing ones are pulled once, a few at a time. `reap_stale_containers` removes containers that an
earlier, dead runner process on this host left behind (they carry its PID in `abr.owner_pid`).
"""

from __future__ import annotations

import os
import socket
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import docker
from docker.errors import DockerException, ImageNotFound, NotFound

Progress = Callable[[str, str], None]  # (image, status): "present" | "pulling" | "pulled" | "failed"


def prepare_images(
    images: set[str],
    *,
    pull: bool = True,
    max_concurrency: int = 4,
    progress: Progress | None = None,
    client: docker.DockerClient | None = None,
) -> dict[str, str | None]:
    """Return image -> None when it is ready, or a message saying why it cannot be used."""
    names = sorted({name for name in images if name})
    if not names:
        return {}
    report = progress or (lambda image, status: None)
    try:
        client = client or docker.from_env()
    except DockerException as exc:
        return {name: f"image '{name}' cannot be checked: cannot reach the Docker engine: {exc}" for name in names}

    def check(name: str) -> str | None:
        problem = get(name)
        return problem or shell_missing(client, name)

    def get(name: str) -> str | None:
        try:
            client.images.get(name)
            report(name, "present")
            return None
        except ImageNotFound:
            pass
        except DockerException as exc:
            report(name, "failed")
            return f"image '{name}' could not be inspected: {_explain(exc)}"
        if not pull:
            report(name, "failed")
            return f"image '{name}' not found locally (pulling is disabled)"
        report(name, "pulling")
        try:
            client.images.pull(name)  # the SDK pulls `:latest` when the name has no tag
        except DockerException as exc:
            report(name, "failed")
            return f"image '{name}' not found locally and pull failed: {_explain(exc)}"
        report(name, "pulled")
        return None

    with ThreadPoolExecutor(max_workers=max(1, min(max_concurrency, len(names)))) as pool:
        return dict(zip(names, pool.map(check, names)))


def shell_missing(client: docker.DockerClient, name: str) -> str | None:
    """Why image `name` cannot run our commands, or None. Every command, the container's keep-alive
    loop included, runs with `sh -c`: without /bin/sh Docker would only say "409 Conflict (container
    is not running)". A created, never started, container shows the image's files."""
    labels = {"abr.owner_pid": str(os.getpid()), "abr.owner_host": socket.gethostname()}  # reaped if left
    try:
        container = client.containers.create(name, entrypoint=["/bin/sh"], network_mode="none", labels=labels)
    except DockerException as exc:
        return f"image '{name}' cannot be used: {_explain(exc)}"
    try:
        chunks, _stat = container.get_archive("/bin/sh")
        chunks.close()  # its presence is enough: no need to copy the file out
        return None
    except NotFound:
        return f"the image '{name}' has no /bin/sh: every command runs with sh -c (use an image with a POSIX shell)"
    except DockerException as exc:
        return f"image '{name}' could not be inspected: {_explain(exc)}"
    finally:
        try:
            container.remove(force=True)
        except DockerException:
            pass


def list_containers(client: docker.DockerClient, filters: dict, attempts: int = 5) -> list:
    """Containers matching `filters`. The SDK lists, then inspects each one; a container removed in
    between (by its own cleanup, or another reaper) makes it raise NotFound: list again."""
    for attempt in range(attempts):
        try:
            return client.containers.list(all=True, filters=filters)
        except NotFound:
            if attempt == attempts - 1:
                raise
    return []


def reap_stale_containers(client: docker.DockerClient | None = None, log: Callable[[str], None] = print) -> int:
    """Remove our containers whose owner process on this host is gone; return how many."""
    client = client or docker.from_env()
    host = socket.gethostname()
    removed = 0
    for container in list_containers(client, {"label": "abr.owner_pid"}):
        labels = container.labels
        if labels.get("abr.owner_host") != host:
            continue  # another machine's container: its PID means nothing here
        try:
            pid = int(labels["abr.owner_pid"])
        except ValueError:
            continue
        if _process_alive(pid):
            continue
        try:
            container.remove(force=True)
        except NotFound:
            continue  # removed meanwhile (by its owner's cleanup or another reaper)
        except DockerException as exc:
            log(f"could not remove stale container {container.name}: {_explain(exc)}")
            continue
        log(
            f"removed stale container {container.name} (run {labels.get('abr.run_name') or '?'} "
            f"{labels.get('abr.run_id') or ''}, task {labels.get('abr.task_id') or '?'}): "
            f"its owner process {pid} is gone"
        )
        removed += 1
    return removed


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    try:  # a zombie (dead, not yet reaped by its parent) no longer owns anything
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


def _explain(exc: Exception) -> str:
    return str(getattr(exc, "explanation", None) or exc)
