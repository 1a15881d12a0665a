"""The run view: what the batch files of a run say, read in one pass by one rule.

Every reader of a run directory goes through this module: resume (`RunStore.load`, which starts
from the counts cached in checkpoint.json and reads only the lines after them), the merge into
trajectories.jsonl, statistics.json and report.html. They cannot disagree, because they share:

- **the rule** (`RowEntry.beaten_by`): for each row key the best outcome wins (ok > discarded >
  failed), and among lines of the same outcome the first committed one (the store never commits a
  second ok or discarded line of a row, so later copies are duplicates of a result that arrived
  twice). An ok line that names a tool we do not know is not a candidate (it is "filtered"): the
  row counts as not done, and a resume runs it again;
- **the dataset**: with a dataset given, only its rows count; lines of rows that are no longer in
  it are "stale" (kept in the batch files, left out of every count but the spend);
- **the spend**: requests, tokens, cost, retries and session time are summed over every committed
  line, kept or not, and split by what became of the line (`SPEND_BUCKETS`).

Lines are parsed with orjson and read through `runner.storage.records.read_line`, not validated again:
the models validated them when they were written.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from agent.usage import COUNT_FIELDS, TOKEN_FIELDS, Spend
from runner.input.samples import row_key_of
from runner.storage.records import OUTCOME_RANK, RESCORES_FILE, LineFields, read_line, read_rescores
from runner.storage.rowtable import NO_WINNER, RowEntry, RowTable  # noqa: F401 (RowEntry: its home for callers)
from runner.storage.scores import ScoreTally, primary_score
from runner.storage.spendtally import SpendTally
from tools.registry import all_tool_names

OK_RANK, DISCARDED_RANK = OUTCOME_RANK["ok"], OUTCOME_RANK["discarded"]
TOKEN_KEYS = TOKEN_FIELDS
COUNT_KEYS = COUNT_FIELDS
# Where each committed line's spend goes: kept (the lines of trajectories.jsonl), discarded
# (tombstones), failed (failed attempts, retried or not) and other (ok lines that are not kept:
# filtered, duplicates, rows no longer in the dataset). Their sum is the spend of every line.
SPEND_BUCKETS = ("kept", "discarded", "failed", "other")
_UNUSED = {"count": 0, "success": 0, "failure": 0}


@dataclass
class KeptTally:
    """Figures over the kept rows (the lines of trajectories.jsonl), as the original counts them."""

    ok: int = 0
    completed: int = 0
    partial: int = 0
    turn_limit: int = 0
    api_calls: int = 0
    tool_stats: dict[str, dict[str, int]] = field(default_factory=dict)
    reasoning: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("total_assistant_turns", "turns_with_reasoning", "turns_without_reasoning"), 0))

    def add(self, raw: dict) -> None:
        self.ok += 1
        completed, partial = bool(raw.get("completed")), bool(raw.get("partial"))
        self.completed += completed
        self.partial += partial
        self.turn_limit += not completed and not partial
        api_calls = raw.get("api_calls")
        self.api_calls += api_calls if isinstance(api_calls, int) else 0
        for name, stats in raw["tool_stats"].items():
            if stats != _UNUSED and isinstance(stats, dict):  # most tools are not called in a row
                total = self.tool_stats.setdefault(name, {"count": 0, "success": 0, "failure": 0})
                for k in total:
                    v = stats.get(k)
                    total[k] += v if isinstance(v, int) else 0
        reasoning = raw.get("reasoning_stats")
        if isinstance(reasoning, dict):
            for k in self.reasoning:
                v = reasoning.get(k)
                self.reasoning[k] += v if isinstance(v, int) else 0


@dataclass(frozen=True)
class Selection:
    """What the outputs keep, decided when they are built (never when a line is committed, so a
    changed filter or selection needs no new model request)."""

    discard_no_reasoning: bool = False  # the original's filter: an ok line whose model never reasoned
    keep: str = "all"  # all | passing | best (--keep)
    stop_after_passing: int | None = None  # a row's samples it spared are done, not "not run"

    @classmethod
    def of(cls, config: Any) -> Selection:
        """From a RunConfig, or config.json's "config" mapping."""
        if isinstance(config, Mapping):
            reasoning = config.get("reasoning") or {}
            disabled = isinstance(reasoning, Mapping) and reasoning.get("effort") == "none"
            discard = not (config.get("keep_no_reasoning") or disabled)
            keep, stop = config.get("keep"), config.get("stop_after_passing")
        else:
            discard, keep, stop = config.discard_without_reasoning, config.keep, config.stop_after_passing
        return cls(discard_no_reasoning=bool(discard), keep=keep if keep in ("passing", "best") else "all",
                   stop_after_passing=stop if isinstance(stop, int) and not isinstance(stop, bool) else None)


