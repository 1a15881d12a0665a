"""The run's processes, through the real CLI: a dead parent, dead workers, crash loops, leftovers.

Every process of a run dies with it (SIGKILL of the runner alone included)
and stops paying; a dead worker never wedges the parent; what a killed run leaves behind (temp
files, working directories, commands) is cleaned up by the next start of the same run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from tests.conftest import REPO, read_jsonl, wait_for, write_jsonl


def _start(dataset: Path, server, cwd: Path, *extra: str, run_name: str = "p", env: dict | None = None) -> subprocess.Popen:
    args = [sys.executable, str(REPO / "batch_runner.py"), f"--dataset_file={dataset}", f"--run_name={run_name}",
            "--batch_size=4", "--distribution=terminal_only", "--max_turns=8", f"--base_url={server.base_url}",
            "--model=m", "--api_key=x", *extra]
    return subprocess.Popen(args, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})}, start_new_session=True)


def _alive(processes: list[psutil.Process]) -> list[psutil.Process]:
    left = []
    for p in processes:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                left.append(p)
        except psutil.NoSuchProcess:
            pass
    return left


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _chatty_rows(n: int, tag: str) -> list[dict]:
    """Prompts that keep calling the model: many short turns, each with a quick command."""
    tools = "\n".join(f'@tool terminal {{"command": "echo {tag}{i}-{t}"}}' for t in range(7) for i in [0])
    return [{"prompt": f"@latency 0.4\n{tools}\nChatty prompt {tag} #{i}."} for i in range(n)]


def test_sigkill_of_the_runner_alone_stops_every_process_and_request(tmp_path, model_server):
    """Item 1: `kill -9 RUNNER` (OOM killer, timeout -s KILL): the fork server, the workers, the
    resource tracker and the commands they started are gone within 5 s, and no model request is
    sent after the kill (beyond those already on the wire)."""
    rows = _chatty_rows(12, "c")
    rows += [{"prompt": f'@tool terminal {{"command": "sleep 60 # long-{i}"}}\nLong command #{i}.'} for i in range(3)]
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    proc = _start(dataset, model_server, tmp_path, "--num_workers=15", "--num_processes=2")
    try:
        assert wait_for(lambda: model_server.count() >= 20, 60), proc.stderr.read() if proc.poll() is not None else ""
        assert wait_for(lambda: sum("sleep 60" in " ".join(p.cmdline()) for p in _alive(
            psutil.Process(proc.pid).children(recursive=True))) >= 3, 30)
        family = psutil.Process(proc.pid).children(recursive=True)
        assert len(family) >= 4  # fork server, 2 workers, resource tracker, commands
        os.kill(proc.pid, signal.SIGKILL)  # the runner alone, not its process group
        killed = time.time()
        proc.wait(10)
        assert wait_for(lambda: not _alive(family), 5.0), [
            (p.pid, p.cmdline()) for p in _alive(family)]
        time.sleep(1.0)
        late = [r for r in model_server.requests if r.time > killed + 1.0]
        assert not late, f"{len(late)} model request(s) sent more than 1 s after the runner died"
        leftover = list(Path(tempfile.gettempdir()).glob(f"{_run_id(tmp_path / 'data' / 'p')}-*"))
        assert not leftover, leftover  # the workers removed their sessions' working directories
    finally:
        _kill_group(proc)
        for p in _alive(locals().get("family", [])):
            p.kill()


def _run_id(run_dir: Path) -> str:
    return json.loads((run_dir / "config.json").read_text())["run_id"]


def _workers(runner_pid: int) -> list[psutil.Process]:
    """The worker processes: children of the runner's fork server."""
    for child in psutil.Process(runner_pid).children():
        if "forkserver" in " ".join(child.cmdline()):
            return child.children()
    return []


