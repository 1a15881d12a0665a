"""From the command line's flags to one validated RunConfig, and the checks a run's configuration
must pass before anything starts (a key for the endpoint, usable scorers, the compressor's
tokenizer, bwrap or Ray when asked for).

The RunConfig returned is frozen: every field is settled here, once (the tools' settings, the
prices and budget, a resumed run's recorded provider, reasoning and drawn seed), and nothing
changes it afterwards. Like batch_runner.py, this driver's module may import every stage.
"""

from __future__ import annotations

import os
import re
import uuid
from pathlib import Path
from typing import Any

from runner.input.errors import UsageError

LOOPBACK = re.compile(r"^https?://(localhost|127\.\d+\.\d+\.\d+|\[::1\])(:\d+)?(/|$)")


def validated(schema, /, **values: Any):
    """schema(**values) without the values left out (None: the field's default); UsageError when bad."""
    from pydantic import ValidationError

    from runner.input.config import flag_error

    try:
        return schema(**{name: value for name, value in values.items() if value is not None})
    except ValidationError as err:
        raise UsageError(flag_error(err, schema)) from None
    except ValueError as err:  # a check outside pydantic (a comma list, the reasoning flags, ...)
        raise UsageError(str(err)) from None


def _as_list(value: Any, flag: str) -> list[str] | None:
    """A comma list, whether fire passed a string, a number or a tuple."""
    if value is None or value == "" or value is False:
        return None
    items = value if isinstance(value, (list, tuple)) else str(value).split(",")
    parts = [str(item).strip() for item in items]
    parts = [p for p in parts if p]
    if not parts:
        raise UsageError(f"--{flag} is empty")
    return parts


