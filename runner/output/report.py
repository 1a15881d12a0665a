"""report.html: one self-contained page to look at a run, rebuilt from the run's files.

The page never counts by itself: every count (outcomes, failures by class, tool and reasoning
figures, spend) is the statistics dict of `runner.output.finalize.build_statistics`, made from the same
run view (runner/storage/runview.py) that wrote trajectories.jsonl. What this module adds are charts
(timeline, histograms, toolset shares, throughput) and a compact summary of every row plus the
full conversations of a bounded, deterministic sample. At the end of a run the runner hands over
its view (`report_details` is the per-row hook the view calls while it reads, so the batch files
are read once); `--report` builds the same view from the files and the dataset named in
config.json.

Why the charts are inline SVG drawn by about 200 lines of our own JavaScript, not a chart
library: the report must open from disk on an offline machine years later, so everything has to
be inline (no CDN). Vendoring a library would add 200 KB to 3 MB of third-party code to every
report, plus a licence and an upgrade path to look after, for six simple chart types (horizontal
bars, histograms, a target marker, a cumulative area over time, a 100 % bar and a meter). SVG is
vector (sharp at any zoom and in print), its text is real text that can be selected, searched,
read by screen readers and by the browser test, it takes the page's CSS, and every mark carries a
`<title>` tooltip with the exact figure. The numbers themselves are computed here, in Python,
where they are unit-tested; the JavaScript only draws them.
"""

from __future__ import annotations

import gc
import hashlib
import heapq
import math
import os
import re
import tempfile
from array import array
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import orjson

from runner.output.statistics import dataset_of, statistics_of
from runner.storage.records import OUTCOMES, LineFields, dropped_lines, note_lines, read_line
from runner.storage.runfiles import ConfigFile, read_config, read_statistics
from runner.storage.runview import Detail, RowEntry, RunView, Selection, parse_time, read_run
from runner.output.spend_view import read_invocations
from runner.output.status import THROUGHPUT_DEFINITION, rows_per_minute, throughput_text
from runner.storage.store import batch_files, keep_mode
from runner.timestamps import iso_of, now_iso

REPORT_NAME = "report.html"
TEMPLATE = Path(__file__).with_name("report_template.html")
PREVIEW_CHARS = 120
ERROR_CHARS = 200
ID_CHARS = 60
TIMELINE_BUCKETS = 120
# Size bounds of the embedded conversations: one value (a reasoning block, a tool result) keeps
# its head and tail; once a conversation or the whole report is past its budget, values shrink.
VALUE_CHARS = 16_000
VALUE_CHARS_TIGHT = 2_000
CONVERSATION_CHARS = 200_000
REPORT_CONVERSATION_CHARS = 24_000_000
# The rows table lists at most this many rows (a sample shared fairly between outcome classes
# past it, every failure class apart), so the page stays a few MB at a million rows; every count
# and chart is over all the rows.
TABLE_ROWS = 10_000

# Row outcome codes on the page; "ok" in statistics.json is OK + PARTIAL.
OK, PARTIAL, DISCARDED, FAILED = 0, 1, 2, 3
OUTCOME_NAMES = ("ok", "partial", "discarded", "failed")
_MARKER = re.compile(rb"\{\{([A-Z_]+)\}\}")


@dataclass(slots=True)
class _Row:
    """The winning line of one row, reduced to what the report needs (made by `report_details`)."""

    key: str
    code: int
    index: int
    entry: RowEntry  # where the line is (file, line number, offset)
    error_class: str | None
    error: str
    row_id: str  # as committed, until `_read_rows` sets the current one
    preview: str
    ts: float | None
    duration: float | None
    toolsets: tuple[str, ...] | None  # offered to the model
    sampled: tuple[str, ...] | None  # drawn from the distribution
    tools: dict[str, tuple[int, int, int]] | None  # tool -> (count, success, failure), called tools only
    tool_calls: int | None
    turns: int | None
    reasoning: tuple[int, int, int] | None  # total, with, without
    completed: bool
    partial: bool
    scores: tuple[tuple[str, float, bool, str], ...] = ()  # metadata.scores: (scorer, value, passed, explanation)

    @property
    def file_no(self) -> int:
        return self.entry.file_no

    @property
    def line_no(self) -> int:
        return self.entry.line_no

    @property
    def sample_class(self) -> str:
        return f"failed:{self.error_class}" if self.code == FAILED else OUTCOME_NAMES[self.code]


def _one_line(text: Any, limit: int) -> str:
    if not isinstance(text, str):
        return ""
    flat = " ".join(text[: limit * 4].split())
    return flat if len(flat) <= limit else flat[: limit - 1].rstrip() + "…"


