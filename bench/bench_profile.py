#!/usr/bin/env python3
"""Where the CPU of a run goes, per prompt: py-spy over the runner's parent and its workers.

    python bench/bench_profile.py --preset b           # 16 sessions, 200 ms, 1,000 prompts
    python bench/bench_profile.py --preset zero        # ~0 latency, 2,000 prompts
    python bench/bench_profile.py --preset c           # 512 sessions, 2 s, 4,000 prompts
    python bench/bench_profile.py --raw saved.txt      # classify a raw py-spy file again

The runner re-executes itself once at start (to take the API key out of its argv), so py-spy is
attached by PID after the runner prints its "🚀 Running" line, with --subprocesses (the fork
server and its workers) and --gil (only samples of a thread holding the GIL: Python CPU; a thread
waiting on a lock or in a system call holding no GIL is not counted). The figures are samples x
interval / prompts: CPU of Python code per prompt, slightly inflated by py-spy pausing the
processes; the CPU of shell commands, of the kernel and of C code released from the GIL is not in
them (bench_throughput.py reports the whole tree's rusage).

Each sample is put in one bucket by its stack: the first frame from the root that belongs to a
whole-step bucket (a commit, a tool call, ...) decides, so that bucket includes the pydantic
validation or the thread hand-off it calls; otherwise the deepest frame that belongs to a bucket
(the model client under the agent loop); the event loop and imports only when nothing else matched.
"""

from __future__ import annotations

import argparse
import collections
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _util import PY, REPO, ModelServerProcess, cmd_text, env_for_children, make_tmpdir, print_table  # noqa: E402
from bench_throughput import write_dataset  # noqa: E402

PRESETS = {
    "b": {"sessions": 16, "latency": 0.2, "prompts": 1000},
    "c": {"sessions": 512, "latency": 2.0, "prompts": 4000},
    "zero": {"sessions": 64, "latency": 0.0, "prompts": 2000},
    "quick": {"sessions": 16, "latency": 0.05, "prompts": 200},
}
RATE = 250  # samples per second

# (bucket, patterns in a frame "function (file)", whole step?): see the module's docstring.
STEP, PART, FALLBACK = "step", "part", "fallback"
BUCKETS = [
    ("finalize (merge, statistics, report)", STEP, ("runner/output/finalize.py", "BatchRunner._write_report",
                                                    "runner/output/report.py", "runner/output/statistics.py")),
    ("commit (parent)", STEP, ("RunStore.commit", "BatchRunner._after_commit", "RunStore.save_checkpoint")),
    ("progress and status (usage reports, live status)", STEP, (
        "report_usage", "CallStats._changed", "CallStats._pend", "runner/output/status.py", "RunMonitor", "row_stats")),
    ("environment set-up and clean-up", STEP, ("LocalEnvironment.start", "LocalEnvironment.cleanup",
                                               "create_environment", "_cleanup (runner/execution/worker.py)")),
    ("tool call (terminal command)", STEP, ("LocalEnvironment.execute", "_run_tool", "tools/")),
    ("scheduling (dataset, tasks, submit)", STEP, ("BatchRunner._tasks", "ProcessExecutor.submit",
                                                   "runner/input/dataset.py")),
    ("IPC (pipes, pickling)", PART, ("multiprocessing/connection.py", "ProcessExecutor._drain", "ProcessExecutor.poll",
                                     "send_results", "read_tasks", "ForkingPickler", "_reap_dead_workers")),
    ("model client (SDK, HTTP, JSON)", PART, ("agent/model_client.py", "agent/plain_http.py", "openai/", "httpx",
                                              "httpcore", "aiohttp/")),
    ("record and trajectory (worker)", PART, ("agent/trajectory.py", "runner/storage/records.py", "_metadata",
                                              "failed_record", "extract_tool_stats", "normalise_tool_stats")),
    ("agent loop and row set-up", PART, ("agent/loop.py", "process_row", "sample_toolsets", "tools_for_toolsets")),
    ("imports", FALLBACK, ("<frozen importlib._bootstrap>",)),
    ("event loop and threads", FALLBACK, ("asyncio/", "concurrent/futures", "threading.py", "selectors.py")),
]
OTHER = "other"


def role_of(heads: list[str]) -> str:
    """The process a stack came from: py-spy prefixes each with its process and the ancestors'."""
    if len(heads) <= 1:
        return "parent"
    return "worker" if "forkserver" in heads[-1] and len(heads) >= 3 else "helper (fork server, tracker)"


def _matches(frame: str, kinds: tuple[str, ...]):
    return next((name for name, kind, patterns in BUCKETS if kind in kinds and any(p in frame for p in patterns)), None)


