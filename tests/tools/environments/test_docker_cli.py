"""The docker backend through the real CLI, on the real engine, with images built offline."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from tests.conftest import REPO, read_jsonl, run_cli, write_jsonl
from tests.helpers.docker_support import (BUSYBOX_IMAGE, MARKED_CONTENT, MARKED_IMAGE, NO_PASSWD_IMAGE,
                                          ensure_no_shell_image, ready_client)
from tools.environments.images import list_containers, reap_stale_containers

pytestmark = pytest.mark.docker


@pytest.fixture(scope="module")
def client():
    return ready_client()


def _containers(client, run_name: str) -> list:
    return list_containers(client, {"label": f"abr.run_name={run_name}"})  # while the runner removes some


@pytest.fixture
def run_name(client, request):
    name = f"dk-{request.node.name[:30].replace('_', '-')}-{os.getpid()}"
    yield name
    leftovers = _containers(client, name)
    for container in leftovers:
        container.remove(force=True)
    assert not leftovers, f"containers of {name} were left behind"


def _args(dataset, server, run_name, *extra):
    return [f"--dataset_file={dataset}", f"--run_name={run_name}", "--batch_size=4", "--terminal_env=docker",
            "--distribution=terminal_only", f"--base_url={server.base_url}", "--model=m", "--api_key=x", *extra]


def _tool_outputs(row: dict) -> list:
    outputs = []
    for turn in row["conversations"]:
        if turn["from"] == "tool":
            body = turn["value"].split("<tool_response>\n", 1)[1].rsplit("\n</tool_response>", 1)[0]
            outputs.append(json.loads(body))
    return outputs


PROBE = ('@tool terminal {"command": "cat /etc/abr-image 2>/dev/null || echo plain-image; pwd"}\n'
         '@tool write_file {"path": "out.txt", "content": "written-inside"}\n'
         '@tool read_file {"path": "out.txt"}\n')


def test_rows_run_in_their_own_image_and_directory(client, model_server, run_name, tmp_path):
    rows = [
        {"prompt": PROBE + "Row in the marked image.", "image": MARKED_IMAGE, "cwd": "/srv/app"},
        {"prompt": PROBE + "Row in the plain image.", "image": BUSYBOX_IMAGE},
        {"prompt": PROBE + "Row with the run's default image.", "cwd": "/data"},
    ]
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    proc = run_cli(_args(dataset, model_server, run_name, f"--docker_image={BUSYBOX_IMAGE}", "--num_workers=3"), tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    kept = read_jsonl(tmp_path / "data" / run_name / "trajectories.jsonl")
    outputs = [_tool_outputs(row) for row in kept]
    terminal = [o[0]["content"]["output"] for o in outputs]
    assert MARKED_CONTENT.strip() in terminal[0] and terminal[0].strip().endswith("/srv/app")
    assert "plain-image" in terminal[1] and terminal[1].strip().endswith("/workspace")
    assert "plain-image" in terminal[2] and terminal[2].strip().endswith("/data")
    for o in outputs:
        assert "written-inside" in o[2]["content"]["content"]  # read_file saw the file write_file made
    assert not (tmp_path / "out.txt").exists()  # nothing was written on the host
    assert not _containers(client, run_name)


def test_image_without_etc_passwd_runs_its_rows(client, model_server, run_name, tmp_path):
    dataset = write_jsonl(tmp_path / "d.jsonl", [{"prompt": PROBE + "Row in an image without /etc/passwd.",
                                                  "image": NO_PASSWD_IMAGE, "cwd": "/srv/app"}])
    proc = run_cli(_args(dataset, model_server, run_name), tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [row] = read_jsonl(tmp_path / "data" / run_name / "trajectories.jsonl")
    outputs = _tool_outputs(row)
    assert "plain-image" in outputs[0]["content"]["output"] and "/srv/app" in outputs[0]["content"]["output"]
    assert "written-inside" in outputs[2]["content"]["content"]


def test_missing_image_fails_its_rows_without_model_calls(client, model_server, run_name, tmp_path):
    rows = [
        {"prompt": "Needs a missing image.", "image": "abr-test/does-not-exist:1"},
        {"prompt": PROBE + "Fine row.", "image": BUSYBOX_IMAGE},
    ]
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    proc = run_cli(_args(dataset, model_server, run_name), tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    out = tmp_path / "data" / run_name
    failed = [r for p in out.glob("batch_*.jsonl") for r in read_jsonl(p) if r.get("failed")]
    assert len(failed) == 1 and failed[0]["error_class"] == "environment"
    assert "abr-test/does-not-exist:1" in failed[0]["error"]
    assert model_server.requests_for("Needs a missing image") == []
    assert len(read_jsonl(out / "trajectories.jsonl")) == 1


def test_an_image_without_a_shell_is_named_before_any_model_call(client, model_server, run_name, tmp_path):
    rows = [
        {"prompt": "Needs a shell.", "image": ensure_no_shell_image(client)},
        {"prompt": PROBE + "Fine row.", "image": BUSYBOX_IMAGE},
    ]
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    proc = run_cli(_args(dataset, model_server, run_name), tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    out = tmp_path / "data" / run_name
    failed = [r for p in out.glob("batch_*.jsonl") for r in read_jsonl(p) if r.get("failed")]
    assert len(failed) == 1 and failed[0]["error_class"] == "environment"
    assert "has no /bin/sh" in failed[0]["error"] and "409" not in failed[0]["error"], failed[0]["error"]
    assert model_server.requests_for("Needs a shell") == []
    assert len(read_jsonl(out / "trajectories.jsonl")) == 1


def test_an_unusable_run_wide_image_stops_the_run_before_any_model_call(client, model_server, run_name, tmp_path):
    rows = [{"prompt": "Takes the run's image."}, {"prompt": PROBE + "Has its own.", "image": BUSYBOX_IMAGE}]
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    missing = "abr-test/does-not-exist:1"
    proc = run_cli(_args(dataset, model_server, run_name, f"--docker_image={missing}"), tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    (line,) = [l for l in proc.stderr.splitlines() if l.strip()]
    assert f"--docker_image={missing}" in line and "needed by 1 row" in line, proc.stderr
    assert model_server.requests == []  # not even the start-up probe
    assert not (tmp_path / "data" / run_name / "trajectories.jsonl").exists()

    # Every row naming its own image: the run's default is not needed, the run goes ahead.
    dataset = write_jsonl(tmp_path / "d2.jsonl", rows[1:])
    proc = run_cli(_args(dataset, model_server, run_name, f"--docker_image={missing}"), tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _wait_for_containers(client, run_name: str, count: int, timeout: float = 60) -> list:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [c for c in _containers(client, run_name) if c.status == "running"]
        if len(found) >= count:
            return found
        time.sleep(0.3)
    raise AssertionError(f"expected {count} running containers of {run_name}")


def _on_a_host_of_its_own(hostname: str, *argv: str) -> list[str]:
    """argv run under a hostname of its own (a UTS namespace): the containers it labels as its host's
    are then no other run's to reap, whatever else runs on this machine meanwhile."""
    namespace = ["unshare", "--uts"] if os.geteuid() == 0 else ["unshare", "--user", "--map-current-user", "--uts"]
    rename = "import os, socket, sys; socket.sethostname(sys.argv[1]); os.execv(sys.argv[2], sys.argv[2:])"
    return [*namespace, sys.executable, "-c", rename, hostname, *argv]


