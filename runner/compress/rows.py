"""The input: a JSONL file or a directory of them, read into rows whose `conversations` (when
they have one) are checked by the record model; bad input is named by file, line and field."""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from pathlib import Path

import orjson

from runner.storage.records import RecordError, read_conversation


class InputError(ValueError):
    """Bad input: one line naming the file, the line and the field."""


@dataclass
class InputRow:
    line: int  # 1-based line of the input file
    raw: bytes  # the line as read (a row without conversations is written back as it is)
    data: dict
    turns: list[dict] | None  # the validated conversations; None: the row has none

    @property
    def key(self) -> str:
        """The hash of the line: what an earlier compression of this very row is found by."""
        return hashlib.sha256(self.raw).hexdigest()[:32]


def input_pairs(input_path: str, output: str | None) -> list[tuple[Path, Path]]:
    """(input file, output file) for a file, or for each *.jsonl of a directory."""
    source = Path(input_path)
    if source.is_dir():
        target = Path(output) if output else _sibling(source, "_compressed")
        files = sorted(path for path in source.glob("*.jsonl") if path.is_file())
        if not files:
            raise InputError(f"--input={input_path}: the directory holds no *.jsonl file")
        if target.resolve() == source.resolve():
            raise InputError("--output must not be the input directory")
        if target.exists() and not target.is_dir():
            raise InputError(f"--output={output}: is a file; the output of a directory is a directory")
        return [(file, target / file.name) for file in files]
    if not source.is_file():
        raise InputError(f"--input={input_path}: no such file or directory")
    target = Path(output) if output else source.with_name(f"{source.stem}_compressed.jsonl")
    if target.exists() and target.resolve() == source.resolve():
        raise InputError("--output must not be the input file")
    if target.is_dir():  # found now, not after every summary was paid for
        raise InputError(f"--output={output}: is a directory; the output of a file is a file")
    return [(source, target)]


def _sibling(folder: Path, suffix: str) -> Path:
    """<folder><suffix> beside the folder; `.` and `..` are named by what they resolve to."""
    if folder.name in ("", ".", ".."):
        folder = folder.resolve()
    return folder.with_name(folder.name + suffix)


def read_rows(path: Path) -> tuple[list[InputRow], str]:
    """The rows of one JSONL file (blank lines skipped) and the hash of its bytes."""
    data = path.read_bytes()
    rows = []
    for number, raw in enumerate(data.split(b"\n"), start=1):
        raw = raw.rstrip(b"\r")
        if not raw.strip():
            continue
        try:
            row = orjson.loads(raw)
        except orjson.JSONDecodeError as err:
            raise InputError(f"{path} line {number}: not valid JSON ({err})") from None
        if not isinstance(row, dict):
            raise InputError(f"{path} line {number}: a row must be a JSON object")
        turns = None
        if "conversations" in row:
            try:
                turns = read_conversation(row["conversations"])
            except RecordError as err:
                raise InputError(f"{path} line {number}: {err}") from None
        rows.append(InputRow(number, raw, row, turns))
    return rows, hashlib.sha256(data).hexdigest()


def sample(rows: list[InputRow], percent: float | None, seed: int) -> list[InputRow]:
    """--sample_percent: that share of the rows, drawn with --seed, kept in input order."""
    if percent is None or percent >= 100:
        return rows
    count = max(1, round(len(rows) * percent / 100)) if rows else 0
    chosen = sorted(random.Random(seed).sample(range(len(rows)), count))
    return [rows[i] for i in chosen]
