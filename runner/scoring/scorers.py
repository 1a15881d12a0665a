"""The scorers a run can use, chosen with --scorer, and the rule that a scorer's failure stays on
its own entry.

Built in: `includes` (a target appears in the final answer), `exact` (the final answer is a
target), `command` (the row's `verify` command, or --verify_command, exits 0 in the sample's
environment), `judge` (a judge model grades the answer). Anything else is a Python scorer,
`path/to/file.py:function` or `package.module:function` (runner/scoring/sample.py documents the
object it is given and what it may return).

A scorer that raises, returns something that is not a score, or runs out of time gives an entry
that did not pass, with value 0.0 and an explanation starting with ERROR_PREFIX; it never fails
the sample.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import math
import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable

from agent.types import REFUSING_CLASSES, ProviderError
from runner.scoring.sample import NoEnvironment, Sample, Score
from runner.storage.scores import JUDGE_REFUSED

BUILT_IN = ("includes", "exact", "command", "judge")
ERROR_PREFIX = "scorer error: "
OUTPUT_TAIL = 1000  # characters of a verify command's output kept as the explanation


class ScorerError(ValueError):
    """--scorer names a scorer that cannot be used (one line for the CLI)."""


@dataclass(frozen=True)
class Scorer:
    name: str  # as given to --scorer
    score: Callable[[Sample, "ScoringContext"], Awaitable[Score]]
    needs_environment: bool  # command, or a Python scorer that calls sample.exec
    needs_target: bool  # includes, exact: every row must have a target


@dataclass
class ScoringContext:
    """What a scorer may use besides the sample: the judge's model session and the run's options."""

    judge: Any = None  # a SessionModel for the judge model (None without the judge scorer)
    rubric: str | None = None  # --judge_rubric
    verify_command: str | None = None  # --verify_command
    verify_timeout: float = 120.0


def row_rule(config: Any) -> Callable[[Any], str | None] | None:
    """Why a dataset row cannot be scored by the run's scorers (a field they need is missing),
    checked with the dataset, before any model call; None when the scorers need no field."""
    wanting_target = [name for name in config.scorer if name in ("includes", "exact")]
    wants_verify = "command" in config.scorer and not config.verify_command
    if not wanting_target and not wants_verify:
        return None

    def problem(row: Any) -> str | None:
        if wanting_target and row.target is None:
            return f"no 'target' field: --scorer={wanting_target[0]} compares the final answer with it"
        if wants_verify and not (row.verify and row.verify.strip()):
            return "no 'verify' field: --scorer=command runs it after the session (or pass --verify_command for every row)"
        return None

    return problem


def normalise(text: str) -> str:
    """Case and runs of whitespace do not count when answers are compared."""
    return " ".join(text.casefold().split())


async def includes(sample: Sample, context: ScoringContext) -> Score:
    answer = normalise(sample.final_answer)
    for target in sample.targets:
        if normalise(target) in answer:
            return Score(1.0, f"the final answer includes {target!r}")
    return Score(0.0, f"the final answer includes no target ({_listed(sample.targets)})")


async def exact(sample: Sample, context: ScoringContext) -> Score:
    answer = normalise(sample.final_answer)
    for target in sample.targets:
        if normalise(target) == answer:
            return Score(1.0, f"the final answer is {target!r}")
    return Score(0.0, f"the final answer is none of the targets ({_listed(sample.targets)})")


def _listed(targets: tuple[str, ...]) -> str:
    shown = ", ".join(repr(t[:80]) for t in targets[:5])
    return shown + (f" and {len(targets) - 5} more" if len(targets) > 5 else "")


async def command(sample: Sample, context: ScoringContext) -> Score:
    script = sample.verify or context.verify_command
    if not script:
        raise ValueError("the row has no 'verify' command and no --verify_command was given")
    result = await sample.exec(script, context.verify_timeout)
    tail = result.output[-OUTPUT_TAIL:].strip()
    if result.timed_out:
        raise TimeoutError(f"the verify command took longer than {context.verify_timeout:g}s"
                           + (f"; its output ended: {tail}" if tail else ""))
    verdict = "passed (exit 0)" if result.exit_code == 0 else f"failed (exit {result.exit_code})"
    return Score(1.0 if result.exit_code == 0 else 0.0, f"verify {verdict}" + (f": {tail}" if tail else ""))


async def judge(sample: Sample, context: ScoringContext) -> Score:
    from runner.scoring.judge import grade

    return await grade(sample, context.judge, sample.rubric or context.rubric)


_BUILT_IN_SCORERS = {
    "includes": Scorer("includes", includes, needs_environment=False, needs_target=True),
    "exact": Scorer("exact", exact, needs_environment=False, needs_target=True),
    "command": Scorer("command", command, needs_environment=True, needs_target=False),
    "judge": Scorer("judge", judge, needs_environment=False, needs_target=False),
}


def scorer_names(flag: Any) -> list[str]:
    """The names in --scorer (a comma list), in order, without repeats; [] when none."""
    if flag is None or flag == "" or flag is False:
        return []
    items = flag if isinstance(flag, (list, tuple)) else str(flag).split(",")
    names: list[str] = []
    for item in (str(i).strip() for i in items):
        if item and item not in names:
            names.append(item)
    if not names:
        raise ScorerError("--scorer is empty: name one or more scorers (includes, exact, command, judge, "
                          "or path/to/file.py:function)")
    return names


def resolve(name: str) -> Scorer:
    """The scorer a name stands for; ScorerError when there is none (an unknown name, a Python
    scorer that cannot be imported or is not a function)."""
    if name in _BUILT_IN_SCORERS:
        return _BUILT_IN_SCORERS[name]
    if ":" not in name:
        raise ScorerError(f"--scorer: unknown scorer {name!r}; the built-in ones are {', '.join(BUILT_IN)}, "
                          "and a Python scorer is written path/to/file.py:function or package.module:function")
    function = _import_function(name)
    return Scorer(name, _python_scorer(function), needs_environment=calls_exec(function), needs_target=False)


def _import_function(name: str) -> Callable:
    where, _, attribute = name.rpartition(":")
    try:
        if where.endswith(".py") or os.sep in where:
            path = Path(where).resolve()
            if not path.is_file():
                raise ScorerError(f"--scorer={name}: no such file {where}")
            module_name = f"abr_scorer_{abs(hash(str(path)))}"
            module = sys.modules.get(module_name)
            if module is None:
                spec = importlib.util.spec_from_file_location(module_name, path)
                module = importlib.util.module_from_spec(spec)
                sys.modules[module_name] = module
                try:
                    spec.loader.exec_module(module)
                except BaseException:
                    del sys.modules[module_name]
                    raise
        else:
            if os.getcwd() not in sys.path:  # a module next to where the run was started
                sys.path.append(os.getcwd())
            module = importlib.import_module(where)
    except ScorerError:
        raise
    except Exception as err:  # the user's module: any error in it means it cannot be used
        raise ScorerError(f"--scorer={name}: cannot import {where}: {type(err).__name__}: {err}") from None
    function = getattr(module, attribute, None)
    if not callable(function):
        raise ScorerError(f"--scorer={name}: {where} has no function {attribute!r}")
    return function


def calls_exec(function: Callable) -> bool:
    """Whether a Python scorer runs commands in the sample's environment (it names `exec`)."""
    code = getattr(inspect.unwrap(function), "__code__", None)
    return code is None or "exec" in code.co_names


