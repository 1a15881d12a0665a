#!/usr/bin/env python3
"""Run every prompt of a JSONL dataset through a tool-using agent and collect trajectories.

    python batch_runner.py --dataset_file=data/example_prompts.jsonl --batch_size=5 \\
                           --run_name=demo --model=mock

Outputs go to <output_dir>/<run_name>/: batch_N.jsonl (committed rows), checkpoint.json,
config.json, trajectories.jsonl and statistics.json. See docs/flags.md for every flag.

Exit codes: 0 every row done; 1 bad input or configuration; 2 finished with failed or unrun rows
(run again with --resume); 3 stopped early: the provider cannot serve the run (auth, quota, an
unreachable endpoint, --max_tokens too small for every first reply);
4 stopped at the cost budget (--max_cost); 5 stopped on a storage error (disk full: committed rows are
safe); 130 interrupted (Ctrl-C / SIGTERM).
"""

from __future__ import annotations

import os
import signal
import sys


def _interrupted_before_the_run(signum, frame):
    """Ctrl-C / SIGTERM before the run's own handlers are in place (imports, flag checks, the
    re-exec that takes the keys out): no row was started yet, so leave at once, without a
    traceback (worker processes started by then notice that their parent is gone). Not by
    raising: an exception raised inside a C extension's import (orjson) crashes the interpreter;
    nor by print(), which may have been interrupted in the middle of a write."""
    try:
        sys.stdout.flush()
    except BaseException:  # reentrant: the signal came in the middle of a write
        pass
    os.write(2, "\n⏹️  Interrupted.\n".encode())
    os._exit(130)  # EXIT_INTERRUPTED, defined below: a signal may come before that line


if __name__ == "__main__":  # first thing, before the heavy imports; never when imported as a library
    for _signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(_signum, _interrupted_before_the_run)
    # The re-exec (runner/input/secrets.py) blocks both signals across execve, so one sent while the new
    # interpreter starts waits here instead of killing it or raising KeyboardInterrupt in its imports.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, (signal.SIGINT, signal.SIGTERM))

import functools
import re
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runner.console import plural
from runner.storage.store import StorageError
from runner.input.config import Commands
from runner.input.flags import flag_named, main_signature
from toolset_distributions import format_distribution_catalogue
from runner.timestamps import now_iso

from runner.outcome import (EXIT_BUDGET, EXIT_ERROR, EXIT_FATAL_PROVIDER, EXIT_INCOMPLETE,
                            EXIT_INTERRUPTED, EXIT_OK, EXIT_STORAGE, Outcome, Stop, decide)
FATAL_CLASSES = ("auth", "quota")
_LOOPBACK = re.compile(r"^https?://(localhost|127\.\d+\.\d+\.\d+|\[::1\])(:\d+)?(/|$)")


if TYPE_CHECKING:  # (the executors are imported when a run starts, never for --help)
    from runner.execution.executor import Executor


class UsageError(Exception):
    """Bad input or configuration: one clear line, exit code 1."""


def main(**flags: Any):
    """Run a JSONL dataset of prompts through the agent (docs/flags.md lists every flag).

    The parameters are the declared flags (runner/input/flags.py; `main.__signature__`, which fire
    reads). A flag left out is None here: its default is defined once, on its field, which also
    checks the value.
    """
    unknown = set(flags) - set(main.__signature__.parameters)
    if unknown:  # (the CLI checked argv already; this is for a caller in Python)
        raise TypeError(f"main() got unexpected keyword argument(s): {', '.join(sorted(unknown))}")
    commands = {name: flags.pop(name) for name in list(flags) if flag_named(name).section == "command"}
    commands = {name: commands.get(name) for name in Commands.model_fields}
    if commands["list_distributions"]:
        print(format_distribution_catalogue())
        raise SystemExit(EXIT_OK)
    try:
        if commands["report"]:
            raise SystemExit(_report_only(flags.get("output_dir"), flags.get("run_name"), flags.get("report_samples"),
                                          keep_no_reasoning=flags.get("keep_no_reasoning"), keep=flags.get("keep")))
        if commands["rescore"]:
            rescore_flags = ("output_dir", "report_samples", "api_key", "scorer", "pass_threshold", "verify_command",
                             "verify_timeout", "judge_model", "judge_base_url", "judge_rubric")
            raise SystemExit(_rescore_only(run_name=flags.get("run_name") or "",
                                           **{name: flags.get(name) for name in rescore_flags}))
        if flags.get("export") is not None and flags.get("dataset_file") is None:
            raise SystemExit(_export_only(flags.get("output_dir"), flags.get("run_name"), flags["export"]))
        recorded = _recorded_config(flags) if commands["resume"] else {}
        config = build_config(**_with_recorded_flags(flags, recorded), recorded=recorded)
        code = BatchRunner(config, resume=bool(commands["resume"]), overwrite=bool(commands["overwrite"]),
                           allow_config_change=bool(commands["allow_config_change"])).run()
    except UsageError as err:
        print(f"❌ Error: {err}", file=sys.stderr)
        code = EXIT_ERROR
    except StorageError as err:
        print(f"\n❌ Stopped: {err}.\n   The committed rows are safe; free some space (or fix the disk), "
              "then run again with --resume to finish.", file=sys.stderr)
        code = EXIT_STORAGE
    except KeyboardInterrupt:  # Ctrl-C before the run's own handler was in place
        print("\n⏹️  Interrupted.", file=sys.stderr)
        code = EXIT_INTERRUPTED
    except Exception as err:  # our bug or an OS error: one clear line, the traceback with --verbose
        print(f"\n❌ Fatal error: {type(err).__name__}: {err}", file=sys.stderr)
        if flags.get("verbose"):
            import traceback

            traceback.print_exc()
        code = EXIT_ERROR
    raise SystemExit(code)


main.__signature__ = main_signature()  # what fire binds and --help lists: the declared flags


def _report_only(output_dir: Any, run_name: Any, report_samples: Any, **selection: Any) -> int:
    """`--report --run_name=NAME`: the end-of-run outputs rebuilt from the run's files (report.html,
    statistics.json, trajectories.jsonl, so they always agree), under the run lock; nothing run.
    `selection` (--keep_no_reasoning, --keep) given here replaces the run's for this rebuild."""
    from runner.input.config import ReportOptions
    from runner.output.finalize import RebuildError, rebuild_outputs
    from runner.storage.lock import RunLock, RunLockBusy

    options = _validated(ReportOptions, output_dir=output_dir, run_name=run_name or "", report_samples=report_samples,
                         **selection)
    run_dir = Path(options.output_dir) / options.run_name
    from runner.storage.runfiles import has_config

    if not has_config(run_dir):
        raise UsageError(f"{run_dir} holds no run (no config.json)")
    lock = RunLock(run_dir)
    try:
        lock.acquire(print)
    except RunLockBusy as err:  # a live run rewrites these files itself when it ends
        raise UsageError(str(err)) from None
    try:
        path = rebuild_outputs(run_dir, max_full_conversations=options.report_samples,
                               selection=options.model_dump(include={"keep_no_reasoning", "keep"}, exclude_none=True))
    except RebuildError as err:
        raise UsageError(str(err)) from None
    finally:
        lock.release()
    print(f"📄 Report written to {path} (statistics.json and trajectories.jsonl rebuilt with it)")
    return EXIT_OK


