"""Shared helpers of the benchmark scripts (bench_*.py): the model server, the CLI, sampling.

Everything here starts processes only on 127.0.0.1, bounds every wait, and cleans up what it
started (by PID / by the process group it created), never by name.
"""

from __future__ import annotations

import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable


def env_for_children() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OPENROUTER_API_KEY", "OPENAI_API_KEY", "TERMINAL_ENV")}
    env["PYTHONPATH"] = str(REPO)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def make_tmpdir(prefix: str, keep: bool) -> Path:
    path = Path(tempfile.mkdtemp(prefix=prefix))
    if keep:
        print(f"(outputs kept in {path})")
    return path


def cmd_text(args: list[str]) -> str:
    return " ".join(shlex.quote(a) for a in args)


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


# --------------------------------------------------------------------------- model server


class ModelServerProcess:
    """`python -m tests.helpers.model_server` as a subprocess (its CPU is not the runner's)."""

    def __init__(self, latency: float, workdir: Path):
        self.latency = latency
        self.port_file = workdir / "model_server.port"
        self.args = [PY, "-m", "tests.helpers.model_server", "--host", "127.0.0.1", "--port", "0",
                     "--latency", f"{latency:g}", "--port-file", str(self.port_file)]
        self.proc: subprocess.Popen | None = None
        self.port: int | None = None

    def __enter__(self) -> "ModelServerProcess":
        self.port_file.unlink(missing_ok=True)
        self.proc = subprocess.Popen(self.args, cwd=REPO, env=env_for_children(), stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.port_file.exists():
                self.port = int(self.port_file.read_text().strip())
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"model server exited early with code {self.proc.returncode}")
            time.sleep(0.05)
        self.stop()
        raise RuntimeError("model server did not write its port within 30 s")

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)

    def __exit__(self, *exc) -> None:
        self.stop()


# --------------------------------------------------------------------------- sampling


@dataclass
class TreeSampler:
    """Samples a process tree every `interval` s: peak summed RSS (and PSS), per-PID CPU, parent RSS.

    A child that a worker has just (v)forked and that has not yet exec'd its program shares its
    parent's memory but reports the parent's whole RSS (with vfork even the same address space),
    so a raw "sum of RSS" counts that memory twice. Such children are recognised by having their
    parent's command line; `peak_rss_dedup` / `peak_pss` leave them out, `peak_rss` does not.
    """

    root_pid: int
    interval: float = 0.2
    pss: bool = True
    peak_rss: int = 0  # raw sum of RSS over the tree
    peak_rss_dedup: int = 0  # without pre-exec fork children
    peak_pss: int = 0  # sum of PSS without pre-exec fork children (shared pages split)
    peak_parent_rss: int = 0
    peak_procs: int = 0
    preexec_at_peak: int = 0  # pre-exec children in the sample with the raw peak
    max_preexec: int = 0
    samples: int = 0
    cpu_by_pid: dict[int, float] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _marks: dict[str, float] = field(default_factory=dict)  # name -> CPU seconds of the tree then
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> "TreeSampler":
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(5)

    def cpu_seen(self) -> float:
        return sum(self.cpu_by_pid.values())

    def mark(self, name: str) -> None:
        """Remember the CPU the tree had used when this happened (sampled now)."""
        self._sample()
        self._marks[name] = self.cpu_seen()

    def marked(self, name: str) -> float | None:
        return self._marks.get(name)

    def _sample(self) -> None:
        with self._lock:
            self._sample_locked()

    def _sample_locked(self) -> None:
        try:
            root = psutil.Process(self.root_pid)
            procs = [root] + root.children(recursive=True)
        except psutil.Error:
            return
        info = {}
        for proc in procs:
            try:
                with proc.oneshot():
                    cmdline = tuple(proc.cmdline())
                    ppid = proc.ppid()
                    rss = proc.memory_info().rss
                    times = proc.cpu_times()
            except psutil.Error:
                continue
            info[proc.pid] = (proc, cmdline, ppid, rss)
            # own CPU only (children_* would double count the children we also sample)
            self.cpu_by_pid[proc.pid] = max(self.cpu_by_pid.get(proc.pid, 0.0), times.user + times.system)
        total = dedup = pss = preexec = 0
        for pid, (proc, cmdline, ppid, rss) in info.items():
            total += rss
            if pid == self.root_pid:
                self.peak_parent_rss = max(self.peak_parent_rss, rss)
            parent = info.get(ppid)
            if pid != self.root_pid and parent is not None and parent[1] == cmdline:
                preexec += 1
                continue
            dedup += rss
            if self.pss:
                try:
                    pss += proc.memory_full_info().pss
                except (psutil.Error, AttributeError):
                    pss += rss
        if total > self.peak_rss:
            self.peak_rss, self.preexec_at_peak = total, preexec
        self.peak_rss_dedup = max(self.peak_rss_dedup, dedup)
        self.peak_pss = max(self.peak_pss, pss)
        self.max_preexec = max(self.max_preexec, preexec)
        self.peak_procs = max(self.peak_procs, len(info))
        self.samples += 1

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.interval)


