"""report.html: one self-contained page to look at a run, rebuilt from the run's files.

`summarise_run(run_dir)` streams the batch files once (never the runner's memory, so a finished,
interrupted or resumed run all work) and returns the numbers the page shows; `write_report`
adds a compact summary of every row plus the full conversations of a bounded, deterministic
sample, and writes `report.html` atomically. Rows are identified by `metadata.row_key` and each
row's best attempt wins exactly as in `runner.finalize` (ok > discarded > failed, the first line
of a rank kept; ok rows naming an unknown tool are filtered), so the page agrees with
statistics.json.

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
import math
import os
import re
import tempfile
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Callable

import orjson

from runner.store import OUTCOME_RANK, batch_files, iter_records, keep_mode, record_outcome
from tools.registry import ALL_TOOL_NAMES

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

# Row outcome codes on the page; "ok" in statistics.json is OK + PARTIAL.
OK, PARTIAL, DISCARDED, FAILED = 0, 1, 2, 3
OUTCOME_NAMES = ("ok", "partial", "discarded", "failed")
_KNOWN_TOOLS = frozenset(ALL_TOOL_NAMES)
_USAGE_KEYS = ("prompt_tokens", "completion_tokens", "reasoning_tokens", "cached_tokens", "total_tokens")
_MARKER = re.compile(rb"\{\{([A-Z_]+)\}\}")


@dataclass(slots=True)
class _Row:
    """The best attempt of one row key so far, reduced to what the report needs."""

    key: str
    rank: int
    code: int
    index: int
    file_no: int
    line_no: int
    offset: int
    length: int
    error_class: str | None
    error: str
    row_id: str
    preview: str
    ts: float | None
    duration: float | None
    toolsets: tuple[str, ...] | None
    tools: dict[str, tuple[int, int, int]] | None  # tool -> (count, success, failure), called tools only
    tool_calls: int | None
    turns: int | None
    reasoning: tuple[int, int, int] | None  # total, with, without
    usage: tuple[float, ...] | None  # _ROW_USAGE figures of a kept row
    api_calls: int
    completed: bool
    partial: bool

    @property
    def sample_class(self) -> str:
        return f"failed:{self.error_class}" if self.code == FAILED else OUTCOME_NAMES[self.code]


def _parse_time(value: Any) -> float | None:
    if not isinstance(value, str):
        return None
    try:
        return datetime.fromisoformat(value).timestamp()
    except ValueError:
        return None


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


def _invalid_tool(record: dict) -> bool:
    """The rule of runner.finalize: an ok row naming a tool we do not know is filtered."""
    stats = record.get("tool_stats")
    if not isinstance(stats, dict) or not isinstance(record.get("conversations"), list):
        return True
    return not _KNOWN_TOOLS.issuperset(stats)


def _int(value: Any) -> int:
    try:
        return int(value or 0)
    except (TypeError, ValueError):
        return 0


def _num(value: Any) -> float:
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else 0


_UNUSED = {"count": 0, "success": 0, "failure": 0}
_ROW_USAGE = (*_USAGE_KEYS, "cost", "retries")  # the order of _Row.usage


def _tool_counts(raw: Any) -> dict[str, tuple[int, int, int]]:
    if not isinstance(raw, dict):
        return {}
    used = [(name, s) for name, s in raw.items() if s != _UNUSED and isinstance(s, dict)]
    counts = {str(name): (_int(s.get("count")), _int(s.get("success")), _int(s.get("failure"))) for name, s in used}
    return {name: c for name, c in counts.items() if any(c)}


def _make_row(record: dict, key: str, rank: int, file_no: int, line_no: int, offset: int, length: int,
              ts: float | None) -> _Row:
    """The report's view of one attempt (only called when it beats the row's best so far)."""
    metadata = record["metadata"]
    outcome = record_outcome(record)
    tools = turns = reasoning = toolsets = usage = None
    if outcome == "failed":
        code = FAILED
    else:
        code = DISCARDED if outcome == "discarded" else PARTIAL if record.get("partial") else OK
        tools = _tool_counts(record.get("tool_stats"))
        used = record.get("toolsets_used")
        toolsets = tuple(map(str, used)) if isinstance(used, list) else ()
        rs = record.get("reasoning_stats")
        rs = rs if isinstance(rs, dict) else {}
        reasoning = (_int(rs.get("total_assistant_turns")), _int(rs.get("turns_with_reasoning")),
                     _int(rs.get("turns_without_reasoning")))
        turns = reasoning[0]
        if not turns and isinstance(record.get("conversations"), list):
            turns = sum(1 for t in record["conversations"] if isinstance(t, dict) and t.get("from") == "gpt")
        raw_usage = metadata.get("usage")
        if code != DISCARDED and isinstance(raw_usage, dict):
            usage = tuple(_num(raw_usage.get(k)) for k in _ROW_USAGE)
    duration = metadata.get("duration_seconds")
    row_id = metadata.get("id")
    return _Row(
        key=key, rank=rank, code=code, index=_int(record.get("prompt_index")), file_no=file_no, line_no=line_no,
        offset=offset, length=length,
        error_class=(str(record.get("error_class") or "agent") if code == FAILED else None),
        error=_one_line(record.get("error"), ERROR_CHARS) if code == FAILED else "",
        row_id=_one_line(str(row_id), ID_CHARS) if row_id is not None else "",
        preview=_one_line(_prompt_of(record), PREVIEW_CHARS),
        ts=ts,
        duration=float(duration) if isinstance(duration, (int, float)) and not isinstance(duration, bool) else None,
        toolsets=toolsets, tools=tools, tool_calls=None if tools is None else sum(c[0] for c in tools.values()),
        turns=turns, reasoning=reasoning, usage=usage,
        api_calls=_int(record.get("api_calls")),
        completed=bool(record.get("completed")),
        partial=bool(record.get("partial")),
    )


def _read_json(path: Path) -> dict | None:
    try:
        value = orjson.loads(path.read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return None
    return value if isinstance(value, dict) else None


class _Scan:
    """One streaming pass over all batch files of a run, in file order: the winning attempt per
    row key, and run-wide tallies.

    One process on purpose: parsing the JSON is the cost (about 1.4 GB per 100,000 real rows), and
    worker processes would have to send every row's summary back through pickle, which cost as
    much as it saved when we measured it.
    """

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.files = batch_files(self.run_dir) if self.run_dir.is_dir() else []
        self.rows: dict[str, _Row] = {}
        self.attempts: Counter[str] = Counter()
        self.lines = 0
        self.unreadable = 0
        self.filtered = 0
        self.spent = {**dict.fromkeys(_USAGE_KEYS, 0), "cost": 0.0, "requests": 0}  # every attempt
        self.invocations: dict[str, list] = {}  # run_id -> [start, end, lines]
        for file_no, path in enumerate(self.files):
            self.read_file(file_no, path)

    def read_file(self, file_no: int, path: Path) -> None:
        for line_no, (offset, line, record, key) in enumerate(iter_records(path), start=1):
            self.lines += 1
            if key is None:
                self.unreadable += 1
                continue
            self.attempts[key] += 1
            ts = self._note_attempt(record["metadata"])
            outcome = record_outcome(record)
            if outcome == "ok" and _invalid_tool(record):
                self.filtered += 1
                continue
            rank = OUTCOME_RANK[outcome]
            best = self.rows.get(key)
            if best is None or rank > best.rank:
                self.rows[key] = _make_row(record, key, rank, file_no, line_no, offset, len(line), ts)

    def _note_attempt(self, metadata: dict) -> float | None:
        """Tally what every attempt spent and when each invocation ran; returns the line's time."""
        usage = metadata.get("usage")
        if isinstance(usage, dict):
            spent = self.spent
            for k, v in usage.items():
                if k in spent and isinstance(v, (int, float)):
                    spent[k] += v
        ts = _parse_time(metadata.get("timestamp"))
        if ts is None:
            return None
        duration = metadata.get("duration_seconds")
        start = ts - (duration if isinstance(duration, (int, float)) and not isinstance(duration, bool) else 0)
        self._note_span(str(metadata.get("run_id") or "?"), start, ts, 1)
        return ts

    def _note_span(self, run_id: str, start: float, end: float, lines: int) -> None:
        span = self.invocations.get(run_id)
        if span is None:
            self.invocations[run_id] = [start, end, lines]
        else:
            span[0], span[1], span[2] = min(span[0], start), max(span[1], end), span[2] + lines