class ScorerRaised(Exception):
    """A Python scorer ended with an exception that would end the worker (SystemExit,
    KeyboardInterrupt, ...): its entry names it, and the sample is kept."""


def _python_scorer(function: Callable) -> Callable[[Sample, ScoringContext], Awaitable[Score]]:
    async def score(sample: Sample, context: ScoringContext) -> Score:
        try:
            if inspect.iscoroutinefunction(function):
                value = await function(sample)
            else:  # off the event loop: a slow scorer must not stall the other sessions
                value = await in_own_thread(function, sample)
                if inspect.isawaitable(value):
                    value = await value
        except (Exception, asyncio.CancelledError):
            raise
        except BaseException as err:
            raise ScorerRaised(f"{type(err).__name__}{f': {err}' if str(err) else ''}") from None
        return as_score(value)

    return score


def in_own_thread(function: Callable, *args: Any) -> Awaitable[Any]:
    """`function(*args)` in a daemon thread of its own. A scorer that never returns keeps only its
    thread: the event loop's shared threads (the sessions' commands and clean-ups) stay free, and
    the worker can still exit."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():  # the scorer's time ran out
            return
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)

    def run() -> None:
        try:
            result, error = function(*args), None
        except BaseException as err:  # handed to the awaiting scorer, never left to end the thread noisily
            result, error = None, err
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop closed while the scorer ran
            pass

    threading.Thread(target=run, name="python-scorer", daemon=True).start()
    return future


def as_score(value: Any) -> Score:
    """A scorer's return value as a Score; ValueError when it is none."""
    explanation = ""
    if isinstance(value, dict):
        value, explanation = value.get("value"), value.get("explanation", "")
    elif not isinstance(value, (int, float)) and hasattr(value, "value"):
        value, explanation = value.value, getattr(value, "explanation", "")
    if isinstance(value, bool):
        value = float(value)
    if not isinstance(value, (int, float)) or not math.isfinite(float(value)):
        raise ValueError(f"the scorer returned {value!r}, not a finite number or a score")
    return Score(float(value), "" if explanation is None else str(explanation))


def error_entry(name: str, err: BaseException) -> dict:
    if isinstance(err, ScorerRaised):
        return {"scorer": name, "value": 0.0, "passed": False, "explanation": f"{ERROR_PREFIX}{err}"}
    message = str(err).strip() or type(err).__name__
    if isinstance(err, ProviderError) and err.error_class in REFUSING_CLASSES:
        return {"scorer": name, "value": 0.0, "passed": False,
                "explanation": f"{ERROR_PREFIX}{JUDGE_REFUSED} ({err.error_class}): {message}"}
    kind = "timed out" if isinstance(err, (TimeoutError, asyncio.TimeoutError)) else type(err).__name__
    return {"scorer": name, "value": 0.0, "passed": False, "explanation": f"{ERROR_PREFIX}{kind}: {message}"}


def is_error(entry: dict) -> bool:
    return str(entry.get("explanation", "")).startswith(ERROR_PREFIX)


async def run_scorers(scorers: list[Scorer], sample: Sample, context: ScoringContext, threshold: float) -> list[dict]:
    """One `metadata.scores` entry per scorer, in order. A scorer's failure is its own entry's.
    --verify_timeout bounds each scorer but the judge (whose requests have their own limits)."""
    entries = []
    for scorer in scorers:
        time_limit = None if scorer.name == "judge" else context.verify_timeout + 5
        try:
            score = await asyncio.wait_for(scorer.score(sample, context), time_limit)
        except asyncio.CancelledError:
            raise
        except NoEnvironment:
            raise  # --rescore: the whole rescore stops, nothing is written
        except Exception as err:
            if isinstance(err, asyncio.TimeoutError) and not str(err):
                err = TimeoutError(f"the scorer took longer than {time_limit:g}s")
            entries.append(error_entry(scorer.name, err))
            continue
        entries.append({"scorer": scorer.name, "value": score.value, "passed": score.value >= threshold,
                        "explanation": score.explanation})
    return entries