def _rescore_only(*, output_dir: Any, run_name: Any, api_key: Any, scorer: Any, **flags: Any) -> int:
    """`--rescore --run_name=NAME --scorer=...`: the committed samples scored again (the judge's
    requests only) into rescores.jsonl, then the outputs rebuilt, under the run lock."""
    from runner.input.config import ReportOptions, RescoreOptions
    from runner.input.secrets import register
    from runner.output.finalize import RebuildError, rebuild_outputs
    from runner.storage.runfiles import ConfigFile, read_config
    from runner.scoring.rescore import check_scorers, rescore_run
    from runner.scoring.scorers import scorer_names
    from runner.storage.lock import RunLock, RunLockBusy

    where = _validated(ReportOptions, output_dir=output_dir, run_name=run_name)
    run_dir = Path(where.output_dir) / where.run_name
    if not (run_dir / "config.json").exists():
        raise UsageError(f"{run_dir} holds no run (no config.json)")
    saved = (read_config(run_dir) or ConfigFile()).config
    options = _validated(
        RescoreOptions, output_dir=output_dir, run_name=run_name, scorer=_checked(scorer_names, scorer),
        api_key=_api_key(api_key), base_url=saved.get("base_url"), request_timeout=saved.get("request_timeout"),
        max_requests_per_minute=saved.get("max_requests_per_minute"), prices=saved.get("prices"), **flags)
    register(options.api_key.get_secret_value() if options.api_key else None)  # redacted from every line
    _checked(check_scorers, options.scorer)
    make_judge = None
    if "judge" in options.scorer:
        options.judge_base_url = options.judge_base_url or options.base_url
        _checked(check_scoring, options)
        make_judge = functools.partial(_judge_client, options)
    lock = RunLock(run_dir)
    try:
        lock.acquire(print)
    except RunLockBusy as err:  # a live run's samples are not all committed yet
        raise UsageError(str(err)) from None
    try:
        scored = rescore_run(run_dir, options, make_judge=make_judge, log=print)
        path = rebuild_outputs(run_dir, max_full_conversations=options.report_samples)
    except (RebuildError, ValueError) as err:  # RescoreError, a scorer that cannot be used
        raise UsageError(str(err)) from None
    finally:
        lock.release()
    print(f"🎯 Rescored {plural(scored, 'sample')} with {', '.join(options.scorer)} (rescores.jsonl); "
          f"{path.name}, statistics.json and trajectories.jsonl rebuilt")
    return EXIT_OK


def _judge_client(options):
    from agent.model_client import ModelClient, RetryPolicy
    from runner.scoring.rescore import CONCURRENT

    return ModelClient(options.judge_base_url, options.api_key.get_secret_value() if options.api_key else None,
                       max_in_flight=CONCURRENT, requests_per_minute=options.max_requests_per_minute,
                       policy=RetryPolicy(request_timeout=options.request_timeout))


def _export_formats(value: Any) -> list[str] | None:
    from runner.output.export import parse_formats

    return None if value is None else parse_formats(value)


def _export_only(output_dir: Any, run_name: Any, export: Any) -> int:
    """`--export=FORMATS --run_name=NAME`: the run's exports written from its files, under the run
    lock; nothing run."""
    from runner.input.config import ReportOptions
    from runner.output.export import ExportError
    from runner.output.finalize import export_run_dir
    from runner.storage.lock import RunLock, RunLockBusy
    from runner.storage.runfiles import has_config

    formats = _checked(_export_formats, export)
    options = _validated(ReportOptions, output_dir=output_dir, run_name=run_name or "")
    run_dir = Path(options.output_dir) / options.run_name
    if not has_config(run_dir):
        raise UsageError(f"{run_dir} holds no run (no config.json)")
    lock = RunLock(run_dir)
    try:
        lock.acquire(print)
    except RunLockBusy as err:
        raise UsageError(str(err)) from None
    try:
        print(f"📤 Exporting {run_dir}:")
        export_run_dir(run_dir, formats)
    except ExportError as err:
        raise UsageError(str(err)) from None
    finally:
        lock.release()
    return EXIT_OK


def _validated(schema, /, **values: Any):
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


def _recorded_config(flags: dict) -> dict:
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


# Besides the fingerprinted flags, what a resume needs to find the same rows and files.
_RESUMED_AS_RECORDED = ("dataset_file", "batch_size", "samples_per_prompt")


def _with_recorded_flags(flags: dict, recorded: dict) -> dict:
    """The flags, with the fingerprinted ones left out taken from the recorded configuration (a
    resume continues the run as it was made; the flags given are checked against it by the
    fingerprint), and the dataset and batch size. The others (workers, budget, timeouts, ...) are
    this invocation's. The key is never recorded; a drawn seed is found again by the run itself."""
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


def build_config(*, recorded: dict | None = None, **flags: Any):
    """The flags as a validated RunConfig; a bad one raises UsageError with one clear line.

    Each flag goes to the model whose field declares it (runner/input/flags.py, SECTIONS): the models
    check the values and default the ones left out (None). The request flags become the fields they
    set; the budget flags are checked with the prices. `recorded` (a resumed run's configuration)
    gives the fingerprinted fields that request flags set when none of them is given.
    """
    from runner.input.config import RunConfig, provider_preferences, reasoning_request
    from runner.input.flags import by_section
    from tools.settings import ToolSettings

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
    fields["api_key"] = _api_key(fields.get("api_key"))
    fields["prefill_messages"] = _prefill(fields.get("prefill_messages_file"))
    if fields.get("export") is not None:
        fields["export"] = _checked(_export_formats, fields["export"])
    if fields.get("scorer") is not None:
        from runner.scoring.scorers import scorer_names

        fields["scorer"] = _checked(scorer_names, fields["scorer"])
    config = _validated(
        RunConfig, **fields,
        provider=_checked(provider_preferences, _as_list(request.get("providers_allowed"), "providers_allowed"),
                          _as_list(request.get("providers_ignored"), "providers_ignored"),
                          _as_list(request.get("providers_order"), "providers_order"), request.get("provider_sort")),
        reasoning=_checked(reasoning_request, request.get("reasoning_effort"), bool(request.get("reasoning_disabled"))),
    )
    tool_flags["terminal_env"] = tool_flags.get("terminal_env") or os.environ.get("TERMINAL_ENV")
    tool_flags["moa_reference_models"] = _as_list(tool_flags.get("moa_reference_models"), "moa_reference_models")
    config.tools = _validated(ToolSettings, **tool_flags, run_name=config.run_name, run_id=uuid.uuid4().hex[:12],
                              model=config.model, **_tool_endpoints())
    _require_api_key(config)
    from runner.execution.budget import cost_options  # (after the fields' checks: a bad value imports nothing more)

    config = config.model_copy(update=_checked(cost_options, cost_flags, config.model))
    _require_installed(config)
    _check_compression(config)
    _checked(check_scoring, config)
    if "dpo" in (config.export or []) and not config.scorer:
        raise UsageError("--export=dpo needs scored samples: add --scorer (and several samples per prompt)")
    if config.reasoning:
        effort = config.reasoning["effort"]
        print("🧠 Reasoning: DISABLED (effort=none)" if effort == "none" else f"🧠 Reasoning effort: {effort}")
    return config


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