def test_worker_killed_halfway_through_a_large_result_never_wedges_the_run(tmp_path, model_server):
    """Item 2: results of ~600 KB each pile up while the runner is stopped (SIGSTOP), so a worker is
    blocked in the middle of sending one; it is killed there. The runner reads the half-sent
    message as that worker's death: its rows fail (retried on resume) and the run ends."""
    big = "\n".join('@tool terminal {"command": "yes x | head -c 60000"}' for _ in range(10))
    rows = [{"prompt": f"{big}\nLarge result #{i}."} for i in range(8)]
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    proc = _start(dataset, model_server, tmp_path, "--num_workers=8", "--num_processes=2", "--max_turns=12")
    try:
        assert wait_for(lambda: len(_workers(proc.pid)) == 2, 60)
        assert wait_for(lambda: model_server.count() >= 1, 60)
        os.kill(proc.pid, signal.SIGSTOP)  # the parent reads nothing now
        finals = lambda: sum(len(model_server.requests_for(f"Large result #{i}.")) >= 11 for i in range(8))  # noqa: E731
        assert wait_for(lambda: finals() == 8, 120), finals()
        time.sleep(1.0)  # the workers are now blocked sending their records to the stopped parent
        for victim in _workers(proc.pid):  # both: whichever is halfway through a message
            victim.kill()
            victim.wait(5)
        os.kill(proc.pid, signal.SIGCONT)
        out, err = proc.communicate(timeout=60)  # today: wedged for ever in the shared queue
    finally:
        os.kill(proc.pid, signal.SIGCONT) if proc.poll() is None else None
        _kill_group(proc)
    assert proc.returncode == 2, err
    assert "Worker 0 died" in out + err or "Worker 1 died" in out + err
    run_dir = tmp_path / "data" / "p"
    stats = json.loads((run_dir / "statistics.json").read_text())
    assert stats["outcomes"]["failed"] >= 1 and stats["outcomes"]["ok"] + stats["outcomes"]["failed"] == 8
    failed = [r for p in run_dir.glob("batch_*.jsonl") for r in read_jsonl(p) if r.get("failed")]
    assert all("worker process died" in r["error"] for r in failed)
    resume = _start(dataset, model_server, tmp_path, "--num_workers=8", "--num_processes=2", "--max_turns=12", "--resume")
    _, err = resume.communicate(timeout=120)
    assert resume.returncode == 0, err
    assert len(read_jsonl(run_dir / "trajectories.jsonl")) == 8


def test_deaths_spread_over_time_are_not_a_crash_loop():
    """Item 3, the rule: deaths of one slot count within a sliding window, not over the whole run."""
    from runner.execution.process_pool import DeathWindow

    now = [0.0]
    window = DeathWindow(limit=5, window=60.0, clock=lambda: now[0])
    for _ in range(20):  # one death every 20 s for almost 7 minutes: OOM kills, not a loop
        assert not window.record()
        now[0] += 20.0
    now[0] += 100.0
    assert [window.record() for _ in range(5)] == [False, False, False, False, True]  # 5 at once: a loop


def test_a_worker_that_keeps_dying_stops_the_run_like_an_interrupt(tmp_path, model_server):
    """Item 3: a crash loop stops the run with a merge, statistics, the report and exit 2 (and a
    resume hint), never `Fatal error ... exit 1`; a resume then finishes the run."""
    rows = [{"prompt": f'@latency 0.3\n@tool terminal {{"command": "echo {i}"}}\nPrompt #{i}.'} for i in range(40)]
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    proc = _start(dataset, model_server, tmp_path, "--num_workers=4", "--num_processes=1")
    try:
        killed = []
        for _ in range(6):
            if not wait_for(lambda: [w for w in _workers(proc.pid) if w.pid not in killed], 20):
                break  # no new worker: the runner stopped restarting it
            worker = next(w for w in _workers(proc.pid) if w.pid not in killed)
            wait_for(lambda: model_server.count() > 2 * len(killed), 20)
            killed.append(worker.pid)
            worker.kill()
            time.sleep(0.3)
        out, err = proc.communicate(timeout=120)
    finally:
        _kill_group(proc)
    assert proc.returncode == 2, out + err
    assert "Fatal error" not in err
    assert "died 5 times" in err and "--resume" in err
    run_dir = tmp_path / "data" / "p"
    stats = json.loads((run_dir / "statistics.json").read_text())  # merged and written despite the stop
    assert stats["outcomes"]["ok"] + stats["outcomes"]["failed"] + stats["outcomes"]["not_run"] == 40
    assert stats["outcomes"]["not_run"] > 0 and (run_dir / "report.html").exists()
    assert len(read_jsonl(run_dir / "trajectories.jsonl")) == stats["outcomes"]["ok"]
    resume = _start(dataset, model_server, tmp_path, "--num_workers=4", "--num_processes=1", "--resume")
    _, err = resume.communicate(timeout=120)
    assert resume.returncode == 0, err