def _prompt_of(record: dict) -> str:
    prompt = record.get("prompt")
    if isinstance(prompt, str):
        return prompt
    for turn in record.get("conversations") or ():
        if isinstance(turn, dict) and turn.get("from") == "human":
            return str(turn.get("value") or "")
    return ""


def _int(value: Any) -> int:
    try:
        return int(value or 0)
    except (TypeError, ValueError):
        return 0


_UNUSED = {"count": 0, "success": 0, "failure": 0}


def _tool_counts(raw: Any) -> dict[str, tuple[int, int, int]]:
    """tool -> (count, success, failure) of the tools a row called (most of its entries are zero)."""
    if not isinstance(raw, dict):
        return {}
    counts = {}
    for name, s in raw.items():
        if s != _UNUSED and isinstance(s, dict):
            c = (_int(s.get("count")), _int(s.get("success")), _int(s.get("failure")))
            if c != (0, 0, 0):
                counts[str(name)] = c
    return counts


def _strings(value: Any) -> tuple[str, ...] | None:
    return tuple(value) if isinstance(value, list) else None


def _make_row(fields: LineFields, entry: RowEntry) -> _Row:
    """The report's view of a row's winning line (the run view calls this while it reads)."""
    record = fields.raw
    outcome = OUTCOMES[entry.rank]  # the view's: the quality filters applied
    tools = turns = reasoning = toolsets = None
    if outcome == "failed":
        code = FAILED
    else:
        code = DISCARDED if outcome == "discarded" else PARTIAL if record.get("partial") else OK
        tools = _tool_counts(record.get("tool_stats"))
        toolsets = _strings(record.get("toolsets_used")) or ()
        rs = record.get("reasoning_stats")
        rs = rs if isinstance(rs, dict) else {}
        reasoning = (_int(rs.get("total_assistant_turns")), _int(rs.get("turns_with_reasoning")),
                     _int(rs.get("turns_without_reasoning")))
        turns = reasoning[0]
        if not turns and isinstance(record.get("conversations"), list):
            turns = sum(1 for t in record["conversations"] if isinstance(t, dict) and t.get("from") == "gpt")
    return _Row(
        key=fields.key, code=code, index=fields.prompt_index, entry=entry,
        error_class=fields.error_class if code == FAILED else None,
        error=_one_line(record.get("error"), ERROR_CHARS) if code == FAILED else "",
        row_id=fields.row_id,
        preview=_one_line(_prompt_of(record), PREVIEW_CHARS),
        ts=parse_time(fields.timestamp),
        duration=fields.duration,
        toolsets=toolsets,
        sampled=(_strings(fields.meta.toolsets_sampled) or toolsets) if toolsets is not None else None,
        tools=tools, tool_calls=None if tools is None else sum(c[0] for c in tools.values()),
        turns=turns, reasoning=reasoning,
        completed=bool(record.get("completed")),
        partial=bool(record.get("partial")),
        scores=_scores_of(fields.meta.scores),
    )


def _scores_of(raw: Any) -> tuple[tuple[str, float, bool, str], ...]:
    """A line's scores (its latest rescore's, which the run view put in place), as plain tuples."""
    if not isinstance(raw, list):
        return ()
    scores = []
    for entry in raw:
        if isinstance(entry, dict) and isinstance(entry.get("value"), (int, float)):
            scores.append((str(entry.get("scorer") or ""), float(entry["value"]), entry.get("passed") is True,
                           _one_line(entry.get("explanation"), ERROR_CHARS)))
    return tuple(scores)


def _scoring(primary: Counter, rows: list[_Row], stats: dict) -> dict | None:
    """The scores panel: statistics.json's scoring figures (counted where statistics.json is made;
    from the rows of the page's table only when it has none), and the distribution of the primary
    values of every scored ok row (`primary`: rounded value -> rows)."""
    if not primary:
        return None
    figures = stats.get("scoring")
    scored = [r for r in rows if r.scores and r.code in (OK, PARTIAL)]
    if not isinstance(figures, dict) and scored:
        names: list[str] = []
        totals: dict[str, list[float]] = {}
        for r in scored:
            for name, value, _passed, _why in r.scores:
                if name not in totals:
                    names.append(name)
                    totals[name] = [0.0, 0]
                totals[name][0] += value
                totals[name][1] += 1
        passed = sum(r.scores[0][2] for r in scored)
        figures = {"scorers": names, "samples": len(scored), "passed": passed,
                   "mean": round(sum(r.scores[0][1] for r in scored) / len(scored), 6),
                   "pass_at_k": {"1": round(passed / len(scored), 6)},
                   "errors": sum(why.startswith("scorer error") for r in scored for _n, _v, _p, why in r.scores),
                   "by_scorer": {name: round(total / count, 6) for name, (total, count) in totals.items()}}
    return {**(figures or {}), "distribution": [[value, primary[value]] for value in sorted(primary)]}


