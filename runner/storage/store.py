"""The run directory: the only code that writes batch files and checkpoint.json.

Invariants:
- a row is committed when its line, ending in a newline, is fsynced in a batch file;
- committed lines are never rewritten; new work goes to new batch files after the existing ones;
- an unterminated last line (a crash mid-write) is moved aside to `<file>.torn` before anything
  else happens, so no new line can ever be glued onto it;
- checkpoint.json is a cache of what the batch files say (rewritten atomically, coalesced); when
  it disagrees with the files, the files win.
"""

from __future__ import annotations

import errno
import os
import re
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from collections.abc import Mapping
from typing import Any, Iterator


from runner.storage.records import (OUTCOME_RANK, LineFields, outcome_of, record_line, row_key_of, stamp_batch,
                                    validate_record)
from runner.storage.errors import StorageError  # noqa: F401  (raised here, caught by the CLI)
from runner.storage.runfiles import CheckpointError, CheckpointFile, Streamed, read_checkpoint, write_checkpoint
from runner.storage.runview import NO_WINNER, SPEND_BUCKETS, RunView, Selection, Spend
from runner.input.secrets import redact_bytes
from runner.storage.atomic import atomic_write_bytes, atomic_write_json, keep_mode, private_opener  # noqa: F401 (their home for callers)
from runner.timestamps import now_iso

BATCH_FILE = re.compile(r"^batch_(\d+)\.jsonl$")
_OUTCOME_NAME = {rank: name for name, rank in OUTCOME_RANK.items()}


# errno values that mean "the disk cannot take this write", not "our bug"
STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.EFBIG})


@contextmanager
def storage_errors(path: Path | str):
    """Turn an OSError of a write to `path` into a StorageError naming it."""
    try:
        yield
    except OSError as err:
        raise StorageError(path, err) from err


def record_outcome(record: dict) -> str:
    return outcome_of(record)


def record_key(record: dict) -> str | None:
    return row_key_of(record)


def batch_files(run_dir: Path) -> list[Path]:
    """Batch files in numeric order (batch_2 before batch_10)."""
    found = [(int(m.group(1)), p) for p in run_dir.iterdir() if (m := BATCH_FILE.match(p.name))]
    return [p for _, p in sorted(found)]


# What the runner writes into a run directory; --overwrite removes these and nothing else.
OWN_FILES = ("checkpoint.json", "statistics.json", "trajectories.jsonl", "config.json", "report.html", "status.json",
             "status_history.jsonl", "rescores.jsonl")
_OWN_FILE = re.compile(
    r"^(batch_\d+\.jsonl(\.torn)?"
    r"|\.spend_[0-9a-zA-Z]+_\d+_\d+\.journal"  # the workers' spend journals (runner/storage/journal.py)
    r"|\.(checkpoint|statistics|trajectories|config|report|status)_[A-Za-z0-9_]+\.tmp)$"  # atomic-write temp files
)


def is_own_name(name: str) -> bool:
    """A file name the runner writes (or appends to) in a run directory."""
    return name in OWN_FILES or bool(_OWN_FILE.match(name))


def own_files(run_dir: Path) -> list[Path]:
    """The files of the run directory the runner itself wrote (never the user's own files)."""
    return [p for p in run_dir.iterdir() if is_own_name(p.name) and p.is_file()]


def is_own_file_of(run_dir: Path, path: Path | str) -> bool:
    """Is `path` (symlinks resolved) one the runner would write in `run_dir`? A dataset kept there
    under such a name would be overwritten or appended to by the run. The lock record counts too."""
    from runner.storage.lock import RECORD_NAME

    target = Path(path).resolve()
    return target.parent == Path(run_dir).resolve() and (is_own_name(target.name) or target.name == RECORD_NAME)


def iter_lines(path: Path, start: int = 0) -> Iterator[tuple[int, bytes]]:
    """(offset, line) for each complete line from `start`; an unterminated tail is not a line."""
    with open(path, "rb") as handle:
        handle.seek(start)
        offset = start
        for line in handle:
            if not line.endswith(b"\n"):
                return
            yield offset, line
            offset += len(line)


