#!/usr/bin/env python3
"""CPU overhead of the cost accounting and status.json at 64 sessions.

    python bench/bench_budget.py                 # 20,000 prompts, 64 sessions, 60 prompts/s
    python bench/bench_budget.py --prompts 2000  # quicker

What a prompt adds, measured with `time.process_time()` (CPU, not wall) in one process, with the
real code of each step driven the way the runner drives it:

- in the worker: per model request `CallStats.count_request` + `add_usage` (by model, priced from
  tokens: the slower path), and the row's `usage.as_dict()`; each prompt makes 4 requests to the
  run's model and 2 to a tool's model;
- in the parent: `RunMonitor.on_start`, `on_commit` (live spend, budget bookkeeping), the budget's
  `may_start`/`cancel_now` (`--max_cost_hard`) and `tick` once per loop turn, with a clock that
  advances as a run of 64 sessions at 60 prompts/s does (the rate bench_throughput.py preset a
  measures), so status.json is really rewritten (atomically, fsynced) every 5 s of that clock and
  the console line printed every 60 s;
- the extra bytes `usage.by_model` adds to a committed line, and orjson's time to write them;
- at the end of the run, the merge's `SpendTally.add` per committed line (spend by model, retried
  attempts, the spend curve), once per prompt.

Target: at most 1 ms of CPU per prompt in total.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import orjson  # noqa: E402

from agent.model_client import CallStats  # noqa: E402
from agent.pricing import Prices  # noqa: E402
from runner.execution.budget import Budget  # noqa: E402
from agent.usage import Spend, Usage  # noqa: E402
from runner.storage.spendtally import SpendTally  # noqa: E402
from runner.output.status import LiveSpend, RunMonitor  # noqa: E402

TARGET_MS = 1.0
SESSIONS = 64
RATE = 60.0  # prompts per second at 64 sessions (docs/benchmarks.md, preset a)
PRICES = Prices(input_per_mtok=3.0, output_per_mtok=15.0, cached_input_per_mtok=0.3)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def worker_side(prompts: int) -> tuple[float, list[dict]]:
    """CPU seconds of the per-request accounting, and the usage dicts it produced."""
    usages = []
    start = time.process_time()
    for i in range(prompts):
        stats = CallStats(prices=PRICES)
        for turn in range(4):
            stats.count_request("anthropic/claude-sonnet-4.6")
            stats.add_usage({"prompt_tokens": 1200 + 300 * turn, "completion_tokens": 150, "cached_tokens": 1000,
                             "reasoning_tokens": 40, "total_tokens": 1350 + 300 * turn, "cost": None},
                            "anthropic/claude-sonnet-4.6")
        for _ in range(2):
            stats.count_request("openai/gpt-4o")
            stats.add_usage({"prompt_tokens": 400, "completion_tokens": 200, "total_tokens": 600, "cost": None},
                            "openai/gpt-4o")
        usages.append(stats.as_dict())
    return time.process_time() - start, usages


def parent_side(usages: list[dict], run_dir: Path) -> tuple[float, int, int]:
    """CPU seconds of the monitor + budget per prompt, status writes and console lines made."""
    clock = FakeClock()
    lines = []
    spend = LiveSpend()
    budget = Budget(1e9, hard=True, spend=spend)
    monitor = RunMonitor(run_dir, "bench", total_rows=len(usages), finished_before=0, kept_before=0,
                         to_run=len(usages), spend=spend, budget=budget, budget_limit=1e9, log=lines.append,
                         clock=clock)
    writes = 0
    original = monitor.write_status

    def counted(state):
        nonlocal writes
        writes += 1
        return original(state)

    monitor.write_status = counted
    records = [{"prompt_index": i, "metadata": {"row_key": f"k{i}", "duration_seconds": 1.0, "usage": u},
                "conversations": []} for i, u in enumerate(usages)]
    start = time.process_time()
    for i in range(len(records) + SESSIONS):  # 64 rows in flight: row i starts as row i - 64 commits
        clock.now = i / RATE
        if i < len(records) and monitor.may_start():
            monitor.on_start({"key": f"k{i}"})
        if i >= SESSIONS:
            monitor.on_commit([records[i - SESSIONS]])
        monitor.cancel_now()
        monitor.tick(len(budget.started))
    elapsed = time.process_time() - start
    monitor.close("done")
    return elapsed, writes, len(lines)


def status_write_cost(run_dir: Path, rounds: int = 200) -> float:
    """CPU seconds of one status.json rewrite (snapshot, JSON, temp file, fsync, rename)."""
    spend = LiveSpend(now=Spend(Usage(cost=12.3), attempts=5000, priced=5000, cost_squares=0.05, duration_seconds=5000.0))
    monitor = RunMonitor(run_dir, "bench", total_rows=100_000, finished_before=4000, kept_before=3900, to_run=96_000,
                         spend=spend, budget=None, log=lambda text: None)
    monitor.counts["ok"] = 1000
    start = time.process_time()
    for _ in range(rounds):
        monitor.write_status("running")
    return (time.process_time() - start) / rounds


def record_growth(usages: list[dict]) -> tuple[float, float]:
    """Bytes by_model adds to a line, and orjson's extra CPU per line for them."""
    with_model = usages[0]
    without = {k: v for k, v in with_model.items() if k != "by_model"}
    extra = len(orjson.dumps(with_model)) - len(orjson.dumps(without))
    rounds = 20_000
    start = time.process_time()
    for _ in range(rounds):
        orjson.dumps(with_model)
    full = time.process_time() - start
    start = time.process_time()
    for _ in range(rounds):
        orjson.dumps(without)
    return extra, max(0.0, full - (time.process_time() - start)) / rounds


