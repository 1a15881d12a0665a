"""How a flag is declared: `flag(...)` on the config field it sets.

The field gives the flag its name, type, default and checks; `flag` adds what the command line and
its documentation need: the one-line help, the --help group, whether a change of the flag changes a
row's fingerprint (so `--resume` refuses it), and, when --help should say more than the default's
value, how the default is shown. runner/input/flags.py collects the declarations.

A field that no flag sets but that the fingerprint covers is declared with `fingerprinted(...)`.
This module imports only pydantic: the config models import it.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field
from pydantic_core import PydanticUndefined

ORIGINAL = "The original's flags"
NEW = "New flags"
GROUPS = (ORIGINAL, NEW)  # --help and docs/flags.md list the flags in these groups, in this order

FLAG = "flag"  # the key of a flag's declaration in the field's json_schema_extra
FINGERPRINT = "fingerprint"  # True: a key of the fingerprint; a text: a key inside that one
FINGERPRINT_IF = "fingerprint_if"  # the field that must be set for this one to count in the fingerprint


def flag(default: Any = PydanticUndefined, *, help: str, group: str = NEW, fingerprint: bool | str = False,
         fingerprint_if: str | None = None, shown: str | None = None, kind: type | None = None,
         sets: str | None = None, details: str = "", **field: Any):
    """A pydantic Field that is also a command-line flag named like the field.

    fingerprint: True when the flag's value changes what a row contains (a key of the fingerprint),
        or the name of the fingerprint key it is grouped under (tools' backends: "tool_backends").
    fingerprint_if: the field that must be set (true, non-empty) for this one to count in the
        fingerprint (the scorers' options count only in a run that has scorers).
    shown: the default as --help shows it, when not the default's own value ("CPU count").
    kind: how the command line reads the value (str, int, float or bool) when the field's type
        does not say it (a comma list read as text).
    sets: for a flag that only shapes another field (--providers_order: `provider`), that field;
        the flag changes the fingerprint when that field does.
    details: what docs/flags.md says after the help line (markdown), when one line is not enough.
    """
    if group not in GROUPS:
        raise ValueError(f"unknown flag group {group!r}: one of {GROUPS}")
    declaration = {"help": help, "group": group, "shown": shown, "kind": kind.__name__ if kind else None, "sets": sets,
                   "details": details}
    extra: dict[str, Any] = {FLAG: declaration}
    if fingerprint:
        extra[FINGERPRINT] = fingerprint
    if fingerprint_if:
        extra[FINGERPRINT_IF] = fingerprint_if
    return Field(default, description=help, json_schema_extra=extra, **field)


def fingerprinted(default: Any = PydanticUndefined, *, under: str | None = None, **field: Any):
    """A pydantic Field (set by no flag) whose value is part of the fingerprint."""
    return Field(default, json_schema_extra={FINGERPRINT: under or True}, **field)


def declaration(field) -> dict | None:
    """The flag a pydantic FieldInfo declares, or None."""
    extra = field.json_schema_extra
    return extra.get(FLAG) if isinstance(extra, dict) else None


def fingerprint_key(field) -> bool | str:
    """How the field counts in the fingerprint: False, True, or the key it is grouped under."""
    extra = field.json_schema_extra
    return extra.get(FINGERPRINT, False) if isinstance(extra, dict) else False


def fingerprint_condition(field) -> str | None:
    """The field that must be set for this one to count in the fingerprint, or None (always)."""
    extra = field.json_schema_extra
    return extra.get(FINGERPRINT_IF) if isinstance(extra, dict) else None