class RunStore:
    CHECKPOINT_EVERY = 2.0  # seconds between coalesced checkpoint writes, at least
    # checkpoint.json names every row, so writing it takes longer as rows are done: the next write
    # waits this many times as long as the last one took, so it never costs more than about 5% of
    # the parent's time (it is a cache; the batch files are the truth a resume reads).
    CHECKPOINT_PAUSE_FACTOR = 20.0

    def __init__(self, run_dir: Path, run_name: str, batch_size: int, selection: Selection = Selection()):
        self.run_dir = run_dir
        self.run_name = run_name
        self.batch_size = batch_size
        self.writing = False  # inside commit: a line or the checkpoint is being written
        self.checkpoint_path = run_dir / "checkpoint.json"
        # The store needs no selection among samples (--keep is the merge's): only the filters.
        self.selection = Selection(discard_no_reasoning=selection.discard_no_reasoning)
        # what the batch files say (runner/storage/runview.py), without where each line is: the
        # store only asks whether a row is done and how many attempts it took
        self.view = RunView(tally=False, selection=self.selection, located=False)
        self.file_sizes: dict[str, int] = {}
        self._handle = None
        self._opening: Path | None = None  # the batch file being opened (named if that fails)
        self._synced_size = 0  # bytes of the open batch file known to be fsynced
        self._batch_num = 0
        self._lines_in_batch = 0
        self._last_checkpoint = 0.0
        self._checkpoint_gap = self.CHECKPOINT_EVERY
        self._dirty = False
        self._view_diverged = False  # a failed commit left lines in the view that are not in the files

    # --- reading what is there ------------------------------------------------------------

    def repair_torn_tails(self, log=print) -> int:
        """Move an unterminated last line of each batch file to `<file>.torn`. Returns files fixed."""
        fixed = 0
        for path in batch_files(self.run_dir):
            size = path.stat().st_size
            if size == 0:
                continue
            with open(path, "rb+") as handle:
                handle.seek(size - 1)
                if handle.read(1) == b"\n":
                    continue
                end = _last_newline_end(handle, size)
                handle.seek(end)
                torn = handle.read()
                with open(path.with_name(path.name + ".torn"), "ab", opener=private_opener) as side:
                    side.write(torn + b"\n")
                    side.flush()
                    os.fsync(side.fileno())
                handle.truncate(end)
                handle.flush()
                os.fsync(handle.fileno())
            fixed += 1
            log(f"🩹 {path.name}: moved an unfinished last line ({len(torn)} bytes) to {path.name}.torn")
        return fixed

    def load(self, log=print, units: Mapping[str, int] | None = None) -> None:
        """Rebuild the run view from the batch files, reading only what checkpoint.json has not seen.
        `units` (the dataset's sample keys -> their row's index) sizes the view's columns by the
        dataset, so a row committed costs a few bytes and no key string; any key still counts."""
        checkpoint = self._read_checkpoint(log)
        files = batch_files(self.run_dir)
        cached_sizes = checkpoint.files if checkpoint is not None else {}
        trusted = checkpoint is not None and checkpoint.rows is not None and checkpoint.spend is not None and all(
            (self.run_dir / name).exists() and (self.run_dir / name).stat().st_size >= size
            for name, size in cached_sizes.items()
        )
        self.view = RunView(tally=False, log=log, selection=self.selection, units=units, located=False)
        self.view.files = files
        if trusted:
            try:
                self._restore(checkpoint)
            except (TypeError, ValueError, OverflowError):  # a hand-edited or foreign checkpoint.json
                log("⚠️  checkpoint.json's rows are unreadable; rebuilding them from the batch files")
                trusted = False
                self.view = RunView(tally=False, log=log, selection=self.selection, units=units, located=False)
                self.view.files = files
        for file_no, path in enumerate(files):
            start = cached_sizes.get(path.name, 0) if trusted else 0
            self.file_sizes[path.name] = max(self.view.read_file(file_no, path, start), start)
        self._batch_num = int(BATCH_FILE.match(files[-1].name).group(1)) + 1 if files else 0

    def _restore(self, checkpoint: CheckpointFile) -> None:
        """The view as checkpoint.json caches it: row states, batch statistics and the spend."""
        rows = self.view.rows
        for key, (outcome, index, failures, *passed) in checkpoint.rows.items():
            rank = OUTCOME_RANK.get(outcome, NO_WINNER)
            entry = rows.create(key, rank, index)
            entry.failures, entry.attempts = failures, failures + (rank != OUTCOME_RANK["failed"])
            entry.passed = passed[0] if passed else None
        self.view.batch_stats = checkpoint.batch_stats
        for bucket in SPEND_BUCKETS:
            self.view.spend[bucket] = Spend.from_cache(checkpoint.spend.get(bucket) or {})

    def _read_checkpoint(self, log) -> CheckpointFile | None:
        try:
            checkpoint = read_checkpoint(self.checkpoint_path)
        except CheckpointError as err:
            log(f"⚠️  checkpoint.json is unreadable ({err}); rebuilding it from the batch files")
            return None
        if checkpoint is None or checkpoint.run_name != self.run_name:
            return None
        return checkpoint

    @property
    def batch_stats(self) -> dict[str, dict[str, int]]:
        return self.view.batch_stats

    def is_committed(self, key: str) -> bool:
        return self.view.is_committed(key)

    def outcome(self, key: str) -> str | None:
        """The outcome of the row's winning line (None: nothing committed, or only filtered lines)."""
        entry = self.view.entry(key)
        return _OUTCOME_NAME.get(entry.rank) if entry else None

    def failures(self, key: str) -> int:
        entry = self.view.entry(key)
        return entry.failures if entry else 0

    def spent(self) -> Spend:
        """What every committed line of the run spent so far (all invocations), kept or not: kept
        up to date as rows commit, so it costs nothing to ask."""
        return self.view.total_spend()

    # --- writing ----------------------------------------------------------------------------

    def commit(self, records: list[dict]) -> None:
        """Append records (one line each) and fsync once for the group: they are then committed.

        Every known secret value is replaced by [REDACTED] in the line first, so a key that a
        command managed to read still never reaches the dataset. A write that fails (disk full)
        truncates the batch file back to its last fsynced size and raises StorageError: lines
        fsynced before stay committed, the failed group is not."""
        if not records:
            return
        # Every record is checked against its model before any is written (RecordError otherwise).
        models = [validate_record(record) for record in records]
        self.writing = True  # a signal handler must not append while a line is half written
        try:
            for record, model in zip(records, models):
                key = model.metadata.row_key
                if self.is_committed(key):
                    continue  # a result that arrived twice (e.g. a retried Ray task): keep the first
                if self._handle is None or self._lines_in_batch >= self.batch_size:
                    self._rotate()
                stamp_batch(record, model, self._batch_num)
                self._write_all(redact_bytes(record_line(model)[:-1]) + b"\n")
                self._lines_in_batch += 1
                self.view.add(LineFields(record, key), batch=str(self._batch_num))
            if self._handle is not None:
                os.fsync(self._handle.fileno())
                self._synced_size = self._handle.tell()
                self.file_sizes[Path(self._handle.name).name] = self._synced_size
        except OSError as err:
            # The view has counted lines that were cut back off the file: from now on it is not
            # what the files say, so no checkpoint is written from it (a resume reads the files).
            self._view_diverged = True
            path = self._abandon_batch_file()
            raise StorageError(path or self.run_dir, err) from err
        finally:
            self.writing = False
        self._dirty = True
        self.writing = True  # the checkpoint's temp file too
        try:
            self.save_checkpoint()
        finally:
            self.writing = False

    def _write_all(self, data: bytes) -> None:
        view = memoryview(data)
        while view:  # an unbuffered write may be short
            view = view[self._handle.write(view):]

    def _abandon_batch_file(self) -> Path | None:
        """After a failed write: cut the file back to what was fsynced (no half line), close it."""
        if self._handle is None:
            return self._opening
        path = Path(self._handle.name)
        try:
            os.ftruncate(self._handle.fileno(), self._synced_size)
        except OSError:
            pass  # a resume moves an unfinished last line aside anyway
        self._handle.close()
        self._handle = None
        return path

    def _rotate(self) -> None:
        if self._handle is not None:
            os.fsync(self._handle.fileno())
            self.file_sizes[Path(self._handle.name).name] = self._handle.tell()
            self._handle.close()
            self._handle = None
            self._batch_num += 1
        path = self._opening = self.run_dir / f"batch_{self._batch_num}.jsonl"
        # Unbuffered: after a failed write no buffered bytes are left to be written later.
        self._handle = open(path, "ab", buffering=0, opener=private_opener)
        self._synced_size = self._handle.tell()
        self._lines_in_batch = 0
        _fsync_dir(self.run_dir)  # the new file's name must survive a crash too

    def save_checkpoint(self, force: bool = False) -> None:
        if self._view_diverged:
            return
        now = time.monotonic()
        if not force and (not self._dirty or now - self._last_checkpoint < self._checkpoint_gap):
            return
        rows = self.view.rows
        with storage_errors(self.checkpoint_path):
            write_checkpoint(
                self.checkpoint_path,
                {
                    "run_name": self.run_name,
                    "completed_prompts": Streamed(rows.committed_indexes),
                    "batch_stats": self.batch_stats,
                    "last_updated": now_iso(),
                    "files": self.file_sizes,
                    # [outcome, prompt_index, failures] and, for a scored sample, whether it passed
                    "rows": Streamed(lambda: ((key, [_OUTCOME_NAME.get(rank, "none"), index, failures,
                                                     *(() if passed is None else (passed,))])
                                              for key, rank, index, failures, passed in rows.states()),
                                     pairs=True),
                    "spend": {bucket: spend.cache_form() for bucket, spend in self.view.spend.items()},
                },
            )
        self._last_checkpoint = time.monotonic()
        self._checkpoint_gap = max(self.CHECKPOINT_EVERY, self.CHECKPOINT_PAUSE_FACTOR * (self._last_checkpoint - now))
        self._dirty = False

    def close(self) -> None:
        if self._handle is not None:
            self._handle.flush()
            os.fsync(self._handle.fileno())
            self._handle.close()
            self._handle = None
        self.save_checkpoint(force=True)


def _last_newline_end(handle, size: int) -> int:
    """Offset just after the last newline in the file (0 if there is none)."""
    position = size
    while position > 0:
        step = min(65536, position)
        position -= step
        handle.seek(position)
        chunk = handle.read(step)
        found = chunk.rfind(b"\n")
        if found >= 0:
            return position + found + 1
    return 0


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