class ReportColumns:
    """The report's figures of every row, in columns by the run view's slot: the hook a RunView
    calls for each line that becomes a row's winner (`report_details()` makes one per view).

    About 40 bytes a row: the charts (timeline, histograms, toolset shares, tool rows) need a few
    numbers of every row, never its text. Toolsets and called tools repeat from row to row, so a
    row holds the number of its combination. The rows table and the full conversations are a
    bounded sample whose lines are read again at the end (`_table_rows`)."""

    def __init__(self) -> None:
        self.code = array("b")  # OK..FAILED; -1: no winner in this slot
        self.ts = array("d")  # the winning line's timestamp (NaN: none)
        self.duration = array("d")  # NaN: none
        self.turns = array("i")  # -1: none (a failed row)
        self.tool_calls = array("i")
        self.toolsets = array("i")  # index in `toolset_pairs`; -1: none (a failed row)
        self.tools = array("i")  # index in `tool_sets`: the tools the row called
        self.score = array("d")  # the first score's value (NaN: not scored)
        self.toolset_pairs: list[tuple[tuple[str, ...], tuple[str, ...]]] = []  # (offered, sampled)
        self.tool_sets: list[tuple[str, ...]] = []
        self._numbers: dict[Any, int] = {}

    def _number(self, table: list, value: Any) -> int:
        found = self._numbers.get((id(table), value))
        if found is None:
            found = self._numbers[(id(table), value)] = len(table)
            table.append(value)
        return found

    def __call__(self, fields: LineFields, entry: RowEntry) -> None:
        row = _make_row(fields, entry)
        slot = entry.slot
        if slot >= len(self.code):
            grow = slot + 1 - len(self.code)
            for column, default in ((self.code, -1), (self.ts, math.nan), (self.duration, math.nan), (self.turns, -1),
                                    (self.tool_calls, -1), (self.toolsets, -1), (self.tools, -1), (self.score, math.nan)):
                column.extend([default] * grow)
        self.code[slot] = row.code
        self.ts[slot] = math.nan if row.ts is None else row.ts
        self.duration[slot] = math.nan if row.duration is None else row.duration
        self.turns[slot] = -1 if row.turns is None else row.turns
        self.tool_calls[slot] = -1 if row.tool_calls is None else row.tool_calls
        self.toolsets[slot] = (-1 if row.toolsets is None else
                               self._number(self.toolset_pairs, (row.toolsets, tuple(row.sampled or ()))))
        called = tuple(name for name, (count, _, _) in (row.tools or {}).items() if count)
        self.tools[slot] = self._number(self.tool_sets, called)
        self.score[slot] = row.scores[0][1] if row.scores and row.code in (OK, PARTIAL) else math.nan
        return None  # nothing kept on the entry: the columns have it

    def slots(self) -> Iterator[int]:
        """The slots that have a winner."""
        return (slot for slot, code in enumerate(self.code) if code >= 0)


def report_details() -> Detail:
    """The hook a RunView calls for each line that becomes a row's winner: the report's columns."""
    return ReportColumns()


def read_view(run_dir: Path, dataset: dict[str, int] | None = None, ids: dict[str, str] | None = None,
              log=lambda _: None) -> tuple[RunView, dict]:
    """The run view and its statistics, as the runner's merge makes them, against `dataset` or
    else the dataset config.json names (without either, every row in the files counts and
    "not run" is unknown). Writes nothing: the CLI's `--report` rebuilds statistics.json and
    trajectories.jsonl too (runner.output.finalize.rebuild_outputs)."""
    config = (read_config(run_dir) or ConfigFile()).config
    if dataset is None:
        dataset, ids = dataset_of(config)
    files = batch_files(run_dir) if run_dir.is_dir() else []
    view = read_run(files, RunView(dataset, ids=ids, detail=ReportColumns(), log=log, selection=Selection.of(config)))
    return view, statistics_of(run_dir, view)


def _rate(success: int, failure: int) -> float:
    answered = success + failure
    return round(success / answered * 100, 2) if answered else 0.0


