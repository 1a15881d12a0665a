"""Run-wide tool configuration, shared by every session of a run.

Filled once by the CLI (flags, then environment variables) and sent to the worker processes.
The flags' checks are the fields' constraints (runner/input/config.py turns a failed one into the CLI's
one-line error). Secrets are SecretStr: they never appear in config.json, logs or trajectories.
The model endpoint's key is not here: tools that call a model (vision, moa, browser_vision) do so
through the session's model client (`ToolContext.model`), which holds it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, StrictFloat, field_validator, model_validator

# Defaults that the environment backends share with these settings (defined here only).
COMMAND_TIMEOUT = 180.0  # default timeout of one terminal command, seconds
MAX_OUTPUT_CHARS = 50_000  # tool output above this is truncated (head and tail kept)
MAX_READ_BYTES = 16 * 2**20  # a file tool reads at most this much of a file: more is an error


class ToolSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelt option is an error, not ignored

    # Where terminal and file tools run.
    terminal_env: str = "local"  # a name in tools.environments.BACKENDS: local | docker | singularity | modal
    sandbox: Literal["bwrap"] | None = None  # local only: "bwrap" runs each command under bubblewrap
    keep_workdirs: bool = False
    workdir_root: str | None = None  # local: parent of the per-prompt working directories
    command_timeout: StrictFloat = Field(default=COMMAND_TIMEOUT, gt=0)
    max_output_chars: int = MAX_OUTPUT_CHARS

    # Container backends.
    docker_image: str | None = None  # default image for rows that name none
    container_memory: str | None = None  # e.g. "2g"
    container_cpus: StrictFloat | None = Field(default=None, gt=0)
    container_network: str | None = None  # None: no network
    run_name: str = ""
    run_id: str = ""  # unique per invocation; labels containers and task ids

    # The run's model: the default of the tools that call a model (vision, moa, browser_vision).
    model: str = "mock"
    vision_model: str | None = None  # default: the run's model
    moa_reference_models: list[str] = Field(
        default_factory=lambda: [
            "anthropic/claude-sonnet-4.6",
            "google/gemini-2.5-pro",
            "openai/gpt-5",
            "deepseek/deepseek-r1",
        ]
    )
    moa_aggregator_model: str = "anthropic/claude-sonnet-4.6"

    # Web tools.
    web_search_backend: str | None = None  # searxng | tavily | exa | brave | firecrawl (None: first configured)
    searxng_url: str | None = None
    tavily_api_key: SecretStr | None = Field(default=None, exclude=True)
    exa_api_key: SecretStr | None = Field(default=None, exclude=True)
    brave_api_key: SecretStr | None = Field(default=None, exclude=True)
    firecrawl_api_key: SecretStr | None = Field(default=None, exclude=True)

    # Image generation.
    image_backend: str | None = None  # fal | openai (None: first configured)
    fal_key: SecretStr | None = Field(default=None, exclude=True)
    images_base_url: str | None = None  # OpenAI-compatible images endpoint
    images_api_key: SecretStr | None = Field(default=None, exclude=True)
    image_model: str | None = None

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

    @field_validator("sandbox", mode="before")
    @classmethod
    def _sandbox_none(cls, value):
        if value == "none":  # --sandbox=none: the default, said out loud
            return None
        if value not in (None, "bwrap"):
            raise ValueError(f"--sandbox must be 'bwrap' or 'none' (got {value!r})")
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