def _rate(success: int, failure: int) -> float:
    answered = success + failure
    return round(success / answered * 100, 2) if answered else 0.0


def _timeline(rows: list[_Row], invocations: dict[str, list]) -> dict | None:
    stamped = [r for r in rows if r.ts is not None]
    if not stamped:
        return None
    starts = [span[0] for span in invocations.values()] or [min(r.ts for r in stamped)]
    times = [r.ts for r in stamped]
    start, end = min(min(starts), min(times)), max(times)
    bucket = _nice_bucket((end - start) / TIMELINE_BUCKETS)
    count = min(int((end - start) // bucket) + 1, TIMELINE_BUCKETS + 1)
    series = [[0] * count for _ in OUTCOME_NAMES]
    for r in stamped:
        series[r.code][min(count - 1, int((r.ts - start) // bucket))] += 1
    return {
        "start": datetime.fromtimestamp(start).isoformat(timespec="milliseconds"),
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


def _percentile(values: list[float], q: float) -> float | None:
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


def _summarise(scan: _Scan) -> dict:
    run_dir = scan.run_dir
    config_file = _read_json(run_dir / "config.json") or {}
    config = config_file.get("config") if isinstance(config_file.get("config"), dict) else {}
    stats_path = run_dir / "statistics.json"
    statistics = _read_json(stats_path)
    rows = sorted(scan.rows.values(), key=lambda r: (r.index, r.key))

    ok_rows = [r for r in rows if r.code in (OK, PARTIAL)]
    by_code = Counter(r.code for r in rows)
    failed_by_class = Counter(r.error_class for r in rows if r.code == FAILED)

    # Tool, reasoning and token figures over the kept (ok) rows, as statistics.json counts them.
    tools: dict[str, list[int]] = {}
    rows_using: Counter[str] = Counter()
    reasoning = [0, 0, 0]
    tokens = dict.fromkeys(_USAGE_KEYS, 0)
    cost = 0.0
    retries = api_calls = 0
    for r in ok_rows:
        for name, (count, success, failure) in r.tools.items():
            total = tools.setdefault(name, [0, 0, 0])
            total[0] += count
            total[1] += success
            total[2] += failure
            if count:
                rows_using[name] += 1
        for i in range(3):
            reasoning[i] += r.reasoning[i]
        if r.usage:
            for k, v in zip(_USAGE_KEYS, r.usage):
                tokens[k] += v
            cost += r.usage[5]
            retries += int(r.usage[6])
        api_calls += r.api_calls
    tool_statistics = {
        name: {"count": c, "success": s, "failure": f, "success_rate": _rate(s, f), "rows": rows_using[name]}
        for name, (c, s, f) in sorted(tools.items(), key=lambda kv: (-kv[1][0], kv[0]))
    }

    # Realised toolsets: share of the rows that record their toolsets (ok and discarded rows).
    with_toolsets = [r for r in rows if r.toolsets is not None]
    realised = Counter(t for r in with_toolsets for t in set(r.toolsets))
    distribution = config.get("distribution") or (statistics or {}).get("distribution")
    target = _target_distribution(distribution)
    names = list(target or {}) + sorted(set(realised) - set(target or {}))
    toolsets = {
        name: {
            "rows": realised[name],
            "share": round(realised[name] / len(with_toolsets) * 100, 2) if with_toolsets else 0.0,
            "target": (target or {}).get(name, 0 if target is not None else None),
        }
        for name in names
    }

    stale = int((statistics or {}).get("stale_rows") or 0)
    total_prompts = (statistics or {}).get("total_prompts")
    not_run = max(0, int(total_prompts) - (len(rows) - stale)) if isinstance(total_prompts, int) else None
    newest_batch = max((p.stat().st_mtime for p in scan.files), default=0.0)
    stats_outdated = statistics is None or stats_path.stat().st_mtime + 1e-6 < newest_batch

    invocations = sorted(
        ({"run_id": rid, "start": datetime.fromtimestamp(s).isoformat(timespec="seconds"),
          "seconds": round(e - s, 3), "lines": n} for rid, (s, e, n) in scan.invocations.items()),
        key=lambda item: item["start"],
    )
    active = sum(item["seconds"] for item in invocations)
    durations = [r.duration for r in rows if r.duration is not None]
    stamps = [r.ts for r in rows if r.ts is not None]
    return {
        "run_name": (config.get("run_name") or (statistics or {}).get("run_name") or run_dir.name),
        "run_dir": str(run_dir),
        "generated_at": datetime.now().isoformat(timespec="seconds"),
        "model": config.get("model") or (statistics or {}).get("model"),
        "distribution": distribution,
        "fingerprint": config_file.get("fingerprint") or (statistics or {}).get("fingerprint"),
        "fingerprint_fields": config_file.get("fingerprint_fields") or {},
        "config": config,
        "created_at": config_file.get("created_at"),
        "updated_at": config_file.get("updated_at"),
        "rows": len(rows),
        "total_prompts": total_prompts,
        "outcomes": {
            "ok": len(ok_rows),
            "completed": sum(1 for r in ok_rows if r.completed),
            "partial": by_code[PARTIAL],
            "turn_limit": sum(1 for r in ok_rows if not r.completed and not r.partial),
            "discarded": by_code[DISCARDED],
            "failed": by_code[FAILED],
            "not_run": not_run,
            "filtered": scan.filtered,
        },
        "failed_by_class": dict(sorted(failed_by_class.items())),
        "retried_rows": sum(1 for r in rows if scan.attempts[r.key] > 1),
        "tool_statistics": tool_statistics,
        "toolsets": toolsets,
        "toolset_rows": len(with_toolsets),
        "reasoning_statistics": dict(zip(("total_assistant_turns", "turns_with_reasoning", "turns_without_reasoning"),
                                         reasoning)),
        "discarded_no_reasoning": by_code[DISCARDED],
        "tokens": {k: int(v) for k, v in tokens.items()},
        "cost": round(cost, 6),
        "spent_all_attempts": {**{k: int(scan.spent[k]) for k in (*_USAGE_KEYS, "requests")},
                               "cost": round(scan.spent["cost"], 6)},
        "retries": retries,
        "api_calls": api_calls,
        "histograms": {
            "turns": _histogram(r.turns for r in rows if r.turns is not None),
            "tool_calls": _histogram(r.tool_calls for r in rows if r.tool_calls is not None),
        },
        "timeline": _timeline(rows, scan.invocations),
        "duration": {
            "first_row_at": datetime.fromtimestamp(min(stamps)).isoformat(timespec="seconds") if stamps else None,
            "last_row_at": datetime.fromtimestamp(max(stamps)).isoformat(timespec="seconds") if stamps else None,
            "span_seconds": round(max(stamps) - min(stamps), 3) if stamps else None,
            "active_seconds": round(active, 3),
            "invocations": invocations,
            "rows_per_minute": round(len(rows) / active * 60, 2) if active > 0 else None,
            "row_seconds_p50": _percentile(durations, 0.5),
            "row_seconds_p90": _percentile(durations, 0.9),
            "row_seconds_max": max(durations) if durations else None,
            "last_invocation_seconds": (statistics or {}).get("duration_seconds"),
        },
        "files": {
            "batch_files": len(scan.files),
            "lines": scan.lines,
            "unreadable_lines": scan.unreadable,
            "torn_files": sorted(p.name for p in run_dir.glob("batch_*.jsonl.torn")) if run_dir.is_dir() else [],
            "stale_rows": stale,
        },
        "statistics": statistics,
        "statistics_outdated": stats_outdated,
    }


def _histogram(values) -> dict[str, int]:
    counts = Counter(values)
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


def summarise_run(run_dir: Path) -> dict:
    """Every figure the report shows, from the run directory's files alone (JSON-serialisable)."""
    with _no_gc_pauses():
        return _summarise(_Scan(Path(run_dir)))


# --- the sample of full conversations --------------------------------------------------------


def _stable_hash(key: str) -> bytes:
    return hashlib.blake2b(key.encode(), digest_size=8).digest()


def choose_sample(rows: list[_Row], limit: int) -> list[int]:
    """Positions in `rows` of at most `limit` rows, shared fairly between outcome classes.

    Every class (ok, partial, discarded, each failure class) gets an equal share; a class with
    fewer rows gives its unused share to the others. Within a class the rows are ordered by a
    hash of their key, so the choice is deterministic and spread over the whole run.
    """
    classes: dict[str, list[int]] = {}
    for pos, row in enumerate(rows):
        classes.setdefault(row.sample_class, []).append(pos)
    quota = dict.fromkeys(classes, 0)
    left = max(0, limit)
    open_classes = sorted(classes, key=lambda c: len(classes[c]))
    while left and open_classes:
        share = max(1, left // len(open_classes))
        for name in list(open_classes):
            take = min(share, len(classes[name]) - quota[name], left)
            quota[name] += take
            left -= take
            if quota[name] == len(classes[name]):
                open_classes.remove(name)
            if not left:
                break
    chosen: list[int] = []
    for name, members in classes.items():
        members.sort(key=lambda pos: _stable_hash(rows[pos].key))
        chosen.extend(members[: quota[name]])
    return sorted(chosen)


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


def _full_entry(record: dict, row: _Row, files: list[Path], clipper: _Clipper, systems: dict[str, int]) -> dict:
    clip = clipper.conversation()
    metadata = record.get("metadata") if isinstance(record.get("metadata"), dict) else {}
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
    meta = {k: metadata.get(k) for k in ("row_key", "id", "timestamp", "attempt", "duration_seconds", "model",
                                          "stop_reason", "seed", "run_id") if metadata.get(k) is not None}
    meta["file"] = f"{files[row.file_no].name}:{row.line_no}"
    if isinstance(metadata.get("usage"), dict):
        meta["usage"] = metadata["usage"]
    if isinstance(metadata.get("tools_offered"), list):
        meta["tools_offered"] = metadata["tools_offered"]
    entry: dict[str, Any] = {"meta": meta, "turns": turns}
    if row.code == FAILED:
        entry["error"] = clip(record.get("error") or "")
        entry["prompt"] = clip(record.get("prompt") or "")
    elif row.code == DISCARDED:
        entry["prompt"] = clip(record.get("prompt") or "")
        entry["discarded"] = str(record.get("discarded"))
    for k in ("completed", "partial", "api_calls", "reasoning_stats"):
        if k in record:
            entry[k] = record[k]
    if isinstance(record.get("tool_error_counts"), dict):
        entry["tool_errors"] = {k: v for k, v in record["tool_error_counts"].items() if v}
    if row.tools:
        entry["tool_stats"] = {k: list(v) for k, v in row.tools.items()}
    return entry


def _load_full(scan: _Scan, rows: list[_Row], chosen: list[int]) -> tuple[dict[str, dict], list[str]]:
    clipper = _Clipper()
    systems: dict[str, int] = {}
    full: dict[str, dict] = {}
    handles: dict[int, Any] = {}
    try:
        for pos in sorted(chosen, key=lambda p: (rows[p].file_no, rows[p].offset)):
            row = rows[pos]
            handle = handles.get(row.file_no) or handles.setdefault(row.file_no, open(scan.files[row.file_no], "rb"))
            handle.seek(row.offset)
            try:
                record = orjson.loads(handle.read(row.length))
            except orjson.JSONDecodeError:
                continue
            full[str(pos)] = _full_entry(record, row, scan.files, clipper, systems)
    finally:
        for handle in handles.values():
            handle.close()
    return full, list(systems)


# --- the page --------------------------------------------------------------------------------


def _compact_rows(rows: list[_Row], summary: dict, files: list[Path], attempts: Counter) -> dict:
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
            r.file_no, r.line_no, attempts[r.key], r.error, r.row_id,
        ])
    return {
        "fields": ["index", "outcome", "error_class", "toolsets", "tools", "turns", "tool_calls", "preview",
                   "t", "file", "line", "attempts", "error", "id"],
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


def write_report(run_dir: Path, *, max_full_conversations: int = 500, log=print) -> Path:
    """Write <run_dir>/report.html (temp file + rename) from the run's files and return its path."""
    run_dir = Path(run_dir)
    with _no_gc_pauses():
        scan = _Scan(run_dir)
        summary = _summarise(scan)
        rows = sorted(scan.rows.values(), key=lambda r: (r.index, r.key))
        compact = _compact_rows(rows, summary, scan.files, scan.attempts)
        chosen = choose_sample(rows, max_full_conversations)
        full, systems = _load_full(scan, rows, chosen)
    summary["sample"] = {"embedded": len(full), "limit": max_full_conversations, "rows": len(rows)}
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
    log(f"   report.html: {len(rows):,} rows, {len(full):,} full conversations, {target.stat().st_size / 1e6:.1f} MB")
    return target
