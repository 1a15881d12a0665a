"""The command-line flags: one table that both checks the command line and writes `--help`.

python-fire parses the command line, but it only rejects a leftover argument after `main()` has
returned, and `main()` never returns (it exits with the run's code). So the command line is
checked here first, with fire's own grammar: `--flag=value`, `--flag value`, a bare `--flag`
(true), `--noflag` (false) and `--hyphenated-name`. A misspelled flag then stops the run before
anything starts, instead of being ignored while a paid model runs with the default.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass

from tools.environments import backend_choices

ORIGINAL = "The original's flags"
NEW = "New flags"


# The flag's default is its config field's (runner/input/config.py), where it is defined once.
CONFIG = "<the config field's default>"


@dataclass(frozen=True)
class Flag:
    name: str
    group: str  # the README's flags table the flag is listed in
    default: str  # as shown to the user ("" when there is none), or CONFIG
    help: str  # one line

    def shown_default(self) -> str:
        if self.default != CONFIG:
            return self.default
        from runner.input.config import flag_default  # (pydantic: only imported for --help)

        return flag_default(self.name)


def _flags(group: str, *rows: tuple[str, str, str]) -> list[Flag]:
    return [Flag(name, group, default, text) for name, default, text in rows]


FLAGS: list[Flag] = _flags(
    ORIGINAL,
    ("dataset_file", "required", "Input JSONL, one object with a 'prompt' per line."),
    ("batch_size", "required", "Rows per output file batch_N.jsonl (does not limit parallelism)."),
    ("run_name", "required", "Output folder <output_dir>/<run_name>/ (letters, digits, '.', '_', '-')."),
    ("distribution", CONFIG, "Toolset distribution (--list_distributions shows them)."),
    ("model", CONFIG, "Model id; 'mock' is the built-in offline model."),
    ("api_key", "$OPENROUTER_API_KEY or $OPENAI_API_KEY", "API key of the model endpoint (the variable is safer: flags show in ps)."),
    ("base_url", CONFIG, "OpenAI-compatible endpoint."),
    ("max_turns", CONFIG, "Model calls per prompt (the agent's iteration limit)."),
    ("num_workers", CONFIG, "Concurrent agent sessions."),
    ("resume", "off", "Continue the run: skip committed rows, retry failed ones."),
    ("verbose", "off", "Per-prompt logs (sampled toolsets, outcomes, tracebacks)."),
    ("list_distributions", "", "Print the toolset distributions and exit."),
    ("ephemeral_system_prompt", "", "Added to the system prompt at call time only; never saved."),
    ("log_prefix_chars", CONFIG, "Length of the prompt preview in --verbose per-prompt lines."),
    ("providers_allowed", "", "Comma list: OpenRouter provider.only."),
    ("providers_ignored", "", "Comma list: OpenRouter provider.ignore."),
    ("providers_order", "", "Comma list: OpenRouter provider.order."),
    ("provider_sort", "", "price, throughput or latency (OpenRouter provider.sort)."),
    ("max_tokens", "", "Output tokens per response."),
    ("reasoning_effort", "", "none, minimal, low, medium, high, xhigh, max or ultra."),
    ("reasoning_disabled", "off", "Send reasoning effort 'none'; turns off the no-reasoning filter."),
    ("prefill_messages_file", "", "JSON array of {role, content} messages inserted at call time only."),
    ("max_samples", "all", "Only the first N valid rows."),
) + _flags(
    NEW,
    ("tool_choice", CONFIG, "auto, required or none: tool_choice sent with every request that offers tools."),
    ("prompt_caching", CONFIG, "cache_control breakpoints: auto (Claude models on OpenRouter), on or off."),
    ("seed", "drawn", "Reproducible toolset sampling (each row's sample depends on the seed and the row); "
                      "without it one is drawn for the run and recorded in config.json."),
    ("output_dir", CONFIG, "Parent of the run folder."),
    ("skip_invalid", "off", "Run the valid rows of a dataset that has invalid lines."),
    ("allow_duplicate_ids", "off", "Accept rows that share an 'id' (refused by default)."),
    ("keep_no_reasoning", "off", "Keep rows whose model never reasoned."),
    ("overwrite", "off", "Delete the run's earlier outputs and start again."),
    ("allow_config_change", "off", "Let --resume continue with a changed configuration."),
    ("num_processes", "CPU count", "Worker processes the sessions are spread over."),
    ("prompt_timeout", "none", "Wall-clock limit of one prompt, seconds (the row fails as timeout)."),
    ("request_timeout", CONFIG, "Limit of one model request, seconds (then retried)."),
    ("max_requests_per_minute", "none", "Pace model requests for the whole run."),
    ("grace_period", CONFIG, "After the first Ctrl-C, seconds in-flight prompts may take to finish."),
    ("terminal_env", "$TERMINAL_ENV or local", f"Where commands run: {backend_choices()}."),
    ("docker_image", "", "Image for rows that name none (--terminal_env=docker)."),
    ("sandbox", "", "bwrap: run local commands under bubblewrap."),
    ("keep_workdirs", "off", "Keep the per-prompt working directories (local backend)."),
    ("command_timeout", CONFIG, "Default timeout of one terminal command, seconds."),
    ("container_memory", "none", "Memory limit of each container (e.g. 2g)."),
    ("container_cpus", "none", "CPU limit of each container."),
    ("container_network", "no network", "Network of each container (e.g. bridge)."),
    ("vision_model", "the run's model", "Model used by vision_analyze and browser_vision."),
    ("moa_reference_models", CONFIG, "Comma list: reference models of mixture_of_agents."),
    ("moa_aggregator_model", CONFIG, "Aggregator model of mixture_of_agents."),
    ("web_search_backend", "first configured", "searxng, tavily, exa, brave or firecrawl."),
    ("image_backend", "first configured", "fal or openai."),
    ("image_model", "backend default", "Model of the image backend."),
    ("executor", CONFIG, "local (process pool) or ray."),
    ("ray_address", "", "Ray cluster address (auto)."),
    ("sessions_per_node", "", "Sessions per Ray node."),
    ("report", "", "With --run_name: rebuild report.html, statistics.json and trajectories.jsonl from the run's files (nothing run) and exit."),
    ("report_samples", CONFIG, "Full conversations embedded in report.html."),
    ("export", "", "Comma list of messages, dpo: training-ready files in <run>/export/ (with a run, or alone with --run_name)."),
    ("price_input_per_mtok", "", "USD per million input tokens, for replies whose endpoint reports no cost."),
    ("price_output_per_mtok", "", "USD per million output tokens (with --price_input_per_mtok)."),
    ("price_cached_input_per_mtok", "the input price", "USD per million cached input tokens."),
    ("max_cost", "none", "Budget in USD: no new row starts once spend (+ rows in flight) reaches it; exit 4."),
    ("max_cost_hard", "off", "At the budget, cancel the rows in flight instead of letting them finish."),
    ("max_cost_scope", CONFIG, "run: earlier invocations' spend counts against --max_cost; invocation: only this one."),
    ("scorer", "none", "Comma list of scorers, the first primary: includes, exact, command, judge, path/to/file.py:function."),
    ("pass_threshold", CONFIG, "A score passes when its value is at least this."),
    ("verify_command", "the row's verify", "Shell command of the command scorer for every row (exit 0 passes)."),
    ("verify_timeout", CONFIG, "Seconds a verify command (and each scorer but the judge) may take."),
    ("judge_model", "", "Model of the judge scorer."),
    ("judge_base_url", "--base_url", "OpenAI-compatible endpoint of the judge model."),
    ("judge_rubric", "the row's rubric", "What the judge is told to look for, for every row."),
    ("rescore", "", "With --run_name and --scorer: score the committed samples again (judge requests only), rebuild the outputs and exit."),
)
FLAG_NAMES = [flag.name for flag in FLAGS]

USAGE = (
    "usage: python batch_runner.py --dataset_file=FILE --batch_size=N --run_name=NAME [--flag=value ...]\n\n"
    "Run every prompt of a JSONL dataset through a tool-using agent and collect ShareGPT trajectories.\n"
    "Flags are written --flag=value or --flag value; a bare --flag is true and --noflag false;\n"
    "an on/off flag's value is true/false, yes/no, on/off or 1/0.\n"
    "README.md explains each flag further.\n"
    "Exit codes: 0 done, 1 bad input, 2 rows left, 3 provider stop, 4 cost budget, 5 storage error, 130 interrupted."
)


class FlagError(ValueError):
    """The command line names a flag that does not exist, or gives a text flag no value."""


def format_help() -> str:
    width = max(len(name) for name in FLAG_NAMES) + 4
    lines = [USAGE]
    for group in (ORIGINAL, NEW):
        lines.append(f"\n{group}:")
        for flag in FLAGS:
            if flag.group == group:
                shown = flag.shown_default()
                if shown == "required":
                    lines.append(f"  --{flag.name:<{width}}Required. {flag.help}")
                else:
                    default = f" [default: {shown}]" if shown else ""
                    lines.append(f"  --{flag.name:<{width}}{flag.help}{default}")
    return "\n".join(lines)


def wants_help(argv: list[str]) -> bool:
    return any(arg in ("-h", "--help") for arg in argv)


_SINGLE_DASH = re.compile(r"^-[A-Za-z]")


def _is_flag(arg: str) -> bool:
    """fire's rule: a leading '--', or '-' and a letter (so -1 is a value, not a flag)."""
    return arg.startswith("--") or bool(_SINGLE_DASH.match(arg))


