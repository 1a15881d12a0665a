"""Pick and configure the sandbox backend for one session from the run's ToolSettings."""

from __future__ import annotations

from tools.settings import ToolSettings

from .base import Environment, SandboxError

BACKENDS = ("local", "docker", "singularity", "modal")


def create_environment(settings: ToolSettings, *, task_id: str, image: str | None, cwd: str | None) -> Environment:
    """Build (not start) the environment of one session.

    `image` is the row's own image; container backends fall back to `settings.docker_image`.
    The local backend has no image and ignores it. Backends are imported here, on demand, so a run
    never imports an SDK it does not use.
    """
    backend = settings.terminal_env
    if backend not in BACKENDS:
        raise ValueError(f"unknown terminal_env {backend!r}: expected one of {', '.join(BACKENDS)}")
    common = {
        "task_id": task_id,
        "max_output_chars": settings.max_output_chars,
        "command_timeout": settings.command_timeout,
    }

    if backend == "local":
        from .local import LocalConfig, LocalEnvironment

        return LocalEnvironment(
            LocalConfig(
                **common,
                workdir_root=settings.workdir_root,
                cwd=cwd,
                keep_workdir=settings.keep_workdirs,
                sandbox=settings.sandbox,
            )
        )

    image = image or settings.docker_image
    if not image:
        raise SandboxError(
            f"terminal_env={backend} needs a container image: give the row an 'image' (or 'docker_image') "
            "field, or set a default image for the run (docker_image)"
        )
    limits = {
        "memory": settings.container_memory,
        "cpus": settings.container_cpus,
        "network": settings.container_network,
    }

    if backend == "docker":
        from .docker import DockerConfig, DockerEnvironment

        labels = {"abr.run_name": settings.run_name, "abr.run_id": settings.run_id}
        # The container itself adds abr.task_id and its owner (os.getpid() and host) at start.
        return DockerEnvironment(DockerConfig(**common, **limits, image=image, cwd=cwd, labels=labels))

    if backend == "singularity":
        from .singularity import SingularityConfig, SingularityEnvironment

        return SingularityEnvironment(
            SingularityConfig(
                **common, **limits, image=image, cwd=cwd,
                workdir_root=settings.workdir_root, keep_workdir=settings.keep_workdirs,
            )
        )

    from .modal import ModalConfig, ModalEnvironment

    return ModalEnvironment(ModalConfig(**common, **limits, image=image, cwd=cwd))
