"""The spend journal: what a worker has sent, kept where the runner's death cannot take it.

The parent is the only process that commits records, and it learns each request's usage from its
workers as the requests go. When the parent itself is killed (SIGKILL, the OOM killer), the usage
of the rows still in flight would die with it. So each worker process also appends every usage
change of its rows to a journal file of its own in the run directory, before the request it
counts is sent: one line per change, a plain write() (it survives the process; no fsync, so a
crash of the machine may lose the last lines). The next invocation of the run (a resume, or
--report), under the run lock, commits what no committed line covers and then deletes the
journals.

Files: `.spend_<run id>_<pid>_<generation>.journal`, readable by the owner only. Lines:
- `{"journal": 1, "run_id", "model", "t"}` first (the invocation, the run's model, the wall time);
- `{"start": {...}}` the first time an attempt spends (what its record needs: index, key, id,
  attempt, seeds, sample, prompt);
- `{"k": key, "a": attempt, "t": time, "u": usage}` its usage so far after each change (the
  session's `CallStats.report()`: a request without its reply counts at an unknown cost).

An attempt is covered when a committed line names the same row key, run id and attempt: the
parent committed its result, or the failed record of its dead worker or of an interrupt. The
journal is a safety net for the parent's death only; the parent's records stay the truth. To find
those lines, the batch files modified since the journals began are read (after a kill only: an
invocation that ends normally checks its own journals against the store's view).

Size: a worker starts a new generation once its file holds JOURNAL_ROTATE_BYTES and is
JOURNAL_ROTATE_AGE seconds old, writing there the latest lines of the attempts it still runs, and
deletes the generation before the previous one: the attempts only that one names finished more
than a generation ago, and the parent committed their results long since.

The writer holds an exclusive flock on each of its files while it lives: a reader waits for it
(the workers of a killed runner stop within seconds), so a journal is never read while it grows.
"""

from __future__ import annotations

import fcntl
import os
import re
import stat
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import orjson

from runner.input.secrets import redact_bytes

JOURNAL_NAME = re.compile(r"^\.spend_([0-9a-zA-Z]+)_(\d+)_(\d+)\.journal$")
JOURNAL_ROTATE_BYTES = 1 << 20
JOURNAL_ROTATE_AGE = 30.0  # seconds
# A journal's attempts are committed after its first line: batch files last modified before that
# (less this slack, for coarse or slightly skewed file times) cannot cover them and are not read.
MTIME_SLACK = 600.0
WAIT_FOR_WRITERS = 10.0  # seconds a reader waits for a worker of a killed runner to exit


def journal_path(run_dir: Path, run_id: str, pid: int, generation: int) -> Path:
    return run_dir / f".spend_{run_id}_{pid}_{generation}.journal"


def _line(data: dict) -> bytes:
    return orjson.dumps(data) + b"\n"


def _start_line(task: Any) -> bytes:
    """What the record of an attempt (a runner.execution.task.Task) needs, once per attempt; its
    prompt redacted like a committed line."""
    return redact_bytes(_line({"start": {
        "key": task.key, "index": task.index, "id": task.id, "attempt": task.attempt, "seed": task.seed,
        "sample": task.sample, "samples": task.samples, "sample_seed": task.sample_seed, "prompt": task.prompt,
        "t": time.time()}}))


