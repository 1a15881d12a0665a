"""--executor=ray: whole runs through the real CLI on a local two-node Ray cluster.

The cluster is made of real Ray processes on this machine (`ray.cluster_utils.Cluster`: one head,
plus one worker node per test), bound to 127.0.0.1. The runs talk to the local model server.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import pytest

from runner.execution.task import Task
from tests.conftest import REPO, read_jsonl, run_cli, write_jsonl
from tests.helpers.model_server import ModelServer

# Not imported here: Ray reads its settings when first imported, and the fixture sets them first.
HAVE_RAY = importlib.util.find_spec("ray") is not None

pytestmark = pytest.mark.ray
needs_ray = pytest.mark.skipif(not HAVE_RAY and not os.environ.get("CI"), reason="ray is not installed (pip install ray)")

NODE_ARGS = {"num_cpus": 1, "object_store_memory": 100 * 1024 * 1024}
# Everything on loopback: Ray otherwise binds and dials the machine's outward address.
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}
NATURALLY_DIFFERENT = ("timestamp", "run_id", "duration_seconds", "batch_num")
TIMING_STATS = ("completed_at", "duration_seconds", "run_time")
CALL_ID = re.compile(r"call_(?:c\d+_)?[0-9a-f]{8,}")  # the scripted server may prefix its conversation


@pytest.fixture(scope="module")
def ray_head():
    """One head node for the module (1 CPU: it takes work too)."""
    with pytest.MonkeyPatch.context() as patch:
        for name, value in LOOPBACK_ENV.items():
            patch.setenv(name, value)  # for the Ray processes and the runs (subprocesses)
        import ray
        import ray._private.ray_constants as ray_constants
        from ray.cluster_utils import Cluster

        patch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)  # in case Ray was imported already
        cluster = Cluster(initialize_head=True, head_node_args=dict(NODE_ARGS))
        try:
            yield cluster
        finally:
            ray.shutdown()
            cluster.shutdown()


@pytest.fixture
def two_nodes(ray_head):
    """The head plus one worker node. The worker node outlives the test (starting and removing nodes
    is what makes this file slow); a test that removed it gets a fresh one next time."""
    if not ray_head.worker_nodes:
        ray_head.add_node(**NODE_ARGS)
        ray_head.wait_for_nodes()
    return ray_head, next(iter(ray_head.worker_nodes))


@pytest.fixture
def server():
    model = ModelServer(latency=0.05).start()
    yield model
    model.stop()


def _args(dataset: Path, server: ModelServer, *extra: str) -> list[str]:
    return [f"--dataset_file={dataset}", "--run_name=r", "--batch_size=4", "--model=m", "--api_key=x",
            f"--base_url={server.base_url}", "--distribution=terminal_only", "--seed=5", *extra]


def _normalised(record: dict) -> dict:
    """The record without what differs between any two runs: the model server's random call ids, times."""
    record = json.loads(CALL_ID.sub("call_<id>", json.dumps(record)))
    for name in NATURALLY_DIFFERENT:
        record["metadata"].pop(name, None)
    return record


def _prompts(count: int) -> list[dict]:
    rows = []
    for i in range(count):
        if i % 4 == 3:
            prompt = (f'@tool write_file {{"path": "f{i}.txt", "content": "row {i}"}}\n'
                      f'@tool read_file {{"path": "f{i}.txt"}}\nWrite then read #{i}.')
        elif i % 4 == 2:
            prompt = f"Answer without tools #{i}."
        else:
            prompt = f'@tool terminal {{"command": "echo hi-{i}"}}\nRun it #{i}.'
        rows.append({"prompt": prompt, "id": f"row-{i}"})
    return rows


