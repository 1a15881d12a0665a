"""The error a full or broken disk raises, in a module of its own: the CLI catches it at start-up,
and importing the store (with the record models) for that alone would slow down every command."""

from __future__ import annotations

from pathlib import Path


class StorageError(Exception):
    """The run directory cannot be written (disk full, quota, read-only, I/O error)."""

    def __init__(self, path: Path | str, error: OSError):
        self.path = Path(path)
        self.error = error
        super().__init__(f"cannot write {self.path}: {error.strerror or error}")