class SpendJournal:
    """A worker process's journal (see the module docstring): `note(task, usage)` after every
    change of an attempt's usage, `finished(key)` once its result is on its way to the parent."""

    def __init__(self, run_dir: Path, run_id: str, model: str):
        self.run_dir, self.run_id, self.model = run_dir, run_id, model
        self.generation = -1
        self.files: list[tuple[Path, int]] = []  # (path, fd): the previous generation, then the current
        self.size = 0
        self.opened = 0.0
        self.attempts: dict[str, list[bytes]] = {}  # key of an attempt still running -> [start line, last line]
        self.broken = False  # a write failed (disk full): the parent's own records remain
        self.lock = threading.Lock()  # a tool's thread may count a request of its session too

    def note(self, task: Any, usage: dict) -> None:
        with self.lock:
            self._note(task, usage)

    def _note(self, task: Any, usage: dict) -> None:
        if self.broken:
            return
        lines = self.attempts.get(task.key)
        new = b""
        if lines is None:
            new = _start_line(task)
            lines = self.attempts[task.key] = [new, b""]
        lines[1] = _line({"k": task.key, "a": task.attempt, "t": round(time.time(), 3), "u": usage})
        try:
            if not self.files or (self.size >= JOURNAL_ROTATE_BYTES
                                  and time.monotonic() - self.opened >= JOURNAL_ROTATE_AGE):
                self._rotate()  # the new file holds every running attempt's lines, this one's too
            else:
                self._write(self.files[-1][1], new + lines[1])
        except OSError:
            self.broken = True

    def finished(self, key: str) -> None:
        with self.lock:
            self.attempts.pop(key, None)

    def _write(self, fd: int, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        self.size += len(data)

    def _rotate(self) -> None:
        self.generation += 1
        path = journal_path(self.run_dir, self.run_id, os.getpid(), self.generation)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)  # held until this process exits
        self.files.append((path, fd))
        self.size, self.opened = 0, time.monotonic()
        header = _line({"journal": 1, "run_id": self.run_id, "model": self.model, "t": time.time()})
        self._write(fd, header + b"".join(start + last for start, last in self.attempts.values()))
        if len(self.files) > 2:
            old_path, old_fd = self.files.pop(0)
            old_path.unlink(missing_ok=True)
            os.close(old_fd)


# --- reading, by the next invocation -------------------------------------------------------------


@dataclass
class JournaledAttempt:
    run_id: str
    model: str
    start: dict
    path: Path
    usage: dict = field(default_factory=dict)
    last: float = 0.0  # wall time of its last usage line


def journals(run_dir: Path) -> list[Path]:
    """The journal files of the run directory: regular files only (a directory, FIFO or symlink
    under a journal's name is none of the workers' and is never opened)."""
    return [p for p in _named_journals(run_dir) if _is_regular(p)]


def _named_journals(run_dir: Path) -> list[Path]:
    try:
        return sorted((p for p in run_dir.iterdir() if JOURNAL_NAME.match(p.name)), key=_order)
    except FileNotFoundError:
        return []


def _is_regular(path: Path) -> bool:
    try:
        return stat.S_ISREG(path.lstat().st_mode)
    except OSError:
        return False


