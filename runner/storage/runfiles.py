"""The run directory's JSON files, each with its model and its one reader (and writer).

- config.json (`ConfigFile`): the run's configuration, its fingerprint and every invocation;
- statistics.json (`StatisticsFile`): the end-of-run figures (runner/output/finalize.py makes them);
- status.json and status_history.jsonl (`StatusFile`): the live status (runner/output/status.py);
- checkpoint.json (`CheckpointFile`): the store's cache of what the batch files say.

The batch lines have theirs in records.py. Readers are lenient: a file that cannot be read, or a
field of the wrong type (an older version, a hand edit), reads as missing, never as a crash; the
models keep unknown fields (`extra="allow"`), so a file written by a newer version reads back whole.
A new field of one of these files is declared on its model here.
"""

from __future__ import annotations

import os
from pathlib import Path
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import orjson
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError

from runner.storage.atomic import atomic_write_bytes, atomic_write_json, atomic_write_lines, private_opener

CONFIG_FILE = "config.json"
STATISTICS_FILE = "statistics.json"
STATUS_FILE = "status.json"
STATUS_HISTORY_FILE = "status_history.jsonl"
CHECKPOINT_FILE = "checkpoint.json"


class _File(BaseModel):
    model_config = ConfigDict(extra="allow")
    _data: dict = PrivateAttr(default_factory=dict)

    @property
    def data(self) -> dict:
        """The file as it was read (every field, in its order): what a reader shows whole."""
        return self._data

    def as_json(self) -> dict:
        """The fields given or read (defaults not added), for writing the file back."""
        return self.model_dump(mode="json", exclude_unset=True)


M = TypeVar("M", bound=_File)


def _lenient(model: type[M], data: Any) -> M | None:
    """`data` as `model`, leaving out the top-level fields that do not fit (None: not an object)."""
    if not isinstance(data, dict):
        return None
    original, data = data, dict(data)
    for _ in range(len(data) + 1):
        try:
            parsed = model.model_validate(data)
            parsed._data = original
            return parsed
        except ValidationError as err:
            bad = {e["loc"][0] for e in err.errors() if e["loc"]}
            if not bad & data.keys():
                return None
            for name in bad:
                data.pop(name, None)
    return None


