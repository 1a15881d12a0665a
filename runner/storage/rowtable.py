"""The run view's per-row state, in columns: a few bytes per row instead of an object per row.

A million-row run keeps, for every row key, its winning line's outcome, its attempts and where
the line is. As one Python object per row (with its key string, a dict slot and boxed ints) that
was 400 bytes a row, growing with every row committed. Here each field is one `array` column
indexed by a row's slot, and a field that few rows have (an error class, an id, the report's
summary) sits in a dict by slot.

Slots: given the dataset's units (sample key -> its row's index, `samples` keys per row), a key's
slot is `index * samples + sample`, so the columns are sized by the dataset up front and no
per-row key is stored at all; a key outside them (a stale row, or no units given) gets the next
free slot through a dict. `RowEntry` is a two-field handle on one slot with the attributes the
readers use (`entry.rank`, `entry.attempts += 1`, ...).
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterator, Mapping
from typing import Any

ABSENT = -2  # rank of a slot no line has reached
NO_WINNER = -1  # rank of a row whose lines were all filtered (runview.py)
_DISCARDED_RANK = 1  # OUTCOME_RANK["discarded"] (records.py): at or above it a row is done

# column name -> array typecode and the value of a fresh slot. "Located" columns say where the
# winning line is: only the merge and its readers need them (the store's view does without).
_BASE = {"rank": ("b", ABSENT), "prompt_index": ("q", 0), "failures": ("I", 0), "attempts": ("I", 0),
         "passed": ("b", -1)}
_LOCATED = {"file_no": ("i", -1), "line_no": ("I", 0), "offset": ("Q", 0), "length": ("I", 0),
            "sample": ("q", 0), "score": ("d", math.nan), "selected": ("B", 1)}
# fields few rows have (or only the merge's readers): slot -> value; absent means the default
_SPARSE = {"error_class": None, "row_id": "", "detail": None, "rescored": None, "pending": None}


def _units_layout(units: Mapping[str, int]) -> tuple[int, int, bool] | None:
    """(rows, samples per row, whether the mapping lists the units in slot order) when every
    unit's slot `index * samples + sample` is distinct and in range (the dataset's units always
    are, in order); None otherwise (a hand-made mapping)."""
    if not units:
        return None
    rows = max(units.values()) + 1
    samples = len(units) // rows
    if samples < 1 or rows * samples != len(units) or min(units.values()) < 0:
        return None
    seen = bytearray(rows * samples)
    ordered, last = True, -1
    for key, index in units.items():
        slot = _slot(key, index, samples)
        if slot is None or seen[slot]:
            return None
        seen[slot] = 1
        ordered, last = ordered and slot > last, slot
    return rows, samples, ordered


def _slot(key: str, index: int, samples: int) -> int | None:
    if samples == 1:
        return index if "/s" not in key else None
    _row, sep, tail = key.partition("/s")
    if not sep:
        sample = 0
    elif tail.isdigit():
        sample = int(tail)
    else:
        return None
    return index * samples + sample if sample < samples else None


class RowTable:
    """Row key -> RowEntry, as a mapping (`get`, `in`, `[]`, `items()`, `values()`, `len`)."""

    def __init__(self, units: Mapping[str, int] | None = None, *, located: bool = True):
        layout = _units_layout(units) if units is not None else None
        self.units = units if layout is not None else None
        self.samples = layout[1] if layout is not None else 1
        # the units are listed by (row index, sample): iterating them is their order, no sort needed
        self.ordered = layout is not None and layout[2]
        size = layout[0] * layout[1] if layout is not None else 0
        self.fixed = size  # slots below this belong to the units
        spec = {**_BASE, **(_LOCATED if located else {})}
        self.columns = {name: array(code, [default]) * size for name, (code, default) in spec.items()}
        self.defaults = {name: default for name, (_code, default) in spec.items()}
        self.sparse: dict[str, dict[int, Any]] = {name: {} for name in _SPARSE}
        self.extra: dict[str, int] = {}  # key -> slot, for keys outside the units
        self.count = 0

    # --- slots --------------------------------------------------------------------------------

    def slot_of(self, key: str) -> int | None:
        if self.units is not None:
            index = self.units.get(key)
            if index is not None:
                return _slot(key, index, self.samples)
        return self.extra.get(key)

    def _new_slot(self, key: str) -> int:
        slot = self.slot_of(key)
        if slot is None:
            slot = self.extra[key] = len(self.columns["rank"])
            for name, column in self.columns.items():
                column.append(self.defaults[name])
        return slot

    def create(self, key: str, rank: int, prompt_index: int) -> RowEntry:
        """The entry of a key no line has reached yet."""
        slot = self._new_slot(key)
        if self.columns["rank"][slot] == ABSENT:
            self.count += 1
        self.columns["rank"][slot] = rank
        self.columns["prompt_index"][slot] = prompt_index
        return RowEntry(self, slot)

    def set_winner(self, slot: int, rank: int, prompt_index: int, file_no: int, line_no: int, offset: int,
                   length: int, *, error_class: str | None, row_id: str, sample: int, rescored: list | None,
                   passed: bool | None, score: float | None) -> None:
        """A line became the slot's winner: its fields, straight into the columns."""
        c = self.columns
        c["rank"][slot], c["prompt_index"][slot] = rank, prompt_index
        c["passed"][slot] = -1 if passed is None else int(bool(passed))
        if "file_no" in c:
            c["file_no"][slot], c["line_no"][slot], c["offset"][slot], c["length"][slot] = file_no, line_no, offset, length
            c["sample"][slot] = sample
            c["score"][slot] = math.nan if score is None else float(score)
        for name, value in (("error_class", error_class), ("row_id", row_id), ("rescored", rescored)):
            values = self.sparse[name]
            if value is None or value == _SPARSE[name]:
                values.pop(slot, None)
            else:
                values[slot] = value

    # --- the mapping --------------------------------------------------------------------------

    def get(self, key: str, default: Any = None) -> RowEntry | None:
        slot = self.slot_of(key)
        if slot is None or self.columns["rank"][slot] == ABSENT:
            return default
        return RowEntry(self, slot)

    def __getitem__(self, key: str) -> RowEntry:
        entry = self.get(key)
        if entry is None:
            raise KeyError(key)
        return entry

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self.get(key) is not None

    def __len__(self) -> int:
        return self.count

    def keys(self) -> Iterator[str]:
        return (key for key, _slot in self._slots())

    def __iter__(self) -> Iterator[str]:
        return self.keys()

    def items(self) -> Iterator[tuple[str, RowEntry]]:
        return ((key, RowEntry(self, slot)) for key, slot in self._slots())

    def values(self) -> Iterator[RowEntry]:
        return (RowEntry(self, slot) for _key, slot in self._slots())

    def _slots(self) -> Iterator[tuple[str, int]]:
        """(key, slot) of every key a line has reached: the units in dataset order, then the others."""
        rank = self.columns["rank"]
        if self.units is not None:
            samples = self.samples
            for key, index in self.units.items():
                slot = index if samples == 1 else _slot(key, index, samples)
                if rank[slot] != ABSENT:
                    yield key, slot
        for key, slot in self.extra.items():
            if rank[slot] != ABSENT:
                yield key, slot

    def states(self) -> Iterator[tuple[str, int, int, int, bool | None]]:
        """(key, rank, prompt_index, failures, passed) of every key, read from the columns directly
        (checkpoint.json's rows, without an entry object per row)."""
        c = self.columns
        rank, index, failures, passed = c["rank"], c["prompt_index"], c["failures"], c["passed"]
        for key, slot in self._slots():
            flag = passed[slot]
            yield key, rank[slot], index[slot], failures[slot], None if flag < 0 else bool(flag)

    def committed_indexes(self) -> Iterator[int]:
        """The distinct prompt indexes of the committed rows, ascending (marked in a bitmap)."""
        rank, index = self.columns["rank"], self.columns["prompt_index"]
        marks = bytearray()
        for slot in range(len(rank)):
            if rank[slot] >= _DISCARDED_RANK and (at := index[slot]) >= 0:
                if at >= len(marks):
                    marks.extend(bytes(max(at + 1 - len(marks), len(marks))))
                marks[at] = 1
        return (at for at, mark in enumerate(marks) if mark)

    def outcome_tally(self) -> tuple[int, int, int, int, dict[str, int]]:
        """(rows retried, discarded, failed, with a winner, failed rows by error class), read from
        the columns directly (statistics.json's counts at a million rows, without an entry per row)."""
        rank, attempts = self.columns["rank"], self.columns["attempts"]
        retried = sum(1 for slot, tries in enumerate(attempts) if tries > 1 and rank[slot] != ABSENT)
        discarded = rank.count(_DISCARDED_RANK)
        with_winner = len(rank) - rank.count(ABSENT) - rank.count(NO_WINNER)
        classes = self.sparse["error_class"]
        by_class: dict[str, int] = {}
        failed = 0
        for slot, value in enumerate(rank):
            if value == 0:  # OUTCOME_RANK["failed"]
                failed += 1
                cls = classes.get(slot) or "agent"
                by_class[cls] = by_class.get(cls, 0) + 1
        return retried, discarded, failed, with_winner, by_class

    def nbytes(self) -> int:
        """Bytes of the columns (the per-slot cost, without the sparse fields and extra keys)."""
        return sum(column.itemsize * len(column) for column in self.columns.values())