def _checked(function, *args):
    """function(*args), its ValueError as a UsageError."""
    try:
        return function(*args)
    except ValueError as err:
        raise UsageError(str(err)) from None


def _api_key(flag: Any) -> str | None:
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
    if config.model != "mock" and not config.api_key and not (config.base_url and _LOOPBACK.match(config.base_url)):
        raise UsageError(
            f"no API key for {config.base_url or 'the model endpoint'}: pass --api_key or set OPENROUTER_API_KEY "
            "(or OPENAI_API_KEY); for an offline try-out use --model=mock"
        )


def check_scoring(config) -> None:
    """The scorers can be used (known, importable) and have what they need; ValueError if not."""
    from runner.scoring.scorers import resolve

    for name in config.scorer:
        resolve(name)
    if "judge" in config.scorer:
        if not config.judge_model:
            raise ValueError("--scorer=judge needs --judge_model (the model that grades the answers)")
        endpoint = config.judge_base_url or config.base_url
        if not endpoint:
            raise ValueError("--scorer=judge needs --judge_base_url: the run's model is the offline one, "
                             "which cannot grade")
        if not config.api_key and not _LOOPBACK.match(endpoint):
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


def _count_lines(path: str, stop_at: int) -> int:
    """Lines in the file, counting only until `stop_at` (a bound, read in a moment even for a huge
    file); a missing file counts as `stop_at` (the dataset scan reports it)."""
    lines, last = 0, b"\n"
    try:
        with open(path, "rb") as handle:
            while lines < stop_at and (chunk := handle.read(1 << 20)):
                lines, last = lines + chunk.count(b"\n"), chunk[-1:]
    except OSError:
        return stop_at
    return lines + (last != b"\n")


def _refuse_run_while_a_worker_imports_the_script() -> None:
    """A script that calls run() without `if __name__ == "__main__":` calls it again in every
    process multiprocessing starts (forkserver and spawn import the script as `__mp_main__`);
    say so here instead of leaving rows "worker process died"."""
    import multiprocessing

    main_module = getattr(sys.modules.get("__main__"), "__name__", "__main__")
    if (multiprocessing.parent_process() is not None or multiprocessing.current_process().name != "MainProcess"
            or main_module == "__mp_main__"):
        raise RuntimeError(
            'BatchRunner.run() was called while a worker process imported your script: start the run under '
            '`if __name__ == "__main__":` (the workers import the script again; see docs/python-api.md)'
        )


def _shown(value: Any) -> str:
    """A recorded option's value as a message shows it: text quoted, the rest as JSON."""
    import json

    return repr(value) if isinstance(value, str) else json.dumps(value, sort_keys=True)


