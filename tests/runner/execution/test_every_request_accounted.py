"""Every model request the endpoint received is in the run's figures, whatever ended its row.

Rows abandoned when the grace period ends, rows of a worker killed mid-row, a request cut off by
--prompt_timeout and rows cut short by the budget all reach statistics.json and status.json: their
requests are counted, with the cost the replies reported, and a request that never got its reply
counts as one of unknown cost. The budget is checked per request as replies arrive, in the parent,
so once the known spend reaches --max_cost no worker sends another request.
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

from tests.conftest import REPO, read_jsonl, wait_for, write_jsonl

COST = 0.01  # what each scripted reply says it cost


def _start(tmp_path: Path, server, rows: list[dict], *extra: str) -> subprocess.Popen:
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    args = [sys.executable, str(REPO / "batch_runner.py"), f"--dataset_file={dataset}", "--run_name=r",
            "--batch_size=4", "--distribution=terminal_only", "--max_turns=8", f"--base_url={server.base_url}",
            "--model=m", "--api_key=x", "--price_input_per_mtok=1", "--price_output_per_mtok=1", *extra]
    return subprocess.Popen(args, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, start_new_session=True)


def _finish(proc: subprocess.Popen, timeout: float = 120) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=timeout)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _figures(tmp_path: Path) -> tuple[dict, dict, list[dict]]:
    run_dir = tmp_path / "data" / "r"
    stats = json.loads((run_dir / "statistics.json").read_text())
    status = json.loads((run_dir / "status.json").read_text())
    lines = [r for p in sorted(run_dir.glob("batch_*.jsonl")) for r in read_jsonl(p)]
    return stats, status, lines


def _workers(runner_pid: int) -> list[psutil.Process]:
    for child in psutil.Process(runner_pid).children():
        if "forkserver" in " ".join(child.cmdline()):
            return child.children()
    return []


def test_rows_abandoned_when_the_grace_period_ends_are_counted(tmp_path, model_server):
    rows = [{"prompt": f"@cost {COST}\n@hang\nNever answered {i}."} for i in range(4)]
    proc = _start(tmp_path, model_server, rows, "--num_workers=4", "--grace_period=1")
    try:
        assert wait_for(lambda: model_server.count() == 4, 60), model_server.count()
        proc.send_signal(signal.SIGINT)
        out, err = _finish(proc)
    finally:
        _finish(proc, 1) if proc.poll() is None else None
    assert proc.returncode == 130, out + err
    stats, status, lines = _figures(tmp_path)
    received = model_server.count()
    assert stats["spend"]["all"]["requests"] == received == 4  # today: 0 of the 4 sent
    assert stats["cost"] is None and stats["spend"]["all"]["unpriced_attempts"] == 4  # no reply: unknown
    assert status["spend"]["requests"] == received and status["spend"]["total_usd"] is None
    assert all(r["failed"] and r["error_class"] == "interrupted" for r in lines) and len(lines) == 4


def test_rows_of_a_worker_killed_mid_row_are_counted(tmp_path, model_server):
    tools = "\n".join(f'@tool terminal {{"command": "echo {t}"}}' for t in range(2))
    rows = [{"prompt": f"@cost {COST}\n@latency 0.5\n{tools}\nSlow row {i}."} for i in range(2)]
    proc = _start(tmp_path, model_server, rows, "--num_workers=2", "--num_processes=1")
    try:
        # both rows had an answer and have sent their next request: the worker dies under them
        assert wait_for(lambda: all(len(model_server.requests_for(f"Slow row {i}.")) >= 2 for i in range(2)), 60)
        for worker in _workers(proc.pid):
            worker.kill()
        out, err = _finish(proc)
    finally:
        _finish(proc, 1) if proc.poll() is None else None
    assert "worker process died" in out + err
    stats, status, lines = _figures(tmp_path)
    received = model_server.count()
    assert stats["spend"]["all"]["requests"] == received  # today: the dead rows' requests are missing
    assert status["spend"]["requests"] == received
    died = [r for r in lines if r.get("failed") and "worker process died" in r["error"]]
    assert died and all(r["metadata"]["usage"]["requests"] >= 2 for r in died)
    # the answered requests cost what they said; the ones cut off are of unknown cost
    assert all(r["metadata"]["usage"]["cost"] >= COST for r in died)
    assert all(r["metadata"]["usage"]["unpriced_requests"] >= 1 for r in died)


def test_a_request_cut_off_by_the_prompt_timeout_has_an_unknown_cost(tmp_path, model_server):
    rows = [{"prompt": f"@cost {COST}\n@latency 1.5\n" + '@tool terminal {"command": "echo 1"}\nCut off.'}]
    proc = _start(tmp_path, model_server, rows, "--prompt_timeout=2.5")
    out, err = _finish(proc)
    (line,) = _figures(tmp_path)[2]
    assert line["error_class"] == "timeout", out + err
    usage = line["metadata"]["usage"]
    received = len(model_server.requests_for("Cut off."))
    assert usage["requests"] == received == 2
    # today: cost 0.01 and no unpriced request, as if the cut-off request were free
    assert usage["unpriced_requests"] == 1 and usage["cost"] == COST


def test_the_budget_stops_every_worker_sending_once_the_known_spend_reaches_it(tmp_path, model_server):
    tools = "\n".join(f'@tool terminal {{"command": "echo {t}"}}' for t in range(2))
    rows = [{"prompt": f"@cost {COST}\n@latency 0.5\n{tools}\nBudget row {i}."} for i in range(8)]
    proc = _start(tmp_path, model_server, rows, "--num_workers=8", "--num_processes=2", "--max_cost=0.001")
    out, err = _finish(proc)
    assert proc.returncode == 4, out + err
    stats, status, lines = _figures(tmp_path)
    received = model_server.count()
    # the first reply alone passes the budget: only the requests in flight then may go past it
    # (today every row finishes: 24 requests)
    assert 1 <= received <= 8
    assert stats["spend"]["all"]["requests"] == received == status["spend"]["requests"]
    assert stats["cost"] == pytest.approx(received * COST)
    cut = [r for r in lines if r.get("failed")]
    assert cut and all(r["error_class"] == "budget" for r in cut)


def _cut_off_rows(count: int) -> list[dict]:
    """Rows whose third request is cut off by --prompt_timeout=2.5 (two replies of known cost first)."""
    tools = '@tool terminal {"command": "echo 1"}\n@tool terminal {"command": "echo 2"}\n'
    return [{"prompt": f"@cost {COST}\n@latency 1\n{tools}Partly known {i}."} for i in range(count)]


def test_the_known_part_of_a_spend_with_cut_off_requests_is_summed_and_shown(tmp_path, model_server):
    proc = _start(tmp_path, model_server, _cut_off_rows(4), "--prompt_timeout=2.5", "--num_workers=4")
    out, err = _finish(proc)
    stats, status, lines = _figures(tmp_path)
    assert len(lines) == 4 and model_server.count() == 12, out + err
    known = sum(line["metadata"]["usage"]["cost"] for line in lines)
    assert all(line["metadata"]["usage"]["unpriced_requests"] == 1 for line in lines)
    assert status["spend"]["known_usd"] == pytest.approx(known) and known == pytest.approx(8 * COST)
    assert status["spend"]["total_usd"] is None and stats["cost"] is None  # the total stays unknown
    assert stats["spend"]["all"]["known_cost"] == pytest.approx(known)
    assert f"at least ${known:.4f}" in out and "4 requests of unknown cost" in out, out
    assert "no --price_* flags were given" not in out and "without a reply" in out, out


def test_a_request_cut_off_by_the_timeout_does_not_halt_a_budgeted_run(tmp_path, model_server):
    proc = _start(tmp_path, model_server, _cut_off_rows(6), "--prompt_timeout=2.5", "--num_workers=2",
                  "--max_cost=0.05")
    out, err = _finish(proc)
    assert "cannot be enforced" not in out + err and "could not be enforced" not in out + err, out + err
    assert "Stopped at the cost budget" in err and "(an estimate)" in err, out + err
    stats, status, lines = _figures(tmp_path)
    # each row: $0.02 known, and its cut-off request at the mean request cost ($0.01), an estimate
    assert lines and status["budget"]["counted_usd"] == pytest.approx(len(lines) * 3 * COST), out + err
    assert status["spend"]["known_usd"] == pytest.approx(len(lines) * 2 * COST) and status["spend"]["estimated"]


def test_a_second_interrupt_quits_at_once_and_records_the_requests_already_sent(tmp_path, model_server):
    tools = "".join(f'@tool terminal {{"command": "echo {n}"}}\n' for n in range(3))
    rows = [{"prompt": f"@cost {COST}\n@latency 1\n{tools}Quit {i}."} for i in range(10)]
    proc = _start(tmp_path, model_server, rows, "--num_workers=4", "--num_processes=2")
    try:
        assert wait_for(lambda: model_server.count() >= 9, 60), model_server.count()
        os.killpg(proc.pid, signal.SIGINT)
        time.sleep(1)
        os.killpg(proc.pid, signal.SIGINT)
        started = time.monotonic()
        out, err = _finish(proc, 30)
        assert time.monotonic() - started < 5, out + err  # still at once
    finally:
        _finish(proc, 1) if proc.poll() is None else None
    assert proc.returncode == 130, out + err
    run_dir = tmp_path / "data" / "r"
    status = json.loads((run_dir / "status.json").read_text())
    lines = [r for p in sorted(run_dir.glob("batch_*.jsonl")) for r in read_jsonl(p)]
    received = model_server.count()
    assert status["state"] == "interrupted" and status["spend"]["requests"] == received, (status, received)
    assert sum(line["metadata"]["usage"]["requests"] for line in lines) == received
    assert {line["error_class"] for line in lines if line.get("failed")} <= {"interrupted", "timeout"}
    report = subprocess.run([sys.executable, str(REPO / "batch_runner.py"), "--report", "--run_name=r"], cwd=tmp_path,
                            capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert report.returncode == 0, report.stdout + report.stderr
    assert json.loads((run_dir / "statistics.json").read_text())["requests"] == received, report.stdout
