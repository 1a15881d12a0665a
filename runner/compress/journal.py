"""What an unfinished compression has already paid for, kept on disk beside the output.

`<output>.progress` starts with a header (the fingerprint of the options that change a row's
output), then one line per row that needed a summary request: its key (the hash of the input
line, so a changed or reordered input still finds its rows), its status (compressed or failed), what the request spent, and the output row. Each line is
handed to the kernel (written and flushed) before the row is counted, so a Ctrl-C or a SIGKILL
loses at most the rows in flight; it is fsynced at most FSYNC_EVERY seconds later (and when the
journal is closed), so a crash of the machine itself loses at most that last second of rows, and
a summary request waits for no disk. A torn last line (killed mid-write) is dropped when the
journal is read; a damaged line before it (the file was changed) stops the resume, naming it.
A row's requests are journaled as they go too: an `in_flight` line (no output row) with what the
row has spent so far, written before each request is sent and after each reply, which the row's
final line replaces. A SIGKILL then loses no request already sent: --resume counts the spend of a
row cut off in flight (a request without its reply at an unknown cost), closes it with a `cut_off`
line (so the row's next attempt journals a spend of its own) and asks for it again.
A --resume after a whole run (its journal removed) starts its journal with that run's spend (an
`earlier_run` line, from the metrics JSON) and compressed rows (from its output), so that a
resume cut off in its turn is resumed from the journal alone. A line is whole only with its
newline: a last line without one is torn.
`--resume` keeps the compressed rows (never asked for again) and retries the failed ones; the
journal is removed once the output is written whole. The compression writing it holds a lock on it
(flock, released by the kernel however the process ends), so a second compression of the same output
started meanwhile is refused instead of paying again for the rows the first one is summarising.
"""

from __future__ import annotations

import fcntl
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from agent.usage import COUNT_FIELDS
from runner.compress.metrics import COMPRESSED, FAILED
from runner.compress.options import same_fingerprint
from runner.storage.atomic import private_opener

JOURNAL_SUFFIX = ".progress"
IN_FLIGHT = "in_flight"  # a row's spend while its requests go, replaced by its final line
# The final line a resume writes for a row it found in flight: its spend stays counted, and the
# row's new attempt journals lines of its own (which must not replace that spend).
CUT_OFF = "cut_off"
# What a whole run before spent (from its metrics JSON), carried into the journal of a --resume.
EARLIER = "earlier_run"
FSYNC_EVERY = 1.0  # seconds


class JournalError(ValueError):
    """A journal that does not belong to this input and these options."""


@dataclass
class Entry:
    key: str  # rows.InputRow.key of the input row
    status: str  # compressed | failed
    usage: dict  # agent.model_client.CallStats.as_dict() of the row's requests
    row: bytes  # the output line, without its newline