def _prefill(path: Any) -> list[dict] | None:
    if not path:
        return None
    import json

    try:
        messages = json.loads(Path(str(path)).read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise UsageError(f"cannot load --prefill_messages_file {path}: {err}") from None
    if not isinstance(messages, list):
        raise UsageError(f"{path}: prefill_messages_file must contain a JSON array of messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ("system", "user", "assistant") or not isinstance(
            message.get("content"), str
        ):
            raise UsageError(f"{path}: message {i} must be an object with 'role' (system/user/assistant) and string 'content'")
    print(f"💬 Loaded {len(messages)} prefill messages from {path}")
    return messages


def recorded_config(flags: dict) -> dict:
    """The configuration config.json records for the run --resume continues ({} when none)."""
    from runner.input.config import RunConfig
    from runner.storage.runfiles import read_config

    if not flags.get("run_name"):
        return {}
    output_dir = flags.get("output_dir") or RunConfig.model_fields["output_dir"].default
    try:
        recorded = read_config(Path(str(output_dir)) / str(flags["run_name"]))
    except (OSError, ValueError):  # a name no folder can have: the validation names it
        return {}
    return recorded.config if recorded is not None else {}


# Besides the fingerprinted flags, what a resume needs to find the same rows and files, to keep
# writing the same files (trajectories_compressed.jsonl follows trajectories.jsonl on every
# resume), and what decides which samples are paid for and kept (a resumed run would otherwise
# start the samples --stop_after_passing spared, and select another set of samples, or drop from
# trajectories.jsonl the rows --keep_no_reasoning kept), where the model's commands run (a resume
# must not run the rows left outside the sandbox or the container limits the run was started with),
# the exports rebuilt at the end, and the judge's endpoint.
_RESUMED_AS_RECORDED = ("dataset_file", "batch_size", "samples_per_prompt", "compress_to_tokens", "tokenizer",
                        "summary_model", "summary_target_tokens", "protect_last_n_turns", "max_concurrent_requests",
                        "per_trajectory_timeout", "stop_after_passing", "keep", "keep_no_reasoning", "sandbox",
                        "container_network", "container_memory", "container_cpus", "export", "judge_base_url")


def with_recorded_flags(flags: dict, recorded: dict) -> dict:
    """The flags, with the fingerprinted ones left out taken from the recorded configuration (a
    resume continues the run as it was made; the flags given are checked against it by the
    fingerprint), and the dataset and batch size. The others (workers, budget, timeouts, ...) are
    this invocation's. The key is never recorded; a drawn seed is taken again by build_config."""
    from runner.input.flags import FLAGS

    filled = dict(flags)
    for flag in FLAGS:
        if not (flag.fingerprint or flag.name in _RESUMED_AS_RECORDED):
            continue
        source = recorded if flag.section == "run" else recorded.get("tools") if flag.section == "tools" else None
        if flags.get(flag.name) is not None or not isinstance(source, dict):
            continue
        value = source.get(flag.name)
        if value is not None and value != [] and not (flag.name == "seed" and recorded.get("seed_drawn")):
            filled[flag.name] = value
    return filled


def build_config(*, recorded: dict | None = None, given_fields: dict | None = None, **flags: Any):
    """The flags as one validated, frozen RunConfig; a bad one raises UsageError with one clear line.

    Each flag goes to the model whose field declares it (runner/input/flags.py, SECTIONS): the models
    check the values and default the ones left out (None). The request flags become the fields they
    set; the budget flags are checked with the prices. `recorded` (a resumed run's configuration)
    gives the fingerprinted fields that request flags set when none of them is given, and the seed
    the run drew. `given_fields` are RunConfig fields given as they are (the Python API's
    reasoning_config and prefill_messages), in place of what their flags would make.
    """
    from runner.input.config import RunConfig, cost_options, provider_preferences, reasoning_request
    from runner.input.flags import by_section

    try:
        sections = by_section(flags)
    except TypeError as err:
        raise UsageError(str(err)) from None
    if any(value is not None for value in sections["command"].values()):
        raise UsageError(f"build_config() takes no command flags ({', '.join(sections['command'])})")
    fields, tool_flags, request = sections["run"], sections["tools"], sections["request"]
    request = {**request, **_recorded_request_flags(request, recorded or {})}
    cost_flags = {name: request.pop(name, None) for name in ("price_input_per_mtok", "price_output_per_mtok",
                                                              "price_cached_input_per_mtok")}
    cost_flags.update({name: fields.pop(name, None) for name in ("max_cost", "max_cost_hard", "max_cost_scope")})
    fields["ephemeral_system_prompt"] = fields.get("ephemeral_system_prompt") or None  # "" is none
    fields["api_key"] = api_key_from(fields.get("api_key"))
    fields["prefill_messages"] = _prefill(fields.get("prefill_messages_file"))
    if fields.get("export") is not None:
        fields["export"] = checked(export_formats, fields["export"])
    if fields.get("scorer") is not None:
        from runner.scoring.scorers import scorer_names

        fields["scorer"] = checked(scorer_names, fields["scorer"])
    tool_flags["terminal_env"] = tool_flags.get("terminal_env") or os.environ.get("TERMINAL_ENV")
    tool_flags["moa_reference_models"] = _as_list(tool_flags.get("moa_reference_models"), "moa_reference_models")
    tools = {name: value for name, value in {**tool_flags, **_tool_endpoints()}.items() if value is not None}
    values = {
        **fields, **_settled_seed(fields.pop("seed", None), recorded or {}),
        "provider": checked(provider_preferences, _as_list(request.get("providers_allowed"), "providers_allowed"),
                            _as_list(request.get("providers_ignored"), "providers_ignored"),
                            _as_list(request.get("providers_order"), "providers_order"), request.get("provider_sort")),
        "reasoning": checked(reasoning_request, request.get("reasoning_effort"), bool(request.get("reasoning_disabled"))),
        **checked(cost_options, cost_flags, fields.get("model")),
        "tools": {**tools, "run_id": new_run_id()},
    }
    config = validated(RunConfig, **{**values, **(given_fields or {})})
    _require_api_key(config)
    _require_installed(config)
    _check_compression(config)
    checked(check_scoring, config)
    if "dpo" in (config.export or []) and not config.scorer:
        raise UsageError("--export=dpo needs scored samples: add --scorer (and several samples per prompt)")
    return config


def print_reasoning(config) -> None:
    """The reasoning the requests ask for, once the flags are read (before the run's header)."""
    if config.reasoning:
        effort = config.reasoning.get("effort")
        print("🧠 Reasoning: DISABLED (effort=none)" if effort == "none" else f"🧠 Reasoning effort: {effort}")


def _settled_seed(given: Any, recorded: dict) -> dict:
    """--seed, else the seed a resumed run drew (config.json records it), else none: RunConfig
    draws one."""
    saved = recorded.get("seed") if recorded.get("seed_drawn") else None
    if given is None and isinstance(saved, int) and not isinstance(saved, bool):
        return {"seed": saved, "seed_drawn": True}
    return {"seed": given}


def with_recorded_seed(config, recorded: dict):
    """The config, its drawn seed replaced by the one the resumed run drew (config.json records
    it): a RunConfig built without --seed draws a new one, yet a resume samples as the run began."""
    settled = _settled_seed(None, recorded)
    if not config.seed_drawn or not settled.get("seed_drawn") or settled["seed"] == config.seed:
        return config
    return config.model_copy(update={"seed": settled["seed"]})


def with_new_run_id(config):
    """The config with a run id of its own, for another invocation of the same configuration."""
    return config.model_copy(update={"tools": config.tools.model_copy(update={"run_id": new_run_id()})})


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]


def export_formats(value: Any) -> list[str] | None:
    from runner.output.export import parse_formats

    return None if value is None else parse_formats(value)


