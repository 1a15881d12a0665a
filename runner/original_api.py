"""The original's Python API: `BatchRunner(dataset_file=..., batch_size=..., ...).run(resume=...)`.

Scripts written for the original build the runner with its constructor's keywords and defaults
(which differ from the CLI's: `max_iterations`, not `max_turns`; model `claude-opus-4-20250514`;
lists and dicts instead of comma strings and files). This module turns those keywords into our
RunConfig through the same validation as the command line. Our own flags (`output_dir`, `seed`,
`terminal_env`, ...) are accepted as keywords too.
"""

from __future__ import annotations

import difflib
import re
from typing import Any

from runner import configure
from runner.input.errors import UsageError

# The original constructor's parameters and defaults.
ORIGINAL_DEFAULTS: dict[str, Any] = {
    "dataset_file": None,
    "batch_size": None,
    "run_name": None,
    "distribution": "default",
    "max_iterations": 10,
    "base_url": None,
    "api_key": None,
    "model": "claude-opus-4-20250514",
    "num_workers": 4,
    "verbose": False,
    "ephemeral_system_prompt": None,
    "log_prefix_chars": 100,
    "providers_allowed": None,
    "providers_ignored": None,
    "providers_order": None,
    "provider_sort": None,
    "openrouter_min_coding_score": None,
    "max_tokens": None,
    "reasoning_config": None,
    "prefill_messages": None,
    "max_samples": None,
}
# The original's keywords and ours that set the same thing.
_SPELLINGS = (("max_iterations", "max_turns"), ("reasoning_config", "reasoning_effort"),
              ("reasoning_config", "reasoning_disabled"), ("prefill_messages", "prefill_messages_file"))


def config_from_original(keywords: dict[str, Any], recorded: dict | None = None):
    """A RunConfig from the original constructor's keywords (plus any of our flags). A bad keyword
    or value raises as the CLI would, in the keywords' words (`batch_size`, not `--batch_size`)."""
    try:
        return _config(keywords, recorded)
    except UsageError as err:
        raise UsageError(keyword_message(str(err), keywords)) from None


def keyword_message(text: str, keywords: dict[str, Any]) -> str:
    """A CLI message in the Python API's words: `--flag=` is `flag=`, an on/off `--flag` is
    `flag=True`, any other `--flag` is `flag`; the flags named after another keyword take its name
    (max_turns is the original's max_iterations)."""
    from runner.input.flags import FLAG_NAMES, bool_flags

    renamed = {ours: original for original, ours in _SPELLINGS if original in keywords and ours not in keywords}
    switches = bool_flags()

    def keyword(match: re.Match) -> str:
        name, assigned = match.group(1), match.group(2)
        if name not in FLAG_NAMES:
            return match.group(0)
        shown = renamed.get(name, name)
        return f"{shown}=" if assigned else (f"{shown}=True" if name in switches else shown)

    return re.sub(r"--([a-z][a-z0-9_]*)(=)?", keyword, text)


def _unknown_keywords(unknown: list[str], known: set[str]) -> TypeError:
    """Python's own message for an unexpected keyword, with the CLI's suggestion of the closest one."""
    if len(unknown) > 1:
        return TypeError(f"BatchRunner() got unexpected keyword arguments: {', '.join(map(repr, unknown))}")
    guess = difflib.get_close_matches(unknown[0], sorted(known), n=1, cutoff=0.6)
    hint = f"; did you mean {guess[0]}?" if guess else ""
    return TypeError(f"BatchRunner() got an unexpected keyword argument {unknown[0]!r}{hint}")


def _config(keywords: dict[str, Any], recorded: dict | None):
    from runner.input.flags import FLAGS

    # Not the command flags (--resume, --report, ...): run() and its resume take their place.
    known = set(ORIGINAL_DEFAULTS) | {flag.name for flag in FLAGS if flag.section != "command"}
    unknown = sorted(set(keywords) - known)
    if unknown:
        raise _unknown_keywords(unknown, known)
    given = {**ORIGINAL_DEFAULTS, **keywords}
    if given.pop("openrouter_min_coding_score") is not None:
        raise UsageError("openrouter_min_coding_score is not supported (no pareto-router plugin)")
    for original, ours in _SPELLINGS:
        if keywords.get(original) is not None and keywords.get(ours) is not None:
            # Two spellings of one setting: which one wins would be a guess, so neither does.
            raise UsageError(f"BatchRunner() got both {original} and {ours}: they set the same "
                                          f"thing, give one of them")
    reasoning = given.pop("reasoning_config")
    if reasoning is not None and not isinstance(reasoning, dict):
        raise UsageError(f"reasoning_config must be a dict such as {{'effort': 'high'}} (got {reasoning!r})")
    prefill = given.pop("prefill_messages")
    if prefill is not None and not (isinstance(prefill, list) and all(
        isinstance(m, dict) and m.get("role") in ("system", "user", "assistant") and isinstance(m.get("content"), str)
        for m in prefill
    )):
        raise UsageError("prefill_messages must be a list of {'role', 'content'} dicts")
    # A flag the script leaves out (or gives as None, like the original's base_url) keeps the CLI's default.
    max_iterations = given.pop("max_iterations")
    flags = {**given, "max_turns": keywords.get("max_turns", max_iterations)}
    # The original's keywords replace only what build_config makes of our flags when they are given:
    # reasoning_effort=, reasoning_disabled= and prefill_messages_file= are kept otherwise.
    originals = {"reasoning": reasoning, "prefill_messages": prefill}
    return configure.build_config(**flags, recorded=recorded,
                                  given_fields={name: value for name, value in originals.items() if value is not None})