def _unknown(arg: str, key: str) -> FlagError:
    guess = difflib.get_close_matches(key, FLAG_NAMES, n=1, cutoff=0.6)
    hint = f"; did you mean --{guess[0]}?" if guess else ""
    return FlagError(f"unknown flag {arg.split('=', 1)[0]}{hint} (python batch_runner.py --help lists the flags)")


# The words a boolean flag's value may be (any case), and what they mean. fire alone would make
# any other text true ("--overwrite=no" deleting the outputs), so anything else is refused.
BOOL_WORDS = {"true": True, "yes": True, "on": True, "1": True,
              "false": False, "no": False, "off": False, "0": False}


def _bool_value(key: str, value: str) -> bool:
    meaning = BOOL_WORDS.get(value.strip().lower())
    if meaning is None:
        raise FlagError(f"--{key} is on or off, not {value!r}: write --{key}, --no{key} or "
                        f"--{key}=true/false (yes/no, on/off, 1/0)")
    return meaning


def check_argv(argv: list[str], text_flags: set[str], bool_flags: set[str] = frozenset()) -> list[str]:
    """Raise FlagError for the first argument fire would not bind to one of FLAGS; return argv
    with each boolean flag rewritten as fire's bare `--flag` or `--noflag`.

    `text_flags` are the flags whose value is text: they need a value (a bare `--run_name`
    would otherwise become the name "True"). `bool_flags` take a bare `--flag`, `--noflag` or one
    of BOOL_WORDS as value. A lone `--` is refused like a stray word: fire would take what follows
    as its own options and the run would silently ignore them (we use none of fire's options).
    """
    checked: list[str] = []
    index = 0
    while index < len(argv):
        arg = argv[index]
        if arg == "--":
            raise FlagError("unexpected argument '--': everything is a flag, written --flag=value "
                            "(nothing after '--' would be used; see --help)")
        if not _is_flag(arg):
            raise FlagError(f"unexpected argument {arg!r}: flags are written --flag=value (see --help)")
        if not arg.startswith("--"):
            raise FlagError(f"unknown flag {arg.split('=', 1)[0]}: flags are written --flag=value (see --help)")
        body = arg[2:]
        has_value = "=" in body
        key = body.split("=", 1)[0].replace("-", "_")
        bare = not has_value and (index + 1 == len(argv) or _is_flag(argv[index + 1]))
        if key not in FLAG_NAMES:
            if bare and key.startswith("no") and key[2:] in FLAG_NAMES and key[2:] not in text_flags:
                checked.append(arg)
                index += 1
                continue
            raise _unknown(arg, key)
        if bare and key in text_flags:
            raise FlagError(f"--{key} needs a value: --{key}=VALUE")
        if key in bool_flags and not bare:
            value = body.split("=", 1)[1] if has_value else argv[index + 1]
            checked.append(f"--{key}" if _bool_value(key, value) else f"--no{key}")
        else:
            checked.extend(argv[index:index + (1 if (has_value or bare) else 2)])
        index += 1 if (has_value or bare) else 2
    return checked