# --------------------------------------------------------------------------- the CLI


@dataclass
class CliRun:
    args: list[str]
    returncode: int | None = None
    started: float = 0.0  # time.monotonic() at Popen
    started_wall: float = 0.0  # time.time() at Popen (to compare with timestamps the runner writes)
    ended: float = 0.0
    lines: list[tuple[float, str]] = field(default_factory=list)  # (seconds since start, stdout line)
    rusage: object | None = None  # os.wait4 rusage of the runner (includes its reaped workers)
    sampler: TreeSampler | None = None
    timed_out: bool = False

    def first(self, marker: str) -> float | None:
        """Seconds from process start to the first stdout line containing `marker`."""
        return next((t for t, line in self.lines if marker in line), None)

    @property
    def wall(self) -> float:
        return self.ended - self.started

    @property
    def rusage_cpu(self) -> float | None:
        return None if self.rusage is None else self.rusage.ru_utime + self.rusage.ru_stime

    def tail(self, n: int = 15) -> str:
        return "\n".join(line for _, line in self.lines[-n:])


def finalize_phases(run_dir: Path, t_combining: float, t_exit: float) -> dict:
    """The finalize step split by when its files were last written (wall-clock timestamps):
    merge = '📦 Combining' to trajectories.jsonl, statistics = to statistics.json, report = to
    report.html, exit = report.html to the runner's exit."""
    marks = [t_combining]
    for name in ("trajectories.jsonl", "statistics.json", "report.html"):
        try:
            marks.append(max(marks[-1], (run_dir / name).stat().st_mtime))
        except OSError:
            marks.append(marks[-1])
    return {"merge": marks[1] - marks[0], "statistics": marks[2] - marks[1], "report": marks[3] - marks[2],
            "exit": max(0.0, t_exit - marks[3])}


def run_cli(args: list[str], cwd: Path, timeout: float, *, sample: bool = False, stderr_path: Path | None = None,
            on_line=None, interval: float = 0.2) -> CliRun:
    """Run `python batch_runner.py ARGS`, timestamping each stdout line; reap it with os.wait4.

    on_line(run, t, line, proc) may act on a line (e.g. send SIGINT); the run is killed (its own
    process group) if it has not exited after `timeout` seconds.
    """
    full = [PY, str(REPO / "batch_runner.py"), *args]
    run = CliRun(full)
    err = open(stderr_path, "wb") if stderr_path else subprocess.DEVNULL
    try:
        run.started, run.started_wall = time.monotonic(), time.time()
        proc = subprocess.Popen(full, cwd=cwd, env=env_for_children(), stdout=subprocess.PIPE, stderr=err,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    finally:
        if stderr_path:
            err.close()
    if sample:
        run.sampler = TreeSampler(proc.pid, interval=interval).start()

    def killer() -> None:
        if not done.wait(timeout):
            run.timed_out = True
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the group this function created
            except ProcessLookupError:
                pass

    done = threading.Event()
    threading.Thread(target=killer, daemon=True).start()
    for raw in proc.stdout:  # until EOF: the runner (and every worker sharing the pipe) has exited
        t = time.monotonic() - run.started
        line = raw.decode("utf-8", "replace").rstrip("\n")
        run.lines.append((t, line))
        if on_line:
            on_line(run, t, line, proc)
    proc.stdout.close()
    # os.wait4 instead of Popen.wait: the rusage of the runner includes the CPU of every worker
    # process it reaped (multiprocessing joins them), and of their reaped subprocesses.
    _, status, rusage = os.wait4(proc.pid, 0)
    run.ended = time.monotonic()
    done.set()
    proc.returncode = run.returncode = os.waitstatus_to_exitcode(status)
    run.rusage = rusage
    if run.sampler:
        run.sampler.stop()
    return run


def print_table(headers: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) for i, h in enumerate(headers)]
    line = "  ".join(str(h).ljust(w) for h, w in zip(headers, widths))
    print(line)
    print("-" * len(line))
    for row in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)))


def verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("PASS" if ok else "FAIL")
