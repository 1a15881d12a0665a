"""The run's configuration: validated options, what config.json records, and the fingerprint.

The flags are checked here, by the fields' types and constraints (and a few validators), and each
default is defined once, on its field: the CLI passes only the flags the user gave. `flag_error`
turns pydantic's report of a bad value into the CLI's one line, named by the flag (fields are
named like their flags).

The fingerprint hashes every option that changes what a row's output would be. `--resume` compares
it with the one saved in config.json and refuses to mix outputs of two configurations unless
`--allow_config_change` is given.
"""

from __future__ import annotations

import hashlib
import os
import re
from typing import Annotated, Any, Literal, get_args, get_origin

import orjson
from annotated_types import Ge, Gt, Lt
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, SecretStr, StrictFloat, StrictInt, ValidationError, field_validator, model_validator

from agent.model_client import RetryPolicy
from agent.pricing import FREE, Prices
from tools.settings import ToolSettings

ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max", "ultra"]
ProviderSort = Literal["price", "throughput", "latency"]
REASONING_EFFORTS = get_args(ReasoningEffort)
PROVIDER_SORTS = get_args(ProviderSort)
_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")

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

# Options that change a sample's scores; fingerprinted only in a run that has scorers.
SCORING_FINGERPRINT_FIELDS = ("scorer", "pass_threshold", "verify_command", "judge_model", "judge_rubric")


def _check_run_name(value: str) -> str:
    if not value:
        raise ValueError("--run_name is required")
    if not _RUN_NAME.match(value):  # (this also refuses "." and "..")
        raise ValueError(
            f"--run_name={value!r} is not allowed: use letters, digits, '.', '_' and '-' (it names a folder "
            "inside the output directory and cannot leave it)"
        )
    return value


RunName = Annotated[str, AfterValidator(_check_run_name)]


class RunConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelt option is an error, not ignored

    dataset_file: str
    run_name: RunName
    batch_size: StrictInt = Field(ge=1)
    output_dir: str = "data"
    distribution: str = "default"
    model: str = "anthropic/claude-sonnet-4.6"
    base_url: str | None = "https://openrouter.ai/api/v1"  # None for the offline model
    api_key: SecretStr | None = Field(default=None, exclude=True)
    max_turns: StrictInt = Field(default=10, ge=1)
    num_workers: StrictInt = Field(default=4, ge=1)  # concurrent agent sessions
    # worker processes (default: CPU count, at most num_workers)
    num_processes: StrictInt | None = Field(default=None, ge=1)
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    reasoning: dict | None = None  # the `reasoning` request field, from the reasoning flags
    provider: dict | None = None  # the OpenRouter `provider` request field
    # the `tool_choice` request field, sent whenever tools are offered
    tool_choice: Literal["auto", "required", "none"] = "auto"
    # cache_control breakpoints (auto: Claude models on OpenRouter). Not fingerprinted: it changes
    # what a row costs, not what it contains.
    prompt_caching: Literal["auto", "on", "off"] = "auto"
    ephemeral_system_prompt: str | None = None
    prefill_messages: list[dict] = Field(default_factory=list)
    prefill_messages_file: str | None = None
    max_samples: StrictInt | None = Field(default=None, ge=1)  # 0 on the command line: all rows
    # 0 <= seed < 2**63: the run's random generator and the int64 metadata.seed column take it as it is
    seed: StrictInt | None = Field(default=None, ge=0, lt=2**63)  # without --seed, BatchRunner draws one for the run (seed_drawn) and records it
    seed_drawn: bool = False
    keep_no_reasoning: bool = False
    skip_invalid: bool = False
    export: list[str] = Field(default_factory=list)  # --export formats written at the end (runner/output/export.py)
    allow_duplicate_ids: bool = False  # rows may share an `id` (refused by default: it names one row)
    verbose: bool = False
    log_prefix_chars: StrictInt = Field(default=100, ge=0)
    prompt_timeout: StrictFloat | None = Field(default=None, gt=0)  # wall-clock limit of one prompt, seconds
    request_timeout: StrictFloat = Field(default=RetryPolicy.request_timeout, gt=0)
    max_requests_per_minute: StrictFloat | None = Field(default=None, gt=0)
    grace_period: StrictFloat = Field(default=30.0, ge=0)  # after the first Ctrl-C: how long in-flight prompts may finish
    executor: Literal["local", "ray"] = "local"  # local (process pool) | ray (a Ray cluster)
    ray_address: str | None = None
    # ray: concurrent sessions per node (default num_workers)
    sessions_per_node: StrictInt | None = Field(default=None, ge=1)
    report_samples: StrictInt = Field(default=500, ge=0)  # full conversations embedded in report.html
    prices: Prices | None = None  # --price_*_per_mtok: for replies whose endpoint reports no cost
    max_cost: float | None = None  # USD budget (runner/execution/budget.py checks the cost flags)
    max_cost_hard: bool = False  # cancel rows in flight at the budget instead of letting them finish
    max_cost_scope: Literal["run", "invocation"] = "run"  # run: spend of earlier invocations counts; invocation: only this one
    # Scoring (runner/scoring): the scorers by name, the first one primary; a sample's score
    # passes at pass_threshold; the command scorer's command and time limit; the judge's model.
    scorer: list[str] = Field(default_factory=list)
    pass_threshold: StrictFloat = 1.0
    verify_command: str | None = None
    verify_timeout: StrictFloat = Field(default=120.0, gt=0)
    judge_model: str | None = None
    judge_base_url: str | None = None  # default: base_url
    judge_rubric: str | None = None
    tool_schema_version: str = ""
    tools: ToolSettings = Field(default_factory=ToolSettings)

    @field_validator("dataset_file", "output_dir", mode="before")
    @classmethod
    def _path_as_text(cls, value):
        return os.fspath(value) if isinstance(value, os.PathLike) else value

    @field_validator("dataset_file")
    @classmethod
    def _dataset_given(cls, value: str) -> str:
        if not value:
            raise ValueError("--dataset_file is required")
        return value

    @field_validator("distribution")
    @classmethod
    def _known_distribution(cls, value: str) -> str:
        from toolset_distributions import DISTRIBUTIONS

        if value not in DISTRIBUTIONS:
            raise ValueError(f"unknown --distribution={value!r}; available: {', '.join(sorted(DISTRIBUTIONS))}")
        return value

    @field_validator("max_samples", mode="before")
    @classmethod
    def _zero_is_all(cls, value):
        return None if value == 0 and not isinstance(value, bool) else value

    @model_validator(mode="after")
    def _key_fits_an_http_header(self):
        from runner.input.secrets import check_header_safe

        check_header_safe("the API key (--api_key, OPENROUTER_API_KEY or OPENAI_API_KEY)", self.api_key)
        return self

    @model_validator(mode="after")
    def _offline_model_has_no_endpoint(self):
        if self.model == "mock":
            self.base_url = None
        return self

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
        fields = {name: getattr(self, name) for name in FINGERPRINT_FIELDS}
        if self.scorer:  # only then: the fingerprint of a run without scorers stays what it was
            fields.update({name: getattr(self, name) for name in SCORING_FINGERPRINT_FIELDS})
        return fields

    def fingerprint(self) -> str:
        blob = orjson.dumps(self.fingerprint_fields(), option=orjson.OPT_SORT_KEYS)
        return hashlib.sha256(blob).hexdigest()[:16]

    def public_dict(self) -> dict:
        """Everything config.json records: no secret (SecretStr fields are excluded)."""
        return self.model_dump(mode="json")


class ReportOptions(BaseModel):
    """What `--report` reads, checked and defaulted as for a run."""

    output_dir: str = RunConfig.model_fields["output_dir"]
    run_name: RunName
    report_samples: StrictInt = RunConfig.model_fields["report_samples"]


class RescoreOptions(BaseModel):
    """What `--rescore` reads: the run, the scorers and the judge, checked and defaulted as for a
    run; the endpoint, key and prices default to the run's (config.json)."""

    model_config = ConfigDict(extra="forbid")

    output_dir: str = RunConfig.model_fields["output_dir"]
    run_name: RunName
    report_samples: StrictInt = RunConfig.model_fields["report_samples"]
    scorer: list[str] = Field(default_factory=list)
    pass_threshold: StrictFloat = RunConfig.model_fields["pass_threshold"]
    verify_command: str | None = None
    verify_timeout: StrictFloat = RunConfig.model_fields["verify_timeout"]
    judge_model: str | None = None
    judge_base_url: str | None = None
    judge_rubric: str | None = None
    base_url: str | None = None  # the run's (the judge's default endpoint)
    api_key: SecretStr | None = Field(default=None, exclude=True)
    request_timeout: StrictFloat = RunConfig.model_fields["request_timeout"]
    max_requests_per_minute: StrictFloat | None = None
    prices: Prices | None = None

    @property
    def request_prices(self) -> Prices | None:
        return self.prices


