"""Run-wide tool configuration, shared by every session of a run.

Filled once by the CLI (flags, then environment variables) and sent to the worker processes.
A field that a flag sets declares that flag (`flag(...)`: its help, its --help group, whether it
changes a row's fingerprint); the flags' checks are the fields' constraints (runner/input/config.py
turns a failed one into the CLI's one-line error). Secrets are SecretStr: they never appear in
config.json, logs or trajectories. The model endpoint's key is not here: tools that call a model
(vision, moa, browser_vision) do so through the session's model client (`ToolContext.model`).

The options of the environment backends are grouped in sections (CommandOptions, WorkdirOptions,
LocalOptions, ContainerOptions). A backend's config class derives from the sections it uses, so
it takes those options from the run's settings by name (tools/environments/base.py,
`Backend.from_settings`): an option is declared once, in its section.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, StrictFloat, field_validator, model_validator

from runner.input.flag_declaration import flag

# Defaults that the environment backends share with these settings (defined here only).
COMMAND_TIMEOUT = 180.0  # default timeout of one terminal command, seconds
MAX_OUTPUT_CHARS = 50_000  # tool output above this is truncated (head and tail kept)
MAX_READ_BYTES = 16 * 2**20  # a file tool reads at most this much of a file: more is an error


class CommandOptions(BaseModel):
    """How every backend runs a command."""

    command_timeout: StrictFloat = flag(COMMAND_TIMEOUT, gt=0, help="Default timeout of one terminal command, seconds.")
    max_output_chars: int = MAX_OUTPUT_CHARS


class WorkdirOptions(BaseModel):
    """The per-prompt working directories on the host (local, singularity)."""

    keep_workdirs: bool = flag(False, help="Keep the per-prompt working directories (local backend).")
    workdir_root: str | None = None  # parent of the per-prompt working directories (None: the temp dir)


class LocalOptions(WorkdirOptions):
    """The local backend's options."""

    sandbox: Literal["bwrap"] | None = flag(None, help="bwrap: run local commands under bubblewrap.")

    @field_validator("sandbox", mode="before")
    @classmethod
    def _sandbox_none(cls, value):
        if value == "none":  # --sandbox=none: the default, said out loud
            return None
        if value not in (None, "bwrap"):
            raise ValueError(f"--sandbox must be 'bwrap' or 'none' (got {value!r})")
        return value


class ContainerOptions(BaseModel):
    """The container backends' options (docker, singularity, modal)."""

    docker_image: str | None = flag(None, fingerprint=True, help="Image for rows that name none (--terminal_env=docker).")
    container_memory: str | None = flag(None, shown="none", help="Memory limit of each container (e.g. 2g).")
    container_cpus: StrictFloat | None = flag(None, gt=0, shown="none", help="CPU limit of each container.")
    container_network: str | None = flag(None, shown="no network", help="Network of each container (e.g. bridge).")


def _terminal_env_help() -> str:
    from tools.environments import backend_choices  # (the registry: no backend is imported)

    return f"Where commands run: {backend_choices()}."


# What the tools answer with: a change makes a row's tool results, hence the row, different.
TOOL_BACKENDS = "tool_backends"


class ToolSettings(CommandOptions, LocalOptions, ContainerOptions):
    model_config = ConfigDict(extra="forbid", frozen=True)  # a misspelt option is an error, not ignored

    # Where terminal and file tools run: a name in tools.environments.BACKENDS.
    terminal_env: str = flag("local", fingerprint=True, shown="$TERMINAL_ENV or local", help=_terminal_env_help())

    run_name: str = ""
    run_id: str = ""  # unique per invocation; labels containers and task ids

    # The run's model: the default of the tools that call a model (vision, moa, browser_vision).
    model: str = "mock"
    vision_model: str | None = flag(None, fingerprint=TOOL_BACKENDS, shown="the run's model",
                                    help="Model used by vision_analyze and browser_vision.")
    moa_reference_models: list[str] = flag(
        default_factory=lambda: [
            "anthropic/claude-sonnet-4.6",
            "google/gemini-2.5-pro",
            "openai/gpt-5",
            "deepseek/deepseek-r1",
        ],
        fingerprint=TOOL_BACKENDS, kind=str, help="Comma list: reference models of mixture_of_agents.",
    )
    moa_aggregator_model: str = flag("anthropic/claude-sonnet-4.6", fingerprint=TOOL_BACKENDS,
                                     help="Aggregator model of mixture_of_agents.")

    # Web tools.
    web_search_backend: str | None = flag(None, fingerprint=TOOL_BACKENDS, shown="first configured",
                                          help="searxng, tavily, exa, brave or firecrawl.")
    searxng_url: str | None = None
    tavily_api_key: SecretStr | None = Field(default=None, exclude=True)
    exa_api_key: SecretStr | None = Field(default=None, exclude=True)
    brave_api_key: SecretStr | None = Field(default=None, exclude=True)
    firecrawl_api_key: SecretStr | None = Field(default=None, exclude=True)

    # Image generation.
    image_backend: str | None = flag(None, fingerprint=TOOL_BACKENDS, shown="first configured", help="fal or openai.")
    fal_key: SecretStr | None = Field(default=None, exclude=True)
    images_base_url: str | None = None  # OpenAI-compatible images endpoint
    images_api_key: SecretStr | None = Field(default=None, exclude=True)
    image_model: str | None = flag(None, fingerprint=TOOL_BACKENDS, shown="backend default",
                                   help="Model of the image backend.")

    # Browser.
    browser_executable: str | None = "/usr/bin/chromium"
    browser_timeout: float = 30.0

    @field_validator("terminal_env")
    @classmethod
    def _known_terminal_env(cls, value: str) -> str:
        from tools.environments import BACKENDS, backend_choices  # (the registry: no backend is imported)

        if value not in BACKENDS:
            raise ValueError(f"--terminal_env must be {backend_choices()} (got {value!r})")
        return value

    @model_validator(mode="after")
    def _keys_fit_an_http_header(self):
        from runner.input.secrets import check_header_safe

        for name in ("tavily_api_key", "exa_api_key", "brave_api_key", "firecrawl_api_key", "fal_key", "images_api_key"):
            check_header_safe(f"the key in {name.upper()}", getattr(self, name))
        return self

    @model_validator(mode="after")
    def _sandbox_is_local(self):
        if self.sandbox == "bwrap" and self.terminal_env != "local":
            raise ValueError("--sandbox=bwrap applies to --terminal_env=local only")
        return self
