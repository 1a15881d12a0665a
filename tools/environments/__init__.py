"""Sandbox backends, by --terminal_env name.

Each backend is one module: a pydantic config plus a class derived from `base.Backend` that builds
itself from the run's ToolSettings (`from_settings`) and may prepare the run (`prepare_run`: image
checks). Adding a backend is one file and one line in BACKENDS. The modules are imported only when
a run uses them, so no run imports an SDK (docker, modal) it does not use.
"""

from __future__ import annotations

import functools
import importlib

# name -> "module:class" (the module relative to this package).
BACKENDS = {
    "local": "local:LocalEnvironment",
    "docker": "docker:DockerEnvironment",
    "singularity": "singularity:SingularityEnvironment",
    "modal": "modal:ModalEnvironment",
}


def backend_choices() -> str:
    """The backend names for a message: "local, docker, singularity or modal"."""
    *most, last = BACKENDS
    return f"{', '.join(most)} or {last}" if most else last


@functools.cache  # once per process: every session asks for its environment's class
def backend_class(name: str):
    """The class of backend `name` (its module is imported now). ValueError if there is none."""
    if name not in BACKENDS:
        raise ValueError(f"unknown terminal_env {name!r}: expected one of {', '.join(BACKENDS)}")
    module, _, cls = BACKENDS[name].partition(":")
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)


def create_environment(settings, *, task_id: str, image: str | None, cwd: str | None):
    """Build (not start) the environment of one session from the run's ToolSettings.

    `image` is the row's own image; container backends fall back to `settings.docker_image`.
    """
    return backend_class(settings.terminal_env).from_settings(settings, task_id=task_id, image=image, cwd=cwd)
