"""Reading and validating the input JSONL, and the identity of each row.

The file is streamed twice instead of held in memory: `scan_dataset` validates every line before
any model call and maps each row key to its index; `iter_rows` yields the rows again for dispatch.

Row identity (`row_key`) is a hash of what the row asks for (prompt, image, cwd) plus the row's
occurrence number among identical rows: duplicates stay distinct rows, and a reordered or
extended dataset still resumes correctly.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import orjson
from pydantic import BaseModel, ConfigDict, StrictInt, StrictStr, ValidationError, field_validator


class DatasetError(Exception):
    """The dataset cannot be used; the message names the file (and lines) at fault."""


class DatasetChanged(DatasetError):
    """The file no longer reads as it did when it was scanned: rewritten or edited in place."""


class DatasetRow(BaseModel):
    """One line of the input. Unknown fields are allowed and ignored (an `id` is carried along)."""

    model_config = ConfigDict(extra="allow")

    prompt: StrictStr
    image: StrictStr | None = None
    docker_image: StrictStr | None = None
    cwd: StrictStr | None = None
    id: StrictStr | StrictInt | None = None  # an integer id is carried as text ("7")
    # What the scorers (--scorer) read: the expected answer(s), a shell command that checks the
    # sample's environment, and what a judge model is told to look for.
    target: StrictStr | list[StrictStr] | None = None
    verify: StrictStr | None = None
    rubric: StrictStr | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt_not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must not be empty")
        return value

    @field_validator("target")
    @classmethod
    def _target_not_blank(cls, value: str | list[str] | None) -> str | list[str] | None:
        texts = [value] if isinstance(value, str) else value or []
        if value is not None and (not texts or not all(text.strip() for text in texts)):
            raise ValueError("must be a non-empty string or a non-empty list of non-empty strings")
        return value

    def targets(self) -> tuple[str, ...]:
        """The target as a tuple of answers (empty when the row has none)."""
        if self.target is None:
            return ()
        return (self.target,) if isinstance(self.target, str) else tuple(self.target)


@dataclass(frozen=True)
class Row:
    index: int  # 0-based position among the valid rows (the original's prompt_index)
    key: str
    prompt: str
    image: str | None
    cwd: str | None
    id: str  # the row's `id` as text ("" when it has none): one type in every output row
    targets: tuple[str, ...] = ()  # the row's `target` (one or more expected answers)
    verify: str | None = None  # the row's `verify` command
    rubric: str | None = None  # the row's `rubric` for a judge
    line: bytes = b""  # the row's line as written (a Python scorer gets it parsed, as `row`)


@dataclass
class DatasetScan:
    path: Path
    key_to_index: dict[str, int] = field(default_factory=dict)
    ids: dict[str, str] = field(default_factory=dict)  # row key -> id, for the rows that have one
    errors: list[tuple[int, str]] = field(default_factory=list)  # (line number, reason)
    duplicate_ids: list[tuple[int, str, int]] = field(default_factory=list)  # (line, id, the id's first line)
    images: set[str] = field(default_factory=set)
    rows_without_image: int = 0  # rows that take the run's default image, if any
    mtime_ns: int = 0  # the file as it was when the scan started (to see whether it changed since)
    size: int = 0

    @property
    def rows(self) -> int:
        return len(self.key_to_index)


_JSON_TYPES = {dict: "an object", list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean"}


def json_type(value: Any) -> str:
    """What the user wrote, in JSON's words (null, not NoneType)."""
    return "null" if value is None else _JSON_TYPES.get(type(value), type(value).__name__)


def _describe(error: ValidationError) -> str:
    first = error.errors()[0]
    where = str(first["loc"][0]) if first["loc"] else "row"
    kind = first["type"]
    if kind == "missing":
        return f"missing '{where}' field"
    if kind.endswith("_type"):
        wanted = {"id": "a string or an integer", "target": "a string or a list of strings"}.get(where, "a string")
        return f"'{where}' must be {wanted}, got {json_type(first.get('input'))}"
    return f"'{where}' {first['msg'].removeprefix('Value error, ')}"


def _parse_line(raw: bytes) -> tuple[DatasetRow | None, str | None]:
    """The row, or why the line is not one. Valid lines take pydantic's one-pass JSON validation."""
    try:
        return DatasetRow.model_validate_json(raw), None
    except ValidationError:
        return None, _explain(raw)