def _read(path: Path) -> Any:
    try:
        return orjson.loads(path.read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return None


# --- config.json ------------------------------------------------------------------------------


class Invocation(_File):
    run_id: str | None = None
    started_at: str | None = None
    ended_at: str | None = None


class ConfigFile(_File):
    config: dict[str, Any] = Field(default_factory=dict)  # RunConfig.public_dict(): no secret
    fingerprint: str = ""
    fingerprint_fields: dict[str, Any] = Field(default_factory=dict)
    run_id: str = ""
    created_at: str | None = None
    updated_at: str | None = None
    invocations: list[Invocation] = Field(default_factory=list)

    def setting(self, name: str, default: Any = None) -> Any:
        """One recorded setting of the run (a RunConfig field, or a tool setting under `tools`)."""
        return self.config.get(name, default)


def has_config(run_dir: Path) -> bool:
    return (run_dir / CONFIG_FILE).exists()


def read_config(run_dir: Path) -> ConfigFile | None:
    """config.json, or None when there is none or it cannot be read."""
    data = _read(run_dir / CONFIG_FILE)
    if isinstance(data, dict) and isinstance(data.get("invocations"), list):
        data = {**data, "invocations": [i for i in data["invocations"] if isinstance(i, dict)]}
    return _lenient(ConfigFile, data)


def write_config(run_dir: Path, config: ConfigFile) -> None:
    atomic_write_json(run_dir / CONFIG_FILE, config.as_json())


def record_invocation_end(run_dir: Path, run_id: str, ended_at: str) -> list[Invocation]:
    """Stamp the end of the invocation `run_id` in config.json; returns every invocation there."""
    saved = read_config(run_dir)
    if saved is None:
        return []
    for item in saved.invocations:
        if item.run_id == run_id:
            item.ended_at = ended_at
    write_config(run_dir, saved)
    return saved.invocations


# --- statistics.json --------------------------------------------------------------------------


class StatisticsFile(_File):
    """The fields a reader of an earlier statistics.json uses; the others are kept as they are."""

    run_name: str | None = None
    distribution: str | None = None
    batch_size: int | None = None
    model: str | None = None
    rows_this_run: int | None = None
    outcome: dict[str, Any] | None = None  # how the last invocation ended (runner/outcome.py)


def read_statistics(run_dir: Path) -> StatisticsFile | None:
    return _lenient(StatisticsFile, _read(run_dir / STATISTICS_FILE))


def write_statistics(run_dir: Path, stats: dict) -> dict:
    atomic_write_json(run_dir / STATISTICS_FILE, stats)
    return stats


# --- status.json, status_history.jsonl --------------------------------------------------------


class StatusFile(_File):
    """The fields of a status that its readers use (the report's list of invocations)."""

    state: str | None = None
    started_at: str | None = None
    updated_at: str | None = None
    rows: dict[str, Any] = Field(default_factory=dict)
    spend: dict[str, Any] = Field(default_factory=dict)
    forecast: dict[str, Any] | None = None
    budget: dict[str, Any] | None = None


def write_status(run_dir: Path, status: dict) -> None:
    atomic_write_bytes(run_dir / STATUS_FILE, orjson.dumps(status, option=orjson.OPT_INDENT_2) + b"\n")


def read_status(run_dir: Path) -> StatusFile | None:
    return _lenient(StatusFile, _read(run_dir / STATUS_FILE))


def append_status_history(run_dir: Path, status: dict) -> None:
    with open(run_dir / STATUS_HISTORY_FILE, "ab", opener=private_opener) as handle:
        handle.write(orjson.dumps(status) + b"\n")
        handle.flush()
        os.fsync(handle.fileno())


def read_status_history(run_dir: Path) -> list[StatusFile]:
    """The last status of each invocation; a torn last line (a crash) is skipped."""
    try:
        lines = (run_dir / STATUS_HISTORY_FILE).read_bytes().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            status = _lenient(StatusFile, orjson.loads(line))
        except orjson.JSONDecodeError:
            continue
        if status is not None:
            out.append(status)
    return out


# --- checkpoint.json --------------------------------------------------------------------------


class CheckpointFile(_File):
    """What the cache holds. Its large parts (a row per dataset row) are typed loosely on purpose:
    validating a million entries would cost a resume more than reading the batch files' tails."""

    run_name: str
    completed_prompts: list[Any] = Field(default_factory=list)
    batch_stats: dict[str, Any] = Field(default_factory=dict)
    last_updated: str | None = None
    files: dict[str, int] = Field(default_factory=dict)  # batch file -> size the cache covers
    # key -> [outcome, prompt_index, failures] (+ passed, for a scored sample); None: no cache of rows
    rows: dict[str, Any] | None = None
    spend: dict[str, Any] | None = None  # bucket -> Spend.cache_form()


class CheckpointError(ValueError):
    """checkpoint.json exists but cannot be read."""


def read_checkpoint(path: Path) -> CheckpointFile | None:
    """checkpoint.json: None when there is none or it does not have the checkpoint's shape;
    CheckpointError when it cannot be parsed."""
    if not path.exists():
        return None
    try:
        data = orjson.loads(path.read_bytes())
    except (OSError, orjson.JSONDecodeError) as err:
        raise CheckpointError(str(err)) from None
    try:
        return CheckpointFile.model_validate(data) if isinstance(data, dict) else None
    except ValidationError:
        return None


def write_checkpoint(path: Path, checkpoint: dict) -> None:
    """checkpoint.json, streamed: a value given as `Streamed` (the rows, a million at 1,000,000
    rows) is serialised a few thousand items at a time, never built whole in memory. The bytes
    are those of the whole dict serialised at once (two-space indent)."""
    atomic_write_lines(path, indented_json_chunks(checkpoint))


class Streamed:
    """A value of a top-level JSON object made by `items()` as it is written: an iterator of its
    items (a list), or of its (key, value) pairs (an object, `pairs=True`). Iterated like the list
    or the object's keys."""

    def __init__(self, items: Callable[[], Iterator], *, pairs: bool = False):
        self.items = items
        self.pairs = pairs

    def __iter__(self) -> Iterator:
        return (pair[0] for pair in self.items()) if self.pairs else self.items()


_CHUNK = 4096  # items serialised at a time


def indented_json_chunks(value: dict) -> Any:
    """orjson.dumps(value, OPT_INDENT_2) + b"\n", in chunks, with `Streamed` values expanded."""
    yield b"{" if value else b"{}"
    for position, (key, item) in enumerate(value.items()):
        yield (b",\n  " if position else b"\n  ") + orjson.dumps(key) + b": "
        if isinstance(item, Streamed):
            yield from _streamed_chunks(item)
        else:
            yield orjson.dumps(item, option=orjson.OPT_INDENT_2).replace(b"\n", b"\n  ")
    yield b"\n}\n" if value else b"\n"


def _streamed_chunks(value: Streamed) -> Any:
    iterator = value.items()
    first = True
    while True:
        batch = [item for _, item in zip(range(_CHUNK), iterator)]
        if not batch:
            break
        text = orjson.dumps(dict(batch) if value.pairs else batch, option=orjson.OPT_INDENT_2)
        # "[\n  a,\n  b\n]" -> the items one level deeper, as inside the enclosing object
        yield (b"[\n" if not value.pairs else b"{\n") if first else b",\n"
        yield b"  " + text[2:-2].replace(b"\n", b"\n  ")
        first = False
    yield (b"{}" if value.pairs else b"[]") if first else (b"\n  }" if value.pairs else b"\n  ]")
