"""The command-line flags, derived from their declarations: main()'s parameters, --help, docs/flags.md.

Each flag is declared once, with `flag(...)` on the field it sets (runner/input/flag_declaration.py),
in one of the SECTIONS below; the section says where the value goes. Everything else is read from
those declarations: the parameters fire binds (`main_signature`), --help (`format_help`), the flags
reference docs/flags.md (`python -m runner.input.flags` writes it; a test checks it is current) and
the fingerprint (runner/input/config.py).

python-fire parses the command line, but it only rejects a leftover argument after `main()` has
returned, and `main()` never returns (it exits with the run's code). So the command line is
checked here first, with fire's own grammar: `--flag=value`, `--flag value`, a bare `--flag`
(true), `--noflag` (false) and `--hyphenated-name`. A misspelled flag then stops the run before
anything starts, instead of being ignored while a paid model runs with the default.
"""

from __future__ import annotations

import difflib
import inspect
import re
import types
from dataclasses import dataclass
from typing import Annotated, Literal, Union, get_args, get_origin

from runner.input.config import Commands, RequestFlags, RunConfig
from runner.input.flag_declaration import GROUPS, NEW, ORIGINAL, declaration, fingerprint_key
from tools.settings import ToolSettings

__all__ = ["NEW", "ORIGINAL", "FLAGS", "FLAG_NAMES", "SECTIONS", "Flag"]

# Where a flag's value goes: the model whose field declares it.
SECTIONS = {
    "run": RunConfig,  # the run's configuration
    "tools": ToolSettings,  # RunConfig.tools, with the environment backends' sections
    "request": RequestFlags,  # flags that build another field (build_config)
    "command": Commands,  # what this invocation does (resume, report, ...)
}


@dataclass(frozen=True)
class Flag:
    name: str
    section: str  # a key of SECTIONS
    group: str  # the --help and docs/flags.md group it is listed in
    help: str  # one line
    kind: type  # how the command line reads its value: str, int, float or bool
    default: str  # as shown to the user ("" when there is none, "required")
    fingerprint: bool  # a change of it makes --resume refuse (without --allow_config_change)
    details: str = ""  # docs/flags.md's text after the help line


def _kind(annotation) -> type:
    """str, int, float or bool: what the value of a field of this type is typed as."""
    plain = _plain_types(annotation)
    for kind in (bool, int, float):
        if kind in plain:
            return kind
    return str  # text, a choice (Literal), a secret, a comma list


def _plain_types(annotation) -> set:
    if get_origin(annotation) is Annotated:  # StrictInt is Annotated[int, Strict()]
        return _plain_types(get_args(annotation)[0])
    if get_origin(annotation) is Literal:
        return {str}
    if get_origin(annotation) in (Union, types.UnionType):
        return {t for arg in get_args(annotation) for t in _plain_types(arg)}
    return {annotation}


def _shown_default(field, declared: str | None) -> str:
    if declared is not None:
        return declared
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    if value is None:
        return ""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return f"{value:g}"
    return ",".join(value) if isinstance(value, list) else str(value)  # as the flag is written


def _fingerprinted(model, name: str, sets: str | None) -> bool:
    target = model.model_fields.get(sets or name)
    if target is None:  # `sets` names a RunConfig field (the request flags)
        target = RunConfig.model_fields[sets]
    return bool(fingerprint_key(target))


def _declared_flags() -> list[Flag]:
    flags = []
    for section, model in SECTIONS.items():
        for name, field in model.model_fields.items():
            declared = declaration(field)
            if declared is None:
                continue
            kind = {"str": str, "int": int, "float": float, "bool": bool}.get(declared["kind"]) or _kind(field.annotation)
            flags.append(Flag(name, section, declared["group"], declared["help"], kind,
                              _shown_default(field, declared["shown"]), _fingerprinted(model, name, declared["sets"]),
                              declared["details"]))
    duplicated = {f.name for f in flags if [g.name for g in flags].count(f.name) > 1}
    if duplicated:
        raise RuntimeError(f"flags declared twice: {sorted(duplicated)}")
    return [f for group in GROUPS for f in flags if f.group == group]


FLAGS: list[Flag] = _declared_flags()
FLAG_NAMES = [flag.name for flag in FLAGS]
_BY_NAME = {flag.name: flag for flag in FLAGS}


def flag_named(name: str) -> Flag:
    return _BY_NAME[name]


