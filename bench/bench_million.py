#!/usr/bin/env python3
"""A large run end to end through the real CLI: dispatch, a SIGKILL at half way, resume, merge,
statistics.json and report.html, with the parent's memory sampled against the rows done.

    python bench/bench_million.py                  # 1,000,000 rows (about half an hour here)
    python bench/bench_million.py --rows 100000    # a chosen size
    python bench/bench_million.py --preset quick   # 2,000 rows, a smoke check of the script

The dataset is short prompts ("Say hello to number N."), run by the built-in offline model
(`--model=mock --distribution=minimal`: no tool is offered without a web key, so each row is
one model turn and no sandbox), 64 sessions. Phase 1 runs until the progress line shows half of
the rows finished, then SIGKILLs the runner's whole process group (parent, fork server, workers).
Phase 2 runs the same command with --resume to the end. Reported per phase: wall time from
process start to the "🚀 Running" line (resume start), the dispatch ("🚀 Running" to "📦
Combining"), then merge (to trajectories.jsonl written), statistics (to statistics.json) and
report (to report.html), each from the files' modification times; the parent's RSS (psutil,
every 0.5 s) against the rows committed (estimated from the batch files' sizes), its peak, and its growth over
the dispatch; trajectories.jsonl lines against the rows, and report.html's size.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import psutil  # noqa: E402

from _util import PY, REPO, cmd_text, env_for_children, finalize_phases, make_tmpdir, print_table, verdict  # noqa: E402

PRESETS = {"full": 1_000_000, "quick": 2_000}
SESSIONS = 64
SAMPLE_EVERY = 0.5  # seconds between RSS samples of the parent


def write_dataset(path: Path, rows: int) -> None:
    with open(path, "w", encoding="utf-8", buffering=1 << 20) as handle:
        for i in range(rows):
            handle.write(json.dumps({"prompt": f"Say hello to number {i}."}) + "\n")


@dataclass
class Phase:
    name: str
    args: list[str]
    started: float = 0.0  # time.time() at Popen
    ended: float = 0.0
    returncode: int | None = None
    marks: dict[str, float] = field(default_factory=dict)  # stdout marker -> time.time() first seen
    rss: list[tuple[float, int, int]] = field(default_factory=list)  # (time, rows finished, parent RSS bytes)
    done: int = 0  # rows finished, from the last progress line
    killed_at: int | None = None  # rows finished when SIGKILLed
    tree: list = field(default_factory=list)  # the runner's processes when it was killed

    def since_start(self, mark: str) -> float | None:
        return self.marks[mark] - self.started if mark in self.marks else None


class CommittedRows:
    """Rows committed so far, estimated from the batch files' sizes (stat only, so the estimate
    costs the machine nothing) over the mean length of a committed line, measured once on the
    first lines written. The rows of this dataset are alike, so the mean holds."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.line_length: float | None = None

    def estimate(self) -> int:
        files = sorted(self.run_dir.glob("batch_*.jsonl"))
        size = sum(f.stat().st_size for f in files if f.exists())
        if self.line_length is None and files:
            with open(files[0], "rb") as handle:
                head = handle.read(1 << 20)
            lines = head.count(b"\n")
            if lines >= 50:
                self.line_length = head.rfind(b"\n") / lines
        return int(size / self.line_length) if self.line_length else 0