@needs_ray
def test_ray_run_matches_local_run(tmp_path, two_nodes, server):
    cluster, _ = two_nodes
    dataset = write_jsonl(tmp_path / "d.jsonl", _prompts(10))
    (tmp_path / "ray").mkdir()
    (tmp_path / "local").mkdir()
    env = dict(LOOPBACK_ENV)

    ray_proc = run_cli(_args(dataset, server, "--executor=ray", f"--ray_address={cluster.address}",
                             "--sessions_per_node=3"), tmp_path / "ray", timeout=180, env=env)
    assert ray_proc.returncode == 0, ray_proc.stdout + ray_proc.stderr
    assert "Ray: 2 nodes x 3 sessions" in ray_proc.stdout
    server.reset()
    local_proc = run_cli(_args(dataset, server, "--executor=local", "--num_workers=3"), tmp_path / "local",
                         timeout=180, env=env)
    assert local_proc.returncode == 0, local_proc.stdout + local_proc.stderr

    ray_dir, local_dir = tmp_path / "ray" / "data" / "r", tmp_path / "local" / "data" / "r"
    ray_rows, local_rows = read_jsonl(ray_dir / "trajectories.jsonl"), read_jsonl(local_dir / "trajectories.jsonl")
    assert [r["prompt_index"] for r in ray_rows] == list(range(10))
    assert [_normalised(r) for r in ray_rows] == [_normalised(r) for r in local_rows]
    assert all(r["completed"] for r in ray_rows)
    assert "hi-0" in json.dumps(ray_rows[0]["conversations"])  # the tool really ran, on some node

    ray_stats = json.loads((ray_dir / "statistics.json").read_text())
    local_stats = json.loads((local_dir / "statistics.json").read_text())
    for name in TIMING_STATS:
        ray_stats.pop(name), local_stats.pop(name)
    for stats in (ray_stats, local_stats):  # session time is timing too
        for bucket in stats["spend"].values():
            bucket.pop("duration_seconds")
    assert ray_stats == local_stats
    assert ray_stats["outcomes"]["ok"] == 10 and ray_stats["outcomes"]["failed"] == 0


@needs_ray
def test_ray_runs_each_sample_once_like_the_local_pool(tmp_path, two_nodes, server):
    cluster, _ = two_nodes
    dataset = write_jsonl(tmp_path / "d.jsonl", _prompts(3))
    proc = run_cli(_args(dataset, server, "--executor=ray", f"--ray_address={cluster.address}",
                         "--sessions_per_node=2", "--samples_per_prompt=3"), tmp_path, timeout=180,
                   env=dict(LOOPBACK_ENV))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = read_jsonl(tmp_path / "data" / "r" / "trajectories.jsonl")
    assert [(r["prompt_index"], r["metadata"]["sample"], r["metadata"]["samples"]) for r in rows] == [
        (i, s, 3) for i in range(3) for s in range(3)]
    assert len({r["metadata"]["sample_seed"] for r in rows}) == 9


def _task(index: int, prompt: str) -> Task:
    return Task(key=f"k{index}", index=index, prompt=prompt, image=None, cwd=None, id="", attempt=1,
                task_id=f"t-p{index}-a1", seed=1)


def _poll_until(executor, count: int, seconds: float) -> list[dict]:
    records: list[dict] = []
    deadline = time.monotonic() + seconds
    while len(records) < count and time.monotonic() < deadline:
        records += executor.poll(0.2)
    return records


@needs_ray
def test_lost_worker_is_replaced_then_rows_fail_when_none_is_left(tmp_path, two_nodes, server):
    """In-process: a killed actor's row runs again (on a live worker); once no worker can be
    started, the rows in flight come back as failed records and the run stops."""
    import ray

    ray_head, _ = two_nodes

    from runner.input.config import RunConfig
    from runner.execution.ray_pool import RayExecutor
    from tools.settings import ToolSettings

    ray.init(address=ray_head.address)  # the test's own connection: the executor leaves it open
    config = RunConfig(dataset_file="d.jsonl", run_name="r", batch_size=1, model="m", base_url=server.base_url,
                       api_key="x", distribution="terminal_only", executor="ray", ray_address=ray_head.address,
                       sessions_per_node=2, tools=ToolSettings(workdir_root=str(tmp_path)))  # (killed: no cleanup)
    logs: list[str] = []
    executor = RayExecutor(config, {}, log=logs.append)
    executor.NODE_REFRESH = executor.NO_NODE_GRACE = 0.5
    try:
        assert executor.describe() == "Ray: 2 nodes x 2 sessions"
        executor.start()
        assert executor.free_slots() == 4
        executor.submit(_task(0, "@latency 1.5\nslow #0"))
        deadline = time.monotonic() + 30
        while not server.requests_for("slow #0") and time.monotonic() < deadline:
            time.sleep(0.05)
        [first] = [a for a in executor.actors if a.in_flight]
        time.sleep(0.3)  # (its report of the request reaches the driver meanwhile)
        ray.kill(first.handle)  # the worker process dies with the row in flight
        records = _poll_until(executor, 1, 60)
        assert [r["metadata"]["row_key"] for r in records] == ["k0"] and not records[0].get("failed"), (records, logs)
        assert len(server.requests_for("slow #0")) >= 2  # it really ran twice
        # the record counts the request the lost run sent too (of unknown cost: it got no reply)
        usage = records[0]["metadata"]["usage"]
        assert usage["requests"] == len(server.requests_for("slow #0")) and usage["unpriced_requests"] == 1, usage
        assert any("lost" in line and "1 row(s) in flight" in line for line in logs), logs
        deadline = time.monotonic() + 30
        while len(executor.actors) < 2 or not all(a.ready for a in executor.actors):
            assert time.monotonic() < deadline, logs
            executor.poll(0.1)  # the killed worker's node is alive: it gets a new worker
        assert first not in executor.actors and first.node_id in {a.node_id for a in executor.actors}

        executor.MAX_RESTARTS = 0  # from now on a worker that dies is not replaced
        executor.submit(_task(1, "@hang\nforever #1"))
        executor.submit(_task(2, "@hang\nforever #2"))
        while len(server.requests_for("forever")) < 2 and time.monotonic() < deadline + 30:
            time.sleep(0.05)
        for actor in list(executor.actors):
            ray.kill(actor.handle)
        records = _poll_until(executor, 2, 30)
        assert sorted(r["metadata"]["row_key"] for r in records) == ["k1", "k2"], (records, logs)
        assert all(r["failed"] and r["error_class"] == "agent" for r in records)
        assert executor.in_flight() == 0
        with pytest.raises(RuntimeError, match="no node is left"):
            time.sleep(executor.NO_NODE_GRACE)
            executor.free_slots()
    finally:
        executor.shutdown(abandon=True, timeout=5)
        assert ray.is_initialized()  # a connection the executor did not open stays open
        ray.shutdown()


