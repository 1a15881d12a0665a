"""The run lock through the real CLI: two runners on one run directory, a live run of another
host on a shared disk, a stale one, and a record naming our own PID after a container restart."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from tests.conftest import REPO, read_jsonl, run_cli, write_jsonl


def _args(dataset, server, *extra):
    return [f"--dataset_file={dataset}", "--run_name=r", "--batch_size=5", "--distribution=terminal_only",
            f"--base_url={server.base_url}", "--model=m", "--api_key=x", "--num_workers=2", *extra]


def _rows(n: int, latency: float = 0.0) -> list[dict]:
    return [{"prompt": f"@latency {latency}\nLock row {i}."} for i in range(n)]


def _record(run_dir, **fields):
    from runner.storage.lock import machine_id

    host, boot_id = machine_id()
    record = {"held": True, "host": host, "boot_id": boot_id, "pid": os.getpid(), "refreshed_at": time.time(),
              "lease_seconds": 60, **fields}
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / ".lock").write_text(json.dumps(record) + "\n")


def _paid_rows(server, n: int) -> list[int]:
    return [len(server.requests_for(f"@latency 2.0\nLock row {i}.")) for i in range(n)]


def test_two_runners_on_one_run_dir_never_both_run(model_server, tmp_path):
    dataset = write_jsonl(tmp_path / "d.jsonl", _rows(8, latency=2.0))
    cmd = [sys.executable, str(REPO / "batch_runner.py"), *_args(dataset, model_server, "--resume")]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    first = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not list((tmp_path / "data" / "r").glob("config.json")) and time.monotonic() < deadline:
        time.sleep(0.1)
    second = run_cli(_args(dataset, model_server, "--resume"), tmp_path)
    out, err = first.communicate(timeout=120)
    assert first.returncode == 0, err
    assert second.returncode == 1
    assert "in use by another batch_runner" in second.stderr and f"PID {first.pid}" in second.stderr
    assert _paid_rows(model_server, 8) == [1] * 8  # every row paid exactly once
    assert len(read_jsonl(tmp_path / "data" / "r" / "trajectories.jsonl")) == 8
    # The lock file stays (deleting it would let two runners lock two different files), released.
    assert json.loads((tmp_path / "data" / "r" / ".lock").read_text())["held"] is False


def test_live_run_of_another_host_is_refused_and_a_stale_one_taken_over(model_server, tmp_path):
    dataset = write_jsonl(tmp_path / "d.jsonl", _rows(3))
    run_dir = tmp_path / "data" / "r"
    _record(run_dir, host="other-host", boot_id="another-boot", pid=4242, refreshed_at=time.time() - 5)
    proc = run_cli(_args(dataset, model_server), tmp_path)
    assert proc.returncode == 1
    assert "PID 4242 on host 'other-host'" in proc.stderr and "in use by another batch_runner" in proc.stderr
    assert not model_server.requests_for("Lock row")  # nothing was paid for

    _record(run_dir, host="other-host", boot_id="another-boot", pid=4242, refreshed_at=time.time() - 600)
    proc = run_cli(_args(dataset, model_server), tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "stale lock of PID 4242 on host 'other-host'" in proc.stdout
    assert len(read_jsonl(run_dir / "trajectories.jsonl")) == 3


def test_record_naming_our_own_pid_without_the_kernel_lock_is_taken_over(model_server, tmp_path):
    """A container restarted after a kill: its runner is PID 1 again, and so is the record's."""
    dataset = write_jsonl(tmp_path / "d.jsonl", _rows(2))
    run_dir = tmp_path / "data" / "r"
    _record(run_dir, pid=1)
    proc = run_cli(_args(dataset, model_server), tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "Taking over the lock of a runner that is gone (PID 1" in proc.stdout


def test_lock_record_is_refreshed_while_held_and_the_kernel_lock_decides(tmp_path):
    from runner.storage.lock import RunLock

    lock = RunLock(tmp_path, refresh=0.2)
    lock.acquire(log=lambda s: None)
    try:
        first = json.loads((tmp_path / ".lock").read_text())
        assert first["held"] and first["pid"] == os.getpid()
        time.sleep(0.7)
        assert json.loads((tmp_path / ".lock").read_text())["refreshed_at"] > first["refreshed_at"]
        # Another process finds the kernel lock held, whatever the record says.
        probe = subprocess.run(
            [sys.executable, "-c", "import sys; from runner.storage.lock import RunLock; RunLock(sys.argv[1]).acquire()", str(tmp_path)],
            cwd=REPO, capture_output=True, text=True,
        )
        assert probe.returncode != 0 and "in use by another batch_runner" in probe.stderr
    finally:
        lock.release()


def test_two_runners_that_both_find_a_stale_lock_never_both_run(model_server, tmp_path):
    """The old lock deleted a stale lock file and made a new one: two runners racing there both
    won. With the kernel lock exactly one of them holds the directory."""
    dataset = write_jsonl(tmp_path / "d.jsonl", _rows(6, latency=2.0))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    _record(tmp_path / "data" / "r", pid=int(dead.stdout))
    cmd = [sys.executable, str(REPO / "batch_runner.py"), *_args(dataset, model_server)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    runners = [subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for _ in range(2)]
    outputs = [r.communicate(timeout=120) for r in runners]
    results = [(r.returncode, out + err) for r, (out, err) in zip(runners, outputs)]
    assert sorted(code for code, _ in results) == [0, 1], results
    loser = next(console for code, console in results if code == 1)
    assert "in use by another batch_runner" in loser
    assert _paid_rows(model_server, 6) == [1] * 6


def test_deleting_the_lock_file_of_a_live_run_does_not_let_a_second_runner_in(model_server, tmp_path):
    """The kernel lock is on the run directory: a deleted .lock is a lost record, not a lost lock."""
    dataset = write_jsonl(tmp_path / "d.jsonl", _rows(8, latency=2.0))
    run_dir = tmp_path / "data" / "r"
    cmd = [sys.executable, str(REPO / "batch_runner.py"), *_args(dataset, model_server, "--resume")]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    first = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (run_dir / "config.json").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    (run_dir / ".lock").unlink()
    second = run_cli(_args(dataset, model_server, "--resume"), tmp_path)
    out, err = first.communicate(timeout=120)
    assert first.returncode == 0, err
    assert second.returncode == 1, second.stdout + second.stderr
    assert "in use by another batch_runner" in second.stderr
    assert _paid_rows(model_server, 8) == [1] * 8  # every row paid exactly once
    # The holder wrote its record again (then released it).
    assert json.loads((run_dir / ".lock").read_text())["held"] is False


def test_the_holder_recreates_a_deleted_lock_record(tmp_path):
    from runner.storage.lock import RunLock

    lock = RunLock(tmp_path, refresh=0.1)
    lock.acquire(log=lambda s: None)
    try:
        (tmp_path / ".lock").unlink()
        time.sleep(0.5)
        record = json.loads((tmp_path / ".lock").read_text())
        assert record["held"] is True and record["pid"] == os.getpid()
    finally:
        lock.release()


def _write_raw_record(run_dir, text: str) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / ".lock").write_text(text)


def _other_host_record(**fields) -> str:
    record = {"held": True, "host": "other-host", "boot_id": "another-boot", "pid": 4242,
              "refreshed_at": time.time(), "lease_seconds": 60, **fields}
    return json.dumps(record)


import pytest  # noqa: E402


@pytest.mark.parametrize("text, says", [
    (_other_host_record(refreshed_at="abc"), "is not a time"),
    (_other_host_record(refreshed_at=None), "is not a time"),
    (_other_host_record(refreshed_at=True), "is not a time"),
    ('{"held": true, "host": "other-host", "pid": 4242, "refreshed_at": NaN}', "is not a time"),
    ('{"held": true, "host": "other-host", "pid": 4242, "refreshed_at": Infinity}', "is not a time"),
    ("[1]", "cannot be read (a JSON list, not an object)"),
    (_other_host_record()[:40], "cannot be read (not complete JSON)"),
    (_other_host_record(refreshed_at=time.time() + 3 * 3600), "not refreshed for"),  # hours in the future
])
def test_a_bad_lock_record_is_taken_over_with_a_line_saying_so(tmp_path, text, says):
    from runner.storage.lock import RunLock

    _write_raw_record(tmp_path, text)
    lines: list[str] = []
    lock = RunLock(tmp_path)
    lock.acquire(log=lines.append)
    try:
        assert len(lines) == 1 and says in lines[0], lines
        assert json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()
    finally:
        lock.release()


def test_a_refresh_time_slightly_in_the_future_is_honoured_only_within_the_lease(tmp_path):
    from runner.storage.lock import RunLock, RunLockBusy

    _write_raw_record(tmp_path, _other_host_record(refreshed_at=time.time() + 10))  # a clock 10 s ahead
    with pytest.raises(RunLockBusy, match="refreshed 10s ago"):
        RunLock(tmp_path).acquire(log=lambda s: None)


def test_a_record_of_this_kernel_under_another_host_name_is_decided_by_the_kernel_lock(tmp_path):
    """A container re-created on the same machine has a new host name but the same boot id."""
    from runner.storage.lock import RunLock, machine_id

    _, boot_id = machine_id()
    assert boot_id, "this test needs /proc/sys/kernel/random/boot_id"
    _write_raw_record(tmp_path, _other_host_record(host="old-container", boot_id=boot_id))
    lines: list[str] = []
    lock = RunLock(tmp_path)
    lock.acquire(log=lines.append)
    try:
        assert lines and "Taking over the lock of a runner that is gone (PID 4242" in lines[0]
    finally:
        lock.release()


def test_a_lock_record_that_is_no_time_does_not_block_the_cli(model_server, tmp_path):
    dataset = write_jsonl(tmp_path / "d.jsonl", _rows(2))
    _write_raw_record(tmp_path / "data" / "r", _other_host_record(refreshed_at="abc"))
    proc = run_cli(_args(dataset, model_server), tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "Fatal error" not in proc.stderr
    assert "its refresh time 'abc' is not a time" in proc.stdout


def test_without_a_kernel_lock_on_the_directory_the_record_alone_guards_the_run(tmp_path, monkeypatch):
    """NFS emulates flock with POSIX locks, which refuse an exclusive lock on a read-only fd (EBADF)."""
    import errno

    from runner.storage import lock as lock_module
    from runner.storage.lock import RunLock, RunLockBusy

    def no_flock(fd, operation):
        raise OSError(errno.EBADF, "Bad file descriptor")

    monkeypatch.setattr(lock_module.fcntl, "flock", no_flock)
    _record(tmp_path, pid=4242)  # a live runner of this machine, refreshed just now
    lines: list[str] = []
    with pytest.raises(RunLockBusy, match="PID 4242"):
        RunLock(tmp_path).acquire(log=lines.append)
    assert "no kernel lock on this file system" in lines[0]

    _record(tmp_path, pid=4242, refreshed_at=time.time() - 600)  # stale: taken over
    lock = RunLock(tmp_path)
    lock.acquire(log=lines.append)
    try:
        assert "stale lock of PID 4242" in lines[-1]
    finally:
        lock.release()
