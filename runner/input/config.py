"""The run's configuration: validated options, what config.json records, and the fingerprint.

Most flags are declared here, each on the field it sets (`flag(...)`, runner/input/flag_declaration.py:
its help, group and fingerprint mark); RequestFlags and Commands declare the others. The flags are
checked by the fields' types and constraints (and a few validators), and each default is defined
once, on its field: the CLI passes only the flags the user gave. `flag_error` turns pydantic's
report of a bad value into the CLI's one line, named by the flag (fields are named like their flags).

The fingerprint hashes every option that changes what a row's output would be (the fields declared
with `fingerprint`). `--resume` compares
it with the one saved in config.json and refuses to mix outputs of two configurations unless
`--allow_config_change` is given.
"""

from __future__ import annotations

import hashlib
import os
import re
import urllib.parse
from typing import Annotated, Any, Literal, get_args, get_origin

import orjson
from annotated_types import Ge, Gt, Lt
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, SecretStr, StrictFloat, StrictInt, ValidationError, field_validator, model_validator

from agent.pricing import FREE, Prices
from agent.types import REQUEST_TIMEOUT
from runner.input.flag_declaration import ORIGINAL, fingerprint_condition, fingerprint_key, fingerprinted, flag
from tools.settings import TOOL_BACKENDS, ToolSettings


ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max", "ultra"]
ProviderSort = Literal["price", "throughput", "latency"]
REASONING_EFFORTS = get_args(ReasoningEffort)
PROVIDER_SORTS = get_args(ProviderSort)
_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")

# The run folder's name, with room left in a file system's 255-byte name limit for what is derived
# from it (a temp file beside the folder, container and task names).
RUN_NAME_MAX = 128


def _check_run_name(value: str) -> str:
    if not value:
        raise ValueError("--run_name is required")
    if len(value) > RUN_NAME_MAX:
        raise ValueError(f"--run_name is {len(value)} characters long: at most {RUN_NAME_MAX} are allowed (it names "
                         "a folder inside the output directory)")
    if not _RUN_NAME.match(value):  # (this also refuses "." and "..")
        raise ValueError(
            f"--run_name={value!r} is not allowed: use letters, digits, '.', '_' and '-' (it names a folder "
            "inside the output directory and cannot leave it)"
        )
    return value


RunName = Annotated[str, AfterValidator(_check_run_name)]


