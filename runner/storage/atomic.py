"""Writing the run directory's files: private by default, replaced atomically."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import orjson


def private_opener(path: str, flags: int) -> int:
    """`open(..., opener=private_opener)`: a file the runner creates is readable by its owner only
    (rows may hold whatever the prompts and tools saw); an existing file keeps its mode."""
    return os.open(path, flags, 0o600)


def keep_mode(tmp: str | Path, target: Path) -> None:
    """A replacement written to a private temp file takes the mode of the file it replaces."""
    if target.exists():
        os.chmod(tmp, target.stat().st_mode & 0o777)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write via a private temp file in the same folder, fsync, then rename over the target."""
    atomic_write_lines(path, (data,))


def atomic_write_lines(path: Path, chunks) -> None:
    """atomic_write_bytes for content streamed in chunks (the merge never holds the whole file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}_", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            for chunk in chunks:
                handle.write(chunk)
            handle.flush()
            os.fsync(handle.fileno())
        keep_mode(tmp, path)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: Path, value: Any) -> None:
    atomic_write_bytes(path, orjson.dumps(value, option=orjson.OPT_INDENT_2) + b"\n")
