"""The run's configuration: validated options, what config.json records, and the fingerprint.

The fingerprint hashes every option that changes what a row's output would be. `--resume` compares
it with the one saved in config.json and refuses to mix outputs of two configurations unless
`--allow_config_change` is given.
"""

from __future__ import annotations

import hashlib
from typing import Any

import orjson
from pydantic import BaseModel, Field, SecretStr

from agent.pricing import FREE, Prices
from tools.settings import ToolSettings

REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max", "ultra")
PROVIDER_SORTS = ("price", "throughput", "latency")
TOOL_CHOICES = ("auto", "required", "none")
PROMPT_CACHING = ("auto", "on", "off")

# Options whose change makes new rows incomparable with old ones.
FINGERPRINT_FIELDS = (
    "model",
    "base_url",
    "distribution",
    "max_turns",
    "max_tokens",
    "reasoning",
    "ephemeral_system_prompt",
    "prefill_messages",
    "seed",
    "provider",
    "tool_choice",
    "tool_schema_version",
    "terminal_env",
    "docker_image",
    "tool_backends",
)


class RunConfig(BaseModel):
    dataset_file: str
    run_name: str
    batch_size: int
    output_dir: str = "data"
    distribution: str = "default"
    model: str = "anthropic/claude-sonnet-4.6"
    base_url: str | None = "https://openrouter.ai/api/v1"
    api_key: SecretStr | None = Field(default=None, exclude=True)
    max_turns: int = 10
    num_workers: int = 4  # concurrent agent sessions
    num_processes: int | None = None  # worker processes (default: CPU count, at most num_workers)
    max_tokens: int | None = None
    reasoning: dict | None = None  # the `reasoning` request field, from the reasoning flags
    provider: dict | None = None  # the OpenRouter `provider` request field
    tool_choice: str = "auto"  # the `tool_choice` request field, sent whenever tools are offered
    # cache_control breakpoints (auto: Claude models on OpenRouter). Not fingerprinted: it changes
    # what a row costs, not what it contains.
    prompt_caching: str = "auto"
    ephemeral_system_prompt: str | None = None
    prefill_messages: list[dict] = Field(default_factory=list)
    prefill_messages_file: str | None = None
    max_samples: int | None = None
    seed: int | None = None  # without --seed, BatchRunner draws one for the run (seed_drawn) and records it
    seed_drawn: bool = False
    keep_no_reasoning: bool = False
    skip_invalid: bool = False
    verbose: bool = False
    log_prefix_chars: int = 100
    prompt_timeout: float | None = None  # wall-clock limit of one prompt, seconds
    request_timeout: float = 600.0
    max_requests_per_minute: float | None = None
    grace_period: float = 30.0  # after the first Ctrl-C: how long in-flight prompts may finish
    executor: str = "local"  # local (process pool) | ray (a Ray cluster)
    ray_address: str | None = None
    sessions_per_node: int | None = None  # ray: concurrent sessions per node (default num_workers)
    report_samples: int = 500  # full conversations embedded in report.html
    prices: Prices | None = None  # --price_*_per_mtok: for replies whose endpoint reports no cost
    max_cost: float | None = None  # USD budget (runner/budget.py)
    max_cost_hard: bool = False  # cancel rows in flight at the budget instead of letting them finish
    max_cost_scope: str = "run"  # run: spend of earlier invocations counts; invocation: only this one
    tool_schema_version: str = ""
    tools: ToolSettings = Field(default_factory=ToolSettings)

    @property
    def terminal_env(self) -> str:
        return self.tools.terminal_env

    @property
    def docker_image(self) -> str | None:
        return self.tools.docker_image

    @property
    def tool_backends(self) -> dict:
        """The models and services tools answer with: they shape tool results, hence the rows."""
        t = self.tools
        return {"vision_model": t.vision_model, "moa_reference_models": t.moa_reference_models,
                "moa_aggregator_model": t.moa_aggregator_model, "web_search_backend": t.web_search_backend,
                "image_backend": t.image_backend, "image_model": t.image_model}

    @property
    def request_prices(self) -> Prices | None:
        """The prices of replies without a reported cost: the user's, else free for the offline model."""
        return self.prices or (FREE if self.model == "mock" else None)

    @property
    def discard_without_reasoning(self) -> bool:
        """The original's no-reasoning filter; off when reasoning is disabled or it is turned off."""
        disabled = bool(self.reasoning) and self.reasoning.get("effort") == "none"
        return not (self.keep_no_reasoning or disabled)

    def extra_body(self) -> dict | None:
        body: dict[str, Any] = {}
        if self.provider:
            body["provider"] = self.provider
        if self.reasoning is not None:
            body["reasoning"] = self.reasoning
        return body or None

    def fingerprint_fields(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in FINGERPRINT_FIELDS}

    def fingerprint(self) -> str:
        blob = orjson.dumps(self.fingerprint_fields(), option=orjson.OPT_SORT_KEYS)
        return hashlib.sha256(blob).hexdigest()[:16]

    def public_dict(self) -> dict:
        """Everything config.json records: no secret (SecretStr fields are excluded)."""
        return self.model_dump(mode="json")


def diff_fingerprints(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Names of the fingerprinted options whose values differ."""
    keys = sorted(set(saved) | set(current))
    return [k for k in keys if orjson.dumps(saved.get(k), option=orjson.OPT_SORT_KEYS) != orjson.dumps(current.get(k), option=orjson.OPT_SORT_KEYS)]