def flag_default(name: str) -> str | None:
    """The default of the flag that sets this field, as `--help` shows it (None: no such field)."""
    for model in (RunConfig, ToolSettings):
        field = model.model_fields.get(name)
        if field is not None:
            value = field.get_default(call_default_factory=True)
            if isinstance(value, float):
                return f"{value:g}"
            return ",".join(value) if isinstance(value, list) else str(value)  # as the flag is written
    return None


def diff_fingerprints(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Names of the fingerprinted options whose values differ."""
    keys = sorted(set(saved) | set(current))
    return [k for k in keys if orjson.dumps(saved.get(k), option=orjson.OPT_SORT_KEYS) != orjson.dumps(current.get(k), option=orjson.OPT_SORT_KEYS)]


def flag_error(error: ValidationError, model: type[BaseModel] = RunConfig) -> str:
    """The CLI's one line for the first bad value pydantic found, named by its flag."""
    first = error.errors(include_url=False)[0]
    kind, loc, value = first["type"], first["loc"], first.get("input")
    if kind == "value_error":  # our validators' messages are whole sentences
        return str(first["ctx"]["error"])
    flag = f"--{loc[-1]}"
    if kind == "missing":
        return f"{flag} is required"
    if kind == "literal_error":
        return f"{flag} must be one of: {', '.join(map(str, _choices(_field(model, loc).annotation)))} (got {value!r})"
    field = _field(model, loc)
    bounds = {type(c): c for c in field.metadata if isinstance(c, (Ge, Gt, Lt))}
    if int in _types(field.annotation):
        if Ge in bounds and Lt in bounds:
            return f"{flag} must be an integer >= {bounds[Ge].ge} and < {bounds[Lt].lt} (got {value!r})"
        if Ge in bounds:
            return f"{flag} must be an integer >= {bounds[Ge].ge} (got {value!r})"
        if kind.startswith("int"):
            return f"{flag} must be an integer (got {value!r})"
    if Gt in bounds and bounds[Gt].gt == 0:
        return f"{flag} must be a positive number (got {value!r})"
    if Ge in bounds:
        return f"{flag} must be a number >= {bounds[Ge].ge:g} (got {value!r})"
    return f"{flag}: {first['msg'].lower()} (got {value!r})"


def _field(model: type[BaseModel], loc: tuple):
    """The field a validation error's location names, nested models (RunConfig.tools) included."""
    for name in loc[:-1]:
        model = model.model_fields[name].annotation
    return model.model_fields[loc[-1]]


def _types(annotation) -> set:
    """The plain types an annotation allows (`StrictInt | None`: int and NoneType)."""
    args = get_args(annotation)
    return {t for arg in args for t in _types(arg)} if args else {annotation}


def _choices(annotation) -> tuple:
    """The values of a Literal annotation (also inside `Literal[...] | None`)."""
    if get_origin(annotation) is Literal:
        return get_args(annotation)
    return tuple(choice for arg in get_args(annotation) for choice in _choices(arg))


def reasoning_request(effort: str | None, disabled: bool) -> dict | None:
    """The `reasoning` request field from --reasoning_effort and --reasoning_disabled."""
    if disabled:
        return {"effort": "none"}
    if effort is None:
        return None
    if effort not in REASONING_EFFORTS:
        raise ValueError(f"--reasoning_effort must be one of: {', '.join(REASONING_EFFORTS)} (got {effort!r})")
    return {"enabled": True, "effort": effort}


def provider_preferences(only: list[str] | None, ignore: list[str] | None, order: list[str] | None,
                         sort: str | None) -> dict | None:
    """The OpenRouter `provider` request field from the --providers_* flags and --provider_sort."""
    if sort is not None and sort not in PROVIDER_SORTS:
        raise ValueError(f"--provider_sort must be one of: {', '.join(PROVIDER_SORTS)} (got {sort!r})")
    fields = {"only": only, "ignore": ignore, "order": order, "sort": sort}
    return {key: value for key, value in fields.items() if value} or None