def _recorded_request_flags(given: dict, recorded: dict) -> dict:
    """The request flags that give a resumed run its recorded provider and reasoning (both
    fingerprinted), for each of those fields none of whose flags is given."""
    def none_given(*names: str) -> bool:
        return all(given.get(name) is None for name in names)

    flags: dict[str, Any] = {}
    provider = recorded.get("provider") or {}
    if none_given("providers_allowed", "providers_ignored", "providers_order", "provider_sort"):
        flags.update(providers_allowed=provider.get("only"), providers_ignored=provider.get("ignore"),
                     providers_order=provider.get("order"), provider_sort=provider.get("sort"))
    reasoning = recorded.get("reasoning") or {}
    if none_given("reasoning_effort", "reasoning_disabled") and reasoning.get("effort") == "none":
        flags["reasoning_disabled"] = True
    elif none_given("reasoning_effort", "reasoning_disabled") and reasoning.get("effort"):
        flags["reasoning_effort"] = reasoning["effort"]
    return {name: value for name, value in flags.items() if value is not None}


def checked(function, *args):
    """function(*args), its ValueError as a UsageError."""
    try:
        return function(*args)
    except ValueError as err:
        raise UsageError(str(err)) from None


def api_key_from(flag: Any) -> str | None:
    """--api_key (the CLI takes it out of argv first: runner/input/secrets.py), else the environment's."""
    from runner.input import secrets

    if flag in (None, "", True):
        flag = secrets.get(secrets.API_KEY_FLAG) or secrets.get("OPENROUTER_API_KEY") or secrets.get("OPENAI_API_KEY")
    return None if flag is None else str(flag)


def _tool_endpoints() -> dict:
    """The tool backends' endpoints and keys, from the environment."""
    from runner.input import secrets

    return {"searxng_url": os.environ.get("SEARXNG_URL"), "tavily_api_key": secrets.get("TAVILY_API_KEY"),
            "exa_api_key": secrets.get("EXA_API_KEY"), "brave_api_key": secrets.get("BRAVE_API_KEY"),
            "firecrawl_api_key": secrets.get("FIRECRAWL_API_KEY"), "fal_key": secrets.get("FAL_KEY"),
            "images_base_url": os.environ.get("IMAGES_BASE_URL"), "images_api_key": secrets.get("IMAGES_API_KEY")}


def _require_api_key(config) -> None:
    """A remote model needs a key; a server on this machine (llama.cpp, a proxy) may not."""
    if config.model != "mock" and not config.api_key and not (config.base_url and LOOPBACK.match(config.base_url)):
        raise UsageError(
            f"no API key for {config.base_url or 'the model endpoint'}: pass --api_key or set OPENROUTER_API_KEY "
            "(or OPENAI_API_KEY); for an offline try-out use --model=mock"
        )


_SCORER_OPTIONS = (("verify_command", "command"), ("judge_model", "judge"), ("judge_base_url", "judge"),
                   ("judge_rubric", "judge"))


def check_scoring(config) -> None:
    """The scorers can be used (known, importable) and have what they need; ValueError if not."""
    from runner.scoring.scorers import resolve

    for name in config.scorer:
        resolve(name)
    for option, scorer in _SCORER_OPTIONS:  # ignored, the check the user asked for would never run
        if getattr(config, option, None) is not None and scorer not in config.scorer:
            raise ValueError(f"--{option} is an option of --scorer={scorer}, which is not given")
    if "judge" in config.scorer:
        if not config.judge_model:
            raise ValueError("--scorer=judge needs --judge_model (the model that grades the answers)")
        endpoint = config.judge_base_url or config.base_url
        if not endpoint:
            raise ValueError("--scorer=judge needs --judge_base_url: the run's model is the offline one, "
                             "which cannot grade")
        if not config.api_key and not LOOPBACK.match(endpoint):
            raise ValueError(f"no API key for the judge's endpoint {endpoint}: pass --api_key or set "
                             "OPENROUTER_API_KEY (or OPENAI_API_KEY)")


def _check_compression(config) -> None:
    """--compress_to_tokens and the summariser's options: checked (the tokenizer loaded) before the run."""
    from pydantic import ValidationError

    from runner.compress.after_run import SUMMARISER_FIELDS, compressor_for
    from runner.compress.tokens import TokenizerError

    if not config.compress_to_tokens:
        given = [name for name in (*SUMMARISER_FIELDS, "summary_model") if getattr(config, name) is not None]
        if given:
            raise UsageError(f"--{given[0]} is an option of --compress_to_tokens, which is not given")
        return
    try:
        compressor_for(Path(config.output_dir) / config.run_name, config)
    except TokenizerError as err:
        raise UsageError(str(err)) from None
    except ValidationError as err:
        first = err.errors(include_url=False)[0]
        raise UsageError(f"--{first['loc'][0]}: {first['msg'].lower()}") from None


def _require_installed(config) -> None:
    """What the options need on this machine, checked before anything is written."""
    import shutil

    if config.tools.sandbox == "bwrap" and (not shutil.which("bwrap") or not shutil.which("nsenter")):
        raise UsageError("--sandbox=bwrap needs bubblewrap and nsenter: apt-get install bubblewrap util-linux")
    if config.executor == "ray":
        try:
            import ray  # noqa: F401
        except ImportError:
            raise UsageError("--executor=ray needs Ray: pip install 'agent-batch-runner[ray]' (or pip install ray)") from None
