"""Run-wide tool configuration, shared by every session of a run.

Filled once by the CLI (flags, then environment variables) and sent to the worker processes.
Secrets are SecretStr: they never appear in config.json, logs or trajectories.
"""

from __future__ import annotations

from pydantic import BaseModel, Field, SecretStr


class ToolSettings(BaseModel):
    # Where terminal and file tools run.
    terminal_env: str = "local"  # a name in tools.environments.BACKENDS: local | docker | singularity | modal
    sandbox: str | None = None  # local only: "bwrap" runs each command under bubblewrap
    keep_workdirs: bool = False
    workdir_root: str | None = None  # local: parent of the per-prompt working directories
    command_timeout: float = 180.0  # default timeout of one terminal command, seconds
    max_output_chars: int = 50_000  # tool output above this is truncated (head and tail kept)

    # Container backends.
    docker_image: str | None = None  # default image for rows that name none
    container_memory: str | None = None  # e.g. "2g"
    container_cpus: float | None = None
    container_network: str | None = None  # None: no network
    run_name: str = ""
    run_id: str = ""  # unique per invocation; labels containers and task ids

    # Model endpoint used by tools that call a model (vision, moa, browser_vision).
    model: str = "mock"
    base_url: str | None = None
    api_key: SecretStr | None = Field(default=None, exclude=True)
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