class RunConfig(BaseModel):
    """The run's options, validated once and then frozen: nothing changes them during the run
    (runner/configure.py settles every field from the flags)."""

    model_config = ConfigDict(extra="forbid", frozen=True)  # a misspelt option is an error, not ignored

    dataset_file: str = flag(group=ORIGINAL, help="Input JSONL, one object with a 'prompt' per line.")
    run_name: RunName = flag(
        group=ORIGINAL, help="Output folder <output_dir>/<run_name>/ (letters, digits, '.', '_', '-').",
        details="At most 128 characters, kept as typed (`007` stays `007`); `../x` is refused.")
    batch_size: StrictInt = flag(
        ge=1, group=ORIGINAL, help="Rows per output file batch_N.jsonl (does not limit parallelism).")
    output_dir: str = flag("data", help="Parent of the run folder.")
    distribution: str = flag(
        "default", group=ORIGINAL, fingerprint=True, help="Toolset distribution (--list_distributions shows them).")
    model: str = flag(
        "anthropic/claude-sonnet-4.6", group=ORIGINAL, fingerprint=True,
        help="Model id; 'mock' is the built-in offline model.")
    base_url: str | None = flag(  # None for the offline model
        "https://openrouter.ai/api/v1", group=ORIGINAL, fingerprint=True, help="OpenAI-compatible endpoint.")
    api_key: SecretStr | None = flag(
        None, exclude=True, group=ORIGINAL, shown="$OPENROUTER_API_KEY or $OPENAI_API_KEY",
        help="API key of the model endpoint (the variable is safer: flags show in ps).",
        details="Never written to any file.")
    max_turns: StrictInt = flag(
        10, ge=1, group=ORIGINAL, fingerprint=True, help="Model calls per prompt (the agent's iteration limit).")
    num_workers: StrictInt = flag(4, ge=1, group=ORIGINAL, help="Concurrent agent sessions.")
    num_processes: StrictInt | None = flag(  # at most num_workers
        None, ge=1, shown="CPU count", help="Worker processes the sessions are spread over.")
    max_tokens: StrictInt | None = flag(
        None, ge=1, group=ORIGINAL, fingerprint=True, help="Output tokens per response.")
    reasoning: dict | None = fingerprinted(None)  # the `reasoning` request field, from the reasoning flags
    provider: dict | None = fingerprinted(None)  # the OpenRouter `provider` request field
    tool_choice: Literal["auto", "required", "none"] = flag(
        "auto", fingerprint=True, help="auto, required or none: tool_choice sent with every request that offers tools.")
    prompt_caching: Literal["auto", "on", "off"] = flag(
        "auto", help="cache_control breakpoints: auto (Claude models on OpenRouter), on or off.",
        details="Anthropic `cache_control` breakpoints on the system message and the last messages (at most 4); "
                "`on` also serves proxies that pass them through. Not fingerprinted: it changes what a row "
                "costs, not what it contains.")
    ephemeral_system_prompt: str | None = flag(
        None, group=ORIGINAL, fingerprint=True, help="Added to the system prompt at call time only; never saved.")
    prefill_messages: list[dict] = fingerprinted(default_factory=list)
    prefill_messages_file: str | None = flag(
        None, group=ORIGINAL, sets="prefill_messages",
        help="JSON array of {role, content} messages inserted at call time only.",
        details="They go after the system prompt.")
    max_samples: StrictInt | None = flag(  # 0 on the command line: all rows
        None, ge=1, group=ORIGINAL, shown="all", help="Only the first N valid rows.")
    # 0 <= seed < 2**63: the run's random generator and the int64 metadata.seed column take it as it is.
    # Without --seed, one is drawn when the configuration is validated (seed_drawn) and recorded in
    # config.json, where a resume finds it again.
    seed: StrictInt | None = flag(
        None, ge=0, lt=2**63, fingerprint=True, shown="drawn",
        help="Reproducible toolset sampling (each row's sample depends on the seed and the row); "
             "without it one is drawn for the run and recorded in config.json.",
        details="An integer, 0 <= seed < 2**63. The sample does not depend on the worker count or the "
                "finishing order; resumes use the recorded seed again. Recorded in each row.")
    seed_drawn: bool = False
    export: list[str] = flag(  # written at the end (runner/output/export.py); alone with --run_name: see main()
        default_factory=list, kind=str, shown="",
        help="Comma list of messages, dpo: training-ready files in <run>/export/ (with a run, or alone with --run_name).")
    # --compress_to_tokens: trajectory_compressor.py at the end of the run, with the run's endpoint and key
    # (runner/compress/after_run.py). The summariser's options left out (None) take the compressor's
    # defaults, defined once in runner/compress/options.py.
    compress_to_tokens: StrictInt | None = flag(
        None, ge=1, shown="off",
        help="At the end, compress trajectories.jsonl to this many tokens a row: trajectories_compressed.jsonl "
             "beside it (docs/compressor.md).")
    tokenizer: str | None = flag(
        None, shown="estimate", help="With --compress_to_tokens: a tokenizer.json directory, a hub name, or estimate.")
    summary_model: str | None = flag(
        None, shown="the run's model", help="With --compress_to_tokens: the summariser (on the run's endpoint).")
    summary_target_tokens: StrictInt | None = flag(
        None, ge=1, shown="as trajectory_compressor.py", help="With --compress_to_tokens: the size of a summary.")
    protect_last_n_turns: StrictInt | None = flag(
        None, ge=0, shown="as trajectory_compressor.py", help="With --compress_to_tokens: turns kept at the end.")
    max_concurrent_requests: StrictInt | None = flag(
        None, ge=1, shown="as trajectory_compressor.py", help="With --compress_to_tokens: summary requests in flight.")
    per_trajectory_timeout: StrictFloat | None = flag(
        None, gt=0, shown="as trajectory_compressor.py",
        help="With --compress_to_tokens: seconds a row's summary may take, retries included.")
    keep_no_reasoning: bool = flag(
        False, help="Keep rows whose model never reasoned.", details="The original always discarded them.")
    # Samples of every row (runner/input/samples.py). Not fingerprinted: raising it on resume adds
    # samples to the rows; lowering it is refused by BatchRunner (the extra samples are paid for).
    samples_per_prompt: StrictInt = flag(
        1, ge=1, help="Run every row N times: each sample its own unit of work (key, seed, environment, commit).",
        details="See docs/samples-and-scoring.md. A larger N on --resume runs only the new samples; a smaller one is refused.")
    # Which samples trajectories.jsonl holds: applied when the outputs are built, so not fingerprinted.
    keep: Literal["all", "passing", "best"] = flag(
        "all", help="Samples trajectories.jsonl holds: all, passing (needs --scorer) or best (one per row).",
        details="The others stay in the batch files, counted as unselected, their spend reported apart.")
    stop_after_passing: StrictInt | None = flag(
        None, ge=1, shown="", help="Once K samples of a row passed, its samples not started are not run (needs --scorer).")
    skip_invalid: bool = flag(False, help="Run the valid rows of a dataset that has invalid lines.")
    allow_duplicate_ids: bool = flag(  # an `id` names one row
        False, help="Accept rows that share an 'id' (refused by default).")
    verbose: bool = flag(False, group=ORIGINAL, help="Per-prompt logs (sampled toolsets, outcomes, tracebacks).")
    log_prefix_chars: StrictInt = flag(
        100, ge=0, group=ORIGINAL, help="Length of the prompt preview in --verbose per-prompt lines.",
        details="Failure lines show the whole error.")
    prompt_timeout: StrictFloat | None = flag(
        None, gt=0, shown="none", help="Wall-clock limit of one prompt, seconds (the row fails as timeout).")
    request_timeout: StrictFloat = flag(
        REQUEST_TIMEOUT, gt=0, help="Limit of one model request, seconds (then retried).")
    max_requests_per_minute: StrictFloat | None = flag(
        None, gt=0, shown="none", help="Pace model requests for the whole run.")
    grace_period: StrictFloat = flag(
        30.0, ge=0, help="After the first Ctrl-C, seconds in-flight prompts may take to finish.")
    executor: Literal["local", "ray"] = flag("local", help="local (process pool) or ray.")
    ray_address: str | None = flag(None, help="Ray cluster address (auto).")
    sessions_per_node: StrictInt | None = flag(None, ge=1, help="Sessions per Ray node.")  # default num_workers
    report_samples: StrictInt = flag(500, ge=0, help="Full conversations embedded in report.html.")
    prices: Prices | None = None  # --price_*_per_mtok: for replies whose endpoint reports no cost
    # The budget flags are checked together with the prices (cost_options, below).
    max_cost: float | None = flag(
        None, shown="none", help="Budget in USD: no new row starts once spend (+ rows in flight) reaches it; exit 4.",
        details="The spend is the committed spend plus the expected spend of the rows in flight.")
    max_cost_hard: bool = flag(
        False, help="At the budget, cancel the rows in flight instead of letting them finish.",
        details="Cancelled rows are not committed; they run again on resume.")
    max_cost_scope: Literal["run", "invocation"] = flag(
        "run", help="run: earlier invocations' spend counts against --max_cost; invocation: only this one.")
    # Scoring (runner/scoring): the scorers by name, the first one primary. Their options change a
    # sample's scores: fingerprinted only in a run that has scorers (a run without keeps its fingerprint).
    scorer: list[str] = flag(
        default_factory=list, kind=str, shown="none", fingerprint=True, fingerprint_if="scorer",
        help="Comma list of scorers, the first primary: includes, exact, command, judge, path/to/file.py:function.")
    pass_threshold: StrictFloat = flag(
        1.0, fingerprint=True, fingerprint_if="scorer", help="A score passes when its value is at least this.")
    verify_command: str | None = flag(
        None, shown="the row's verify", fingerprint=True, fingerprint_if="scorer",
        help="Shell command of the command scorer for every row (exit 0 passes).")
    verify_timeout: StrictFloat = flag(
        120.0, gt=0, help="Seconds a verify command (and each scorer but the judge) may take.")
    judge_model: str | None = flag(
        None, fingerprint=True, fingerprint_if="scorer", help="Model of the judge scorer.")
    judge_base_url: str | None = flag(
        None, shown="--base_url", help="OpenAI-compatible endpoint of the judge model.")
    judge_rubric: str | None = flag(
        None, shown="the row's rubric", fingerprint=True, fingerprint_if="scorer",
        help="What the judge is told to look for, for every row.")
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

    @field_validator("base_url", "judge_base_url")
    @classmethod
    def _no_credentials_in_the_url(cls, value: str | None, info) -> str | None:
        # The URL is written to config.json and shown in messages; a key has its own flag, never written.
        if value and "@" in urllib.parse.urlsplit(value).netloc:
            raise ValueError(f"--{info.field_name}: a user name or password in the URL would be written to config.json "
                             "and shown in messages; give the endpoint's key with --api_key (or OPENAI_API_KEY) instead")
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
    def _no_key_in_the_urls(self):
        key = self.api_key.get_secret_value() if self.api_key else ""
        for name in ("base_url", "judge_base_url"):
            if key and key in (getattr(self, name) or ""):  # a gateway's ?key=...: the URL is written to config.json
                raise ValueError(f"--{name} holds the API key, and the URL is written to config.json and shown in "
                                 "messages; give the key with --api_key (or OPENAI_API_KEY) only")
        return self

    @model_validator(mode="after")
    def _selection_needs_a_scorer(self):
        if not self.scorer:  # without a score no sample passes
            if self.keep != "all":
                raise ValueError(f"--keep={self.keep} selects samples by their score: it needs --scorer")
            if self.stop_after_passing is not None:
                raise ValueError("--stop_after_passing counts the samples that passed: it needs --scorer")
        return self

    @model_validator(mode="before")
    @classmethod
    def _settled_inputs(cls, data: Any) -> Any:
        """What the other options decide: the offline model has no endpoint, the tools know the run
        and model they serve, and a run without --seed draws one."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        model = data.get("model", cls.model_fields["model"].default)
        if model == "mock":
            data["base_url"] = None
        if isinstance(data.get("tools", {}), dict):
            data["tools"] = {**data.get("tools", {}), "run_name": data.get("run_name", ""), "model": model}
        if data.get("seed") is None:
            import secrets

            data["seed"], data["seed_drawn"] = secrets.randbelow(2**31), True
        return data

    @property
    def terminal_env(self) -> str:
        return self.tools.terminal_env

    @property
    def docker_image(self) -> str | None:
        return self.tools.docker_image

    @property
    def tool_backends(self) -> dict:
        """The models and services tools answer with: they shape tool results, hence the rows."""
        return self.fingerprint_fields()[TOOL_BACKENDS]

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
        """The options whose change makes new rows incomparable with old ones: the fields declared
        with `fingerprint` (runner/input/flag_declaration.py), here and in the tool settings."""
        fields: dict[str, Any] = {}
        for owner in (self, self.tools):
            for name, info in type(owner).model_fields.items():
                key = fingerprint_key(info)
                condition = fingerprint_condition(info)
                if condition and not getattr(owner, condition):
                    continue
                if key is True:
                    fields[name] = getattr(owner, name)
                elif key:
                    fields.setdefault(key, {})[name] = getattr(owner, name)
        from tools.registry import tool_schema_version  # (imports every tool: only when a run records it)

        fields["tool_schema_version"] = tool_schema_version()  # the tools' schemas shape every row
        return fields

    def fingerprint(self) -> str:
        blob = orjson.dumps(self.fingerprint_fields(), option=orjson.OPT_SORT_KEYS)
        return hashlib.sha256(blob).hexdigest()[:16]

    def public_dict(self) -> dict:
        """Everything config.json records: no secret (SecretStr fields are excluded)."""
        return self.model_dump(mode="json")


class RequestFlags(BaseModel):
    """The flags that are no field of RunConfig: build_config (runner/configure.py) makes them into the
    field each `sets` (the `provider` and `reasoning` request fields, the prices), with the checks
    and messages of the functions below (provider_preferences, reasoning_request, cost_options)."""

    providers_allowed: str | None = flag(
        None, group=ORIGINAL, sets="provider", help="Comma list: OpenRouter provider.only.")
    providers_ignored: str | None = flag(
        None, group=ORIGINAL, sets="provider", help="Comma list: OpenRouter provider.ignore.")
    providers_order: str | None = flag(
        None, group=ORIGINAL, sets="provider", help="Comma list: OpenRouter provider.order.")
    provider_sort: str | None = flag(
        None, group=ORIGINAL, sets="provider", help="price, throughput or latency (OpenRouter provider.sort).")
    reasoning_effort: str | None = flag(
        None, group=ORIGINAL, sets="reasoning", help="none, minimal, low, medium, high, xhigh, max or ultra.")
    reasoning_disabled: bool = flag(
        False, group=ORIGINAL, sets="reasoning", help="Send reasoning effort 'none'; turns off the no-reasoning filter.",
        details='It sends `reasoning: {"effort": "none"}`.')
    price_input_per_mtok: float | None = flag(
        None, sets="prices", help="USD per million input tokens, for replies whose endpoint reports no cost.",
        details="Give both prices; a cost the endpoint does report still wins.")
    price_output_per_mtok: float | None = flag(
        None, sets="prices", help="USD per million output tokens (with --price_input_per_mtok).")
    price_cached_input_per_mtok: float | None = flag(
        None, sets="prices", shown="the input price", help="USD per million cached input tokens.")


class Commands(BaseModel):
    """The flags that say what this invocation does, rather than how the run is configured."""

    resume: bool = flag(False, group=ORIGINAL, help="Continue the run: skip committed rows, retry failed ones.")
    list_distributions: bool = flag(False, group=ORIGINAL, shown="", help="Print the toolset distributions and exit.")
    overwrite: bool = flag(
        False, help="Delete the run's earlier outputs and start again.",
        details="Only the files the runner writes (and its temp files), never a dataset or anything else kept "
                "in the folder.")
    allow_config_change: bool = flag(False, help="Let --resume continue with a changed configuration.")
    report: bool = flag(
        False, shown="", help="With --run_name: rebuild report.html, statistics.json and trajectories.jsonl from "
                              "the run's files (nothing run) and exit.")
    rescore: bool = flag(
        False, shown="", help="With --run_name and --scorer: score the committed samples again (judge requests only), "
                              "rebuild the outputs and exit.")


class ReportOptions(BaseModel):
    """What `--report` reads, checked and defaulted as for a run."""

    output_dir: str = RunConfig.model_fields["output_dir"]
    run_name: RunName
    report_samples: StrictInt = RunConfig.model_fields["report_samples"]
    # Given with --report, these replace the run's own for the rebuilt outputs.
    keep_no_reasoning: bool | None = None
    keep: Literal["all", "passing", "best"] | None = None


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


# The price and budget flags, checked together (RequestFlags and the budget fields of RunConfig).
SCOPES = get_args(RunConfig.model_fields["max_cost_scope"].annotation)


def _non_negative(value: Any, flag: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ValueError(f"--{flag} must be a number >= 0 (got {value!r})")
    return float(value)


def cost_options(flags: dict, model: str) -> dict:
    """RunConfig fields of the price and budget flags; ValueError with one clear line when bad."""
    price_in = _non_negative(flags.get("price_input_per_mtok"), "price_input_per_mtok")
    price_out = _non_negative(flags.get("price_output_per_mtok"), "price_output_per_mtok")
    price_cached = _non_negative(flags.get("price_cached_input_per_mtok"), "price_cached_input_per_mtok")
    prices = None
    if price_in is not None or price_out is not None or price_cached is not None:
        if price_in is None or price_out is None:
            raise ValueError("--price_input_per_mtok and --price_output_per_mtok go together (give both; "
                             "--price_cached_input_per_mtok is optional and defaults to the input price)")
        prices = Prices(input_per_mtok=price_in, output_per_mtok=price_out, cached_input_per_mtok=price_cached)
    max_cost = flags.get("max_cost")
    if max_cost is not None and (isinstance(max_cost, bool) or not isinstance(max_cost, (int, float)) or max_cost <= 0):
        raise ValueError(f"--max_cost must be a positive number of USD (got {max_cost!r})")
    scope = flags.get("max_cost_scope")  # None: RunConfig's default (run)
    if scope is not None and scope not in SCOPES:
        raise ValueError(f"--max_cost_scope must be run or invocation (got {scope!r})")
    hard = bool(flags.get("max_cost_hard"))
    if max_cost is None and hard:
        raise ValueError("--max_cost_hard needs --max_cost")
    options = {"prices": prices, "max_cost": None if max_cost is None else float(max_cost), "max_cost_hard": hard}
    return options if scope is None else {**options, "max_cost_scope": scope}