def _processes_with(text: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        if text in " ".join(p.info["cmdline"] or ()) and p.pid != os.getpid():
            found.append(p)
    return _alive(found)


def test_next_start_cleans_up_what_a_killed_run_left(tmp_path, model_server):
    """Item 9: after `kill -9` of the whole process group, commands (in sessions of their own) keep
    running and working directories stay in the temp dir; the next start of the same run stops
    those commands, removes those directories and the runner's temp files in the run directory."""
    marker = f"leftover-{os.getpid()}-{time.monotonic_ns()}"
    rows = [{"prompt": f'@tool terminal {{"command": "sleep 120 # {marker}"}}\nA long command.'}]
    rows += [{"prompt": f"@latency 0.2\nQuick prompt #{i}."} for i in range(3)]
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    proc = _start(dataset, model_server, tmp_path, "--num_workers=4", "--command_timeout=4")
    try:
        assert wait_for(lambda: _processes_with(f"sleep 120 # {marker}"), 60)
    finally:
        _kill_group(proc)
        proc.wait(10)
    run_dir = tmp_path / "data" / "p"
    run_id = _run_id(run_dir)
    sleepers = _processes_with(f"sleep 120 # {marker}")
    workdirs = list(Path(tempfile.gettempdir()).glob(f"{run_id}-p*"))
    assert sleepers and workdirs  # what the kill left: the command runs on, its folder stays
    merge_leftover = run_dir / ".trajectories_k1ll3d00.tmp"  # what a SIGKILL during the merge leaves
    merge_leftover.write_bytes(b'{"half": "a line"}\n' * 1000)
    users_own = run_dir / ".notes_1.tmp"  # not a name the runner uses: never touched
    users_own.write_text("mine")
    try:
        resume = _start(dataset, model_server, tmp_path, "--num_workers=4", "--command_timeout=4", "--resume")
        out, err = resume.communicate(timeout=120)
        assert resume.returncode == 0, err
        assert not _alive(sleepers), "the killed run's command is still running"
        assert not [p for p in workdirs if p.exists()], "the killed run's working directories are still there"
        assert not merge_leftover.exists() and users_own.read_text() == "mine"
        assert "killed" in out
        # --overwrite also starts clean (it used to leave the merge's temp files behind).
        merge_leftover.write_bytes(b"x")
        again = _start(dataset, model_server, tmp_path, "--num_workers=4", "--command_timeout=4", "--overwrite")
        _, err = again.communicate(timeout=120)
        assert again.returncode == 0, err
        assert not merge_leftover.exists() and not list(run_dir.glob(".trajectories_*.tmp"))
    finally:
        for p in _alive(sleepers):
            p.kill()


def test_two_ctrl_c_during_the_merge_exit_130_without_traceback(tmp_path, model_server):
    """Item 10: two Ctrl-C 50 ms apart while the merge runs: no traceback, exit 130, and
    trajectories.jsonl is either the old version (here: none) or the complete new one; the next
    start removes the merge's temp file and finishes."""
    filler = "lorem ipsum " * 20000  # ~240 KB per prompt, so the merge copies ~30 MB and takes a while
    rows = [{"prompt": f"Big prompt #{i}. {filler}"} for i in range(120)]
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    proc = _start(dataset, model_server, tmp_path, "--num_workers=8", "--batch_size=40")
    run_dir = tmp_path / "data" / "p"
    try:
        seen = wait_for(lambda: run_dir.is_dir() and any(n.startswith(".trajectories_") for n in os.listdir(run_dir)),
                         180, step=0.001)
        assert seen, "the merge was never seen running"
        os.kill(proc.pid, signal.SIGINT)
        time.sleep(0.05)
        os.kill(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        _kill_group(proc)
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-2000:]
    target = run_dir / "trajectories.jsonl"
    if target.exists():  # the new version, complete
        assert [t["prompt_index"] for t in read_jsonl(target)] == list(range(120))
    resume = _start(dataset, model_server, tmp_path, "--num_workers=8", "--batch_size=40", "--resume")
    _, err = resume.communicate(timeout=180)
    assert resume.returncode == 0, err
    assert [t["prompt_index"] for t in read_jsonl(target)] == list(range(120))
    assert not list(run_dir.glob(".trajectories_*.tmp"))


def test_parent_cleans_up_after_a_worker_killed_mid_run(tmp_path, model_server):
    """Item 9, mid-run: a worker killed with SIGKILL cannot stop its sessions' commands (they run
    in sessions of their own) nor remove their working directories; the parent does it as soon as
    it sees the death, and the run goes on (the worker is replaced)."""
    marker = f"orphan-{os.getpid()}-{time.monotonic_ns()}"
    rows = [{"prompt": f'@tool terminal {{"command": "sleep 120 # {marker}"}}\nA long command.'}]
    rows += [{"prompt": f"@latency 0.3\nQuick prompt #{i}."} for i in range(6)]
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    proc = _start(dataset, model_server, tmp_path, "--num_workers=2", "--num_processes=1")
    try:
        assert wait_for(lambda: _processes_with(f"sleep 120 # {marker}"), 60)
        sleepers = _processes_with(f"sleep 120 # {marker}")
        run_id = _run_id(tmp_path / "data" / "p")
        workdirs = list(Path(tempfile.gettempdir()).glob(f"{run_id}-p0-*"))
        assert workdirs
        _workers(proc.pid)[0].kill()
        assert wait_for(lambda: not _alive(sleepers), 10), "the dead worker's command still runs"
        assert wait_for(lambda: not [p for p in workdirs if p.exists()], 10)
        out, err = proc.communicate(timeout=120)
    finally:
        _kill_group(proc)
        for p in _alive(locals().get("sleepers", [])):
            p.kill()
    assert proc.returncode == 2, err  # the long row failed with its worker; the others ran
    stats = json.loads((tmp_path / "data" / "p" / "statistics.json").read_text())
    assert stats["outcomes"]["failed"] >= 1 and stats["outcomes"]["ok"] + stats["outcomes"]["failed"] == 7


def test_the_dead_workers_workdirs_are_gone_when_the_run_ends_however_large(tmp_path, model_server):
    """The parent removes a killed worker's working directories in a thread of its own: the run
    waits for that removal before it exits, or a large directory is left half removed."""
    marker = f"filled-{os.getpid()}-{time.monotonic_ns()}"
    fill = "for i in $(seq 1 40); do mkdir d$i; (cd d$i && seq 1 2000 | xargs touch); done"
    rows = [{"prompt": f'@tool terminal {{"command": "{fill}; touch done; sleep 120 # {marker}"}}\nFill the folder.'}]
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    proc = _start(dataset, model_server, tmp_path, "--num_workers=1")
    try:
        assert wait_for(lambda: (tmp_path / "data" / "p" / "config.json").exists(), 60)
        run_id = _run_id(tmp_path / "data" / "p")
        filled = lambda: [p for p in Path(tempfile.gettempdir()).glob(f"{run_id}-p0-*") if (p / "done").exists()]  # noqa: E731
        assert wait_for(filled, 120)
        workdirs = filled()
        _workers(proc.pid)[0].kill()
        out, err = proc.communicate(timeout=180)
    finally:
        _kill_group(proc)
    assert proc.returncode == 2, err  # its only row failed with its worker
    assert [p for p in workdirs if p.exists()] == [], "the run ended before the dead worker's workdir was removed"