def run_phase(phase: Phase, cwd: Path, run_dir: Path, kill_at: int | None, timeout: float) -> Phase:
    """Run the CLI; SIGKILL its process group once `kill_at` rows are finished (if given)."""
    phase.started = time.time()
    proc = subprocess.Popen([PY, str(REPO / "batch_runner.py"), *phase.args], cwd=cwd, env=env_for_children(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    stop = threading.Event()

    def kill_group() -> None:
        try:
            phase.tree = psutil.Process(proc.pid).children(recursive=True)
        except psutil.Error:
            pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the group this function created
        except ProcessLookupError:
            pass

    def read_stdout() -> None:
        for raw in proc.stdout:
            line = raw.decode("utf-8", "replace")
            for mark in ("🚀 Running", "📦 Combining"):
                if mark in line and mark not in phase.marks:
                    phase.marks[mark] = time.time()

    def read_stderr() -> None:
        for _ in proc.stderr:  # drained so the runner never blocks on it
            pass

    counter = CommittedRows(run_dir)

    def sample() -> None:
        parent = psutil.Process(proc.pid)
        while not stop.is_set():
            phase.done = counter.estimate()
            try:
                phase.rss.append((time.time(), phase.done, parent.memory_info().rss))
            except psutil.Error:
                return
            if kill_at is not None and phase.done >= kill_at and phase.killed_at is None:
                phase.killed_at = phase.done
                kill_group()
                return
            stop.wait(SAMPLE_EVERY)

    readers = [threading.Thread(target=fn, daemon=True) for fn in (read_stdout, read_stderr, sample)]
    for thread in readers:
        thread.start()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        kill_group()
        proc.wait()
        raise SystemExit(f"{phase.name}: still running after {timeout:.0f} s; killed")
    finally:
        stop.set()
        for thread in readers:
            thread.join(10)
    phase.ended = time.time()
    phase.returncode = proc.returncode
    return phase


def wait_gone(procs: list[psutil.Process], limit: float = 30.0) -> None:
    """Every process of the killed run is gone before the resume starts."""
    _, alive = psutil.wait_procs(procs, timeout=limit)
    for proc in alive:
        print(f"  ! process {proc.pid} outlived the kill by {limit:g} s")


def rss_growth(phase: Phase) -> tuple[float | None, float | None, float | None]:
    """Parent RSS (MB) at the first quarter and the end of the dispatch, and the peak in it."""
    t0, t1 = phase.marks.get("🚀 Running"), phase.marks.get("📦 Combining", phase.ended)
    inside = [(t, done, rss) for t, done, rss in phase.rss if t0 is not None and t0 <= t <= t1]
    if len(inside) < 4:
        return None, None, None
    quarter = inside[len(inside) // 4][2] / 2**20
    end = inside[-1][2] / 2**20
    return quarter, end, max(r for _, _, r in inside) / 2**20


def count_lines(path: Path) -> int:
    with open(path, "rb") as handle:
        return sum(chunk.count(b"\n") for chunk in iter(lambda: handle.read(1 << 20), b""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, help="dataset rows (default: the preset's)")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="full", help="full (1,000,000 rows) or quick (2,000)")
    parser.add_argument("--keep", action="store_true", help="keep the temp dir")
    parser.add_argument("--timeout", type=float, help="seconds each phase may take before its runner is killed "
                                                      "(default: 300 + rows / 50)")
    opts = parser.parse_args()
    rows = opts.rows or PRESETS[opts.preset]
    print(f"$ {cmd_text([PY, *sys.argv])}")
    tmp = make_tmpdir("bench_million_", opts.keep)
    ok = True
    try:
        dataset = tmp / "prompts.jsonl"
        write_dataset(dataset, rows)
        out = tmp / "out"
        args = [f"--dataset_file={dataset}", "--run_name=million", "--model=mock", "--distribution=minimal",
                f"--num_workers={SESSIONS}", "--batch_size=10000", f"--output_dir={out}"]
        timeout = opts.timeout or 300 + rows / 50  # far above the expected few hundred rows per second
        load0 = os.getloadavg()
        print(f"▶ {rows:,} rows, {SESSIONS} sessions, --model=mock; SIGKILL of the process group at half way")
        print(f"  phase 1: $ {cmd_text([PY, str(REPO / 'batch_runner.py'), *args])}")
        first = run_phase(Phase("phase 1", args), tmp, out / "million", kill_at=rows // 2,
                          timeout=timeout)
        if first.killed_at is None:
            raise SystemExit(f"phase 1 ended (exit {first.returncode}) before half the rows were finished")
        wait_gone(first.tree)
        resume = args + ["--resume"]
        print(f"  phase 1 killed at {first.killed_at:,} rows finished; phase 2: the same command with --resume")
        second = run_phase(Phase("phase 2", resume), tmp, out / "million", kill_at=None, timeout=timeout)
        load1 = os.getloadavg()
        run_dir = out / "million"
        if second.returncode != 0:
            raise SystemExit(f"phase 2 exited with {second.returncode}")
        combining = second.marks.get("📦 Combining")
        files = (finalize_phases(run_dir, combining, second.ended) if combining is not None
                 else dict.fromkeys(("merge", "statistics", "report", "exit")))
        lines = count_lines(run_dir / "trajectories.jsonl")
        report_size = (run_dir / "report.html").stat().st_size
        stats = json.loads((run_dir / "statistics.json").read_text())
        summary = json.loads(_script_block(run_dir / "report.html", "summary-data") or "{}")
        ok = report(rows, first, second, files, lines, report_size, stats, summary, (load0, load1))
    finally:
        if not opts.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    sys.exit(0 if ok else 1)


def _script_block(path: Path, element_id: str) -> str | None:
    """The JSON of report.html's <script id=...> block (the summary: counts and the sample's size)."""
    text = path.read_text(encoding="utf-8", errors="replace")
    match = re.search(rf'<script[^>]*id="{element_id}"[^>]*>(.*?)</script>', text, re.S)
    return match.group(1) if match else None


def report(rows: int, first: Phase, second: Phase, files: dict, lines: int, report_size: int, stats: dict,
           summary: dict, load: tuple) -> bool:
    fmt = lambda v, f=".1f": "-" if v is None else format(v, f)  # noqa: E731
    q1, e1, p1 = rss_growth(first)
    q2, e2, p2 = rss_growth(second)
    peak = lambda ph: max((r for _, _, r in ph.rss), default=0) / 2**20  # noqa: E731
    dispatch = lambda ph: (ph.marks.get("📦 Combining", ph.ended) - ph.marks["🚀 Running"]) if "🚀 Running" in ph.marks else None  # noqa: E731
    print(f"\n=== {rows:,} rows end to end (SIGKILL at half way, then --resume) ===")
    print_table(["measure", "phase 1 (killed)", "phase 2 (--resume)"], [
        ["start -> '🚀 Running' (s)", fmt(first.since_start("🚀 Running"), ".2f"), fmt(second.since_start("🚀 Running"), ".2f")],
        ["dispatch (s)", fmt(dispatch(first), ".1f"), fmt(dispatch(second), ".1f")],
        ["rows committed in the phase", f"about {first.killed_at:,}", f"the rest, about {rows - first.killed_at:,}"],
        ["rows/s over the dispatch", fmt(first.killed_at / dispatch(first) if dispatch(first) else None),
         fmt((rows - first.killed_at) / dispatch(second) if dispatch(second) else None)],
        ["merge -> trajectories.jsonl (s)", "-", fmt(files["merge"], ".2f")],
        ["statistics -> statistics.json (s)", "-", fmt(files["statistics"], ".2f")],
        ["report -> report.html (s)", "-", fmt(files["report"], ".2f")],
        ["report.html -> exit (s)", "-", fmt(files["exit"], ".2f")],
        ["wall, start to end (s)", fmt(first.ended - first.started), fmt(second.ended - second.started)],
        ["parent RSS peak (MB)", fmt(peak(first), ".0f"), fmt(peak(second), ".0f")],
        ["parent RSS in dispatch: at 1/4, at end, peak (MB)", f"{fmt(q1, '.0f')}, {fmt(e1, '.0f')}, {fmt(p1, '.0f')}",
         f"{fmt(q2, '.0f')}, {fmt(e2, '.0f')}, {fmt(p2, '.0f')}"],
    ])
    print("\nParent RSS against rows committed (phase 1, then phase 2):")
    for phase in (first, second):
        points = phase.rss[:: max(1, len(phase.rss) // 8)] + phase.rss[-1:]
        print(f"  {phase.name}: " + ", ".join(f"{done:,} rows {rss / 2**20:.0f} MB" for _, done, rss in points))
    sample = summary.get("sample", {})
    print(f"\ntrajectories.jsonl: {lines:,} lines for {rows:,} rows; statistics.json ok = "
          f"{stats.get('outcomes', {}).get('ok', 0):,}; report.html {report_size / 1e6:.1f} MB "
          f"(its rows table lists {sample.get('table', sample.get('rows', '?'))} of {sample.get('rows', '?')} rows, "
          f"limit {sample.get('table_limit', 'none')}; {sample.get('embedded', '?')} full conversations, limit "
          f"{sample.get('limit', '?')})")
    print(f"load average before / after: {load[0][0]:.1f} / {load[1][0]:.1f}")
    growth = (e2 - q2) if e2 is not None and q2 is not None else None
    checks = [
        ("trajectories.jsonl lines == rows", lines == rows, f"{lines:,}"),
        ("phase 2 exit 0", second.returncode == 0, str(second.returncode)),
        ("parent RSS grows by < 10% of its size over phase 2's dispatch", None if growth is None else growth < 0.1 * q2,
         f"{fmt(growth, '+.0f')} MB"),
    ]
    for label, ok, value in checks:
        print(f"  [{verdict(ok)}] {label}: {value}")
    return all(ok is not False for _, ok, _ in checks)


if __name__ == "__main__":
    main()