def _timeline(columns: ReportColumns, first: float | None, last: float | None,
              invocations: dict[str, list]) -> dict | None:
    """Rows finished per time step by outcome (`first`, `last`: the earliest and latest stamp)."""
    if first is None or last is None:
        return None
    starts = [span[0] for span in invocations.values()] or [first]
    start, end = min(min(starts), first), last
    bucket = _nice_bucket((end - start) / TIMELINE_BUCKETS)
    count = min(int((end - start) // bucket) + 1, TIMELINE_BUCKETS + 1)
    series = [[0] * count for _ in OUTCOME_NAMES]
    for slot in columns.slots():
        ts = columns.ts[slot]
        if ts == ts:  # not NaN
            series[columns.code[slot]][min(count - 1, int((ts - start) // bucket))] += 1
    return {
        "start": iso_of(start, "milliseconds"),
        "start_epoch": start,
        "bucket_seconds": bucket,
        "series": dict(zip(OUTCOME_NAMES, series)),
        "invocation_starts": sorted(round(s - start, 3) for s in starts),
    }


_BUCKET_LADDER = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 15, 30, 60, 120, 300, 600,
                  900, 1800, 3600, 7200, 10800, 21600, 43200, 86400)


def _nice_bucket(raw: float) -> float:
    """The smallest round time step (1 s, 15 s, 5 min, 1 h, a day, ...) not below `raw` seconds."""
    for step in _BUCKET_LADDER:
        if step >= raw:
            return float(step)
    return float(math.ceil(raw / 86400) * 86400)


def _percentile(values, q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def _target_distribution(name: str | None) -> dict[str, float] | None:
    try:
        from toolset_distributions import DISTRIBUTIONS
    except ImportError:  # the report must still render if the catalogue cannot be imported
        return None
    entry = DISTRIBUTIONS.get(name or "")
    return dict(entry["toolsets"]) if entry else None


@dataclass
class _Figures:
    """What the charts show of every row with a winner, from the report's columns in one pass."""

    rows: int = 0
    rows_using: Counter = field(default_factory=Counter)  # tool -> ok rows that called it
    with_toolsets: int = 0  # rows that record their toolsets (ok and discarded)
    offered: Counter = field(default_factory=Counter)
    sampled: Counter = field(default_factory=Counter)
    durations: array = field(default_factory=lambda: array("d"))
    first: float | None = None  # earliest and latest stamp of a winning line
    last: float | None = None
    turns: Counter = field(default_factory=Counter)
    tool_calls: Counter = field(default_factory=Counter)
    primary: Counter = field(default_factory=Counter)  # rounded first score of scored ok rows -> rows


def _figures(columns: ReportColumns) -> _Figures:
    fig = _Figures()
    toolsets: Counter[int] = Counter()
    tools: Counter[int] = Counter()
    c = columns
    for slot in c.slots():
        fig.rows += 1
        code = c.code[slot]
        if code in (OK, PARTIAL):
            tools[c.tools[slot]] += 1
        if c.toolsets[slot] >= 0:
            toolsets[c.toolsets[slot]] += 1
        if (duration := c.duration[slot]) == duration:
            fig.durations.append(duration)
        if (ts := c.ts[slot]) == ts:
            fig.first = ts if fig.first is None else min(fig.first, ts)
            fig.last = ts if fig.last is None else max(fig.last, ts)
        if c.turns[slot] >= 0:
            fig.turns[c.turns[slot]] += 1
        if c.tool_calls[slot] >= 0:
            fig.tool_calls[c.tool_calls[slot]] += 1
        if (score := c.score[slot]) == score:
            fig.primary[round(score, 4)] += 1
    for number, rows in tools.items():
        for name in c.tool_sets[number]:
            fig.rows_using[name] += rows
    for number, rows in toolsets.items():
        offered, sampled = c.toolset_pairs[number]
        fig.with_toolsets += rows
        for name in set(offered):
            fig.offered[name] += rows
        for name in set(sampled):
            fig.sampled[name] += rows
    return fig


def _columns_of(view: RunView) -> ReportColumns:
    """The view's report columns (empty when it was read without the report's hook)."""
    return view.detail if isinstance(view.detail, ReportColumns) else ReportColumns()


def _table_rows(view: RunView, table_limit: int, full_limit: int) -> tuple[list[_Row], list[int]]:
    """The rows of the page's table, in dataset order, and the positions among them of the rows
    whose full conversation is embedded. Both are samples shared fairly between outcome classes
    (`choose_sample`'s rule): up to `table_limit` rows, and up to `full_limit` of them in full.
    Their lines are read again here; memory stays bounded by the limits, whatever the rows."""
    columns = _columns_of(view)
    keep = max(table_limit, full_limit, 0)
    sizes: Counter[str] = Counter()
    best: dict[str, list] = {}
    for key, entry in view.rows.items():
        slot = entry.slot
        if slot >= len(columns.code) or (code := columns.code[slot]) < 0:
            continue  # no winner (every line filtered)
        cls = f"failed:{entry.error_class}" if code == FAILED else OUTCOME_NAMES[code]
        sizes[cls] += 1
        members = best.setdefault(cls, [])
        members.append((_stable_hash(key), key, entry))
        if len(members) > 2 * keep + 64:
            best[cls] = heapq.nsmallest(keep, members)
    full_quota, table_quota = _quotas(sizes, full_limit), _quotas(sizes, table_limit)
    picked: dict[str, tuple[RowEntry, bool]] = {}
    for cls, members in best.items():
        members.sort()
        for position, (_hash, key, entry) in enumerate(members[: max(full_quota[cls], table_quota[cls])]):
            picked[key] = (entry, position < full_quota[cls])
    rows = _read_rows(view, picked)
    rows.sort(key=lambda r: (r.index, r.key))
    return rows, [pos for pos, row in enumerate(rows) if picked[row.key][1]]


def _read_rows(view: RunView, picked: dict[str, tuple[RowEntry, bool]]) -> list[_Row]:
    """The report's row of each picked key, from its winning line read again (with its rescore)."""
    rows = []
    handles: dict[int, Any] = {}
    try:
        for key, (entry, _full) in sorted(picked.items(), key=lambda kv: (kv[1][0].file_no, kv[1][0].offset)):
            if entry.file_no < 0:
                continue
            handle = handles.get(entry.file_no) or handles.setdefault(entry.file_no, open(view.files[entry.file_no], "rb"))
            handle.seek(entry.offset)
            fields = read_line(handle.read(entry.length))
            if fields is None:
                continue
            if entry.rescored is not None:
                fields.meta.replace("scores", entry.rescored)
            row = _make_row(fields, entry)
            row.index, row.row_id = view.current(key)
            rows.append(row)
    finally:
        for handle in handles.values():
            handle.close()
    return rows


def _summarise(run_dir: Path, view: RunView, stats: dict, fig: _Figures, rows: list[_Row]) -> dict:
    """What the page shows: the counts of `stats` (statistics.json), the charts over every row
    (`fig`), and `rows`, the rows of its table (for the scores panel's rare fallback)."""
    config_file = read_config(run_dir) or ConfigFile()
    config = config_file.config
    stats_path = run_dir / "statistics.json"
    saved_file = read_statistics(run_dir)
    saved = saved_file.data if saved_file is not None else None

    # Rows that called each tool (the chart's tooltip); the counts themselves are statistics.json's.
    rows_using = fig.rows_using
    tool_statistics = {
        name: {"count": t["count"], "success": t["success"], "failure": t["failure"],
               "success_rate": t["success_rate"], "rows": rows_using[name]}
        for name, t in sorted(stats["tool_statistics"].items(), key=lambda kv: (-kv[1]["count"], kv[0]))
    }

    # Toolsets: share of the rows that record them (ok and discarded), offered and sampled.
    offered, sampled = fig.offered, fig.sampled
    distribution = stats.get("distribution") or config.get("distribution")
    target = _target_distribution(distribution)
    names = list(target or {}) + sorted((set(offered) | set(sampled)) - set(target or {}))
    share = (lambda n: round(n / fig.with_toolsets * 100, 2) if fig.with_toolsets else 0.0)
    toolsets = {
        name: {
            "rows": offered[name],
            "share": share(offered[name]),
            "sampled_rows": sampled[name],
            "sampled_share": share(sampled[name]),
            "target": (target or {}).get(name, 0 if target is not None else None),
        }
        for name in names
    }

    newest_batch = max((p.stat().st_mtime for p in view.files), default=0.0)
    stats_outdated = saved is None or stats_path.stat().st_mtime + 1e-6 < newest_batch
    invocations = sorted(
        ({"run_id": rid, "start": iso_of(s, "seconds"),
          "seconds": round(e - s, 3), "lines": n} for rid, (s, e, n) in view.spans.items()),
        key=lambda item: item["start"],
    )
    run_time = stats["run_time"]
    active = run_time["running_seconds"]
    durations = fig.durations
    first, last = fig.first, fig.last
    return {
        "run_name": stats["run_name"],
        "run_dir": str(run_dir),
        "generated_at": now_iso("seconds"),
        "model": stats.get("model") or config.get("model"),
        "distribution": distribution,
        "fingerprint": config_file.fingerprint or stats.get("fingerprint"),
        "fingerprint_fields": config_file.fingerprint_fields,
        "config": config,
        "created_at": config_file.created_at,
        "updated_at": config_file.updated_at,
        "rows": fig.rows,
        "total_prompts": stats["total_prompts"],
        # Counts: statistics.json's, never the page's own.
        "outcomes": stats["outcomes"],
        "failed_by_class": stats["failed_by_class"],
        "retried_rows": stats["retried_rows"],
        "tool_statistics": tool_statistics,
        "toolsets": toolsets,
        "toolset_rows": fig.with_toolsets,
        "reasoning_statistics": stats["reasoning_statistics"],
        "discarded_no_reasoning": stats["discarded_no_reasoning"],
        "tokens": stats["tokens"],
        "cost": stats["cost"],
        "cache_hit_ratio": stats["cache_hit_ratio"],
        "spend": stats["spend"],
        # The spend panel: over time, by model, retried attempts, each invocation's closing forecast.
        "spend_view": {
            "curve": view.cost.curve() if view.cost is not None else None,
            "by_model": stats.get("spend_by_model") or {},
            "retried": stats.get("spend_retried"),
            "invocations": read_invocations(run_dir) if run_dir.is_dir() else [],
        },
        "scoring": _scoring(fig.primary, rows, stats),
        "retries": stats["retries"],
        "requests": stats["requests"],
        "api_calls": stats["api_calls"],
        "histograms": {
            "turns": _histogram(fig.turns),
            "tool_calls": _histogram(fig.tool_calls),
        },
        "timeline": _timeline(_columns_of(view), first, last, view.spans),
        "duration": {
            "first_row_at": iso_of(first, "seconds") if first is not None else None,
            "last_row_at": iso_of(last, "seconds") if last is not None else None,
            "span_seconds": round(last - first, 3) if first is not None else None,
            "active_seconds": active,
            "first_started_at": run_time["first_started_at"],
            "last_ended_at": run_time["last_ended_at"],
            "invocation_count": run_time["invocations"],
            "invocations": invocations,
            "rows_per_minute": _two_places(rows_per_minute(fig.rows, active)),
            "throughput": f"{throughput_text(rows_per_minute(fig.rows, active))} ({THROUGHPUT_DEFINITION})",
            "row_seconds_p50": _percentile(durations, 0.5),
            "row_seconds_p90": _percentile(durations, 0.9),
            "row_seconds_max": max(durations) if durations else None,
        },
        "files": {
            "batch_files": len(view.files),
            "lines": view.lines,
            "unreadable_lines": view.unreadable,
            "torn_files": sorted(p.name for p in run_dir.glob("batch_*.jsonl.torn")) if run_dir.is_dir() else [],
            "stale_rows": stats["stale_rows"],
        },
        "statistics": stats,
        "saved_statistics": saved,
        "statistics_outdated": stats_outdated,
    }


def _histogram(counts: Counter) -> dict[str, int]:
    return {str(k): counts[k] for k in sorted(counts)}


@contextmanager
def _no_gc_pauses():
    """Build the report without cyclic-GC passes: 100,000 live row summaries make every full
    collection walk them all, which cost a third of the time; nothing here creates cycles."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def summarise_run(run_dir: Path, view: RunView | None = None, statistics: dict | None = None, *,
                  dataset: dict[str, int] | None = None, ids: dict[str, str] | None = None) -> dict:
    """Every figure the report shows (JSON-serialisable): from the runner's view and statistics,
    or, without them, from the run directory's files (see `read_view`)."""
    run_dir = Path(run_dir)
    with _no_gc_pauses():
        if view is None or statistics is None:
            view, statistics = read_view(run_dir, dataset, ids)
        rows, _full = _table_rows(view, TABLE_ROWS, 0)
        return _summarise(run_dir, view, statistics, _figures(_columns_of(view)), rows)


# --- the sample of full conversations --------------------------------------------------------


def _stable_hash(key: str) -> bytes:
    return hashlib.blake2b(key.encode(), digest_size=8).digest()


def choose_sample(rows: list[_Row], limit: int) -> list[int]:
    """Positions in `rows` of at most `limit` rows, shared fairly between outcome classes.

    Every class (ok, partial, discarded, each failure class) gets an equal share; a class with
    fewer rows gives its unused share to the others (`_quotas`). Within a class the rows are
    ordered by a hash of their key, so the choice is deterministic and spread over the whole run.
    """
    classes: dict[str, list[int]] = {}
    for pos, row in enumerate(rows):
        classes.setdefault(row.sample_class, []).append(pos)
    quota = _quotas({name: len(members) for name, members in classes.items()}, limit)
    chosen: list[int] = []
    for name, members in classes.items():
        members.sort(key=lambda pos: _stable_hash(rows[pos].key))
        chosen.extend(members[: quota[name]])
    return sorted(chosen)


def _quotas(sizes: dict[str, int], limit: int) -> dict[str, int]:
    """Rows to take of each class (`sizes`: its rows), at most `limit` in all: equal shares, a
    small class's unused share going to the others (the smallest classes served first; between
    equal sizes, the class met first in `sizes`)."""
    quota = dict.fromkeys(sizes, 0)
    left = max(0, limit)
    open_classes = sorted(sizes, key=lambda c: sizes[c])
    while left and open_classes:
        share = max(1, left // len(open_classes))
        for name in list(open_classes):
            take = min(share, sizes[name] - quota[name], left)
            quota[name] += take
            left -= take
            if quota[name] == sizes[name]:
                open_classes.remove(name)
            if not left:
                break
    return quota


class _Clipper:
    """Shortens long values (head and tail kept) within per-conversation and per-report budgets."""

    def __init__(self):
        self.report_chars = 0

    def conversation(self) -> Callable[[str], str]:
        used = 0

        def clip(text: Any) -> str:
            nonlocal used
            text = text if isinstance(text, str) else orjson.dumps(text).decode()
            tight = used > CONVERSATION_CHARS or self.report_chars > REPORT_CONVERSATION_CHARS
            limit = VALUE_CHARS_TIGHT if tight else VALUE_CHARS
            if len(text) > limit:
                head = limit * 3 // 4
                text = (f"{text[:head]}\n\n… [{len(text) - limit:,} characters left out of this report; "
                        f"the batch file has them all] …\n\n{text[-(limit - head):]}")
            used += len(text)
            self.report_chars += len(text)
            return text

        return clip


def _full_entry(fields: LineFields, row: _Row, files: list[Path], clipper: _Clipper, systems: dict[str, int]) -> dict:
    clip = clipper.conversation()
    record, metadata = fields.raw, fields.meta
    turns = []
    for turn in record.get("conversations") or ():
        if not isinstance(turn, dict):
            continue
        role, value = str(turn.get("from") or "?"), turn.get("value")
        if role == "system" and isinstance(value, str) and len(value) > 400:
            # The system turn (the tool schemas) repeats in every row: stored once per report.
            turns.append([role, None, systems.setdefault(value, len(systems))])
        else:
            turns.append([role, clip(value if value is not None else "")])
    present = metadata.present()
    meta = {k: present[k] for k in ("row_key", "timestamp", "attempt", "duration_seconds", "model",
                                    "stop_reason", "seed", "run_id") if present.get(k) is not None}
    meta["id"] = row.row_id  # the current dataset's (the run view's), not the committed one
    meta["file"] = f"{files[row.file_no].name}:{row.line_no}"
    if row.scores:  # the run view's (a rescore's when there was one), not necessarily the line's own
        meta["scores"] = [{"scorer": n, "value": v, "passed": p, "explanation": e} for n, v, p, e in row.scores]
    if isinstance(present.get("usage"), dict):
        meta["usage"] = present["usage"]  # as committed
    for name in ("tools_offered", "toolsets_sampled"):
        if isinstance(present.get(name), list) and present[name]:
            meta[name] = present[name]
    for name, as_text in (("loop_notes", note_lines), ("dropped_replies", dropped_lines)):
        value = present.get(name)
        if isinstance(value, list):  # schema 2 lines kept them as lists of objects
            value = as_text([item for item in value if isinstance(item, dict)])
        if isinstance(value, str) and value:
            meta[name] = value.splitlines()
    entry: dict[str, Any] = {"meta": meta, "turns": turns}
    if row.code == FAILED:
        entry["error"] = clip(record.get("error") or "")
        entry["prompt"] = clip(record.get("prompt") or "")
    elif row.code == DISCARDED:
        entry["prompt"] = clip(record.get("prompt") or "")
        entry["discarded"] = str(record.get("discarded") or "no_reasoning")  # a whole line the filter discarded
    for k in ("completed", "partial", "api_calls", "reasoning_stats"):
        if k in record:
            entry[k] = record[k]
    if isinstance(record.get("tool_error_counts"), dict):
        entry["tool_errors"] = {k: v for k, v in record["tool_error_counts"].items() if v}
    if row.tools:
        entry["tool_stats"] = {k: list(v) for k, v in row.tools.items()}
    return entry


def _load_full(files: list[Path], rows: list[_Row], chosen: list[int]) -> tuple[dict[str, dict], list[str]]:
    clipper = _Clipper()
    systems: dict[str, int] = {}
    full: dict[str, dict] = {}
    handles: dict[int, Any] = {}
    try:
        for pos in sorted(chosen, key=lambda p: (rows[p].file_no, rows[p].entry.offset)):
            row = rows[pos]
            handle = handles.get(row.file_no) or handles.setdefault(row.file_no, open(files[row.file_no], "rb"))
            handle.seek(row.entry.offset)
            fields = read_line(handle.read(row.entry.length))
            if fields is None:
                continue
            full[str(pos)] = _full_entry(fields, row, files, clipper, systems)
    finally:
        for handle in handles.values():
            handle.close()
    return full, list(systems)


# --- the page --------------------------------------------------------------------------------


def _compact_rows(rows: list[_Row], summary: dict, files: list[Path]) -> dict:
    """One small array per row; names of toolsets, tools and classes are table indexes."""
    toolset_names = list(summary["toolsets"])
    toolset_bit = {name: 1 << i for i, name in enumerate(toolset_names[:30])}  # a 32-bit mask in JavaScript
    tool_names = sorted({t for r in rows if r.tools for t in r.tools if r.tools[t][0]})
    tool_id = {name: i for i, name in enumerate(tool_names)}
    classes = sorted({r.error_class for r in rows if r.error_class})
    class_id = {name: i for i, name in enumerate(classes)}
    start = (summary["timeline"] or {}).get("start_epoch")
    packed = []
    for r in rows:
        mask = 0
        for t in r.toolsets or ():
            mask |= toolset_bit.get(t, 0)
        packed.append([
            r.index, r.code, class_id[r.error_class] if r.error_class else -1, mask if r.toolsets is not None else -1,
            [tool_id[t] for t, (count, _, _) in (r.tools or {}).items() if count],
            r.turns, r.tool_calls, r.preview,
            None if r.ts is None or start is None else round(r.ts - start, 1),
            r.file_no, r.line_no, r.entry.attempts, r.error, _one_line(r.row_id, ID_CHARS),
            r.scores[0][1] if r.scores else None, int(r.scores[0][2]) if r.scores else None,
        ])
    return {
        "fields": ["index", "outcome", "error_class", "toolsets", "tools", "turns", "tool_calls", "preview",
                   "t", "file", "line", "attempts", "error", "id", "score", "passed"],
        "outcomes": list(OUTCOME_NAMES),
        "toolsets": toolset_names,
        "tools": tool_names,
        "classes": classes,
        "files": [p.name for p in files],
        "rows": packed,
    }


def _json_for_script(value: Any) -> bytes:
    """JSON that can sit inside <script type="application/json">: no '<' can close the element."""
    return orjson.dumps(value).replace(b"<", b"\\u003c")


def write_report(run_dir: Path, *, max_full_conversations: int = 500, log=print, view: RunView | None = None,
                 statistics: dict | None = None, dataset: dict[str, int] | None = None,
                 ids: dict[str, str] | None = None) -> Path:
    """Write <run_dir>/report.html (temp file + rename) and return its path: from the runner's
    view (read with `report_details`) and statistics, or else from the run's files."""
    run_dir = Path(run_dir)
    with _no_gc_pauses():
        if view is None or statistics is None:
            view, statistics = read_view(run_dir, dataset, ids)
        rows, chosen = _table_rows(view, TABLE_ROWS, max_full_conversations)
        summary = _summarise(run_dir, view, statistics, _figures(_columns_of(view)), rows)
        compact = _compact_rows(rows, summary, view.files)
        full, systems = _load_full(view.files, rows, chosen)
    # "rows": every row with an outcome; "table": those the rows table lists (a sample past TABLE_ROWS)
    summary["sample"] = {"embedded": len(full), "limit": max_full_conversations, "rows": summary["rows"],
                         "table": len(rows), "table_limit": TABLE_ROWS}
    summary.pop("run_dir", None)  # a local path says nothing to whoever receives the file
    blocks = {
        "SUMMARY_JSON": _json_for_script(summary),
        "ROWS_JSON": _json_for_script(compact),
        "FULL_JSON": _json_for_script({"systems": systems, "rows": full}),
    }
    template = TEMPLATE.read_bytes()
    target = run_dir / REPORT_NAME
    fd, tmp = tempfile.mkstemp(prefix=".report_", suffix=".tmp", dir=run_dir)
    try:
        with os.fdopen(fd, "wb") as out:
            position = 0
            for match in _MARKER.finditer(template):
                out.write(template[position:match.start()])
                out.write(blocks[match.group(1).decode()])
                position = match.end()
            out.write(template[position:])
            out.flush()
            os.fsync(out.fileno())
        keep_mode(tmp, target)  # private like every file of the run (it embeds the conversations)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    table = f"{len(rows):,} rows" if len(rows) == summary["rows"] else f"a sample of {len(rows):,} of {summary['rows']:,} rows"
    log(f"   report.html: {table}, {len(full):,} full conversations, {target.stat().st_size / 1e6:.1f} MB")
    return target


def _two_places(value: float | None) -> float | None:
    return None if value is None else round(value, 2)