def without_reasoning(raw: dict) -> bool:
    """An ok line whose model never reasoned (what the no-reasoning filter discards)."""
    stats = raw.get("reasoning_stats")
    return isinstance(stats, dict) and not stats.get("turns_with_reasoning")


def quality_outcome(raw: dict, outcome: str, selection: Selection) -> str:
    """The outcome of a committed line once the quality filters are applied: ok, discarded or failed."""
    if outcome == "ok" and selection.discard_no_reasoning and without_reasoning(raw):
        return "discarded"
    return outcome


def _tally_part(raw: dict) -> dict:
    """What KeptTally.add reads of a line, without its conversation."""
    return {name: raw.get(name) for name in ("completed", "partial", "api_calls", "tool_stats", "reasoning_stats")}


def invalid_tool(raw: dict) -> str | None:
    """Why an ok line cannot be kept: a tool name we do not know, or no conversation at all."""
    stats = raw.get("tool_stats")
    if not isinstance(stats, dict) or not isinstance(raw.get("conversations"), list):
        return "<malformed row>"
    known = _known_tools()
    if known.issuperset(stats):
        return None
    return next(name for name in stats if name not in known)


@functools.cache
def _known_tools() -> frozenset[str]:
    return frozenset(all_tool_names())


def parse_time(value: Any) -> float | None:
    if not isinstance(value, str):
        return None
    try:
        return datetime.fromisoformat(value).timestamp()
    except ValueError:
        return None


Detail = Callable[[LineFields, RowEntry], Any]