def text_flags() -> set[str]:
    """The flags whose value is text: fire must hand them over as typed (a run named 1e3 is not the
    number 1000.0, an API key of digits is not an int)."""
    return {flag.name for flag in FLAGS if flag.kind is str}


def bool_flags() -> set[str]:
    """The flags that are on or off (their value must be one of BOOL_WORDS)."""
    return {flag.name for flag in FLAGS if flag.kind is bool}


def main_signature() -> inspect.Signature:
    """main()'s parameters as fire sees them: every flag, keyword-only, None when not given (the
    field's default applies then)."""
    return inspect.Signature([inspect.Parameter(flag.name, inspect.Parameter.KEYWORD_ONLY, default=None,
                                                annotation=flag.kind) for flag in FLAGS])


def by_section(values: dict) -> dict[str, dict]:
    """The flags' values split by the section they go to; a name that is no flag raises TypeError."""
    sections: dict[str, dict] = {section: {} for section in SECTIONS}
    for name, value in values.items():
        flag = _BY_NAME.get(name)
        if flag is None:
            raise TypeError(f"unknown flag {name!r}")
        sections[flag.section][name] = value
    return sections


USAGE = (
    "usage: python batch_runner.py --dataset_file=FILE --batch_size=N --run_name=NAME [--flag=value ...]\n\n"
    "Run every prompt of a JSONL dataset through a tool-using agent and collect ShareGPT trajectories.\n"
    "Flags are written --flag=value or --flag value; a bare --flag is true and --noflag false;\n"
    "an on/off flag's value is true/false, yes/no, on/off or 1/0.\n"
    "docs/flags.md explains each flag further.\n"
    "Exit codes: 0 done, 1 bad input, 2 rows left, 3 provider stop, 4 cost budget, 5 storage error, 130 interrupted."
)


class FlagError(ValueError):
    """The command line names a flag that does not exist, or gives a text flag no value."""


def format_help() -> str:
    width = max(len(name) for name in FLAG_NAMES) + 4
    lines = [USAGE]
    for group in GROUPS:
        lines.append(f"\n{group}:")
        for flag in FLAGS:
            if flag.group == group:
                shown = flag.default
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


_REFERENCE_INTRO = """\
# Flags

`python batch_runner.py --flag=value ...`. This page is generated from the flags' declarations
(`python -m runner.input.flags > docs/flags.md`; a test checks that it is current), and
`python batch_runner.py --help` prints the same list, one line a flag.

How flags are written: `--flag value`, `--flag=value`, a bare boolean `--flag`, `--noflag` and
`--hyphenated-name` all work. A flag that does not exist stops the run before anything starts
(exit 1, naming the closest real flag), so a typo never runs a paid model with a default; so does a
stray word that is not a flag's value (positional arguments are not used), and a lone `--` (fire
would take what follows as its own options, and the run would ignore them). A boolean flag is a
bare `--flag`, `--noflag`, or `--flag=VALUE` with VALUE one of true/false, yes/no, on/off, 1/0 (any
case); any other value is refused (exit 1, naming the flag), so `--overwrite=no` is off. Text flags
(`--run_name`, `--model`, `--api_key`, ...) are taken as typed: `--run_name=1e3` writes to
`data/1e3`.

*Fingerprint*: changing the flag changes what a row contains, so `--resume` refuses the change
(naming the old and the new value) unless `--allow_config_change` is given. A fingerprinted flag
left out on `--resume` keeps the value config.json records, as do `--dataset_file`,
`--batch_size`, `--samples_per_prompt`, `--stop_after_passing` and `--keep`: `--run_name=NAME --resume` is enough (the API key still comes from the environment
or `--api_key`: it is never recorded). The other flags are each invocation's own.
"""


def flags_reference() -> str:
    """docs/flags.md: every flag, by group, with its default and whether it is fingerprinted."""
    lines = [_REFERENCE_INTRO]
    for group in GROUPS:
        lines += [f"## {group}", "", "| Flag | Default | Fingerprint | Meaning |", "|---|---|---|---|"]
        for flag in FLAGS:
            if flag.group == group:
                default = flag.default if flag.default in ("", "required") else f"`{flag.default}`"
                meaning = f"{flag.help} {flag.details}".strip().replace("|", "\\|").replace("<", "\\<")
                lines.append(f"| `--{flag.name}` | {default} | {'yes' if flag.fingerprint else ''} | {meaning} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(flags_reference(), end="")
