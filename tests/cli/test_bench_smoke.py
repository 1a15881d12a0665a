"""The benchmarks' quick presets, run as a smoke check: each script drives the real CLI to the end
and prints its table. Their figures are not checked: a benchmark's timing is the machine's load
as much as ours, so the scripts stay benchmarks (docs/benchmarks.md), never timed tests."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _bench(script: str, *args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "bench" / script), *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def test_the_throughput_quick_preset_runs_and_shows_the_tail_and_the_finalize_step_apart():
    proc = _bench("bench_throughput.py", "--preset", "quick", timeout=600)
    # 1 = a target missed, which on a shared machine says nothing about the script
    assert proc.returncode in (0, 1) and "Traceback" not in proc.stderr, proc.stdout[-2000:] + proc.stderr[-3000:]
    for line in ("last wave: last row handed out -> done", "merge: -> trajectories.jsonl",
                 "statistics: -> statistics.json", "report: -> report.html", "steady state: first to last wave"):
        assert line in proc.stdout


def test_the_million_row_bench_quick_preset_kills_resumes_and_gets_every_row():
    proc = _bench("bench_million.py", "--preset", "quick", timeout=600)
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "[PASS] trajectories.jsonl lines == rows: 2,000" in proc.stdout, proc.stdout[-3000:]
    assert "[PASS] phase 2 exit 0" in proc.stdout
    assert "merge -> trajectories.jsonl (s)" in proc.stdout and "parent RSS peak (MB)" in proc.stdout