class RunView:
    """The rows of a run as its batch files say, and what every line spent.

    `dataset` maps the row keys of the current dataset to their index (None: every key in the
    files is a row, as the store sees them); `ids` gives their current ids. `tally=True` adds the
    figures over kept rows and the per-invocation time spans (the merge needs them; a resume
    does not). `detail(fields, entry)` is called for each line that becomes a row's winner, and
    its value kept on the entry (the report's per-row summary); `on_line(fields)` for every
    committed line, stale ones included (a reader with sums of its own: the files are read once).
    """

    def __init__(self, dataset: Mapping[str, int] | None = None, *, ids: Mapping[str, str] | None = None,
                 tally: bool = True, detail: Detail | None = None,
                 on_line: Callable[[LineFields], None] | None = None, log: Callable[[str], None] = print,
                 selection: Selection = Selection(), units: Mapping[str, int] | None = None,
                 located: bool = True):
        self.dataset = dataset
        self.selection = selection
        self.ids = ids or {}
        self.tally = tally
        self.detail = detail
        self.on_line = on_line
        self.log = log
        self.files: list[Path] = []
        # row key -> RowEntry, in columns sized by the dataset's units (`units`, else `dataset`);
        # `located=False`: without where each winning line is (the store does not need it)
        self.rows = RowTable(units if units is not None else dataset, located=located)
        self.stale: set[str] = set()
        self.lines = 0
        self.unreadable = 0
        self.filtered = 0
        # "unselected": ok samples that --keep leaves out of trajectories.jsonl
        self.spend = {name: Spend() for name in SPEND_BUCKETS + (("unselected",) if selection.keep != "all" else ())}
        self.kept = KeptTally()
        self.discarded_work = KeptTally()  # the same figures over the rows the filters discarded
        self.scores = ScoreTally()
        self.unselected = 0
        self.batch_stats: dict[str, dict[str, int]] = {}
        self.spans: dict[str, list] = {}  # run_id -> [first start, last end, lines], from line timestamps
        # spend by model, retried attempts and spend over time (the merge and the report need them)
        self.cost = SpendTally() if tally else None
        # (row key, run id, attempt) -> scores of a committed ok line given by --rescore
        self.rescores: dict[tuple[str, str, int], list[dict]] = {}

    def read_rescores(self, run_dir: Path) -> None:
        """rescores.jsonl: its scores replace those of the lines they name; what its judge
        requests spent is the "rescoring" spend (a bucket only runs that were rescored have)."""
        self.rescores, usages = read_rescores(Path(run_dir) / RESCORES_FILE)
        if usages:
            self.spend["rescoring"] = Spend()
        for item in usages:
            self.spend["rescoring"].add(item["usage"], None)
            if self.cost is not None:
                self.cost.add("rescoring", item["row_key"], item["timestamp"], item["usage"])

    # --- reading ----------------------------------------------------------------------------

    def read_file(self, file_no: int, path: Path, start: int = 0, line_no: int = 0) -> int:
        """Add every complete line of `path` from byte `start`; returns the offset after the last."""
        end = start
        with open(path, "rb") as handle:
            handle.seek(start)
            for line in handle:
                if not line.endswith(b"\n"):
                    break  # an unfinished tail is not a line (the store moves it aside)
                line_no += 1
                fields = read_line(line)
                if fields is None:
                    self.lines += 1
                    self.unreadable += 1
                    self.log(f"   ⚠️  {path.name}: skipping an unreadable line at byte {end}")
                else:
                    self.add(fields, file_no, line_no, end, len(line), path.stem.split("_")[-1])
                end += len(line)
        return end

    def add(self, fields: LineFields, file_no: int = -1, line_no: int = 0, offset: int = 0, length: int = 0,
            batch: str | None = None) -> None:
        """Count one committed line (read from a file, or just committed by the store)."""
        self.lines += 1
        key = fields.key
        outcome = quality_outcome(fields.raw, fields.outcome, self.selection)
        rank = OUTCOME_RANK[outcome]
        batch_num = fields.batch_num
        self._count_batch(str(batch if batch_num is None else batch_num), outcome)
        if self.tally:
            self._note_span(fields)
        if self.on_line is not None:
            self.on_line(fields)
        if self.dataset is not None and key not in self.dataset:
            self.stale.add(key)
            self._spend("other" if outcome == "ok" else outcome, fields)
            return
        entry = self.rows.get(key)
        if entry is None:
            entry = self.rows.create(key, NO_WINNER, fields.prompt_index)
        entry.attempts += 1
        if outcome == "failed":
            entry.failures += 1
        rescored = self._rescore(fields) if self.rescores and fields.outcome == "ok" else None
        if outcome == "ok" and (bad := invalid_tool(fields.raw)):
            self.filtered += 1
            where = self.files[file_no].name if 0 <= file_no < len(self.files) else "a new line"
            self.log(f"   ⚠️  Filtering a row of {where}: invalid tool '{bad[:50]}'")
            self._spend("other", fields)
            return
        if not entry.beaten_by(rank):
            self._spend("other" if outcome == "ok" else outcome, fields)
            return
        scores = fields.meta.scores if outcome != "failed" else None
        primary = primary_score(scores)
        self.rows.set_winner(entry.slot, rank, fields.prompt_index, file_no, line_no, offset, length,
                             error_class=fields.error_class, row_id=fields.row_id, sample=fields.meta.sample,
                             rescored=rescored, passed=primary.passed if primary else None,
                             score=primary.value if primary else None)
        if primary is not None and self.tally:
            self.scores.add(row_key_of(key), scores)
        if outcome == "ok" and self.selection.keep != "all":
            entry.pending = (fields.usage, fields.duration, _tally_part(fields.raw))  # select() decides
        elif outcome == "ok":
            self._spend("kept", fields)
            if self.tally:
                self.kept.add(fields.raw)
        else:
            self._spend(outcome, fields)
            if outcome == "discarded" and self.tally and isinstance(fields.raw.get("tool_stats"), dict):
                self.discarded_work.add(fields.raw)
        if self.detail is not None:
            entry.detail = self.detail(fields, entry)

    def select(self) -> None:
        """--keep=passing|best, once every line is read: which ok samples trajectories.jsonl holds.
        passing: the samples whose primary score passed; best: one per row, the highest primary
        value (ties: the lowest sample index). The others are "unselected": counted, their spend
        reported apart."""
        keep = self.selection.keep
        pending = [(key, entry) for key, entry in self.rows.items() if entry.pending is not None]
        chosen: set[str] = set()
        if keep == "passing":
            chosen = {key for key, entry in pending if entry.passed}
        elif keep == "best":
            best: dict[str, tuple] = {}
            for key, entry in pending:
                rank = (entry.score if entry.score is not None else float("-inf"), -entry.sample)
                row = row_key_of(key)
                if row not in best or rank > best[row][0]:
                    best[row] = (rank, key)
            chosen = {key for _rank, key in best.values()}
        for key, entry in pending:
            usage, duration, part = entry.pending
            entry.pending = None
            entry.selected = key in chosen
            self.spend["kept" if entry.selected else "unselected"].add(usage, duration)
            if not entry.selected:
                self.unselected += 1
            elif self.tally:
                self.kept.add(part)

    def _rescore(self, fields: LineFields) -> list | None:
        """Put the line's latest rescore in place of its own scores; those scores, if it had one."""
        scores = self.rescores.get((fields.key, fields.run_id, fields.meta.attempt))
        if scores is not None:
            fields.meta.replace("scores", scores)
        return scores

    def _spend(self, bucket: str, fields: LineFields) -> None:
        self.spend[bucket].add(fields.usage, fields.duration)
        if self.cost is not None:
            self.cost.add(bucket, fields.key, fields.timestamp, fields.usage)

    def _note_span(self, fields: LineFields) -> None:
        end = parse_time(fields.timestamp)
        if end is None:
            return
        start = end - (fields.duration or 0.0)
        span = self.spans.get(fields.run_id)
        if span is None:
            self.spans[fields.run_id] = [start, end, 1]
        else:
            span[0], span[1], span[2] = min(span[0], start), max(span[1], end), span[2] + 1

    def _count_batch(self, batch: str, outcome: str) -> None:
        stats = self.batch_stats.get(batch)
        if stats is None:
            stats = self.batch_stats[batch] = {"processed": 0, "ok": 0, "discarded_no_reasoning": 0, "failed": 0}
        stats["processed"] += 1
        stats["discarded_no_reasoning" if outcome == "discarded" else outcome] += 1

    # --- what the readers ask -----------------------------------------------------------------

    def total_spend(self) -> Spend:
        total = Spend()
        for bucket in self.spend.values():
            total += bucket
        return total

    def entry(self, key: str) -> RowEntry | None:
        return self.rows.get(key)

    def current(self, key: str) -> tuple[int, str]:
        """A row's position and id in the current dataset (as committed, read without a dataset):
        what trajectories.jsonl and report.html both carry, so a dataset edit shows in both."""
        entry = self.rows[key]
        if self.dataset is None:
            return entry.prompt_index, entry.row_id
        return self.dataset[key], self.ids.get(key, "")

    def is_committed(self, key: str) -> bool:
        entry = self.rows.get(key)
        return entry is not None and entry.committed

    def counts(self) -> dict[str, Any]:
        """Row outcomes of the dataset (every key in the files when no dataset was given). With
        --stop_after_passing, the samples of a row that passed enough which were not run (or whose
        attempts failed) are "spared": done, neither failed nor "not run"."""
        spared = spared_winnerless = 0
        if self.selection.stop_after_passing is None:  # nothing is spared: a pass over the columns
            retried, discarded, failed, with_winner, failed_by_class = self.rows.outcome_tally()
        else:
            discarded = failed = retried = with_winner = 0
            failed_by_class: dict[str, int] = {}
            spares = self._spares()
            for key, entry in self.rows.items():
                rank = entry.rank
                retried += entry.attempts > 1
                with_winner += rank != NO_WINNER
                if rank == DISCARDED_RANK:
                    discarded += 1
                elif rank < DISCARDED_RANK and spares(key):
                    spared += 1
                    spared_winnerless += rank == NO_WINNER
                elif rank == OUTCOME_RANK["failed"]:
                    failed += 1
                    cls = entry.error_class or "agent"
                    failed_by_class[cls] = failed_by_class.get(cls, 0) + 1
        total = len(self.dataset) if self.dataset is not None else len(self.rows)
        spared_unrun = 0
        if self.dataset is not None and self.selection.stop_after_passing is not None:
            spared_unrun = sum(1 for key in self.dataset if key not in self.rows and spares(key))
        outcomes = {
            "ok": self.kept.ok,
            "completed": self.kept.completed,
            "partial": self.kept.partial,
            "turn_limit": self.kept.turn_limit,
            "discarded": discarded,
            "failed": failed,
            "not_run": total - with_winner - spared_unrun - spared_winnerless,
            "filtered": self.filtered,
        }
        if self.selection.keep != "all":
            outcomes["unselected"] = self.unselected
        if self.selection.stop_after_passing is not None:
            outcomes["spared"] = spared + spared_unrun
        return {
            "outcomes": outcomes,
            "failed_by_class": dict(sorted(failed_by_class.items())),
            "retried_rows": retried,
        }

    def passed_by_row(self) -> dict[str, int]:
        """Row key -> its committed samples whose primary score passed."""
        passed: dict[str, int] = {}
        for key, entry in self.rows.items():
            if entry.passed and entry.rank >= DISCARDED_RANK:
                row = row_key_of(key)
                passed[row] = passed.get(row, 0) + 1
        return passed

    def _spares(self) -> Callable[[str], bool]:
        """Does --stop_after_passing spare this sample key (its row has that many passing samples)?"""
        wanted = self.selection.stop_after_passing
        if wanted is None:
            return lambda key: False
        passed = self.passed_by_row()
        return lambda key: passed.get(row_key_of(key), 0) >= wanted


def read_run(files: list[Path], view: RunView) -> RunView:
    """Read every batch file (in order) into `view`, then make the selection (--keep)."""
    view.files = list(files)
    if files:
        view.read_rescores(files[0].parent)
    for file_no, path in enumerate(files):
        view.read_file(file_no, path)
    view.select()
    return view