def _open_regular(path: Path) -> int | None:
    """A read-only descriptor of the journal, None when it is gone or is not a regular file: it is
    opened without blocking (a FIFO put there since the listing) nor following a symlink."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    if stat.S_ISREG(os.fstat(fd).st_mode):
        return fd
    os.close(fd)
    return None


def _read_regular(path: Path) -> bytes | None:
    fd = _open_regular(path)
    if fd is None:
        return None
    with os.fdopen(fd, "rb") as handle:
        return handle.read()


def _order(path: Path) -> tuple[str, int, int]:
    run_id, pid, generation = JOURNAL_NAME.match(path.name).groups()
    return run_id, int(pid), int(generation)


def _wait_unlocked(path: Path, timeout: float) -> bool:
    """Wait until no live process holds the file's lock (its worker exited); False on timeout,
    True too when the file is gone."""
    fd = _open_regular(path)
    if fd is None:
        return True
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    return False
                time.sleep(0.05)
    finally:
        os.close(fd)


def settled_journals(run_dir: Path, skip_run_id: str | None, log: Callable[[str], None]) -> list[Path]:
    """The journals of invocations other than `skip_run_id` whose writers have all exited (one
    still alive after WAIT_FOR_WRITERS seconds is left for a later invocation, with a message)."""
    waited: set[Path] = set()
    busy: set[tuple] = set()  # (run id, pid) of a writer still alive
    while True:  # a writer that was still alive may have started another generation meanwhile
        found = [p for p in journals(run_dir) if _order(p)[0] != skip_run_id]
        fresh = [p for p in found if p not in waited]
        if not fresh:
            return [p for p in found if _order(p)[:2] not in busy]
        for path in fresh:
            waited.add(path)
            if _order(path)[:2] not in busy and not _wait_unlocked(path, WAIT_FOR_WRITERS):
                busy.add(_order(path)[:2])
                log(f"⚠️  {path.name}: its worker process is still alive; its spend is recorded by a later invocation")


def read_journals(paths: list[Path], log: Callable[[str], None] = print) -> dict[tuple[str, str, int], JournaledAttempt]:
    """(run id, row key, attempt) -> what the attempt spent as last journaled. A line that is not
    well-formed (a foreign or damaged file) is skipped, with one warning a file."""
    attempts: dict[tuple[str, str, int], JournaledAttempt] = {}
    for path in paths:
        data = _read_regular(path)
        if data is not None:
            _read_journal(path, data, attempts, log)
    return attempts


def _read_journal(path: Path, data: bytes, attempts: dict, log: Callable[[str], None]) -> None:
    header: dict | None = None
    starts: dict[str, dict] = {}
    bad: list[int] = []
    for number, raw in enumerate(data.split(b"\n")[:-1], 1):  # an unterminated tail is not a line
        line = _parsed(raw)
        if _is_header(line):
            header = line
        elif header is not None and _is_start(line):
            starts[line["start"]["key"]] = line["start"]
        elif header is not None and _is_usage(line):
            if line["k"] not in starts:
                continue  # its start line went with an older generation: that attempt finished long ago
            run_id, model = str(header["run_id"]), str(header.get("model") or "")
            key = (run_id, line["k"], line["a"])
            attempt = attempts.get(key)
            if attempt is None:
                attempt = attempts[key] = JournaledAttempt(run_id, model, starts[line["k"]], path)
            attempt.usage, attempt.last = line["u"], float(line["t"])
        else:
            bad.append(number)
    if bad:
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        log(f"⚠️  {path}: line {bad[0]}{more} is not a well-formed journal line; skipped")


def _parsed(raw: bytes) -> Any:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None


# What a journal line's numbers may be: a record must hold them (an int of 64 bits at most, a
# finite float, never negative) and a time must be a date (seconds since 1970, before 2500).
_LARGEST = 2**63 - 1
# A usage's counts and cost: far more than any attempt spends, yet a sum of millions of them
# still fits in 64 bits (one at 2**63 - 1 was counted, and then the run's spend could not be written).
_USAGE_LIMIT = 10**12
_LATEST = 16_725_225_600.0


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _LARGEST


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= _LARGEST


def _is_time(value: Any) -> bool:
    return _is_number(value) and value <= _LATEST


def _numbers_fit(value: Any) -> bool:
    """Every number in a usage (nested dicts and lists, as orjson parses them) is one an
    attempt can have spent (0 to _USAGE_LIMIT). A loop, not a recursion: it runs for every line
    of every journal at the end of a run, and no nesting, however deep, can exhaust the stack."""
    pending = [value]
    while pending:
        item = pending.pop()
        kind = type(item)
        if kind is dict:
            pending.extend(item.values())
        elif kind is list:
            pending.extend(item)
        elif (kind is int or kind is float) and not 0 <= item <= _USAGE_LIMIT:  # a bool is neither
            return False
    return True


def _is_header(line: Any) -> bool:
    return isinstance(line, dict) and "journal" in line and isinstance(line.get("run_id"), str) \
        and isinstance(line.get("model", ""), str)


# The fields of a start line a record is made of, besides key, index and attempt: absent or numbers.
START_NUMBERS = ("seed", "sample", "samples", "sample_seed")


def _is_start(line: Any) -> bool:
    start = line.get("start") if isinstance(line, dict) else None
    return isinstance(start, dict) and isinstance(start.get("key"), str) and _is_int(start.get("index")) \
        and _is_int(start.get("attempt")) and (start.get("t") is None or _is_time(start["t"])) \
        and all(start.get(name) is None or _is_int(start[name]) for name in START_NUMBERS)


def _is_usage(line: Any) -> bool:
    return isinstance(line, dict) and isinstance(line.get("k"), str) and _is_int(line.get("a")) \
        and _is_time(line.get("t")) and isinstance(line.get("u"), dict) and _numbers_fit(line["u"])


def first_times(paths: list[Path]) -> float | None:
    """The earliest header time of these journals (when their first line was written)."""
    times = []
    for path in paths:
        fd = _open_regular(path)
        if fd is None:
            return 0.0  # unknown: every batch file is read
        with os.fdopen(fd, "rb") as handle:
            first = handle.readline()
        try:
            times.append(float(orjson.loads(first)["t"]))
        except (ValueError, KeyError, TypeError, IndexError):
            return 0.0
    return min(times) if times else None


def covered_attempts(run_dir: Path, run_ids: set[str], since: float | None) -> set[tuple[str, str, int]]:
    """(run id, row key, attempt) of every committed line of these invocations, read from the batch
    files modified since `since` (less MTIME_SLACK; None or 0: every batch file)."""
    from runner.storage.records import read_line
    from runner.storage.store import batch_files

    needles = [run_id.encode() for run_id in run_ids]
    found: set[tuple[str, str, int]] = set()
    for path in batch_files(run_dir):
        try:
            if since and path.stat().st_mtime < since - MTIME_SLACK:
                continue
            with open(path, "rb") as handle:
                for raw in handle:
                    if raw.endswith(b"\n") and any(needle in raw for needle in needles):
                        fields = read_line(raw)
                        if fields is not None and fields.run_id in run_ids:
                            found.add((fields.run_id, fields.key, _number(fields.meta.attempt)))
        except FileNotFoundError:
            continue
    return found


def _number(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else -1


def record_journaled_spend(run_dir: Path, store, *, skip_run_id: str | None = None, own_run_id: str | None = None,
                           units: Mapping[str, int] | None = None, log=print) -> int:
    """Commit, through `store` (loaded, under the run lock), a failed record of class
    `interrupted` for each journaled attempt that spent something and that no committed line
    covers, then delete the journals read. Returns the records committed. Idempotent: a run killed
    halfway through finds its own records next time, and commits nothing twice.

    `skip_run_id`: an invocation whose journals are left alone (the one now starting). The
    journals of `own_run_id` (the invocation now ending, its workers stopped) are checked against
    the store's view instead of the files: that invocation ran each row once, and the store has
    seen every line it committed. `units`: the dataset's sample keys; an attempt of a row that is
    not one of them is not recorded (with a warning)."""
    _warn_not_regular(run_dir, log)
    paths = settled_journals(run_dir, skip_run_id, log)
    if not paths:
        return 0
    attempts = read_journals(paths, log)
    if units is not None:
        attempts = _of_dataset(attempts, units, log)
    others = {run_id for run_id, _, _ in attempts if run_id != own_run_id}
    found = covered_attempts(run_dir, others, first_times([p for p in paths if _order(p)[0] != own_run_id])) \
        if others else set()

    def covered(run_id: str, key: str, attempt: int) -> bool:
        if run_id != own_run_id:
            return (run_id, key, attempt) in found
        entry = store.view.entry(key)
        return entry is not None and (entry.committed or entry.failures >= attempt)

    records = [record for key, attempt in sorted(attempts.items())
               if _spent(attempt.usage) and not covered(*key) and (record := _readable_record(attempt, log))]
    store.commit(records)
    for path in paths:
        path.unlink(missing_ok=True)
    if records:
        requests = sum(int(r["metadata"]["usage"]["requests"]) for r in records)
        log(f"🧾 Recorded from the workers' journals what {len(records)} row(s) in flight had spent that no "
            f"committed line held ({requests} request(s))")
    return len(records)


def _warn_not_regular(run_dir: Path, log: Callable[[str], None]) -> None:
    for path in _named_journals(run_dir):
        if not _is_regular(path):
            log(f"⚠️  {path}: not a regular file, so not a worker's journal; skipped")


def _of_dataset(attempts: dict, units: Mapping[str, int], log: Callable[[str], None]) -> dict:
    kept = {}
    for key, attempt in attempts.items():
        if key[1] in units:
            kept[key] = attempt
        else:
            log(f"⚠️  {attempt.path}: row key {key[1]!r} is not in the dataset; its journaled spend is not recorded")
    return kept


def _spent(usage: dict) -> bool:
    requests = usage.get("requests")
    return _is_int(requests) and requests > 0


def _readable_record(attempt: JournaledAttempt, log: Callable[[str], None]) -> dict | None:
    """The attempt's record, if it reads back as a committed line does (a line the store could
    write but never read again would stop every later invocation of the run)."""
    from runner.storage.records import read_line

    try:
        record = _record(attempt)
        if read_line(orjson.dumps(record)) is None:
            raise ValueError("not a record")
        return record
    except (ValueError, TypeError, OverflowError) as err:
        log(f"⚠️  {attempt.path}: the attempt of row key {attempt.start.get('key')!r} makes no valid record "
            f"({type(err).__name__}); skipped")
        return None


def _record(attempt: JournaledAttempt) -> dict:
    from agent.usage import Usage
    from runner.storage.records import FailedRecord, Metadata, UsageRecord, as_dict
    from runner.timestamps import now_iso

    start = attempt.start
    metadata = Metadata(
        timestamp=now_iso(), model=attempt.model, row_key=start["key"], id=str(start.get("id") or ""),
        run_id=attempt.run_id, attempt=int(start["attempt"]),
        duration_seconds=round(max(0.0, attempt.last - float(start.get("t") or attempt.last)), 3),
        usage=UsageRecord.of(Usage.read(attempt.usage)), seed=int(start.get("seed") or 0),
        sample=int(start.get("sample") or 0), samples=int(start.get("samples") or 1),
        sample_seed=int(start.get("sample_seed") or 0), stop_reason="failed",
    )
    return as_dict(FailedRecord(prompt_index=int(start["index"]), failed=True, error_class="interrupted",
                                error="the runner was killed while this row ran; its spend is recorded from its "
                                      "worker's journal", prompt=str(start.get("prompt") or ""), metadata=metadata))


def record_journaled_spend_of_run(run_dir: Path, dataset_units: Callable[[dict], Mapping[str, int] | None],
                                  log=print) -> int:
    """`record_journaled_spend` for a command that runs no prompt (--report): the run's store is
    opened only when there is a journal to record. `dataset_units(config)`: the sample keys of the
    dataset config.json names, None when it cannot be read (then nothing is recorded: the journals
    wait for an invocation that can tell the dataset's rows). The caller holds the run lock."""
    if not _named_journals(run_dir):
        return 0
    from runner.storage.runfiles import read_config
    from runner.storage.runview import Selection
    from runner.storage.store import RunStore

    saved = read_config(run_dir)
    config = saved.config if saved is not None else {}
    units = dataset_units(config)
    if units is None:
        return 0
    batch_size = config.get("batch_size")
    store = RunStore(run_dir, str(config.get("run_name") or run_dir.name),
                     batch_size if isinstance(batch_size, int) and batch_size > 0 else 1, Selection.of(config))
    store.repair_torn_tails(log)
    store.load(log)
    try:
        return record_journaled_spend(run_dir, store, units=units, log=log)
    finally:
        store.close()