def _column(name: str) -> property:
    def get(entry: RowEntry) -> Any:
        columns = entry.table.columns
        return columns[name][entry.slot] if name in columns else entry.table.defaults.get(name, _LOCATED[name][1])

    def put(entry: RowEntry, value: Any) -> None:
        columns = entry.table.columns
        if name in columns:
            columns[name][entry.slot] = value
        # a view that does not locate lines (the store's) has nowhere to put it, and never reads it

    return property(get, put)


def _sparse(name: str) -> property:
    default = _SPARSE[name]

    def get(entry: RowEntry) -> Any:
        return entry.table.sparse[name].get(entry.slot, default)

    def put(entry: RowEntry, value: Any) -> None:
        values = entry.table.sparse[name]
        if value is default or value == default:
            values.pop(entry.slot, None)
        else:
            values[entry.slot] = value

    return property(get, put)


def _optional_bool(name: str) -> property:
    def get(entry: RowEntry) -> bool | None:
        value = entry.table.columns[name][entry.slot]
        return None if value < 0 else bool(value)

    def put(entry: RowEntry, value: bool | None) -> None:
        entry.table.columns[name][entry.slot] = -1 if value is None else int(bool(value))

    return property(get, put)


def _optional_float(name: str) -> property:
    def get(entry: RowEntry) -> float | None:
        columns = entry.table.columns
        if name not in columns:
            return None
        value = columns[name][entry.slot]
        return None if math.isnan(value) else value

    def put(entry: RowEntry, value: float | None) -> None:
        columns = entry.table.columns
        if name in columns:
            columns[name][entry.slot] = math.nan if value is None else float(value)

    return property(get, put)