@needs_ray
def test_node_death_mid_run_loses_nothing(tmp_path, two_nodes):
    cluster, worker_node = two_nodes
    rows = [{"prompt": f'@tool terminal {{"command": "echo row-{i}"}}\nRun it #{i}.'} for i in range(40)]
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    with ModelServer(latency=0.3) as server:
        env = {k: v for k, v in os.environ.items() if k not in ("OPENROUTER_API_KEY", "OPENAI_API_KEY", "TERMINAL_ENV")}
        env.update(LOOPBACK_ENV, PYTHONPATH=str(REPO))
        proc = subprocess.Popen(
            [sys.executable, str(REPO / "batch_runner.py"),
             *_args(dataset, server, "--executor=ray", f"--ray_address={cluster.address}", "--sessions_per_node=4")],
            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        try:
            deadline = time.monotonic() + 90
            # Both nodes' sessions are busy (8 first requests in), and some rows are committed already.
            while time.monotonic() < deadline and proc.poll() is None:
                if server.count() >= 20:
                    break
                time.sleep(0.05)
            assert proc.poll() is None, "the run ended before the node could be killed"
            cluster.remove_node(worker_node, allow_graceful=False)  # its raylet and workers are killed
            out, err = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
            _remove_workdirs_of(tmp_path / "data" / "r")
        requests = server.count()
    assert proc.returncode == 0, out + err
    rerun = re.search(r"lost \(.*\); (\d+) row\(s\) in flight there will run again", out + err)
    assert rerun and int(rerun.group(1)) >= 1, out + err  # the node died with rows in flight
    # Nothing was lost: every row made its two calls. (Not strictly more: a row handed to the dying
    # node may not have sent its first request yet, e.g. while that node's worker was still starting.)
    assert requests >= 2 * 40

    run_dir = tmp_path / "data" / "r"
    trajectories = read_jsonl(run_dir / "trajectories.jsonl")
    assert sorted(t["prompt_index"] for t in trajectories) == list(range(40))
    committed = [r["metadata"]["row_key"] for path in sorted(run_dir.glob("batch_*.jsonl")) for r in read_jsonl(path)]
    assert len(committed) == 40 and not [k for k, n in Counter(committed).items() if n > 1]
    stats = json.loads((run_dir / "statistics.json").read_text())
    assert stats["outcomes"]["ok"] == 40 and stats["outcomes"]["failed"] == 0 and stats["outcomes"]["not_run"] == 0
    # The requests the dead node's sessions had sent are counted with the rows' next delivery. (One
    # may be off: a node killed within the milliseconds between a request and its report.)
    assert abs(stats["spend"]["all"]["requests"] - requests) <= 1, (stats["spend"]["all"], requests)


def _remove_workdirs_of(run_dir: Path) -> None:
    """The killed node could not remove the work dirs of its sessions (they are in the temp dir)."""
    try:
        run_id = json.loads((run_dir / "config.json").read_text())["run_id"]
    except (OSError, ValueError, KeyError):
        return
    for path in Path(tempfile.gettempdir()).glob(f"{run_id}-p*"):
        shutil.rmtree(path, ignore_errors=True)


@needs_ray
def test_unreachable_cluster_is_one_error_line(tmp_path):
    dataset = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "hello"}])
    proc = run_cli([f"--dataset_file={dataset}", "--batch_size=1", "--run_name=r", "--model=mock", "--executor=ray",
                    "--ray_address=127.0.0.1:1"], tmp_path, timeout=60, env=LOOPBACK_ENV)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("❌ Fatal error: RuntimeError: cannot reach the Ray cluster at "
                                                     "127.0.0.1:1"), proc.stderr


