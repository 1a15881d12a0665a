#!/usr/bin/env python3
"""Resuming a large run: 100,000 committed rows, 100 to go.

    python bench/bench_resume.py                 # 100,000 rows of ~3 KB, 2 runs per case
    python bench/bench_resume.py --rows 20000    # smaller, for a quick check

Set-up (timed, not a target):
1. a dataset of ROWS + 100 prompts;
2. `batch_runner.py --model=mock` on a 1-row dataset (its first row) in the same run directory:
   this writes the config.json a resume with the same flags accepts (same fingerprint fields),
   and gives a real committed line to use as the template; its outputs except config.json are
   then removed;
3. ROWS synthetic committed rows (the template with the row's own prompt_index, row_key and
   prompt, padded to ~3 KB) written through `runner.storage.store.RunStore.commit` with batch_size 1,000
   (so 1,000 lines per batch file, fsynced, and checkpoint.json exactly as the runner writes it).

Then `batch_runner.py ... --resume --model=mock` is timed from process start to its lines
"📂 Resuming" (store loaded), "🚀 Running" (starts working on the 100 rows left: the target),
"📦 Combining" (the 100 rows done), and to its exit (merge of ROWS + 100 rows into
trajectories.jsonl, statistics, report.html), in two cases:
- cache:  checkpoint.json present (rows already seen are not re-read);
- rescan: checkpoint.json deleted (every batch file is read again).
Before each run the directory is put back as it was (new batch files and outputs removed,
checkpoint.json restored or deleted). The batch files are in the page cache (just written).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import PY, REPO, cmd_text, make_tmpdir, median, print_table, run_cli, verdict  # noqa: E402

sys.path.insert(0, str(REPO))

REMAINING = 100
BATCH = 1000
LINE_BYTES = 3000
START_TARGET_S = 5.0  # "a few seconds to start working"

TOPICS = ("the quarterly budget", "a shipping delay", "the onboarding guide", "server maintenance", "a recipe for bread",
          "the meeting notes", "an invoice dispute", "the release plan", "a customer review", "the travel policy")


def write_dataset(path: Path, rows: int) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        for i in range(rows):
            topic = TOPICS[i % len(TOPICS)]
            text = f"Resume benchmark row {i}: summarise {topic} in two sentences and say what matters most ({i * 7919 % 100003})."
            handle.write(json.dumps({"prompt": text}) + "\n")


def cli_args(dataset: Path, out: Path, resume: bool) -> list[str]:
    args = [f"--dataset_file={dataset}", "--run_name=resume", f"--batch_size={BATCH}", "--model=mock",
            "--distribution=minimal", "--num_workers=16", f"--output_dir={out}"]
    return args + (["--resume"] if resume else [])


def build_run(tmp: Path, rows: int) -> tuple[Path, Path, dict]:
    """The dataset and the run directory with `rows` committed rows; returns (dataset, run_dir, info)."""
    import orjson

    from runner.input.dataset import iter_rows
    from runner.storage.store import RunStore

    info = {}
    t0 = time.perf_counter()
    dataset = tmp / "dataset.jsonl"
    write_dataset(dataset, rows + REMAINING)
    one = tmp / "one.jsonl"
    with open(dataset, "rb") as src:
        one.write_bytes(src.readline())
    out = tmp / "out"
    run_dir = out / "resume"
    seed = run_cli(cli_args(one, out, resume=False), cwd=tmp, timeout=180, stderr_path=tmp / "seed_stderr.log")
    if seed.returncode != 0:
        print(seed.tail(20))
        raise SystemExit(f"the 1-row seed run failed with exit code {seed.returncode}")
    template = orjson.loads((run_dir / "batch_0.jsonl").read_bytes().splitlines()[0])
    for path in run_dir.iterdir():
        if path.name != "config.json":
            path.unlink()
    info["seed_run_s"] = seed.wall

    # Size the padding so a line is ~LINE_BYTES long.
    conv = template.get("conversations") or []
    system = next((m for m in conv if m.get("from") == "system"), {"from": "system", "value": ""})
    filler_unit = "The note covers the main points, the open questions and the next steps. "

    def record(index: int, key: str, prompt: str, pad: int) -> dict:
        rec = dict(template)
        rec["prompt_index"] = index
        rec["conversations"] = [
            dict(system),
            {"from": "human", "value": prompt},
            {"from": "gpt", "value": f"<think>\nRow {index}.\n</think>\n" + (filler_unit * (pad // len(filler_unit) + 1))[:pad]},
        ]
        meta = dict(template["metadata"])
        meta.update(row_key=key, timestamp=datetime.now().isoformat(), batch_num=-1)
        rec["metadata"] = meta
        return rec

    rows_iter = iter_rows(dataset)
    first = next(rows_iter)
    probe = len(orjson.dumps(record(first.index, first.key, first.prompt, 0)))
    if probe > LINE_BYTES - 200:  # a long template system prompt: trim it so lines stay ~3 KB
        system = dict(system, value=system.get("value", "")[: max(0, len(system.get("value", "")) - (probe - LINE_BYTES + 400))])
        probe = len(orjson.dumps(record(first.index, first.key, first.prompt, 0)))
    pad = max(0, LINE_BYTES - probe)

    store = RunStore(run_dir, "resume", BATCH)
    store.load(lambda text: None)
    chunk = [record(first.index, first.key, first.prompt, pad)]
    written = 1
    for row in rows_iter:
        if written >= rows:
            break
        chunk.append(record(row.index, row.key, row.prompt, pad))
        written += 1
        if len(chunk) == BATCH:
            store.commit(chunk)
            chunk = []
    if chunk:
        store.commit(chunk)
    store.close()
    files = sorted(run_dir.glob("batch_*.jsonl"))
    info.update(build_s=time.perf_counter() - t0, files=len(files), bytes=sum(p.stat().st_size for p in files),
                checkpoint_bytes=(run_dir / "checkpoint.json").stat().st_size, rows=written)
    return dataset, run_dir, info


def reset(run_dir: Path, files: int, checkpoint: bytes | None) -> None:
    """Put the run directory back: only the synthetic batch files and config.json (+ checkpoint)."""
    from runner.storage.store import BATCH_FILE

    for path in run_dir.iterdir():
        m = BATCH_FILE.match(path.name)
        if (m and int(m.group(1)) >= files) or (not m and path.name != "config.json"):
            path.unlink()
    if checkpoint is not None:
        (run_dir / "checkpoint.json").write_bytes(checkpoint)


def count_lines(path: Path) -> int:
    n = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 22):
            n += chunk.count(b"\n")
    return n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=100_000, help="committed rows (the dataset has 100 more)")
    parser.add_argument("--repeat", type=int, default=2, help="runs per case (median reported)")
    parser.add_argument("--keep", action="store_true", help="keep the temp dir")
    opts = parser.parse_args()
    print(f"$ {cmd_text([PY, *sys.argv])}")
    tmp = make_tmpdir("bench_resume_", opts.keep)
    try:
        dataset, run_dir, info = build_run(tmp, opts.rows)
        total_rows = opts.rows + REMAINING
        print(f"built {info['rows']:,} committed rows in {info['files']} batch files ({info['bytes'] / 2**20:.0f} MB, "
              f"{info['bytes'] / info['rows']:.0f} B/line), checkpoint.json {info['checkpoint_bytes'] / 2**20:.1f} MB, "
              f"in {info['build_s']:.1f} s (seed run {info['seed_run_s']:.1f} s)")
        checkpoint = (run_dir / "checkpoint.json").read_bytes()
        args = cli_args(dataset, run_dir.parent, resume=True)
        results: dict[str, list] = {"cache": [], "rescan": []}
        for i in range(opts.repeat):
            for case in ("cache", "rescan"):
                reset(run_dir, info["files"], checkpoint if case == "cache" else None)
                run = run_cli(args, cwd=tmp, timeout=600, sample=True, stderr_path=tmp / "stderr.log")
                resumed = next((line for _, line in run.lines if "📂 Resuming" in line), "")
                merged = count_lines(run_dir / "trajectories.jsonl") if (run_dir / "trajectories.jsonl").exists() else -1
                ok = run.returncode == 0 and f"{opts.rows:,} of {total_rows:,}" in resumed and merged == total_rows
                if not ok:
                    print(run.tail(30))
                    print((tmp / "stderr.log").read_text(errors="replace")[-3000:])
                    raise SystemExit(f"{case} run {i + 1}: exit {run.returncode}, '{resumed.strip()}', {merged} merged lines")
                r = {
                    "resuming": run.first("📂 Resuming"), "running": run.first("🚀 Running"),
                    "combining": run.first("📦 Combining"), "complete": run.first("BATCH PROCESSING COMPLETE"),
                    "report": run.first("- Report:"), "exit": run.wall, "parent_mb": run.sampler.peak_parent_rss / 2**20,
                    "cpu": run.rusage_cpu,
                }
                results[case].append(r)
                print(f"  {case} run {i + 1}: '🚀 Running' at {r['running']:.2f} s, exit at {r['exit']:.2f} s "
                      f"(exit code 0, {merged:,} rows merged)")

        def col(case: str, key: str) -> str:
            values = [r[key] for r in results[case] if r[key] is not None]
            if not values:
                return "-"
            return f"{median(values):.2f}" + (f"  [{min(values):.2f}-{max(values):.2f}]" if len(values) > 1 else "")

        print(f"\n=== Resume benchmark: {opts.rows:,} committed rows + {REMAINING} to run, median of {opts.repeat} "
              f"[min-max], seconds since process start ===")
        print_table(["measure", "cache (checkpoint.json)", "rescan (no checkpoint.json)"], [
            [label, col("cache", key), col("rescan", key)]
            for label, key in (
                ("'📂 Resuming' (store loaded)", "resuming"),
                ("'🚀 Running' = starts working (target)", "running"),
                ("'📦 Combining' (100 rows done)", "combining"),
                ("'BATCH PROCESSING COMPLETE' (merged)", "complete"),
                ("'- Report:' (report.html written)", "report"),
                ("exit", "exit"),
                ("CPU of the runner, wait4 (s)", "cpu"),
                ("parent peak RSS (MB)", "parent_mb"),
            )
        ])
        print("\nTargets:")
        all_ok = True
        for case in ("cache", "rescan"):
            value = median([r["running"] for r in results[case]])
            ok = value <= START_TARGET_S
            all_ok &= ok
            print(f"  [{verdict(ok)}] {case}: starts working within {START_TARGET_S:g} s: {value:.2f} s")
        print("\nNotes: batch files are in the page cache (just written); 2 shared cores, so times move with other load.")
        print("\nCommand timed (after resetting the run directory):")
        print(f"  cd {tmp} && {cmd_text(run.args)}")
        sys.exit(0 if all_ok else 1)
    finally:
        if not opts.keep:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