class RowEntry:
    """One row key's slot: its winning line so far and how many attempts it took."""

    __slots__ = ("table", "slot")

    def __init__(self, table: RowTable, slot: int):
        self.table = table
        self.slot = slot

    rank = _column("rank")  # OUTCOME_RANK of the winning line (NO_WINNER: every line was filtered)
    prompt_index = _column("prompt_index")  # of the winning line, as committed
    failures = _column("failures")  # failed lines of this row (the next attempt is failures + 1)
    attempts = _column("attempts")  # all lines of this row
    file_no = _column("file_no")  # where the winning line is; -1 when known from checkpoint.json only
    line_no = _column("line_no")  # 1-based line number in its file
    offset = _column("offset")
    length = _column("length")
    sample = _column("sample")  # metadata.sample of the winning line
    passed = _optional_bool("passed")  # its primary score passed (None: not scored)
    score = _optional_float("score")  # its primary score's value
    error_class = _sparse("error_class")
    row_id = _sparse("row_id")  # metadata.id of the winning line
    detail = _sparse("detail")  # what the view's `detail` hook made of the winning line (the report's)
    rescored = _sparse("rescored")  # the winning line's latest scores when --rescore gave it some
    pending = _sparse("pending")  # (usage, duration, tally part) of an ok winner until the selection is made

    @property
    def selected(self) -> bool:
        """An ok winner that --keep puts into trajectories.jsonl."""
        columns = self.table.columns
        return bool(columns["selected"][self.slot]) if "selected" in columns else True

    @selected.setter
    def selected(self, value: bool) -> None:
        columns = self.table.columns
        if "selected" in columns:
            columns["selected"][self.slot] = int(bool(value))

    def beaten_by(self, rank: int) -> bool:
        """THE rule: a strictly better outcome wins; the first line of an outcome stays."""
        return rank > self.rank

    @property
    def committed(self) -> bool:
        """Done for good: ok or discarded (a failed or filtered row runs again on resume)."""
        return self.rank >= _DISCARDED_RANK

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RowEntry) and other.table is self.table and other.slot == self.slot

    def __hash__(self) -> int:
        return hash((id(self.table), self.slot))

    def __lt__(self, other: RowEntry) -> bool:  # sorted() of tuples that end in an entry
        return self.slot < other.slot
