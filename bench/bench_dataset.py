#!/usr/bin/env python3
"""A 1,000,000-row dataset: validation + row keys, one dispatch pass, and the CLI's time to first dispatch.

    python bench/bench_dataset.py                  # 1,000,000 rows (~1-2 min in all)
    python bench/bench_dataset.py --rows 100000    # smaller, for a quick check

1. Generates a JSONL file in a temp dir: prompts of 50-400 characters, some rows with `image`,
   `cwd` and/or `id` (string or integer), some exact duplicates of earlier rows.
2. In a fresh subprocess: `runner.input.dataset.scan_dataset(path)` (validates every row, builds the
   row-key -> index map), then one full pass of `runner.input.dataset.iter_rows(path)`, each timed; the
   subprocess's peak RSS is `resource.getrusage(RUSAGE_SELF).ru_maxrss`, read after each step.
3. The real CLI on the same file (`--model=mock --distribution=minimal --num_workers=64`, no
   --max_samples): time from process start to its "🚀 Running" line ("time to first dispatch"),
   with the lines before it as a breakdown; then SIGINT twice stops it. The parent's RSS is
   sampled with psutil every 0.2 s until then.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

if __name__ == "__main__" and sys.argv[1:2] == ["--child"]:
    pass  # the measured subprocess imports nothing else (see child())
else:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _util import PY, REPO, cmd_text, env_for_children, make_tmpdir, print_table, run_cli, verdict  # noqa: E402

TIME_TARGET_S = 30.0
MEM_TARGET_MB = 500.0

WORDS = ("alpha beta gamma delta list files count lines python script compute the sum of numbers read "
         "write a report summarise explain why how data table value check result directory print show "
         "sort unique words test run build fix bug error log parse json csv shell command output").split()
IMAGES = ("python:3.11-slim", "debian:bookworm-slim", "busybox:latest", "node:20-alpine")
CWDS = ("/tmp", "/srv/tasks", "/workspace/project")


def generate(path: Path, rows: int, seed: int = 4) -> dict:
    """Write the dataset; returns counts of what it holds."""
    import orjson

    rng = random.Random(seed)
    counts = {"rows": rows, "image": 0, "cwd": 0, "id": 0, "duplicates": 0, "bytes": 0}
    recent: list[bytes] = []
    with open(path, "wb", buffering=1 << 20) as handle:
        for i in range(rows):
            if recent and rng.random() < 0.03:  # an exact duplicate of an earlier row
                line = rng.choice(recent)
                counts["duplicates"] += 1
            else:
                target = rng.randint(50, 400)
                words = [f"Task {i}:"]
                size = len(words[0])
                while size < target:
                    word = rng.choice(WORDS)
                    words.append(word)
                    size += len(word) + 1
                row: dict = {"prompt": " ".join(words)[:target]}
                r = rng.random()
                if r < 0.10:
                    row["image"] = rng.choice(IMAGES)
                    counts["image"] += 1
                if 0.08 < r < 0.15:
                    row["cwd"] = rng.choice(CWDS)
                    counts["cwd"] += 1
                if rng.random() < 0.25:
                    row["id"] = f"task-{i}" if i % 2 else i
                    counts["id"] += 1
                line = orjson.dumps(row) + b"\n"
                if len(recent) < 2000:
                    recent.append(line)
                elif rng.random() < 0.01:
                    recent[rng.randrange(len(recent))] = line
            handle.write(line)
            counts["bytes"] += len(line)
    return counts


def child(path: str) -> None:
    """`--child PATH`: the measured part, in a fresh interpreter that imports only runner.input.dataset."""
    import resource

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    t0 = time.perf_counter()
    from runner.input.dataset import iter_rows, scan_dataset

    maxrss = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # noqa: E731  (KB on Linux)
    out = {"import_s": time.perf_counter() - t0, "maxrss_import_kb": maxrss()}
    t = time.perf_counter()
    scan = scan_dataset(path)
    out["scan_s"] = time.perf_counter() - t
    out["maxrss_scan_kb"] = maxrss()
    out["rows"], out["errors"], out["images"] = scan.rows, len(scan.errors), len(scan.images)
    t = time.perf_counter()
    n = 0
    for _row in iter_rows(path):  # `scan` stays alive meanwhile, as in the runner
        n += 1
    out["iter_s"] = time.perf_counter() - t
    out["iter_rows"] = n
    out["maxrss_iter_kb"] = maxrss()
    r = resource.getrusage(resource.RUSAGE_SELF)
    out["cpu_s"] = r.ru_utime + r.ru_stime
    print(json.dumps(out))


def run_child(path: Path) -> tuple[dict, list[str]]:
    args = [PY, str(Path(__file__).resolve()), "--child", str(path)]
    proc = subprocess.run(args, cwd=REPO, env=env_for_children(), capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"the scan subprocess failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1]), args


def time_to_dispatch(path: Path, tmp: Path, timeout: float) -> tuple[object, list[str]]:
    args = [f"--dataset_file={path}", "--run_name=ds", "--batch_size=1000", "--model=mock", "--distribution=minimal",
            "--num_workers=64", f"--output_dir={tmp / 'out'}"]

    def on_line(run, t, line, proc):
        if "🚀 Running" in line and not getattr(run, "interrupted", False):
            run.interrupted = True
            run.sampler.mark("running")

            def stop() -> None:
                proc.send_signal(signal.SIGINT)  # first: stop dispatching, wait for in-flight rows
                time.sleep(0.5)
                if proc.poll() is None:
                    proc.send_signal(signal.SIGINT)  # second: quit at once

            threading.Thread(target=stop, daemon=True).start()

    run = run_cli(args, cwd=tmp, timeout=timeout, sample=True, stderr_path=tmp / "cli_stderr.log", on_line=on_line)
    return run, args


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=1, help="repeat the scan subprocess and the CLI N times (median)")
    parser.add_argument("--keep", action="store_true", help="keep the temp dir")
    opts = parser.parse_args()
    print(f"$ {cmd_text([PY, *sys.argv])}")
    tmp = make_tmpdir("bench_ds_", opts.keep)
    try:
        path = tmp / "dataset.jsonl"
        t = time.perf_counter()
        counts = generate(path, opts.rows)
        print(f"generated {path} in {time.perf_counter() - t:.1f} s: {counts['rows']:,} rows, {counts['bytes'] / 2**20:.0f} MB; "
              f"{counts['image']:,} with image, {counts['cwd']:,} with cwd, {counts['id']:,} with id, "
              f"{counts['duplicates']:,} duplicates")

        scans = []
        for i in range(opts.repeat):
            out, child_args = run_child(path)
            scans.append(out)
            print(f"  scan subprocess run {i + 1}: scan {out['scan_s']:.2f} s, iter {out['iter_s']:.2f} s, "
                  f"peak RSS {out['maxrss_iter_kb'] / 1024:.0f} MB")
        runs = []
        for i in range(opts.repeat):
            shutil.rmtree(tmp / "out", ignore_errors=True)
            run, cli_args = time_to_dispatch(path, tmp, timeout=300)
            if run.first("🚀 Running") is None:
                print(run.tail(20))
                print((tmp / "cli_stderr.log").read_text(errors="replace")[-3000:])
                raise SystemExit("the CLI never reached its '🚀 Running' line")
            runs.append(run)
            print(f"  CLI run {i + 1}: '🚀 Running' after {run.first('🚀 Running'):.2f} s; exit code {run.returncode} "
                  f"after SIGINT x2; parent peak RSS {run.sampler.peak_parent_rss / 2**20:.0f} MB")

        def med(values):
            values = sorted(values)
            return values[len(values) // 2]

        scan_s = med([s["scan_s"] for s in scans])
        iter_s = med([s["iter_s"] for s in scans])
        both_s = med([s["scan_s"] + s["iter_s"] for s in scans])
        peak_mb = med([s["maxrss_iter_kb"] / 1024 for s in scans])
        s0 = scans[0]
        dispatch = med([r.first("🚀 Running") for r in runs])
        initialized = med([r.first("📊 Batch Runner Initialized") for r in runs])
        cli_parent_mb = med([r.sampler.peak_parent_rss / 2**20 for r in runs])
        n = s0["rows"]

        print(f"\n=== Dataset benchmark: {opts.rows:,} lines ({counts['bytes'] / 2**20:.0f} MB), "
              f"median of {opts.repeat} run(s) ===")
        print_table(["measure", "value"], [
            ["valid rows / errors / distinct images", f"{n:,} / {s0['errors']} / {s0['images']}"],
            ["import runner.input.dataset (s)", f"{s0['import_s']:.2f}"],
            ["scan_dataset (s)", f"{scan_s:.2f}  ({scan_s / n * 1e6:.1f} us/row)"],
            ["iter_rows, one pass (s)", f"{iter_s:.2f}  ({iter_s / n * 1e6:.1f} us/row)"],
            ["scan + iter (s, target <= 30)", f"{both_s:.2f}"],
            ["subprocess peak RSS after import (MB)", f"{s0['maxrss_import_kb'] / 1024:.0f}"],
            ["subprocess peak RSS after scan (MB)", f"{s0['maxrss_scan_kb'] / 1024:.0f}"],
            ["subprocess peak RSS after iter (MB, target < 500)", f"{peak_mb:.0f}"],
            ["CLI: start -> '📊 Initialized' (scan done) (s)", f"{initialized:.2f}"],
            ["CLI: start -> '🚀 Running' = time to first dispatch (s)", f"{dispatch:.2f}"],
            ["CLI: parent peak RSS until stopped (MB)", f"{cli_parent_mb:.0f}"],
        ])
        print("\nCLI lines before dispatch (first run, seconds since start):")
        for t, line in runs[0].lines:
            if line.strip():
                print(f"  {t:7.2f}  {line[:100]}")
            if "🚀 Running" in line:
                break
        checks = [
            (f"scan_dataset <= {TIME_TARGET_S:g} s", scan_s <= TIME_TARGET_S, f"{scan_s:.2f} s"),
            (f"scan_dataset + one iter_rows pass <= {TIME_TARGET_S:g} s (stricter reading)", both_s <= TIME_TARGET_S,
             f"{both_s:.2f} s"),
            (f"scan subprocess peak RSS < {MEM_TARGET_MB:g} MB", peak_mb < MEM_TARGET_MB, f"{peak_mb:.0f} MB"),
            (f"CLI parent peak RSS < {MEM_TARGET_MB:g} MB", cli_parent_mb < MEM_TARGET_MB, f"{cli_parent_mb:.0f} MB"),
            (f"CLI time to first dispatch <= {TIME_TARGET_S:g} s", dispatch <= TIME_TARGET_S, f"{dispatch:.2f} s"),
        ]
        print("\nTargets:")
        for label, ok, value in checks:
            print(f"  [{verdict(ok)}] {label}: {value}")
        print("\nNotes: the file is in the page cache (just written); 2 shared cores, so times move with other load.")
        print("\nCommands run:")
        print(f"  scan: {cmd_text(child_args)}")
        print(f"  CLI:  cd {tmp} && {cmd_text(runs[0].args)}   (then SIGINT twice)")
        sys.exit(0 if all(ok for _, ok, _ in checks) else 1)
    finally:
        if not opts.keep:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2])
    else:
        main()
