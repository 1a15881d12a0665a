"""A signal sent to the runner's whole process group (GNU `timeout`, systemd, Slurm, `kill -TERM -PGID`).

Such a signal reaches every process of the run at once: the workers and the fork server as well
as the runner. The workers must not die of it: the runner stops them itself, the gentle way, as
for one Ctrl-C (no new prompt, the ones in flight finish within --grace_period and are committed,
exit 130), and the next --resume runs each remaining row once.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, read_jsonl, wait_for, write_jsonl

LATENCY = 1.5  # seconds per model reply: rows are in flight when the signal comes


def _rows(n: int) -> list[dict]:
    return [{"id": f"r{i}", "prompt": f'@latency {LATENCY}\n@tool terminal {{"command": "echo g{i}"}}\nSlow row #{i}.'}
            for i in range(n)]


def _command(dataset: Path, server, *extra: str) -> list[str]:
    return [sys.executable, str(REPO / "batch_runner.py"), f"--dataset_file={dataset}", "--run_name=g",
            "--batch_size=2", "--distribution=terminal_only", "--max_turns=4", f"--base_url={server.base_url}",
            "--model=m", "--api_key=x", "--num_workers=3", "--num_processes=2", "--grace_period=60", *extra]


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO)}


def _committed(run_dir: Path) -> list[dict]:
    lines = []
    for path in sorted(glob.glob(str(run_dir / "batch_*.jsonl"))):
        lines += [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return lines


def _started_rows(server) -> set[str]:
    return {m.group(0) for r in server.requests for m in [_row_tag(r.body)] if m}


def _row_tag(body: dict):
    import re

    text = " ".join(str(m.get("content") or "") for m in body.get("messages", []) if m.get("role") == "user")
    return re.search(r"Slow row #\d+", text)


def _check_graceful_stop(proc: subprocess.Popen, err: str, run_dir: Path, server) -> None:
    assert proc.returncode == 130, err[-3000:]
    assert "worker process died" not in err and "Worker" not in err, err[-3000:]
    committed = _committed(run_dir)
    failed = [r for r in committed if r.get("failed")]
    assert not failed, [r["error"] for r in failed]
    done = {f"Slow row #{r['prompt_index']}" for r in committed}
    # No row starts after the signal, so every row the server saw had started before it: each
    # finished within the grace period and was committed.
    assert _started_rows(server) == done
    stats = json.loads((run_dir / "statistics.json").read_text())
    assert stats["spend"]["all"]["requests"] >= 2 * len(done)


def _resume_runs_the_rest_once(dataset: Path, server, tmp_path: Path, rows: int) -> None:
    run_dir = tmp_path / "data" / "g"
    before = {f"Slow row #{r['prompt_index']}" for r in _committed(run_dir)}
    server.reset()
    again = subprocess.run(_command(dataset, server, "--resume"), cwd=tmp_path, env=_env(), capture_output=True,
                           text=True, timeout=240)
    assert again.returncode == 0, again.stderr[-3000:]
    assert not (_started_rows(server) & before), "a committed row was run again"
    kept = read_jsonl(run_dir / "trajectories.jsonl")
    assert sorted(t["prompt_index"] for t in kept) == list(range(rows))


def test_kill_term_to_the_process_group_stops_the_run_gracefully(tmp_path, model_server):
    rows = 8
    dataset = write_jsonl(tmp_path / "d.jsonl", _rows(rows))
    proc = subprocess.Popen(_command(dataset, model_server), cwd=tmp_path, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert wait_for(lambda: len(_started_rows(model_server)) >= 3, 90), "no row started"
        os.killpg(proc.pid, signal.SIGTERM)  # the whole group, as systemd or Slurm would
        _, err = proc.communicate(timeout=120)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _check_graceful_stop(proc, err, tmp_path / "data" / "g", model_server)
    assert len(_committed(tmp_path / "data" / "g")) < rows  # it stopped: not every row ran
    _resume_runs_the_rest_once(dataset, model_server, tmp_path, rows)


@pytest.mark.skipif(not os.path.exists("/usr/bin/timeout"), reason="GNU timeout is not installed")
def test_gnu_timeout_stops_the_run_gracefully(tmp_path, model_server):
    rows = 24  # about 24 s of work on 3 sessions: timeout's signal comes in the middle
    dataset = write_jsonl(tmp_path / "d.jsonl", _rows(rows))
    # timeout signals its whole process group (the runner, the fork server, the workers).
    proc = subprocess.Popen(["timeout", "--preserve-status", "-s", "TERM", "14", *_command(dataset, model_server)],
                            cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        _, err = proc.communicate(timeout=120)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if not _started_rows(model_server):
        pytest.skip("the machine was too slow: the signal came before the first row started")
    _check_graceful_stop(proc, err, tmp_path / "data" / "g", model_server)
    assert len(_committed(tmp_path / "data" / "g")) < rows
    _resume_runs_the_rest_once(dataset, model_server, tmp_path, rows)