def test_sigkill_leaves_containers_and_next_run_reaps_them(client, model_server, run_name, tmp_path):
    rows = [{"prompt": f'@tool terminal {{"command": "sleep 30"}}\nSleep {i}.', "image": BUSYBOX_IMAGE} for i in range(2)]
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    host = f"abr-test-{uuid.uuid4().hex[:12]}"
    runner = [sys.executable, str(REPO / "batch_runner.py")]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(_on_a_host_of_its_own(host, *runner, *_args(dataset, model_server, run_name)),
                            cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                            start_new_session=True)
    try:
        left = _wait_for_containers(client, run_name, 2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the whole process tree: nobody is left to clean up
        proc.wait(30)
    assert {c.labels["abr.owner_host"] for c in left} == {host}
    time.sleep(1)
    reap_stale_containers(client, log=lambda _line: None)  # another run starting on this machine now
    assert {c.id for c in _containers(client, run_name)} >= {c.id for c in left}
    proc = subprocess.run(
        _on_a_host_of_its_own(host, *runner, *_args(dataset, model_server, run_name, "--resume", "--command_timeout=1")),
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("removed stale container") == 2
    assert not _containers(client, run_name)
    kept = read_jsonl(tmp_path / "data" / run_name / "trajectories.jsonl")
    assert [o[0]["content"]["exit_code"] for o in map(_tool_outputs, kept)] == [124, 124]  # sleep stopped at 1 s


def test_ctrl_c_removes_containers_of_abandoned_prompts(client, model_server, run_name, tmp_path):
    rows = [{"prompt": f'@tool terminal {{"command": "sleep 60"}}\nLong {i}.', "image": BUSYBOX_IMAGE} for i in range(2)]
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    proc = subprocess.Popen([sys.executable, str(REPO / "batch_runner.py"),
                             *_args(dataset, model_server, run_name, "--grace_period=1")],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    _wait_for_containers(client, run_name, 2)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, out + err
    deadline = time.monotonic() + 20
    while _containers(client, run_name) and time.monotonic() < deadline:
        time.sleep(0.3)
    assert not _containers(client, run_name)


def _kill_group(proc) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _running(processes: list) -> list:
    import psutil

    left = []
    for p in processes:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                left.append(p)
        except psutil.NoSuchProcess:
            pass
    return left


def _fork_server_children(runner_pid: int) -> list:
    import psutil

    for child in psutil.Process(runner_pid).children():
        if "forkserver" in " ".join(child.cmdline()):
            return child.children()
    return []


def test_sigkill_of_the_runner_alone_removes_its_containers(client, model_server, run_name, tmp_path):
    """With only the runner killed, its workers see it die, remove their sessions'
    containers and exit within 5 s; a container whose removal outlasts that is reaped at the next start."""
    import psutil

    rows = [{"prompt": f'@tool terminal {{"command": "sleep 60"}}\nOrphan {i}.', "image": BUSYBOX_IMAGE} for i in range(2)]
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    proc = subprocess.Popen([sys.executable, str(REPO / "batch_runner.py"), *_args(dataset, model_server, run_name)],
                            cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, start_new_session=True)
    try:
        _wait_for_containers(client, run_name, 2)
        family = psutil.Process(proc.pid).children(recursive=True)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        deadline = time.monotonic() + 5
        while _running(family) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _running(family)
        deadline = time.monotonic() + 10
        while _containers(client, run_name) and time.monotonic() < deadline:
            time.sleep(0.3)
        if _containers(client, run_name):  # removal outlasted the workers' 3 s: the next start reaps them
            again = run_cli(_args(dataset, model_server, run_name, "--resume", "--command_timeout=1"), tmp_path)
            assert again.returncode == 0, again.stdout + again.stderr
        assert not _containers(client, run_name)
    finally:
        _kill_group(proc)


def test_containers_of_a_killed_worker_are_removed_mid_run(client, model_server, run_name, tmp_path):
    """A worker killed with SIGKILL cannot remove its containers; the parent
    reaps them as soon as it sees the death, while the run goes on."""
    rows = [{"prompt": f'@tool terminal {{"command": "sleep 60"}}\nDoomed {i}.', "image": BUSYBOX_IMAGE} for i in range(2)]
    rows += [{"prompt": f"@latency 3\nLater {i}.", "image": BUSYBOX_IMAGE} for i in range(2)]
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    proc = subprocess.Popen([sys.executable, str(REPO / "batch_runner.py"),
                             *_args(dataset, model_server, run_name, "--num_workers=2", "--num_processes=1")],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, start_new_session=True)
    try:
        doomed = _wait_for_containers(client, run_name, 2)
        _fork_server_children(proc.pid)[0].kill()
        deadline = time.monotonic() + 15
        while {c.id for c in _containers(client, run_name)} & {c.id for c in doomed} and time.monotonic() < deadline:
            time.sleep(0.3)
        assert not {c.id for c in _containers(client, run_name)} & {c.id for c in doomed}
        assert proc.poll() is None  # removed while the run still runs, not by the next start
        out, err = proc.communicate(timeout=120)
    finally:
        _kill_group(proc)
    assert proc.returncode == 2, out + err


def test_a_relative_row_cwd_is_refused_under_docker_naming_the_line(model_server, tmp_path, run_name):
    """A relative cwd passed, then every command failed 'Cwd must be an absolute path'."""
    rows = [{"prompt": "A.", "cwd": "/srv/ok"}] + [{"prompt": f"{cwd} row.", "cwd": cwd}
                                                    for cwd in ("rel/dir", "../..", " ", "~")]
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    proc = run_cli(_args(dataset, model_server, run_name, f"--docker_image={BUSYBOX_IMAGE}"), tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"{dataset}:1:" not in proc.stderr
    for line in (2, 3, 4, 5):
        assert f"{dataset}:{line}:" in proc.stderr, proc.stderr
    assert "'cwd' must be an absolute path under --terminal_env=docker" in proc.stderr
    assert not model_server.requests_for("row.")  # nothing paid for
