#!/usr/bin/env python3
"""Scaling check of report.html: a synthetic run of 100,000 rows, then `write_report` timed.

    python bench/bench_report.py [--rows=100000] [--samples=500] [--keep] [--dir=PATH]

The run directory is written the way the runner writes it (config.json, statistics.json and
batch_N.jsonl files of 1,000 lines): ok rows with realistic conversations (a 7 KB system prompt
of tool schemas, reasoning, tool calls and results, the full per-tool stats), some partial rows,
discarded tombstones, failed rows of every class, rows that failed first and succeeded on a
retry in a later batch file, a second invocation (a --resume two hours later) and 2 % of the
dataset not run yet. It prints the time of `write_report`, the peak memory, the size of the
batch files read and the size of report.html. Targets: under ~15 s and ~40 MB for 100,000 rows.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import shutil
import sys
import tempfile
import time
from datetime import datetime, timedelta
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from runner.output.report import summarise_run, write_report  # noqa: E402
from tools.registry import ALL_TOOL_NAMES  # noqa: E402

BATCH_SIZE = 1000
CLASSES = ("provider", "timeout", "agent", "environment", "quota", "auth")
TOOLS = ("terminal", "read_file", "write_file", "search_files", "web_search", "web_extract", "patch")
WORDS = ("analyse the repository and list every function that writes to disk, then explain the data flow between "
         "modules, check the tests for missing cases and propose a fix with a short patch and a summary of risks").split()


_POOL_RNG = random.Random(1)
_POOL = [_POOL_RNG.choice(WORDS) for _ in range(20_000)]


def _text(rng: random.Random, words: int) -> str:
    start = rng.randrange(len(_POOL) - words)
    return " ".join(_POOL[start:start + words])


def _ok_row(rng: random.Random, index: int, key: str, system: str, ts: datetime, run_id: str, attempt: int) -> dict:
    prompt = f"Task {index}: {_text(rng, rng.randint(15, 60))}"
    conversation = [{"from": "system", "value": system}, {"from": "human", "value": prompt}]
    stats = {name: {"count": 0, "success": 0, "failure": 0} for name in ALL_TOOL_NAMES}
    calls = rng.choice((0, 1, 1, 2, 2, 3, 3, 4, 5, 6, 8))
    for i in range(calls):
        tool = rng.choice(TOOLS)
        failed = rng.random() < 0.06
        stats[tool]["count"] += 1
        stats[tool]["failure" if failed else "success"] += 1
        args = json.dumps({"command": f"grep -rn '{rng.choice(WORDS)}' src/ | head -n {rng.randint(5, 50)}"})
        conversation.append({"from": "gpt", "value": f"<think>\n{_text(rng, rng.randint(20, 80))}\n</think>\n"
                                                     f"<tool_call>\n{{\"name\": \"{tool}\", \"arguments\": {args}}}\n</tool_call>"})
        content = {"error": "file not found"} if failed else {"output": _text(rng, rng.randint(30, 300)), "exit_code": 0}
        conversation.append({"from": "tool", "value": "<tool_response>\n" + json.dumps(
            {"tool_call_id": f"call_{i}", "name": tool, "content": content}) + "\n</tool_response>"})
    conversation.append({"from": "gpt", "value": f"<think>\n{_text(rng, 40)}\n</think>\n{_text(rng, rng.randint(40, 160))}"})
    partial = rng.random() < 0.04
    return {
        "prompt_index": index,
        "conversations": conversation,
        "metadata": _metadata(rng, key, ts, run_id, attempt, requests=calls + 1, stop_reason="final_answer"),
        "completed": not partial,
        "partial": partial,
        "api_calls": calls + 1,
        "toolsets_used": [t for t in ("web", "terminal", "file", "vision") if rng.random() < 0.7] or ["terminal"],
        "tool_stats": stats,
        "tool_error_counts": {name: stats[name]["failure"] for name in ALL_TOOL_NAMES},
        "reasoning_stats": {"total_assistant_turns": calls + 1, "turns_with_reasoning": calls + 1, "turns_without_reasoning": 0},
    }


def _metadata(rng: random.Random, key: str, ts: datetime, run_id: str, attempt: int, requests: int, **extra) -> dict:
    prompt_tokens, completion_tokens = rng.randint(800, 9000), rng.randint(100, 2000)
    return {
        "batch_num": None, "timestamp": ts.isoformat(), "model": "bench/model", "row_key": key, "id": f"row-{key[8:16]}",
        "run_id": run_id, "attempt": attempt, "duration_seconds": round(rng.uniform(2, 90), 3),
        "usage": {"requests": requests, "retries": int(rng.random() < 0.05), "prompt_tokens": prompt_tokens,
                  "completion_tokens": completion_tokens, "reasoning_tokens": completion_tokens // 3, "cached_tokens": 0,
                  "total_tokens": prompt_tokens + completion_tokens, "cost": round(prompt_tokens * 3e-6 + completion_tokens * 1.5e-5, 6)},
        **extra,
    }


def make_run(run_dir: Path, rows: int, seed: int = 7) -> int:
    """Write a synthetic run directory; returns the bytes of batch files written."""
    rng = random.Random(seed)
    run_dir.mkdir(parents=True, exist_ok=True)
    system = "You are a function-calling AI model. <tools>\n" + json.dumps(
        [{"name": n, "description": _text(rng, 40), "parameters": {"type": "object"}} for n in ALL_TOOL_NAMES]) + "\n</tools>"
    start = datetime(2026, 1, 5, 9, 0, 0)
    config = {"run_name": run_dir.name, "distribution": "balanced", "model": "bench/model", "batch_size": BATCH_SIZE,
              "dataset_file": "bench.jsonl", "max_turns": 10, "report_samples": 500}
    (run_dir / "config.json").write_bytes(orjson.dumps({
        "config": config, "fingerprint": "0123456789abcdef", "fingerprint_fields": {"model": "bench/model", "distribution": "balanced"},
        "run_id": "bench2", "created_at": start.isoformat(), "updated_at": start.isoformat()}))
    retry_later: list[tuple[int, str]] = []
    lines: list[bytes] = []
    written = 0
    batch = 0

    def flush(force: bool = False) -> None:
        nonlocal lines, written, batch
        while len(lines) >= BATCH_SIZE or (force and lines):
            chunk, lines = lines[:BATCH_SIZE], lines[BATCH_SIZE:]
            data = b"".join(chunk)
            (run_dir / f"batch_{batch}.jsonl").write_bytes(data)
            written += len(data)
            batch += 1

    for index in range(rows):
        key = f"{index:016x}{rng.getrandbits(40):010x}-0"
        ts = start + timedelta(seconds=index * 0.9 + rng.random())
        run_id = "bench1" if index < rows * 0.6 else "bench2"
        if index >= rows * 0.6:
            ts += timedelta(hours=2)  # a pause, then a --resume
        roll = rng.random()
        if roll < 0.05:
            record = {"prompt_index": index, "discarded": "no_reasoning", "prompt": f"Task {index}: {_text(rng, 30)}",
                      "metadata": _metadata(rng, key, ts, run_id, 1, 2, stop_reason="final_answer"), "api_calls": 2,
                      "toolsets_used": ["terminal"], "tool_stats": {}, "tool_error_counts": {},
                      "reasoning_stats": {"total_assistant_turns": 2, "turns_with_reasoning": 0, "turns_without_reasoning": 2}}
        elif roll < 0.13:
            cls = rng.choice(CLASSES)
            record = {"prompt_index": index, "failed": True, "error": f"HTTP 500: simulated {cls} failure", "error_class": cls,
                      "prompt": f"Task {index}: {_text(rng, 30)}", "metadata": _metadata(rng, key, ts, run_id, 1, 1)}
            if roll < 0.09:
                retry_later.append((index, key))
        else:
            record = _ok_row(rng, index, key, system, ts, run_id, 1)
        record["metadata"]["batch_num"] = batch + len(lines) // BATCH_SIZE
        lines.append(orjson.dumps(record) + b"\n")
        flush()
    for index, key in retry_later:  # the retries of a resumed run, in later batch files
        ts = start + timedelta(seconds=rows * 0.9 + 7200 + index * 0.01)
        lines.append(orjson.dumps(_ok_row(rng, index, key, system, ts, "bench2", 2)) + b"\n")
        flush()
    flush(force=True)
    (run_dir / "statistics.json").write_bytes(orjson.dumps({  # as the end of a run writes it (trimmed)
        "run_name": run_dir.name, "distribution": "balanced", "total_prompts": rows + rows // 50, "model": "bench/model",
        "duration_seconds": round(rows * 0.9, 2), "stale_rows": 0, "fingerprint": "0123456789abcdef"}))
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--samples", type=int, default=500, help="max_full_conversations")
    parser.add_argument("--dir", help="where to build the run (default: a temporary folder)")
    parser.add_argument("--keep", action="store_true", help="keep the run directory (and its report.html)")
    args = parser.parse_args()
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="bench_report_"))
    run_dir = base / "bench"
    try:
        t0 = time.perf_counter()
        batch_bytes = make_run(run_dir, args.rows)
        made = time.perf_counter() - t0
        print(f"synthetic run: {args.rows:,} rows, {batch_bytes / 1e6:,.0f} MB of batch files, built in {made:.1f} s")
        t0, c0 = time.perf_counter(), time.process_time()
        path = write_report(run_dir, max_full_conversations=args.samples, log=lambda _: None)
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
        peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        size = path.stat().st_size
        summary = summarise_run(run_dir)
        print(f"write_report: {elapsed:.2f} s wall, {cpu:.2f} s CPU ({args.rows / elapsed:,.0f} rows/s), "
              f"peak RSS {peak_mb:,.0f} MB")
        print(f"report.html: {size / 1e6:.1f} MB ({size / args.rows:.0f} bytes per row), "
              f"{args.samples} full conversations; outcomes {summary['outcomes']}")
        if args.keep:
            print(f"kept: {path}")
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