class BatchRunner:
    """Owns the run directory for one invocation: validate, resume, dispatch, commit, finalize.

    Two ways to build one: `BatchRunner(config)` with a RunConfig (as main() does), or the
    original's keywords, `BatchRunner(dataset_file=..., batch_size=..., run_name=...,
    max_iterations=..., ...)` then `.run(resume=...)` (see runner/input/original_api.py).
    """

    def __init__(self, config=None, *, resume: bool = False, overwrite: bool = False, allow_config_change: bool = False,
                 **original_keywords: Any):
        self._keywords = original_keywords if config is None else None  # built by the Python API
        if config is None:
            from runner.input.original_api import config_from_original

            config = config_from_original(original_keywords)
        elif original_keywords:
            raise TypeError("BatchRunner() takes a RunConfig or the original's keywords, not both")
        self.config = config
        self.resume = resume
        self.overwrite = overwrite
        self.allow_config_change = allow_config_change
        self.run_dir = Path(config.output_dir) / config.run_name
        self._stop: Stop | None = None  # why no new prompt is started (the first reason; runner/outcome.py)
        self._interrupts = 0
        self._phase = "starting"  # starting -> dispatch -> finishing: what a Ctrl-C interrupts
        self._bar = None
        self._monitor = None  # runner.output.status.RunMonitor of this invocation
        self._store = None  # runner.storage.store.RunStore once the run directory is ready
        self._failed_images: dict[str, str] = {}  # image -> why it cannot be used (the backend's check)
        self._streaks: dict[str, int] = {}  # failure class -> rows in a row that failed with it
        self._passed: dict[str, int] = {}  # row key -> its committed samples that passed
        self._first_finished: list[str] | None = []  # outcomes of the first rows to finish (None: decided)
        self._to_run = 0
        self._same_failure: tuple[str | None, int] = (None, 0)  # every_request_failed_as, rows in a row
        self.started_at = now_iso()
        self._started_clock = time.monotonic()  # the same instant, for the live rate

    @property
    def stopping(self) -> bool:
        return self._stop is not None

    def _stop_with(self, kind: str, message: str = "") -> None:
        """Stop starting rows, for the first reason given (a later one is only logged)."""
        if self._stop is None:
            self._stop = Stop(kind, message)

    # --- logging that does not tear the progress bar --------------------------------------

    def log(self, text: str) -> None:
        if self._bar is not None:
            self._bar.write(text)
        else:
            print(text, flush=True)

    # --- the run --------------------------------------------------------------------------

    def run(self, resume: bool | None = None) -> int:
        """Run (or, with resume=True, continue) the run; returns the exit code (0 every row done).
        Bad input raises UsageError; built from keywords, its message names keywords, not flags."""
        try:
            return self._run(resume)
        except UsageError as err:
            if self._keywords is None:
                raise
            from runner.input.original_api import keyword_message

            raise UsageError(keyword_message(str(err), self._keywords)) from None

    def _run(self, resume: bool | None) -> int:
        _refuse_run_while_a_worker_imports_the_script()
        if resume is not None:
            self.resume = bool(resume)
        from runner.input.dataset import DatasetError, scan_dataset
        from runner.storage.lock import RunLock, RunLockBusy
        from runner.input.secrets import environment_without_keys, register_config
        from runner.storage.runview import Selection
        from runner.storage.store import STORAGE_ERRNOS, RunStore
        from tools.registry import tool_schema_version, unavailable_tools

        config = self.config
        register_config(config)  # every key is redacted from records and console lines
        self._refuse_dataset_among_outputs()
        config.tool_schema_version = tool_schema_version()
        self._settle_seed()  # before the workers start: they sample with it
        unavailable = unavailable_tools(config.tools)
        # Workers start now, so their imports overlap with reading the dataset and the run directory.
        with environment_without_keys():  # workers, and every command they start, never see a key
            executor = self._make_executor(unavailable)
            executor.start()
        previous_handlers = self._install_signal_handlers(executor)
        try:
            try:
                scan = scan_dataset(config.dataset_file, config.max_samples, require_image=self._rows_need_image(),
                                    cwd_error=self._cwd_rule(), row_error=self._row_rule())
            except DatasetError as err:
                raise UsageError(str(err)) from None
            if scan.errors:
                self._report_bad_lines(scan)
            if scan.duplicate_ids and not config.allow_duplicate_ids:
                self._refuse_duplicate_ids(scan)
            if not scan.rows:
                raise UsageError(f"{config.dataset_file}: no valid rows")
            self._warn_if_not_isolated()
            self._failed_images = self._prepare_images(scan)
            self._refuse_unusable_default_image(scan)
            self._probe_endpoint()
            self.run_dir.mkdir(parents=True, exist_ok=True)
            lock = RunLock(self.run_dir)
            try:
                lock.acquire(self.log)
            except RunLockBusy as err:
                raise UsageError(str(err)) from None
            try:
                from runner.storage.leftovers import clean_run_leftovers

                clean_run_leftovers(self.run_dir, self.log)  # what a killed invocation left behind
                self._prepare_run_dir()
                store = RunStore(self.run_dir, config.run_name, config.batch_size, Selection.of(config))
                self._store = store  # a second Ctrl-C commits the rows in flight through it
                return self._run_locked(scan, store, executor, unavailable)
            except OSError as err:  # a write of the merge, statistics, config...: name the path
                if err.errno in STORAGE_ERRNOS:
                    raise StorageError(err.filename or self.run_dir, err) from err
                raise
            finally:
                lock.release()
        finally:
            # SIGTERM to the workers: an idle one exits at once (even mid-import, after a bad
            # dataset); one with sessions left cancels them, which removes their sandboxes.
            executor.shutdown(abandon=True)
            for signum, handler in previous_handlers.items():
                signal.signal(signum, handler)

    def _refuse_dataset_among_outputs(self) -> None:
        from runner.storage.store import is_own_file_of

        if is_own_file_of(self.run_dir, self.config.dataset_file):
            raise UsageError(
                f"{self.config.dataset_file}: the dataset is one of the files the runner writes in its run "
                f"directory {self.run_dir}; the run would overwrite it. Move or rename it, or choose another --run_name"
            )

    def _make_executor(self, unavailable: dict[str, str]) -> Executor:
        config = self.config
        if config.executor == "ray":
            from runner.execution.ray_pool import RayExecutor

            return RayExecutor(config, unavailable, log=self.log)
        from runner.execution.process_pool import ProcessExecutor

        processes = config.num_processes or os.cpu_count() or 1
        return ProcessExecutor(config, unavailable, self._sessions(), processes, log=self.log)

    def _sessions(self) -> int:
        """--num_workers, but never more sessions than the dataset can have rows (2 prompts: 2 sessions)."""
        config = self.config
        wanted = config.num_workers
        rows = _count_lines(config.dataset_file, stop_at=wanted)
        if config.max_samples:
            rows = min(rows, config.max_samples)
        return max(1, min(wanted, rows))

    def _report_bad_lines(self, scan) -> None:
        errors = scan.errors
        shown = errors[:50]
        lines = [f"   {scan.path}:{line_no}: {reason}" for line_no, reason in shown]
        if len(errors) > len(shown):
            lines.append(f"   ... and {len(errors) - len(shown)} more")
        if not self.config.skip_invalid:
            print("\n".join(lines), file=sys.stderr)
            raise UsageError(
                f"{scan.path}: {len(errors)} invalid line(s) (listed above); fix them or pass --skip_invalid to run the valid rows"
            )
        print(f"⚠️  Skipping {len(errors)} invalid line(s) of {scan.path} (--skip_invalid):")
        print("\n".join(lines))

    def _refuse_duplicate_ids(self, scan) -> None:
        """An `id` names one row: two rows with the same one would both reach trajectories.jsonl."""
        duplicates = scan.duplicate_ids
        shown = duplicates[:50]
        lines = [f"   {scan.path}:{line_no}: duplicate id {row_id!r} (first on line {first})"
                 for line_no, row_id, first in shown]
        if len(duplicates) > len(shown):
            lines.append(f"   ... and {len(duplicates) - len(shown)} more")
        print("\n".join(lines), file=sys.stderr)
        raise UsageError(f"{scan.path}: {len(duplicates)} duplicate id(s) (listed above); make each row's id "
                         "unique or pass --allow_duplicate_ids to run them all")

    def _print_header(self, scan) -> None:
        c = self.config
        print("📊 Batch Runner Initialized")
        print(f"   Dataset: {c.dataset_file} ({plural(scan.rows, 'prompt')})")
        print(f"   Batch size: {c.batch_size}")
        print(f"   Run name: {c.run_name}")
        print(f"   Distribution: {c.distribution}")
        print(f"   Model: {c.model}" + (f" @ {c.base_url}" if c.base_url else " (built-in offline model)"))
        print(f"   Output directory: {self.run_dir}")
        if c.executor == "ray":
            print(f"   Workers: Ray cluster {c.ray_address or '(local)'}, {plural(c.sessions_per_node or c.num_workers, 'session')} per node")
        else:
            print(f"   Workers: {plural(self._sessions(), 'concurrent session')}")
        if c.ephemeral_system_prompt:
            text = c.ephemeral_system_prompt
            print(f"   🔒 Ephemeral system prompt: '{text[:60]}{'...' if len(text) > 60 else ''}'")

    def _prepare_run_dir(self) -> None:
        """Refuse to mix runs by accident: a rerun needs --resume (or --overwrite). Runs under the lock."""
        from runner.storage.store import batch_files, own_files

        run_dir = self.run_dir
        has_rows = bool(batch_files(run_dir))
        if has_rows and self.overwrite:
            # Only what the runner wrote: a dataset or notes the user keeps in the folder stay.
            dataset = Path(self.config.dataset_file).resolve()
            for path in own_files(run_dir):
                if path.resolve() != dataset:
                    path.unlink(missing_ok=True)
            print(f"🗑️  --overwrite: removed the earlier outputs of the runner in {run_dir}")
        elif has_rows and not self.resume:
            raise UsageError(
                f"{run_dir} already holds rows of an earlier run; use --resume to continue it "
                "or --overwrite to start again from scratch"
            )

    def _settle_seed(self) -> None:
        """Without --seed, the run's seed is drawn once and recorded in config.json, so every row
        records the seed its sample came from and a resume samples with the same one."""
        import secrets

        from runner.storage.runfiles import read_config

        if self.config.seed is not None:
            return
        saved = None
        recorded = read_config(self.run_dir) if self.resume else None
        if recorded is not None and recorded.setting("seed_drawn"):
            saved = recorded.setting("seed")
        self.config.seed = saved if isinstance(saved, int) else secrets.randbelow(2**31)
        self.config.seed_drawn = True

    def _check_fingerprint(self) -> None:
        from runner.input.config import diff_fingerprints
        from runner.storage.runfiles import read_config

        recorded = read_config(self.run_dir)
        if recorded is None:
            return
        saved, current = recorded.fingerprint_fields, self.config.fingerprint_fields()
        changed = diff_fingerprints(saved, current)
        # Each change with its old and new value: "max_turns: 3 -> 5".
        changes = ", ".join(f"{name}: {_shown(saved.get(name))} -> {_shown(current.get(name))}" for name in changed)
        if changed and not self.allow_config_change:
            raise UsageError(
                f"--resume with a different configuration ({changes}; changed since the rows in "
                f"{self.run_dir} were made); pass --allow_config_change to mix them anyway"
            )
        if changed:
            print(f"⚠️  Configuration changed ({changes}); continuing because of --allow_config_change")
        recorded_samples = recorded.setting("samples_per_prompt")
        wanted = self.config.samples_per_prompt
        if isinstance(recorded_samples, int) and wanted < recorded_samples:  # the extra samples are paid for
            raise UsageError(
                f"--samples_per_prompt={wanted} is lower than the {recorded_samples} samples per prompt of the run "
                f"in {self.run_dir} (their samples are already paid for); resume with "
                f"--samples_per_prompt={recorded_samples} or more")

    def _write_config(self) -> None:
        from runner.storage.runfiles import ConfigFile, Invocation, read_config, write_config

        saved = None if self.overwrite else read_config(self.run_dir)
        created, invocations = (saved.created_at, saved.invocations) if saved is not None else (None, [])
        # Each invocation's start and end: the run's duration is the time spent running, summed.
        invocations.append(Invocation(run_id=self.config.tools.run_id, started_at=self.started_at, ended_at=None))
        write_config(self.run_dir, ConfigFile(
            config=self.config.public_dict(),
            fingerprint=self.config.fingerprint(),
            fingerprint_fields=self.config.fingerprint_fields(),
            run_id=self.config.tools.run_id,
            created_at=created or now_iso(),
            updated_at=now_iso(),
            invocations=invocations,
        ))

    def _run_locked(self, scan, store, executor, unavailable: dict[str, str]) -> int:
        from runner.output.finalize import build_statistics, merge_run, print_summary, record_invocation_end, run_time, write_statistics
        from runner.output.report import report_details
        from runner.storage.runview import Selection

        config = self.config
        if self.resume:
            self._check_fingerprint()
        self._print_header(scan)  # after every check that can stop the run at its start
        self._write_config()
        store.repair_torn_tails(self.log)
        store.load(self.log)
        self._passed = store.view.passed_by_row()  # --stop_after_passing holds across resume

        self._warn_unavailable(unavailable)
        units = self._units(scan)[0]
        done = sum(1 for key in units if store.is_committed(key))
        remaining = len(units) - done
        if self.resume or done:
            what = "rows" if config.samples_per_prompt == 1 else "samples"
            print(f"📂 Resuming: {done:,} of {len(units):,} {what} already committed; {remaining:,} to run")

        rows_this_run = 0
        self._to_run = remaining
        self._monitor = self._make_monitor(scan, store, done, remaining)
        executor.watch(self._monitor)  # each request's usage as it completes; the budget admits requests
        if remaining and not self.stopping:
            rows_this_run = self._execute(scan, store, executor, remaining)
        elif not remaining:
            print("✅ All prompts have already been processed; rebuilding the merged outputs.")
        self._phase = "finishing"
        executor.shutdown()  # nothing is in flight now: the workers are not needed for the merge
        store.close()

        print("\n📦 Combining all batch files into trajectories.jsonl...")
        scan = self._final_dataset(scan)
        details = report_details()
        units, unit_ids = self._units(scan)
        view = merge_run(self.run_dir, units, self.log, ids=unit_ids, detail=details, selection=Selection.of(config))
        stats = build_statistics(
            view, run_name=config.run_name, distribution=config.distribution, total_prompts=scan.rows,
            batch_size=config.batch_size, model=config.model, rows_this_run=rows_this_run,
            run_time=run_time(record_invocation_end(self.run_dir, config.tools.run_id), view, config.tools.run_id),
            fingerprint=config.fingerprint(), samples_per_prompt=config.samples_per_prompt,
        )
        outcomes = stats["outcomes"]
        outcome = decide(self._stop, budget_reached=self._monitor.budget_reached, failed=outcomes["failed"],
                         not_run=outcomes["not_run"])
        stats["outcome"] = outcome.as_dict()
        write_statistics(self.run_dir, stats)
        print_summary(stats, self.run_dir, headline=outcome.headline)
        self._write_exports(view)
        self._monitor.close(outcome.state)  # before the report, which shows it
        self._write_report(view, stats)
        self._say_outcome(outcome)
        code = outcome.exit_code
        if config.compress_to_tokens and not self.stopping:
            code = self._compress(code)
        return code

    def _compress(self, code: int) -> int:
        """--compress_to_tokens: trajectories_compressed.jsonl from trajectories.jsonl (left as it is).
        The run's exit code, or the compression's when it stopped or left rows uncompressed."""
        from runner.compress.after_run import compress_run, compressor_for
        from runner.compress.journal import JournalError
        from runner.compress.run import stopped_message, summary_lines

        print(f"\n🗜️  Compressing trajectories.jsonl to --compress_to_tokens={self.config.compress_to_tokens:,}...")
        compressor = compressor_for(self.run_dir, self.config)
        try:
            outcome = compress_run(compressor)
        except JournalError as err:
            print(f"❌ Not compressed: {err}", file=sys.stderr)
            return code or EXIT_INCOMPLETE
        if outcome.stopped:
            print(stopped_message(outcome), file=sys.stderr)
            return EXIT_FATAL_PROVIDER if outcome.stopped == "fatal" else EXIT_INTERRUPTED
        print("\n".join(summary_lines(outcome.summary, compressor.metrics_path)))
        return EXIT_INCOMPLETE if outcome.summary["rows_failed"] and code == EXIT_OK else code

    def _say_outcome(self, outcome: Outcome) -> None:
        """The last lines: the spend, and what to do next when the run is not done."""
        if outcome.exit_code == EXIT_FATAL_PROVIDER:
            print(f"\n❌ Stopped early: {outcome.message}", file=sys.stderr)
            return
        if outcome.kind == "interrupted":
            print("\n⏸️  Interrupted: committed rows are safe; run again with --resume to finish.", file=sys.stderr)
            return
        snapshot = self._monitor.snapshot("done")
        print(f"\n{self._monitor.spend_line(snapshot)}")
        if outcome.kind == "budget":
            outlook = snapshot["forecast"] or {}
            high = outlook.get("total_high_usd") or outlook.get("total_usd")
            print(f"\n{self._monitor.budget.stop_message(self.config.max_cost_scope, high)}", file=sys.stderr)
        elif outcome.kind == "crash_loop":
            print(f"\n❌ Stopped early: {outcome.message}. Committed rows are safe; run again with --resume "
                  "to finish.", file=sys.stderr)
        elif outcome.kind == "failed_rows":
            print(f"\n⚠️  {outcome.failed + outcome.not_run} row(s) not done; run again with --resume to retry them.")

    def _make_monitor(self, scan, store, done: int, remaining: int):
        """Live spend, forecast and status.json for this invocation, with the budget if one is set."""
        from runner.execution.budget import Budget
        from runner.output.status import FORECAST_MIN_ROWS, LiveSpend, RunMonitor

        config = self.config
        # the scope decides what the budget counts; only a budget counts unknown costs at the mean
        spend = LiveSpend(scope=config.max_cost_scope, estimate_unknown=config.max_cost is not None,
                          prices_given=config.prices is not None, before=store.spent())  # what earlier invocations committed, kept by the run view
        units = self._units(scan)[0]
        kept = sum(1 for key in units if store.outcome(key) == "ok")
        budget = Budget(config.max_cost, config.max_cost_hard, spend) if config.max_cost is not None else None
        monitor = RunMonitor(self.run_dir, config.run_name, total_rows=len(units), finished_before=done,
                             kept_before=kept, to_run=remaining, spend=spend, budget=budget,
                             budget_limit=config.max_cost, log=self.log,
                             forecast_after=max(FORECAST_MIN_ROWS, self._sessions()), t0=self._started_clock)
        from runner.storage.runview import Selection

        monitor.selection = Selection.of(config)
        return monitor

    def _final_dataset(self, scan):
        """The dataset as it is now: rows appended (or edited) during the run belong to the merge."""
        from runner.input.dataset import DatasetError, scan_dataset

        try:
            if os.stat(scan.path).st_mtime_ns == scan.mtime_ns and os.stat(scan.path).st_size == scan.size:
                return scan
            fresh = scan_dataset(scan.path, self.config.max_samples, require_image=self._rows_need_image(),
                                 cwd_error=self._cwd_rule(), row_error=self._row_rule())
        except (OSError, DatasetError) as err:
            self.log(f"⚠️  Could not read the dataset again ({err}); merging against it as it was at the start")
            return scan
        if fresh.rows != scan.rows:
            self.log(f"ℹ️  The dataset changed during the run: {scan.rows:,} -> {fresh.rows:,} rows")
        return fresh

    def _write_exports(self, view) -> None:
        """--export with a run: the exports of what the run now holds, after the merge."""
        if not self.config.export:
            return
        from runner.output.export import ExportError, export_run
        from runner.output.finalize import kept_lines

        try:
            export_run(self.run_dir, lambda: kept_lines(view), self.config.export,
                       ok_lines=lambda: kept_lines(view, selected_only=False))
        except ExportError as err:
            print(f"⚠️  Not exported: {err}")

    def _write_report(self, view, stats) -> None:
        try:
            from runner.output.report import write_report

            path = write_report(self.run_dir, max_full_conversations=self.config.report_samples, view=view,
                                statistics=stats)
            print(f"   - Report: {path.name} (open it in a browser)")
        except Exception as err:  # the report is a view: never let it fail a finished run
            print(f"⚠️  Could not write report.html: {type(err).__name__}: {err}")

    def _warn_if_not_isolated(self) -> None:
        """The local backend without a sandbox runs the model's commands as our own user: say so
        when that user is root, and name the flags that isolate them."""
        from toolset_distributions import get_distribution
        from tools.registry import tools_for_toolsets

        tools = self.config.tools
        toolsets = list(get_distribution(self.config.distribution)["toolsets"])
        commands = any(spec.needs_sandbox for spec in tools_for_toolsets(toolsets, {}))
        if tools.terminal_env == "local" and not tools.sandbox and commands and os.geteuid() == 0:
            print("⚠️  Running as root with --terminal_env=local and no sandbox: the model's commands run as root "
                  "on this machine, unisolated. Isolate them with --sandbox=bwrap or --terminal_env=docker.")

    def _warn_unavailable(self, unavailable: dict[str, str]) -> None:
        from runner.execution.worker import fallback_toolset
        from toolset_distributions import get_distribution
        from tools.registry import TOOLSETS

        wanted = {tool for ts in get_distribution(self.config.distribution)["toolsets"] for tool in TOOLSETS.get(ts, ())}
        missing = {tool: why for tool, why in unavailable.items() if tool in wanted}
        if missing:
            by_reason: dict[str, list[str]] = {}
            for tool, why in missing.items():
                by_reason.setdefault(why, []).append(tool)
            detail = "; ".join(f"{', '.join(tools)} ({why})" for why, tools in by_reason.items())
            print(f"⚠️  Not offered to the model in this run: {detail}")
        if fallback_toolset(self.config.distribution, unavailable) is None:
            print(f"⚠️  No toolset of --distribution={self.config.distribution} can offer a tool in this run: "
                  "every row runs without tools (toolsets_used and metadata.tools_offered are empty)")

    def _units(self, scan) -> tuple[dict[str, int], dict[str, str]]:
        """The units of work of the dataset: every sample key -> its row's index, and their ids."""
        from runner.input.samples import sample_ids, sample_units

        samples = self.config.samples_per_prompt
        if samples == 1:
            return scan.key_to_index, scan.ids
        return sample_units(scan.key_to_index, samples), sample_ids(scan.ids, samples)

    def _tasks(self, store, scan):
        """The samples still to run, each as the task of its next attempt. Samples run in rounds
        (every row's sample 0, then every row's sample 1, ...), so the samples of a row that
        --stop_after_passing spares are the ones not started yet when its row has passed enough.
        A dataset rewritten under the run ends them (with a message): reading on could start a
        row a second time."""
        from runner.input.dataset import DatasetChanged, iter_rows
        from runner.input.samples import sample_key
        from runner.execution.task import Task

        config = self.config
        try:
            for sample in range(config.samples_per_prompt):
                for row in iter_rows(config.dataset_file, config.max_samples, require_image=self._rows_need_image(),
                                     cwd_error=self._cwd_rule(), row_error=self._row_rule(), scanned=scan.key_to_index):
                    key = sample_key(row.key, sample)
                    if not store.is_committed(key) and not self._row_has_passed_enough(row.key):
                        yield Task.of(row, attempt=store.failures(key) + 1, run_id=config.tools.run_id, seed=config.seed,
                                      sample=sample, samples=config.samples_per_prompt)
        except DatasetChanged as err:
            self.log(f"⚠️  {err}: no more rows are read from it. The rows in flight finish; "
                     "run again with --resume for the rest.")

    def _row_has_passed_enough(self, row_key: str) -> bool:
        """--stop_after_passing: this row has that many passing samples committed."""
        wanted = self.config.stop_after_passing
        return wanted is not None and self._passed.get(row_key, 0) >= wanted

    def _cwd_rule(self):
        """The backend's rule for a row's cwd (Backend.cwd_error): a row it refuses is an invalid line."""
        import functools

        from tools.environments import backend_class

        tools = self.config.tools
        return functools.partial(backend_class(tools.terminal_env).cwd_error, settings=tools)

    def _row_rule(self):
        """The scorers' rule for a row (a target, a verify command they need): a row it refuses is an invalid line."""
        from runner.scoring.scorers import row_rule

        return row_rule(self.config)

    def _rows_need_image(self) -> bool:
        """A row naming no image is invalid (found before any cost) when the backend says so and
        the run has no default image."""
        from tools.environments import backend_class

        tools = self.config.tools
        return backend_class(tools.terminal_env).rows_need_image and not tools.docker_image

    def _prepare_images(self, scan) -> dict[str, str]:
        """The backend's run preparation (docker: check and pull every distinct image once), before
        any model call. Returns image -> why it cannot be used."""
        if self.config.executor == "ray":
            return {}  # with Ray, each node prepares the images it needs itself
        from tools.environments import backend_class

        tools = self.config.tools
        images = {image for image in scan.images | {tools.docker_image} if image}
        return backend_class(tools.terminal_env).prepare_run(tools, images, say=print, log=self.log)

    def _refuse_unusable_default_image(self, scan) -> None:
        """The run's default image is a flag: when rows need it and it cannot be used, the run
        stops before any model call instead of failing each of those rows."""
        image = self.config.tools.docker_image
        why = self._failed_images.get(image or "")
        if why and scan.rows_without_image:
            raise UsageError(f"--docker_image={image}: {why} (needed by {plural(scan.rows_without_image, 'row')} "
                             "that name no image)")

    def _execute(self, scan, store, executor, remaining: int) -> int:
        from runner.console import progress
        from runner.execution.worker import failed_record

        config = self.config
        monitor = self._monitor
        failed_images = self._failed_images
        counts = {"ok": 0, "failed": 0, "discarded": 0, "retries": 0}
        self._phase = "dispatch"
        print(f"\n🚀 Running {plural(remaining, 'prompt')}: {executor.describe()}\n")
        tasks = self._tasks(store, scan)
        exhausted = False
        committed = 0
        grace_deadline = None
        self._bar = progress(remaining, waiting=monitor.oldest_wait)  # a bar on a terminal; plain lines in a log
        try:
            while True:
                immediate = []
                while not self.stopping and not exhausted and executor.free_slots() > 0 and len(immediate) < 500:
                    if not monitor.may_start():  # the cost budget (runner/execution/budget.py)
                        break
                    task = next(tasks, None)
                    if task is None:
                        exhausted = True
                    elif unusable := failed_images.get(task.image or config.tools.docker_image or ""):
                        # Known before dispatch: the row fails here, no worker sees it.
                        immediate.append(failed_record(task, config, f"environment: {unusable}", "environment"))
                    else:
                        executor.submit(task)
                        monitor.on_start(task)
                if executor.in_flight() == 0 and not immediate and (exhausted or self.stopping or monitor.budget_reached):
                    break
                if monitor.cancel_now():  # --max_cost_hard
                    self.log(f"💸 Budget reached: cancelling {executor.in_flight()} in-flight prompt(s)")
                    executor.shutdown(abandon=True)
                    committed += self._commit_abandoned(store, executor, "cancelled in flight: the cost budget "
                                                        "was reached (--max_cost_hard)", "budget")
                    break
                if self.stopping and grace_deadline is None:
                    grace_deadline = time.monotonic() + config.grace_period
                if grace_deadline is not None and time.monotonic() > grace_deadline and executor.in_flight():
                    self.log(f"⏹️  Grace period over: abandoning {executor.in_flight()} in-flight prompt(s)")
                    executor.shutdown(abandon=True)  # stop paying for them now, not after the merge
                    committed += self._commit_abandoned(store, executor, "abandoned in flight: the run was "
                                                        "interrupted and the grace period ended", "interrupted")
                    break
                records = immediate + (executor.poll(0.2) if executor.in_flight() else [])
                if executor.stop_reason and not self.stopping:
                    self._stop_with("crash_loop", executor.stop_reason)
                    self.log(f"⛔ {executor.stop_reason}: no new prompts will be started.")
                if records:
                    store.commit(records)
                    committed += len(records)
                    monitor.on_commit(records)
                    self._after_commit(records, counts)
                else:
                    store.save_checkpoint()
                    if hasattr(self._bar, "tick"):
                        self._bar.tick()
                monitor.tick(executor.in_flight())
        finally:
            self._bar.close()
            self._bar = None
        return committed

    def _commit_at_quit(self, executor) -> None:
        """Quitting at once: the rows in flight are committed as failed attempts with what their
        workers last reported spending (one append and fsync, no waiting for a worker), and
        status.json says the run was interrupted, so every request already sent is counted."""
        store, monitor = self._store, self._monitor
        if store is None or monitor is None or store.writing:  # a commit cut mid-line: leave the file whole
            return
        try:
            records = executor.abandoned("quit at once: the run was interrupted a second time", "interrupted")
            if records:
                store.commit(records)
                monitor.on_commit(records)
            monitor.close("interrupted")
        except Exception as err:  # quitting at once must still quit: what was fsynced stays committed
            print(f"⚠️  Could not record the rows in flight: {err}", file=sys.stderr, flush=True)

    def _commit_abandoned(self, store, executor, error: str, error_class: str) -> int:
        """The rows given up in flight: what they spent is committed (as failed attempts, run again
        on resume), so every request sent is in the figures."""
        records = executor.abandoned(error, error_class)
        self._monitor.on_abandoned()
        if records:
            store.commit(records)
            self._monitor.on_commit(records)
        return len(records)

    def _probe_endpoint(self) -> None:
        """One cheap request before anything is written: an unreachable endpoint or a refused key
        stops here (exit 1), named, instead of failing every row after minutes of retries."""
        from agent.model_client import probe_endpoint

        config = self.config
        key = config.api_key.get_secret_value() if config.api_key else None
        endpoints = [] if config.model == "mock" or not config.base_url else [config.base_url]
        if "judge" in config.scorer and config.judge_base_url and config.judge_base_url not in endpoints:
            endpoints.append(config.judge_base_url)  # the judge's own endpoint (--judge_base_url)
        for endpoint in endpoints:
            problem = probe_endpoint(endpoint, key)
            if problem:
                raise UsageError(f"{problem}; nothing was started")

    def _repeated_failure(self, cls: str | None, error: str, usage: Any = None) -> tuple[str, str] | None:
        """The stop (kind, cause) when the same failure comes back row after row, else None: every
        row of a recent window failed to connect, had its first reply cut at --max_tokens, or had
        every request fail the same way (the endpoint is not the API it should be)."""
        streaks = self._streaks
        for name in ("connection", "truncated"):
            streaks[name] = streaks.get(name, 0) + 1 if cls == name else 0
        window = max(3, min(self.config.num_workers, 8))
        if cls == "connection" and streaks[cls] >= window:
            return "endpoint_lost", (f"the model endpoint cannot be reached: the last {streaks[cls]} rows all failed "
                                     f"to connect ({error})")
        if cls == "truncated" and streaks[cls] >= 3:
            limit = (f"--max_tokens={self.config.max_tokens} is too small for this model (raise it or leave it unset)"
                     if self.config.max_tokens else "the server's default output limit is too small for this model "
                     "(pass a larger --max_tokens)")
            return "bad_max_tokens", (f"configuration error: the first reply of the last {streaks[cls]} rows was cut "
                                      f"at the output length limit; {limit}")
        same = every_request_failed_as(error) if cls == "provider" and _no_request_succeeded(usage) else None
        before, count = self._same_failure
        self._same_failure = (same, count + 1 if same and same == before else 1)
        if same and self._same_failure[1] >= window:
            return "endpoint_unusable", (f"the model endpoint {same}: every request of the last "
                                         f"{self._same_failure[1]} rows failed that way ({error})")
        return None

    def _after_commit(self, records: list[dict], counts: dict) -> None:
        from runner.input.samples import row_key_of
        from runner.storage.records import fields_of
        from runner.storage.runview import Selection, quality_outcome
        from runner.storage.scores import primary_score
        from runner.storage.store import record_outcome

        selection = Selection.of(self.config)
        for record in records:
            fields = fields_of(record)
            outcome = quality_outcome(record, record_outcome(record), selection)
            counts[outcome] += 1
            counts["retries"] += fields.usage.retries
            self._warn_if_all_discarded(outcome)
            primary = primary_score(fields.meta.scores) if outcome != "failed" else None
            if primary is not None and primary.passed:
                row = row_key_of(fields.key)
                self._passed[row] = self._passed.get(row, 0) + 1
            index = record["prompt_index"]
            repeated = self._repeated_failure(record.get("error_class") if outcome == "failed" else None,
                                              record.get("error") or "", fields.usage)
            if outcome == "failed":
                cls = record.get("error_class")
                self.log(f"   ❌ Prompt {index} failed ({cls}): {record['error']}")  # the cause whole
                if cls in FATAL_CLASSES and not repeated:
                    repeated = ("fatal_provider", f"the provider refused the request ({cls}): {record['error']}")
                if repeated and not self.stopping:
                    self._stop_with(*repeated)
                    self.log(f"⛔ {repeated[1]}\n   No new prompts will be started.")
            elif self.config.verbose:
                self.log(f"   {'✅' if outcome == 'ok' else '🚫'} Prompt {index} {outcome}: {self._preview(record)}")
        self._bar.set_postfix(counts, refresh=False)
        self._bar.update(len(records))

    FIRST_ROWS = 3  # finished rows that, all discarded by the no-reasoning filter, warrant a warning

    def _warn_if_all_discarded(self, outcome: str) -> None:
        """Say it early: when the first rows that finish are all discarded for no reasoning (a
        model that gives none), every row will be; name the flag that keeps them."""
        if self._first_finished is None:
            return
        if outcome == "failed":
            self._to_run -= 1  # a failed row tells nothing about the filter
            return
        self._first_finished.append(outcome)
        if outcome == "ok":
            self._first_finished = None  # a row was kept: the filter is not discarding everything
        elif len(self._first_finished) >= min(self.FIRST_ROWS, self._to_run):
            finished = len(self._first_finished)
            self._first_finished = None
            self.log(f"⚠️  The first {plural(finished, 'row')} to finish were all discarded for no reasoning "
                     "(this model gives none?): pass --keep_no_reasoning to keep them (--resume "
                     "--keep_no_reasoning keeps the rows already made, with no new request)")

    def _preview(self, record: dict) -> str:
        """The row's prompt, cut at --log_prefix_chars."""
        prompt = record.get("prompt")
        if prompt is None:
            prompt = next((t["value"] for t in record.get("conversations") or () if t.get("from") == "human"), "")
        limit = self.config.log_prefix_chars
        text = " ".join(str(prompt).split())
        return repr(text[:limit] + ("..." if len(text) > limit else ""))

    def _install_signal_handlers(self, executor) -> dict:
        """Ctrl-C / SIGTERM, from the start of the run to its end; returns the handlers they replace.

        The first signal stops the run the gentle way: no new prompts, in-flight ones get the grace
        period, then the merge, statistics and report as usual (exit 130). A second one quits at
        once, wherever the run is (the merge included): every committed line is already fsynced,
        and every output file is replaced atomically, so each is either its old or its new version;
        the next start removes the temp files this leaves.
        """
        def on_signal(signum, frame):
            self._interrupts += 1
            if self._interrupts == 1:
                self._stop_with("interrupted")
                if self._phase == "dispatch":
                    self.log(
                        f"\n⏸️  Stopping: no new prompts; waiting up to {self.config.grace_period:g}s for "
                        f"{executor.in_flight()} in-flight prompt(s). Press Ctrl-C again to quit at once."
                    )
                elif self._phase == "finishing":
                    self.log("\n⏸️  Stopping: writing the merged outputs first. Press Ctrl-C again to quit at once.")
                else:
                    self.log("\n⏸️  Stopping: no prompt will be started. Press Ctrl-C again to quit at once.")
                return
            executor.terminate()
            self._commit_at_quit(executor)
            print("\n⏹️  Quit at once; committed rows are safe. Run again with --resume.", file=sys.stderr, flush=True)
            os._exit(EXIT_INTERRUPTED)

        return {signum: signal.signal(signum, on_signal) for signum in (signal.SIGINT, signal.SIGTERM)}