@dataclass
class Journal:
    path: Path
    entries: dict[str, Entry] = field(default_factory=dict)  # the latest entry of each row, by key
    earlier_usage: list[dict] = field(default_factory=list)  # every entry's usage, the replaced ones too
    _handle: object = None
    _synced: float = 0.0
    _in_flight: dict[str, int] = field(default_factory=dict)  # read: rows cut off in flight (see _read)

    @staticmethod
    def path_for(output: Path) -> Path:
        return output.with_name(output.name + JOURNAL_SUFFIX)

    @classmethod
    def check(cls, output: Path, fingerprint: dict, resume: bool) -> None:
        """JournalError when `open` would refuse; nothing is written."""
        path = cls.path_for(output)
        if path.exists() and not _header_torn(path):
            journal = cls(path)
            with open(path, "rb") as handle:
                _lock(handle, path)  # released when the handle is closed
            journal._read(fingerprint, repair=False)
            journal._refuse_unless(resume)

    def _refuse_unless(self, resume: bool) -> None:
        """Called once the journal is read: what it holds is counted from its entries."""
        if not resume:
            statuses = [entry.status for entry in self.entries.values()]
            done = f"{statuses.count(COMPRESSED)} rows compressed, {statuses.count(FAILED)} failed"
            raise JournalError(f"{self.path} holds an interrupted compression of this output ({done}): run "
                               "again with --resume to finish it without paying for those rows again, or delete it "
                               "to start over")

    @classmethod
    def open(cls, output: Path, fingerprint: dict, resume: bool) -> Journal:
        """The journal of `output`, started afresh or (resume) read back and checked."""
        path = cls.path_for(output)
        journal = cls(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path, "ab", opener=private_opener)  # created empty when new; held, locked, until closed
        try:
            _lock(handle, path)
            if path.stat().st_size and _header_torn(path):  # nothing was journaled: start it again
                handle.truncate(0)
            if path.stat().st_size:
                journal._read(fingerprint, repair=resume)
                journal._refuse_unless(resume)
                journal._handle = handle
                for key, place in journal._in_flight.items():
                    journal.add(Entry(key, CUT_OFF, journal.earlier_usage[place], b"null"))
                journal._in_flight = {}
            else:
                handle.write(orjson.dumps({"fingerprint": fingerprint}) + b"\n")
                handle.flush()
                os.fsync(handle.fileno())
        except BaseException:
            handle.close()
            raise
        journal._handle = handle
        return journal

    def _read(self, fingerprint: dict, repair: bool = True) -> None:
        lines = self.path.read_bytes().split(b"\n")
        try:
            header = orjson.loads(lines[0])
        except orjson.JSONDecodeError:
            header = {}
        saved = header.get("fingerprint") if isinstance(header, dict) else None
        if not same_fingerprint(saved, fingerprint):
            changed = sorted(k for k in set(saved or {}) | set(fingerprint) if (saved or {}).get(k) != fingerprint.get(k))
            raise JournalError(f"{self.path} was written with other options ({', '.join(changed)} "
                               "differ): give the same ones to --resume, or delete it to start over")
        in_flight = self._in_flight  # key -> where in earlier_usage its latest in-flight spend is
        # The last piece is "" or a line a kill cut before its newline (torn): that row is simply
        # done again. Any line before it was written whole, so one that does not read was changed
        # since: the resume stops there rather than drop it and pay again for every row after it.
        for number, line in enumerate(lines[1:-1], start=2):
            try:
                entry = _entry_of(line)
            except ValueError as err:
                raise JournalError(f"{self.path} line {number}: {err}; a compression does not write such a line, "
                                   "so the file was changed or damaged: remove that line to resume with the others "
                                   "(its row is then done again), or delete the file to start over") from None
            place = in_flight.pop(entry.key, None)
            if place is None:
                place = len(self.earlier_usage)
                self.earlier_usage.append(entry.usage)
            self.earlier_usage[place] = entry.usage  # the row's spend so far replaces what it had journaled
            if entry.status == IN_FLIGHT:
                in_flight[entry.key] = place
            elif entry.status != EARLIER:
                self.entries[entry.key] = entry
        if repair and lines[-1]:
            with open(self.path, "r+b") as handle:  # appending after a torn line would glue two lines
                handle.truncate(sum(len(line) + 1 for line in lines[:-1]))

    def sync(self) -> None:
        """Everything added is on disk; the journal stays open, and locked."""
        self._handle.flush()
        os.fsync(self._handle.fileno())

    def add(self, entry: Entry) -> None:
        line = orjson.dumps({"key": entry.key, "status": entry.status, "usage": entry.usage,
                             "row": orjson.Fragment(entry.row)})
        self._handle.write(line + b"\n")
        self._handle.flush()
        if time.monotonic() - self._synced >= FSYNC_EVERY:
            os.fsync(self._handle.fileno())
            self._synced = time.monotonic()
        if entry.status != EARLIER:
            self.entries[entry.key] = entry

    def carry_over(self, entries, usages: list[dict]) -> None:
        """A whole run's compressed rows and spend (read from its output and metrics JSON by a
        --resume), written here as if that run had journaled them."""
        for usage in usages:
            self.add(Entry("", EARLIER, usage, b"null"))
        for entry in entries:
            self.add(entry)

    def spending(self, key: str, usage: dict) -> None:
        """What the row `key` has spent so far, its requests still going (handed to the kernel
        before the request it counts is sent)."""
        self._handle.write(orjson.dumps({"key": key, "status": IN_FLIGHT, "usage": usage, "row": None}) + b"\n")
        self._handle.flush()

    def close(self) -> None:
        if self._handle is not None:
            self._handle.flush()
            os.fsync(self._handle.fileno())
            self._handle.close()
            self._handle = None

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)  # while still locked: no other compression reads it meanwhile
        self.close()