def bucket_of(frames: list[str]) -> str:
    deepest = fallback = None
    for frame in frames:  # root first
        if step := _matches(frame, (STEP,)):
            return step
        deepest = _matches(frame, (PART,)) or deepest
        fallback = fallback or _matches(frame, (FALLBACK,))
    return deepest or fallback or OTHER


def classify(raw: Path) -> dict[tuple[str, str], int]:
    counts: dict[tuple[str, str], int] = collections.Counter()
    with open(raw, encoding="utf-8", errors="replace") as handle:
        for line in handle:
            stack, _, n = line.rstrip("\n").rpartition(" ")
            if not n.isdigit():
                continue
            frames = stack.split(";")
            heads = [f for f in frames if f.startswith("process ")]
            code = [f for f in frames if not f.startswith("process ")]
            counts[(role_of(heads), bucket_of(code))] += int(n)
    return counts


def print_breakdown(counts: dict[tuple[str, str], int], prompts: int) -> None:
    per_sample_ms = 1000 / RATE
    roles = sorted({r for r, _ in counts}, key=lambda r: ("parent", "worker").index(r) if r in ("parent", "worker") else 2)
    names = [b for b, _, _ in BUCKETS] + [OTHER]
    rows = []
    for name in names:
        cells = [counts.get((r, name), 0) * per_sample_ms / prompts for r in roles]
        if sum(cells) > 0:
            rows.append([name] + [f"{c:.2f}" for c in cells] + [f"{sum(cells):.2f}"])
    totals = [sum(v for (r, _), v in counts.items() if r == role) * per_sample_ms / prompts for role in roles]
    rows.append(["total"] + [f"{t:.2f}" for t in totals] + [f"{sum(totals):.2f}"])
    print(f"\n=== Python CPU per prompt (ms), py-spy --gil at {RATE} Hz, {prompts:,} prompts ===")
    print_table(["bucket"] + roles + ["all"], rows)


def profile(name: str, sessions: int, latency: float, prompts: int, keep: bool) -> Path:
    tmp = make_tmpdir(f"bench_profile_{name}_", keep=True)
    dataset = tmp / "prompts.jsonl"
    write_dataset(dataset, prompts)
    raw = tmp / "py-spy.raw.txt"
    with ModelServerProcess(latency, tmp) as server:
        args = [PY, str(REPO / "batch_runner.py"), f"--dataset_file={dataset}", "--run_name=bench", "--batch_size=100",
                f"--num_workers={sessions}", "--distribution=terminal_only", f"--base_url={server.base_url}",
                "--model=bench", "--api_key=x", "--keep_no_reasoning", f"--output_dir={tmp / 'out'}"]
        print(f"▶ {name}: {sessions} sessions, {latency * 1000:g} ms latency, {prompts:,} prompts")
        print(f"  $ {cmd_text(args)}")
        runner = subprocess.Popen(args, cwd=tmp, env=env_for_children(), stdout=subprocess.PIPE,
                                  stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, start_new_session=True)
        spy = None
        try:
            for line in runner.stdout:  # attach once the re-exec is done and the run has started
                if spy is None and "🚀 Running".encode() in line:
                    spy_args = [str(Path(PY).parent / "py-spy"), "record", "-p", str(runner.pid), "--subprocesses",
                                "--gil", "--nolineno", "-r", str(RATE), "-f", "raw", "-o", str(raw)]
                    print(f"  $ {cmd_text(spy_args)}")
                    spy = subprocess.Popen(spy_args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            runner.wait(timeout=600)
        finally:
            if runner.poll() is None:
                runner.kill()
                runner.wait()
            if spy is not None:
                spy.wait(timeout=120)
    if runner.returncode != 0 or not raw.exists():
        raise SystemExit(f"the run exited with {runner.returncode} (py-spy output: {raw.exists()})")
    shutil.rmtree(tmp / "out", ignore_errors=True)
    return raw


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="quick")
    parser.add_argument("--raw", type=Path, help="classify this raw py-spy file instead of running")
    parser.add_argument("--prompts", type=int, help="prompts of that --raw run (default: the preset's)")
    parser.add_argument("--keep", action="store_true", help="keep the temp dir (the raw profile is always kept)")
    opts = parser.parse_args()
    if shutil.which("py-spy", path=str(Path(PY).parent)) is None and opts.raw is None:
        raise SystemExit("py-spy is not installed next to this Python (pip install py-spy)")
    preset = PRESETS[opts.preset]
    raw = opts.raw or profile(opts.preset, preset["sessions"], preset["latency"], preset["prompts"], opts.keep)
    print_breakdown(classify(raw), opts.prompts or preset["prompts"])
    print(f"\nraw profile: {raw}")


if __name__ == "__main__":
    main()