def every_request_failed_as(error: str) -> str | None:
    """The failure a row's error names, as one name for all rows that failed the same way ("HTTP
    500 to every request"), or None for a failure that is not the endpoint's answer."""
    from agent.model_client import ANSWERS_HTML

    if ANSWERS_HTML in error:
        return ANSWERS_HTML.removeprefix("the endpoint ")
    status = re.match(r"HTTP (\d{3})\b", error)
    if status and status.group(1) not in ("400", "413", "422"):  # those refuse a row's own request (too long, ...)
        return f"gives HTTP {status.group(1)} to every request"
    if error.startswith("malformed response"):
        return "gives a malformed reply to every request"
    if error.startswith("request timed out"):
        return "answers no request within --request_timeout"
    if error.startswith("the reply is larger than"):
        return "sends replies larger than a model reply may be"
    return None


def _no_request_succeeded(usage: Any) -> bool:
    """Every request of the attempt (an agent.usage.Usage) failed: all but the first were retries
    (a failed row whose model answered some request says nothing about the endpoint as a whole)."""
    return usage is not None and usage.requests - usage.retries <= 1


def cli(argv: list[str] | None = None) -> None:
    if argv is None:  # the real command line: keys leave our environment and argv first (may re-exec)
        from runner.input.secrets import protect_process_secrets

        protect_process_secrets()
    from runner.input.flags import FlagError, bool_flags, check_argv, format_help, text_flags, wants_help

    argv = sys.argv[1:] if argv is None else list(argv)
    if wants_help(argv):
        print(format_help())
        raise SystemExit(EXIT_OK)
    strings = text_flags()
    try:
        argv = check_argv(argv, strings, bool_flags())  # before fire: main() exits before fire would see a leftover flag
    except FlagError as err:
        print(f"❌ Error: {err}", file=sys.stderr)
        raise SystemExit(EXIT_ERROR) from None
    import fire  # (after --help, which needs none of it)

    fire.Fire(fire.decorators.SetParseFns(**{name: str for name in strings})(main), command=argv)


if __name__ == "__main__":
    cli()
