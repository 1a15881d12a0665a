"""Docker for tests: a daemon that answers, and two tiny images built offline from busybox.

No registry is reachable, so the images are a busybox root filesystem imported with
`docker import`. The second image carries a marker file, so a test can prove which image a
command ran in. With the environment variable CI set, a missing Docker fails the tests instead of
skipping them: CI must never pass by silently not testing the containers.
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import tarfile

import pytest

BUSYBOX_IMAGE = "abr-test/busybox:1"
MARKED_IMAGE = "abr-test/busybox-marked:1"
MARKED_CONTENT = "abr-test marked image v1\n"
# As scratch, distroless and many busybox builds come: no /etc/passwd, so no user *name* resolves.
NO_PASSWD_IMAGE = "abr-test/busybox-nopasswd:1"
# As scratch and distroless images come: files, but no shell at all.
NO_SHELL_IMAGE = "abr-test/no-shell:1"


def unavailable(reason: str):
    if os.environ.get("CI"):
        pytest.fail(f"Docker is required when CI is set: {reason}", pytrace=False)
    pytest.skip(reason)


def docker_client():
    """A client whose daemon answers, or skip (fail under CI)."""
    try:
        import docker

        client = docker.from_env()
        client.ping()
    except Exception as exc:  # noqa: BLE001 - any failure means "no usable engine"
        unavailable(f"no Docker engine answers: {exc}")
    return client


def ready_client():
    """A client whose daemon answers, with both test images built (skip, or fail under CI, if not)."""
    client = docker_client()
    ensure_test_images(client)
    return client


def ensure_test_images(client) -> None:
    """Build the test images (plain, marked, without /etc/passwd) unless they exist."""
    from docker.errors import ImageNotFound

    for image, extra in ((BUSYBOX_IMAGE, {}), (MARKED_IMAGE, {"etc/abr-image": MARKED_CONTENT}), (NO_PASSWD_IMAGE, None)):
        try:
            client.images.get(image)
            continue
        except ImageNotFound:
            pass
        repository, tag = image.rsplit(":", 1)
        client.api.import_image_from_data(
            _rootfs_tar(extra), repository=repository, tag=tag, changes=["ENV PATH=/bin"]
        )
        client.images.get(image)


def ensure_no_shell_image(client) -> str:
    """An image holding a single data file: no /bin/sh, nothing to run."""
    from docker.errors import ImageNotFound

    try:
        client.images.get(NO_SHELL_IMAGE)
    except ImageNotFound:
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w") as tar:
            data = b"no shell here\n"
            info = tarfile.TarInfo("data.txt")
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
        repository, tag = NO_SHELL_IMAGE.rsplit(":", 1)
        client.api.import_image_from_data(buffer.getvalue(), repository=repository, tag=tag)
    return NO_SHELL_IMAGE


def _rootfs_tar(extra_files: dict[str, str] | None) -> bytes:
    """A busybox root filesystem; `extra_files=None` leaves out /etc/passwd and /etc/group."""
    busybox = shutil.which("busybox")
    if busybox is None:
        unavailable("busybox is not installed (apt-get install -y busybox-static)")
    applets = subprocess.run([busybox, "--list"], capture_output=True, text=True, check=True).stdout.split()
    files = {} if extra_files is None else {
        "etc/passwd": "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/sh\n",
        "etc/group": "root:x:0:\nnogroup:x:65534:\n",
        **extra_files,
    }
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, mode in (("bin", 0o755), ("etc", 0o755), ("root", 0o700), ("tmp", 0o1777)):
            info = tarfile.TarInfo(name)
            info.type, info.mode = tarfile.DIRTYPE, mode
            tar.addfile(info)
        tar.add(busybox, arcname="bin/busybox")
        for applet in applets:
            if applet != "busybox":
                info = tarfile.TarInfo(f"bin/{applet}")
                info.type, info.linkname = tarfile.SYMTYPE, "busybox"
                tar.addfile(info)
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()
