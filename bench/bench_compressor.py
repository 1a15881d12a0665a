#!/usr/bin/env python3
"""Rows per second of trajectory_compressor.py against the ideal set by --max_concurrent_requests.

    python bench/bench_compressor.py --preset quick   # 200 long rows, 200 ms summariser (a few seconds)
    python bench/bench_compressor.py                  # 1,000 long rows, 200 ms summariser

Each row is over the default budget (15,250 tokens) and needs one summary request; the
summariser is the scripted model server in its own process (its CPU is not the compressor's),
answering after a fixed latency. With C requests in flight and a latency of L seconds, no
compressor can do better than C / L rows per second; the table gives the measured rate (from the
metrics JSON: rows summarised per second, from the first summary request to the last answer) as
a share of that, and the times of the whole compression and of the whole command beside it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._util import PY, REPO, ModelServerProcess, cmd_text, env_for_children, make_tmpdir  # noqa: E402

PRESETS = {"quick": {"rows": 200}, "full": {"rows": 1000}}
TURN_CHARS = 2000  # 500 estimated tokens a turn
TOOL_ROUNDS = 20  # 44 turns, about 22,000 estimated tokens a row


def write_rows(path: Path, rows: int) -> None:
    filler = ("The command listed the files of the project and their sizes. " * 40)[:TURN_CHARS]
    with open(path, "w", encoding="utf-8") as handle:
        for index in range(rows):
            turns = [{"from": "system", "value": "You are a helpful agent."},
                     {"from": "human", "value": f"Task {index}: " + filler}]
            for call in range(TOOL_ROUNDS):
                turns.append({"from": "gpt", "value": f"<tool_call>{call} {filler}</tool_call>"})
                turns.append({"from": "tool", "value": f"<tool_response>{call} {filler}</tool_response>"})
            turns.append({"from": "gpt", "value": "Done. " + filler})
            handle.write(json.dumps({"prompt_index": index, "conversations": turns}) + "\n")


def run(rows: int, latency: float, concurrency: int, keep: bool) -> dict:
    work = make_tmpdir("bench-compressor-", keep)
    write_rows(work / "rows.jsonl", rows)
    with ModelServerProcess(latency, work) as server:
        args = [PY, str(REPO / "trajectory_compressor.py"), "--input=rows.jsonl", "--tokenizer=estimate",
                f"--base_url={server.base_url}", "--summary_model=bench", f"--max_concurrent_requests={concurrency}"]
        started = time.monotonic()
        result = subprocess.run(args, cwd=work, env=env_for_children(), capture_output=True, text=True, timeout=1800)
        wall = time.monotonic() - started
    if result.returncode != 0:
        raise SystemExit(f"the compressor exited with {result.returncode}:\n{result.stderr[-2000:]}")
    metrics = json.loads((work / "rows_compressed.metrics.json").read_text())
    ideal = concurrency / latency
    measured = metrics["summarised_rows_per_second"]
    return {"rows": rows, "latency": latency, "concurrency": concurrency, "compressed": metrics["rows_compressed"],
            "seconds": metrics["summarising_seconds"], "total": metrics["duration_seconds"], "wall": wall, "rows_per_second": measured, "ideal": ideal,
            "ratio": measured / ideal, "command": cmd_text(args[1:])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="full")
    parser.add_argument("--rows", type=int, help="override the preset's rows")
    parser.add_argument("--latency", type=float, default=0.2, help="seconds per summary request")
    parser.add_argument("--concurrency", type=int, default=50, help="--max_concurrent_requests")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder")
    options = parser.parse_args()
    rows = options.rows or PRESETS[options.preset]["rows"]
    print(f"▶ {rows:,} rows of ~22,000 tokens, {options.latency * 1000:g} ms summariser, "
          f"--max_concurrent_requests={options.concurrency}")
    r = run(rows, options.latency, options.concurrency, options.keep)
    print(f"  rows compressed          {r['compressed']:,} of {r['rows']:,}")
    print(f"  summarising time         {r['seconds']:.2f} s (whole compression {r['total']:.2f} s, "
          f"wall with the interpreter's start {r['wall']:.2f} s)")
    print(f"  rows per second          {r['rows_per_second']:.1f} (while summarising)")
    print(f"  ideal (C / latency)      {r['ideal']:.1f}")
    print(f"  share of the ideal       {r['ratio']:.0%}")
    print(f"  command: {r['command']}")


if __name__ == "__main__":
    main()