def _explain(raw: bytes) -> str:
    """Why a line is invalid, in the user's terms (the slow path, for bad lines only)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        return f"invalid UTF-8 at byte {err.start}"
    try:
        value: Any = orjson.loads(text)
    except orjson.JSONDecodeError as err:
        return f"invalid JSON ({err})"
    if not isinstance(value, dict):
        return f"not a JSON object (got {json_type(value)})"
    try:
        DatasetRow.model_validate(value)
    except ValidationError as err:
        return _describe(err)
    return "invalid row"  # unreachable unless the two validations disagree


def content_hash(prompt: str, image: str | None, cwd: str | None) -> str:
    blob = orjson.dumps({"cwd": cwd, "image": image, "prompt": prompt}, option=orjson.OPT_SORT_KEYS)
    return hashlib.sha256(blob).hexdigest()[:24]


_BOM = b"\xef\xbb\xbf"
CwdRule = Callable[[str], "str | None"]  # a row's cwd -> why the backend cannot use it, or None
# A row -> why the run cannot use it (a field its scorers need is missing), or None
RowRule = Callable[[DatasetRow], "str | None"]
NO_IMAGE = "no 'image' (or 'docker_image') field: --terminal_env=docker needs one per row, or pass --docker_image"


def _lines(path: Path) -> Iterator[tuple[int, bytes]]:
    with open(path, "rb") as handle:
        for line_no, raw in enumerate(handle, start=1):
            if line_no == 1:
                raw = raw.removeprefix(_BOM)  # editors on Windows start UTF-8 files with one
            raw = raw.strip()
            if raw:
                yield line_no, raw


def _walk(
    path: Path, max_samples: int | None, require_image: bool = False, cwd_error: CwdRule | None = None,
    row_error: RowRule | None = None,
) -> Iterator[tuple[int, bytes, DatasetRow | None, str | None, str | None]]:
    """(line_no, raw, row, error, key) for every non-blank line up to max_samples valid rows.
    With `require_image`, a row that names no image is invalid (it could only fail later);
    `cwd_error` is the backend's rule for a row's cwd (Backend.cwd_error): a cwd it refuses is too;
    `row_error` the scorers' rule (a field they need)."""
    occurrences: dict[str, int] = {}
    valid = 0
    for line_no, raw in _lines(path):
        row, error = _parse_line(raw)
        if row is not None and require_image and not (row.image or row.docker_image):
            row, error = None, NO_IMAGE
        if row is not None and row.cwd is not None and cwd_error and (problem := cwd_error(row.cwd)):
            row, error = None, problem
        if row is not None and row_error and (problem := row_error(row)):
            row, error = None, problem
        key = None
        if row is not None:
            if max_samples and valid >= max_samples:
                return
            digest = content_hash(row.prompt, row.image or row.docker_image, row.cwd)
            occurrence = occurrences.get(digest, 0)
            occurrences[digest] = occurrence + 1
            key = f"{digest}-{occurrence}"
            valid += 1
        yield line_no, raw, row, error, key


def scan_dataset(
    path: str | Path, max_samples: int | None = None, require_image: bool = False, cwd_error: CwdRule | None = None,
    row_error: RowRule | None = None,
) -> DatasetScan:
    """Validate the whole file. Raises DatasetError if it is missing or has no valid row.
    `require_image`: every row must name its container image (docker, no --docker_image)."""
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"Dataset file not found: {path}")
    stat = path.stat()
    scan = DatasetScan(path=path, mtime_ns=stat.st_mtime_ns, size=stat.st_size)
    first_line_of: dict[str, int] = {}  # id -> the line that has it first
    for line_no, _raw, row, error, key in _walk(path, max_samples, require_image, cwd_error, row_error):
        if row is None:
            scan.errors.append((line_no, error or "invalid"))
            continue
        scan.key_to_index[key] = len(scan.key_to_index)
        if row.id is not None:
            row_id = str(row.id)  # 7 and "7" are one id: every output carries it as text
            scan.ids[key] = row_id
            if row_id in first_line_of:
                scan.duplicate_ids.append((line_no, row_id, first_line_of[row_id]))
            else:
                first_line_of[row_id] = line_no
        image = row.image or row.docker_image
        if image:
            scan.images.add(image)
        else:
            scan.rows_without_image += 1
    if not scan.key_to_index and not scan.errors:
        raise DatasetError(f"{path}: the dataset is empty (no JSON lines)")
    return scan


def iter_rows(
    path: str | Path, max_samples: int | None = None, require_image: bool = False, cwd_error: CwdRule | None = None,
    row_error: RowRule | None = None, scanned: dict[str, int] | None = None,
) -> Iterator[Row]:
    """The valid rows in file order (invalid lines are left out: scan_dataset reported them).

    `scanned` is the scan's row key -> index. The file is read again lazily, so it may have been
    rewritten under the open handle since the scan, which would then yield rows it already yielded
    (under a new occurrence number) or rows out of place. Every row must therefore be the one the
    scan found at its position, or a new row after the scanned ones (rows appended meanwhile);
    anything else raises DatasetChanged before the row is yielded."""
    index = 0
    for line_no, raw, row, _error, key in _walk(Path(path), max_samples, require_image, cwd_error, row_error):
        if row is None:
            continue
        if scanned is not None and scanned.get(key, index if index >= len(scanned) else -1) != index:
            raise DatasetChanged(f"{path}:{line_no}: the file changed during the run (this line is not the row "
                                 f"that was there when the run started)")
        yield Row(
            index=index,
            key=key,
            prompt=row.prompt,
            image=row.image or row.docker_image,
            cwd=row.cwd,
            id="" if row.id is None else str(row.id),
            targets=row.targets(),
            verify=row.verify,
            rubric=row.rubric,
            line=raw,
        )
        index += 1
