"""The run view's per-row memory: a few bytes a row in columns sized by the dataset, nothing
that grows with the rows committed (a million-row run must fit the parent's memory)."""

from __future__ import annotations

import gc
import tracemalloc

import orjson

from runner.storage import runfiles
from runner.storage.runview import RunView
from runner.storage.store import RunStore

ROWS = 50_000


def _line(key: str, index: int, failed: bool = False) -> bytes:
    metadata = {"timestamp": "2026-01-01T10:00:00+00:00", "model": "m", "row_key": key, "run_id": "r1",
                "attempt": 1, "duration_seconds": 1.0, "seed": 1, "batch_num": 0,
                "usage": {"requests": 1, "prompt_tokens": 10, "completion_tokens": 5, "cost": 0.0}}
    if failed:
        record = {"prompt_index": index, "failed": True, "error": "boom", "error_class": "provider", "prompt": "p"}
    else:
        record = {"prompt_index": index, "conversations": [{"from": "human", "value": f"Say hello to {index}."},
                                                          {"from": "gpt", "value": "Hello."}],
                  "completed": True, "partial": False, "api_calls": 1, "toolsets_used": [], "tool_stats": {},
                  "tool_error_counts": {}, "reasoning_stats": {}}
    return orjson.dumps({**record, "metadata": metadata}) + b"\n"


def _run(tmp_path):
    """A batch file of ROWS committed rows (one in a hundred failed once first), and the units."""
    units = {f"{i:040x}-0": i for i in range(ROWS)}
    with open(tmp_path / "batch_0.jsonl", "wb") as handle:
        for key, index in units.items():
            if index % 100 == 0:
                handle.write(_line(key, index, failed=True))
            handle.write(_line(key, index))
    return units


def _traced(make):
    gc.collect()
    tracemalloc.start()
    try:
        value = make()
        gc.collect()
        return value, tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()


def test_the_stores_view_costs_a_few_bytes_a_row_and_does_not_grow_with_the_rows_committed(tmp_path):
    units = _run(tmp_path)
    path = tmp_path / "batch_0.jsonl"
    RunView(units=units, tally=False, located=False).read_file(0, path)  # imports and caches out of the figure

    view, empty = _traced(lambda: RunView(units=units, tally=False, located=False, log=lambda _: None))
    tracemalloc.start()
    try:
        gc.collect()
        before = tracemalloc.get_traced_memory()[0]
        view.read_file(0, path)
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(view.rows) == ROWS and all(view.is_committed(key) for key in list(units)[::997])
    assert view.rows[f"{100:040x}-0"].failures == 1 and view.rows[f"{100:040x}-0"].attempts == 2
    assert empty / ROWS < 24, f"{empty / ROWS:.1f} bytes a row for the columns"  # allocated up front
    assert grown / ROWS < 4, f"{grown / ROWS:.1f} bytes a row grown while reading"  # the failed rows' class


def test_the_merges_view_costs_under_a_hundred_bytes_a_row(tmp_path):
    units = _run(tmp_path)
    path = tmp_path / "batch_0.jsonl"

    def read():
        view = RunView(units, log=lambda _: None)
        view.files = [path]
        view.read_file(0, path)
        return view

    read()
    view, held = _traced(read)
    assert view.counts()["outcomes"]["ok"] == ROWS
    assert held / ROWS < 100, f"{held / ROWS:.1f} bytes a row"  # was about 400 as an object per row


def test_a_resume_reads_the_checkpoint_the_store_streamed_and_an_old_one(tmp_path):
    units = _run(tmp_path)
    store = RunStore(tmp_path, "r", batch_size=ROWS)
    store.load(log=lambda _: None, units=units)
    store.save_checkpoint(force=True)
    written = orjson.loads((tmp_path / "checkpoint.json").read_bytes())
    assert len(written["rows"]) == ROWS and written["completed_prompts"] == list(range(ROWS))
    # the same bytes as the whole dict serialised at once (what older versions wrote)
    assert (tmp_path / "checkpoint.json").read_bytes() == orjson.dumps(written, option=orjson.OPT_INDENT_2) + b"\n"
    again = RunStore(tmp_path, "r", batch_size=ROWS)
    again.load(log=lambda _: None, units=units)
    assert again.failures(f"{100:040x}-0") == 1 and again.outcome(f"{5:040x}-0") == "ok"
    without_units = RunStore(tmp_path, "r", batch_size=ROWS)
    without_units.load(log=lambda _: None)
    assert without_units.is_committed(f"{ROWS - 1:040x}-0") and without_units.failures(f"{100:040x}-0") == 1


def test_streamed_json_is_the_whole_dict_serialised_at_once(monkeypatch):
    monkeypatch.setattr(runfiles, "_CHUNK", 3)
    for rows in ({}, {"a/s1": ["ok", 1, 0]}, {f"k{i}": ["ok", i, 0, True] if i % 2 else ["failed", i, 2] for i in range(10)}):
        for completed in ([], [1], list(range(7))):
            whole = {"run_name": "x", "completed_prompts": completed, "batch_stats": {"0": {"ok": 1}}, "files": {},
                     "rows": rows, "spend": {"kept": {"a": [1, 2]}}}
            streamed = {**whole, "completed_prompts": runfiles.Streamed(lambda c=completed: iter(c)),
                        "rows": runfiles.Streamed(lambda r=rows: iter(r.items()), pairs=True)}
            assert b"".join(runfiles.indented_json_chunks(streamed)) == orjson.dumps(whole, option=orjson.OPT_INDENT_2) + b"\n"