_STATUSES = (COMPRESSED, FAILED, IN_FLIGHT, CUT_OFF, EARLIER)
_HEADER_LIMIT = 1 << 20  # bytes: a header (the options' fingerprint) is far shorter


def _header_torn(path: Path) -> bool:
    """The journal holds no whole line: it was killed while its header was written (its first
    write, fsynced before any row), so nothing was journaled."""
    with open(path, "rb") as f:
        head = f.read(_HEADER_LIMIT)
    return b"\n" not in head and len(head) < _HEADER_LIMIT


def _entry_of(line: bytes) -> Entry:
    """The entry of one journal line; ValueError naming what is wrong with it."""
    try:
        data = orjson.loads(line)
    except orjson.JSONDecodeError as err:
        raise ValueError(f"not JSON ({err})") from None
    if not isinstance(data, dict) or not isinstance(data.get("key"), str):
        raise ValueError('not an object with a "key" string')
    status, usage, row = data.get("status"), data.get("usage"), data.get("row")
    if status not in _STATUSES:
        raise ValueError(f'"status" is {status!r}, not one of {", ".join(_STATUSES)}')
    problem = _usage_problem(usage, "usage")
    if problem:
        raise ValueError(problem)
    if status in (COMPRESSED, FAILED):
        if not (isinstance(row, dict) and isinstance(row.get("conversations"), list)):
            raise ValueError(f'"row" of a {status} row is not an output row (an object with "conversations")')
        if not _metrics_of(row.get("compression_metrics"), status):
            raise ValueError(f'the "compression_metrics" of a {status} row are not those a compression writes')
    elif row is not None:
        raise ValueError(f'"row" of a {status} line is not null')
    return Entry(data["key"], status, usage, orjson.dumps(row))


def _count(value) -> bool:
    return type(value) is int and value >= 0


def _usage_problem(usage, where: str) -> str | None:
    """What is wrong with a journaled spend (CallStats.as_dict()), None when nothing is."""
    if not isinstance(usage, dict):
        return f'"{where}" is not an object'
    for name in (*COUNT_FIELDS, "unpriced_requests"):
        if name in usage and not _count(usage[name]):
            return f'"{where}.{name}" is not a count'
    cost = usage.get("cost")
    if cost is not None and not (type(cost) in (int, float) and 0 <= cost < float("inf")):
        return f'"{where}.cost" is not an amount'
    by_model = usage.get("by_model", [])
    if not isinstance(by_model, list):
        return f'"{where}.by_model" is not a list'
    for entry in by_model:
        if not (isinstance(entry, dict) and isinstance(entry.get("model"), str)):
            return f'"{where}.by_model" holds an entry without its model'
        problem = _usage_problem(entry, f"{where}.by_model")
        if problem:
            return problem
    return None


def _metrics_of(metrics, status: str) -> bool:
    """The figures the file's tally reads from a row's compression_metrics are there, as written."""
    return (isinstance(metrics, dict) and metrics.get("status") == status and isinstance(metrics.get("failure"), str)
            and type(metrics.get("over_limit")) is bool and _count(metrics.get("tokens_before"))
            and _count(metrics.get("tokens_after")))


def _lock(handle, path: Path) -> None:
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise JournalError(f"another compression is writing this output ({path} is held): wait until it "
                           "ends") from None