def merge_side(usages: list[dict]) -> float:
    """CPU seconds of the merge's spend tally over every committed line (and its summaries)."""
    tally = SpendTally()
    start = time.process_time()
    for i, usage in enumerate(usages):
        tally.add("kept" if i % 10 else "failed", f"k{i}", f"2026-12-01T10:{i // 3600 % 60:02d}:{i % 60:02d}.123456",
                  Usage.read(usage))
    tally.models(), tally.retried(lambda key: True), tally.curve()
    return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=20_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_budget_") as tmp:
        run_dir = Path(tmp)
        worker_cpu, usages = worker_side(args.prompts)
        parent_cpu, writes, lines = parent_side(usages, run_dir)
        one_write = status_write_cost(run_dir)
        extra_bytes, extra_dump = record_growth(usages)
        merge_cpu = merge_side(usages)
    n = args.prompts
    worker_ms = worker_cpu / n * 1000
    parent_ms = parent_cpu / n * 1000
    merge_ms = merge_cpu / n * 1000
    total_ms = worker_ms + parent_ms + extra_dump * 1000 + merge_ms
    print(f"{n:,} prompts, {SESSIONS} sessions, {RATE:g} prompts/s of simulated clock "
          f"({writes} status.json writes, {lines} console spend lines)")
    print(f"  worker: request accounting (6 requests, 2 models, priced) + as_dict  {worker_ms * 1000:8.1f} µs/prompt")
    print(f"  parent: monitor + budget + status.json writes                        {parent_ms * 1000:8.1f} µs/prompt")
    print(f"  one status.json write (snapshot + JSON + atomic fsynced rename)      {one_write * 1e6:8.1f} µs")
    print(f"  usage.by_model in a committed line: +{extra_bytes} bytes, +{extra_dump * 1e6:.2f} µs to serialise")
    print(f"  merge: spend by model, retried, spend curve                          {merge_ms * 1000:8.1f} µs/prompt")
    verdict = "OK" if total_ms <= TARGET_MS else "OVER"
    print(f"  total CPU per prompt: {total_ms:.3f} ms (target at most {TARGET_MS:g} ms): {verdict}")
    raise SystemExit(0 if total_ms <= TARGET_MS else 1)


if __name__ == "__main__":
    main()