def test_without_ray_the_cli_says_how_to_install_it(tmp_path):
    """No `ray` module: one error line naming the install command, exit code 1 (needs no Ray)."""
    dataset = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "hello"}])
    code = (
        "import runpy, sys\n"
        "sys.modules['ray'] = None  # any `import ray` now raises ImportError\n"
        f"sys.argv = ['batch_runner.py', '--dataset_file={dataset}', '--batch_size=1', '--run_name=r',\n"
        "            '--model=mock', '--executor=ray']\n"
        f"runpy.run_path({str(REPO / 'batch_runner.py')!r}, run_name='__main__')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.strip()]
    assert errors == ["❌ Error: --executor=ray needs Ray: pip install 'agent-batch-runner[ray]' "
                      "(or pip install ray)"], proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "data").exists()  # refused before anything was written


def test_a_node_offers_only_the_tools_it_can_run():
    """A tool the driver could offer but a node cannot (e.g. no Chromium there) is left out on that node."""
    from runner.input.config import RunConfig
    from runner.execution.ray_pool import NodeWorker
    from tools.settings import ToolSettings

    config = RunConfig(dataset_file="d", run_name="r", batch_size=1, model="mock",
                       tools=ToolSettings(browser_executable="/nonexistent/chromium"))
    worker = NodeWorker(config, unavailable={"web_search": "no search backend configured"}, sessions=1, run_sessions=1)
    runtime = worker._runtime()
    assert "browser_navigate" in worker.node_missing and "web_search" not in worker.node_missing
    assert "browser_navigate" in runtime.unavailable and "web_search" in runtime.unavailable
    assert "terminal" not in runtime.unavailable


# --- spend under Ray: every request is known to the driver as it is made -------------------------

COST = 0.01  # what each scripted reply says it cost


def _spend_args(dataset: Path, server: ModelServer, address: str, *extra: str) -> list[str]:
    return [f"--dataset_file={dataset}", "--run_name=r", "--batch_size=4", "--model=m", "--api_key=x",
            f"--base_url={server.base_url}", "--distribution=terminal_only", "--max_turns=8", "--executor=ray",
            f"--ray_address={address}", "--price_input_per_mtok=1", "--price_output_per_mtok=1", *extra]


def _spend_figures(run_dir: Path) -> tuple[dict, dict, list[dict]]:
    stats = json.loads((run_dir / "statistics.json").read_text())
    status = json.loads((run_dir / "status.json").read_text())
    lines = [r for p in sorted(run_dir.glob("batch_*.jsonl")) for r in read_jsonl(p)]
    return stats, status, lines


def _tool_calls(count: int) -> str:
    return "".join(f'@tool terminal {{"command": "echo {n}"}}\n' for n in range(count))


