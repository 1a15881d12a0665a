"""The requests of rows in flight when the runner itself is killed with SIGKILL are accounted.

The parent is the only process that commits records, so when it dies (kill -9 of its PID alone, the
OOM killer), the spend its workers reported for the rows still in flight dies with it. The workers
journal every request they send in the run directory; the next invocation of the run (--resume or
--report) records what no committed line covers, once, however often it is itself killed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import REPO, wait_for, write_jsonl

COST = 0.01  # what each scripted reply says it cost


def _rows(count: int) -> list[dict]:
    tools = "".join(f'@tool terminal {{"command": "echo {n}"}}\n' for n in range(3))
    return [{"prompt": f"@cost {COST}\n@latency 0.7\n{tools}Killed runner row {i}."} for i in range(count)]


def _args(tmp_path: Path, server, *extra: str) -> list[str]:
    return [sys.executable, str(REPO / "batch_runner.py"), f"--dataset_file={tmp_path / 'd.jsonl'}", "--run_name=r",
            "--batch_size=4", "--distribution=terminal_only", "--max_turns=8", f"--base_url={server.base_url}",
            "--model=m", "--api_key=x", *extra]


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO)}


def _start(tmp_path: Path, server, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(_args(tmp_path, server, "--num_workers=4", "--num_processes=2", *extra), cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_env(), start_new_session=True)


def _run_processes(runner_pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(runner_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _kill_runner_only(proc: subprocess.Popen, server, *, after_requests: int) -> None:
    """SIGKILL the runner's own PID (not its group) once the endpoint received `after_requests`
    requests, then wait until every process of the run is gone (the workers stop by themselves)."""
    assert wait_for(lambda: server.count() >= after_requests, 90), server.count()
    children = _run_processes(proc.pid)
    assert any("forkserver" in " ".join(c.cmdline()) for c in children)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    _, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, alive


def _cli(tmp_path: Path, server, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(_args(tmp_path, server, "--num_workers=4", *extra), cwd=tmp_path, capture_output=True,
                          text=True, env=_env(), timeout=240)


def _report(tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "batch_runner.py"), "--report", "--run_name=r"], cwd=tmp_path,
                          capture_output=True, text=True, env=_env(), timeout=120)


def _recorded_requests(tmp_path: Path) -> int:
    stats = json.loads((tmp_path / "data" / "r" / "statistics.json").read_text())
    return stats["spend"]["all"]["requests"]


def _status_requests(tmp_path: Path) -> int:
    return json.loads((tmp_path / "data" / "r" / "status.json").read_text())["spend"]["requests"]


def test_a_resume_after_the_runner_was_killed_counts_the_requests_of_its_rows_in_flight(tmp_path, model_server):
    write_jsonl(tmp_path / "d.jsonl", _rows(8))
    proc = _start(tmp_path, model_server)
    _kill_runner_only(proc, model_server, after_requests=10)
    sent = model_server.count()
    resumed = _cli(tmp_path, model_server, "--resume")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    received = model_server.count()
    assert received > sent
    assert _recorded_requests(tmp_path) == received  # before: the killed rows' requests were missing
    assert _status_requests(tmp_path) == received
    again = _cli(tmp_path, model_server, "--resume")  # nothing is counted twice by a later invocation
    assert again.returncode == 0, again.stdout + again.stderr
    assert _recorded_requests(tmp_path) == model_server.count() == received


def test_a_report_after_the_runner_was_killed_counts_the_requests_of_its_rows_in_flight(tmp_path, model_server):
    write_jsonl(tmp_path / "d.jsonl", _rows(8))
    proc = _start(tmp_path, model_server)
    _kill_runner_only(proc, model_server, after_requests=10)
    for _ in range(2):  # a second report counts nothing twice
        report = _report(tmp_path)
        assert report.returncode == 0, report.stdout + report.stderr
        assert _recorded_requests(tmp_path) == model_server.count()


def test_a_resume_killed_in_turn_still_counts_every_request_once(tmp_path, model_server):
    write_jsonl(tmp_path / "d.jsonl", _rows(12))
    proc = _start(tmp_path, model_server)
    _kill_runner_only(proc, model_server, after_requests=10)
    resume = _start(tmp_path, model_server, "--resume")
    _kill_runner_only(resume, model_server, after_requests=model_server.count() + 8)
    resumed = _cli(tmp_path, model_server, "--resume")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert _recorded_requests(tmp_path) == model_server.count()
    assert not list((tmp_path / "data" / "r").glob(".spend_*")), "the journals are retired once recorded"


def _batch_lines(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for path in sorted((tmp_path / "data" / "r").glob("batch_*.jsonl"))
            for line in path.read_text().splitlines() if line.strip()]


def _overwrite_after_a_kill(tmp_path: Path, server, *, after_requests: int) -> tuple[subprocess.CompletedProcess, int]:
    """Kill a run once `after_requests` were sent, then --overwrite it with another dataset; the
    requests the overwriting run sent."""
    write_jsonl(tmp_path / "d.jsonl", _rows(16))  # 4 requests a row, 8 rows at a time
    proc = _start(tmp_path, server)
    _kill_runner_only(proc, server, after_requests=after_requests)
    assert list((tmp_path / "data" / "r").glob(".spend_*")), "the killed run left journals"
    assert bool(_batch_lines(tmp_path)) == (after_requests > 32), "the kill came before (after) the first commit"
    before = server.count()
    write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"@cost {COST}\nFresh row {i}."} for i in range(2)])
    fresh = _cli(tmp_path, server, "--overwrite")
    assert fresh.returncode == 0, fresh.stdout + fresh.stderr
    return fresh, server.count() - before


def _assert_only_the_new_run(tmp_path: Path, fresh: subprocess.CompletedProcess, sent: int) -> None:
    assert "removed the earlier outputs" in fresh.stdout, fresh.stdout
    assert "Recorded from the workers' journals" not in fresh.stdout, fresh.stdout
    lines = _batch_lines(tmp_path)
    assert len(lines) == 2 and not any("Killed runner row" in json.dumps(line) for line in lines), lines
    assert _recorded_requests(tmp_path) == sent == 2
    assert not list((tmp_path / "data" / "r").glob(".spend_*"))


def test_overwrite_after_a_kill_before_any_row_was_committed_removes_the_old_journals(tmp_path, model_server):
    fresh, sent = _overwrite_after_a_kill(tmp_path, model_server, after_requests=2)
    _assert_only_the_new_run(tmp_path, fresh, sent)


def test_overwrite_after_a_kill_with_rows_committed_removes_the_old_journals(tmp_path, model_server):
    fresh, sent = _overwrite_after_a_kill(tmp_path, model_server, after_requests=40)
    _assert_only_the_new_run(tmp_path, fresh, sent)


def _plant_malformed_journals(run_dir: Path) -> None:
    header = json.dumps({"journal": 1, "run_id": "zz", "model": "m", "t": time.time()})
    (run_dir / ".spend_zz_1_0.journal").write_text(f"{header}\n5\n" + '{"start": {"key": "x"}}\n')
    (run_dir / ".spend_zz_2_0.journal").mkdir()
    os.mkfifo(run_dir / ".spend_zz_3_0.journal")
    start = {"key": "no such row", "index": 0, "id": "", "attempt": 1, "prompt": "a row of another dataset"}
    usage = {"requests": 5, "cost": 0.5, "unpriced_requests": 0, "by_model": [], "pending": 0}
    (run_dir / ".spend_zz_4_0.journal").write_text(
        f"{header}\n{json.dumps({'start': start})}\n{json.dumps({'k': 'no such row', 'a': 1, 't': 1.0, 'u': usage})}\n")


def test_malformed_journals_never_stop_a_report_or_a_resume(tmp_path, model_server):
    write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"@cost {COST}\nRow {i}."} for i in range(2)])
    first = _cli(tmp_path, model_server)
    assert first.returncode == 0, first.stdout + first.stderr
    run_dir = tmp_path / "data" / "r"
    for command in (_report, lambda path: _cli(path, model_server, "--resume")):
        _plant_malformed_journals(run_dir)
        done = command(tmp_path)
        said = done.stdout + done.stderr
        assert done.returncode == 0 and "Traceback" not in said and "Fatal error" not in said, said
        assert ".spend_zz_1_0.journal: line 2 (and 1 more) is not a well-formed journal line" in said, said
        assert ".spend_zz_3_0.journal: not a regular file" in said and "'no such row' is not in the dataset" in said
        assert _recorded_requests(tmp_path) == model_server.count() == 2  # nothing of the foreign row counted
        (run_dir / ".spend_zz_2_0.journal").rmdir()
        (run_dir / ".spend_zz_3_0.journal").unlink()


def test_a_report_after_the_runner_was_killed_rewrites_status_json_to_agree_with_statistics_json(tmp_path, model_server):
    write_jsonl(tmp_path / "d.jsonl", _rows(16))
    proc = _start(tmp_path, model_server)
    _kill_runner_only(proc, model_server, after_requests=40)  # some rows committed, others in flight
    run_dir = tmp_path / "data" / "r"
    assert json.loads((run_dir / "status.json").read_text())["state"] == "running"  # as the dead runner left it
    report = _report(tmp_path)
    assert report.returncode == 0, report.stdout + report.stderr
    status = json.loads((run_dir / "status.json").read_text())
    stats = json.loads((run_dir / "statistics.json").read_text())
    assert status["state"] == "interrupted" and status["pid"] != proc.pid and status["eta_seconds"] is None
    assert status["spend"]["requests"] == stats["spend"]["all"]["requests"] == model_server.count()
    outcomes = stats["outcomes"]
    assert status["rows"]["total"] == stats["total_prompts"] == 16 and status["rows"]["in_flight"] == 0
    assert status["rows"]["kept"] == outcomes["ok"] and status["rows"]["remaining"] == outcomes["failed"] + outcomes["not_run"]
    assert status["spend"]["known_usd"] == pytest.approx(stats["spend"]["all"]["known_cost"])


def test_a_journal_whose_numbers_no_sum_can_hold_is_skipped_not_a_run_that_can_never_resume(tmp_path, model_server):
    """A usage at the top of the 64-bit range (or a cost of 9e18 dollars) is no usage a worker
    wrote: added to the run's spend it could not be written again, and every resume died on it."""
    write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"@cost {COST}\nRow {i}."} for i in range(2)])
    first = _cli(tmp_path, model_server)
    assert first.returncode == 0, first.stdout + first.stderr
    run_dir = tmp_path / "data" / "r"
    line = json.loads((run_dir / "batch_0.jsonl").read_text().splitlines()[0])
    key = line["metadata"]["row_key"]
    header = json.dumps({"journal": 1, "run_id": "zz", "model": "m", "t": time.time()})
    start = json.dumps({"start": {"key": key, "index": line["prompt_index"], "id": "", "attempt": 1, "prompt": "p"}})
    for name, usage in [("big", {"requests": 2**63 - 1, "by_model": [], "pending": 0}),
                        ("dear", {"requests": 1, "cost": 9e18, "by_model": [], "pending": 0})]:
        (run_dir / f".spend_{name}_1_0.journal").write_text(
            header.replace('"zz"', f'"{name}"') + "\n" + start + "\n" + json.dumps({"k": key, "a": 1, "t": 1.0, "u": usage}) + "\n")
    for _ in range(2):  # and the next resume too
        done = _cli(tmp_path, model_server, "--resume")
        said = done.stdout + done.stderr
        assert done.returncode == 0 and "Traceback" not in said and "Fatal error" not in said, said
        assert "Recorded from the workers' journals" not in said, said
    assert _recorded_requests(tmp_path) == model_server.count() == 2  # nothing of the planted lines counted
    stats = json.loads((run_dir / "statistics.json").read_text())
    assert stats["spend"]["all"]["requests"] == 2 and stats["spend"]["all"]["cost"] == pytest.approx(2 * COST)
