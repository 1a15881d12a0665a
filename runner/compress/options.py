"""The compressor's options: each default defined once, on its field; `--config` gives a YAML
mapping with the same keys, and a flag given on the command line wins over the file."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, SecretStr, StrictFloat, StrictInt, ValidationError

from runner.compress.tokens import ESTIMATE


class CompressOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input: str
    output: str | None = None  # default: <name>_compressed.jsonl beside a file, <dir>_compressed/ for a directory
    target_max_tokens: StrictInt = Field(default=15250, ge=1)
    tokenizer: str = ESTIMATE
    sample_percent: StrictFloat | StrictInt | None = Field(default=None, gt=0, le=100)
    seed: StrictInt = Field(default=42, ge=0)
    dry_run: bool = False
    base_url: str = "https://openrouter.ai/api/v1"
    summary_model: str = "google/gemini-2.5-flash"
    api_key: SecretStr | None = Field(default=None, exclude=True)
    max_concurrent_requests: StrictInt = Field(default=50, ge=1)
    per_trajectory_timeout: StrictFloat | StrictInt = Field(default=300.0, gt=0)
    protect_last_n_turns: StrictInt = Field(default=4, ge=0)
    summary_target_tokens: StrictInt = Field(default=750, ge=1)
    resume: bool = False

    def fingerprint_fields(self) -> dict:
        """What changes a row's output: a resumed compression must have the same."""
        fields = {name: getattr(self, name) for name in ("target_max_tokens", "tokenizer", "sample_percent", "seed",
                                                          "base_url", "summary_model", "protect_last_n_turns",
                                                          "summary_target_tokens")}
        return {**fields, "tokenizer": tokenizer_identity(self.tokenizer)}


def tokenizer_identity(spec: str) -> str:
    """A local tokenizer by its absolute path (so `tok` and `../tok`, or the same folder named from
    another directory, are one tokenizer); a hub name or `estimate` as given."""
    path = Path(os.path.expanduser(spec))
    return str(path.resolve()) if spec != ESTIMATE and path.exists() else spec


def same_fingerprint(saved, current: dict) -> bool:
    """Is `saved` (read from a journal or a metrics JSON) the fingerprint `current`? A local
    tokenizer saved as given (relative, before tokenizer_identity) is read from here."""
    if not isinstance(saved, dict):
        return False
    if isinstance(saved.get("tokenizer"), str):
        saved = {**saved, "tokenizer": tokenizer_identity(saved["tokenizer"])}
    return saved == current


class OptionsError(ValueError):
    """A bad flag or config file: one line, exit 1."""


# Keys a config file may not set: the key stays out of files, the run's mode stays on the command line.
_NOT_IN_FILE = ("api_key", "config", "resume", "dry_run")


def read_config_file(path: str) -> dict:
    try:
        import yaml
    except ImportError:
        raise OptionsError(f"--config={path} needs PyYAML: pip install -e '.[compress]'") from None

    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as err:
        raise OptionsError(f"--config={path}: cannot read it: {err.strerror or err}") from None
    except yaml.YAMLError as err:
        where = getattr(err, "problem_mark", None)
        line = f" line {where.line + 1}" if where is not None else ""
        raise OptionsError(f"--config={path}{line}: not valid YAML ({getattr(err, 'problem', None) or err})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise OptionsError(f"--config={path}: must be a mapping of option: value")
    for key in data:
        if key in _NOT_IN_FILE:
            raise OptionsError(f"--config={path}: {key} is given on the command line only")
        if key not in CompressOptions.model_fields:
            raise OptionsError(f"--config={path}: unknown key {key!r} (the keys are the flags' names)")
    return data


def build_options(flags: dict[str, Any], config_file: str | None) -> CompressOptions:
    """The options from the file (if any), then the flags given (None: not given)."""
    values = read_config_file(config_file) if config_file else {}
    source = {key: f"--config={config_file}: {key}" for key in values}
    given = {key: value for key, value in flags.items() if value is not None}
    values.update(given)
    for key in given:
        source[key] = f"--{key}"
    try:
        return CompressOptions(**values)
    except ValidationError as err:
        first = err.errors(include_url=False)[0]
        key = str(first["loc"][0]) if first["loc"] else "input"
        name = source.get(key, f"--{key}")
        if first["type"] == "missing":
            raise OptionsError(f"--{key} is required") from None
        raise OptionsError(f"{name}: {first['msg'].lower()} (got {first.get('input')!r})") from None