@needs_ray
def test_ray_budget_is_checked_per_request_and_a_hard_cancel_commits_what_rows_spent(tmp_path, ray_head):
    """--max_cost: the first replies pass the budget mid-row, so no further request is sent and no
    further row starts (per committed row, the first wave would have sent all 3 requests of each row).
    --max_cost_hard: a row whose request is in flight when the spend passes the budget is cancelled
    and committed with that request (of unknown cost), so the figures count what the endpoint got."""
    rows = [{"prompt": f"@cost {COST}\n@latency 1\n{_tool_calls(2)}Budget row {i}."} for i in range(12)]
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    (tmp_path / "soft").mkdir()
    with ModelServer() as server:
        proc = run_cli(_spend_args(dataset, server, ray_head.address, "--sessions_per_node=4", "--max_cost=0.001"),
                       tmp_path / "soft", timeout=240, env=dict(LOOPBACK_ENV))
        received = server.count()
    assert proc.returncode == 4, proc.stdout + proc.stderr
    # (the cluster may have a worker node besides the head, left by an earlier test: 4 sessions each)
    nodes, per_node = map(int, re.search(r"Ray: (\d+) nodes? x (\d+) sessions", proc.stdout).groups())
    sessions = nodes * per_node
    stats, status, lines = _spend_figures(tmp_path / "soft" / "data" / "r")
    assert 1 <= received <= sessions, (received, proc.stdout + proc.stderr)  # only the requests in flight then
    assert stats["spend"]["all"]["requests"] == received == status["spend"]["requests"]
    assert stats["cost"] == pytest.approx(received * COST)
    assert lines and all(r.get("failed") and r["error_class"] == "budget" for r in lines), lines
    assert len(lines) <= sessions < len(rows)  # no row started after the first replies

    rows = ([{"prompt": f"@cost {COST}\n@latency 1\n{_tool_calls(2)}Passes the budget."}]
            + [{"prompt": f"@cost {COST}\n@hang\nIn flight {i}."} for i in range(2)])
    dataset = write_jsonl(tmp_path / "d2.jsonl", rows)
    (tmp_path / "hard").mkdir()
    with ModelServer() as server:
        proc = run_cli(_spend_args(dataset, server, ray_head.address, "--sessions_per_node=3", "--max_cost=0.015",
                                   "--max_cost_hard"), tmp_path / "hard", timeout=240, env=dict(LOOPBACK_ENV))
        received = server.count()
        hung = len(server.requests_for("In flight"))
    assert proc.returncode == 4, proc.stdout + proc.stderr
    assert "cancelled" in proc.stderr, proc.stderr
    stats, status, lines = _spend_figures(tmp_path / "hard" / "data" / "r")
    assert hung == 2 and received >= 3, (received, proc.stdout + proc.stderr)
    assert stats["spend"]["all"]["requests"] == received == status["spend"]["requests"], (stats["spend"], lines)
    cancelled = [r for r in lines if "In flight" in r["prompt"]]
    assert len(cancelled) == 2 and all(r["error_class"] == "budget" for r in cancelled), lines
    assert all(r["metadata"]["usage"]["requests"] == 1 == r["metadata"]["usage"]["unpriced_requests"]
               for r in cancelled)
    assert stats["cost"] is None and stats["spend"]["all"]["known_cost"] == pytest.approx((received - 2) * COST)


@needs_ray
def test_ray_second_interrupt_records_the_requests_already_sent(tmp_path, ray_head):
    rows = [{"prompt": f"@cost {COST}\n@latency 1\n{_tool_calls(3)}Quit {i}."} for i in range(10)]
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    env = {k: v for k, v in os.environ.items() if k not in ("OPENROUTER_API_KEY", "OPENAI_API_KEY", "TERMINAL_ENV")}
    env.update(LOOPBACK_ENV, PYTHONPATH=str(REPO))
    with ModelServer() as server:
        proc = subprocess.Popen([sys.executable, str(REPO / "batch_runner.py"),
                                 *_spend_args(dataset, server, ray_head.address, "--sessions_per_node=4")],
                                cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        try:
            deadline = time.monotonic() + 120
            while server.count() < 9 and time.monotonic() < deadline and proc.poll() is None:
                time.sleep(0.05)
            assert server.count() >= 9, proc.communicate(timeout=5)
            os.killpg(proc.pid, signal.SIGINT)
            time.sleep(1)
            os.killpg(proc.pid, signal.SIGINT)
            started = time.monotonic()
            out, err = proc.communicate(timeout=30)
            assert time.monotonic() - started < 5, out + err  # still at once
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        time.sleep(1)  # a request the cancelled sessions had on the way reaches the server now, if ever
        received = server.count()
    assert proc.returncode == 130, out + err
    run_dir = tmp_path / "data" / "r"
    status = json.loads((run_dir / "status.json").read_text())
    lines = [r for p in sorted(run_dir.glob("batch_*.jsonl")) for r in read_jsonl(p)]
    assert status["state"] == "interrupted" and status["spend"]["requests"] == received, (status["spend"], received)
    assert sum(line["metadata"]["usage"]["requests"] for line in lines) == received
    report = run_cli(["--report", "--run_name=r"], tmp_path, timeout=120)
    assert report.returncode == 0, report.stdout + report.stderr
    assert json.loads((run_dir / "statistics.json").read_text())["requests"] == received, report.stdout
