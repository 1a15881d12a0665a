"""Escapes from --sandbox=bwrap through the real CLI: host unix sockets wherever they live, files a
command leaves on the host (setuid, owned by root), root-only host files, and processes that
detach from their session when their worker is killed."""

from __future__ import annotations

import errno
import json
import os
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import uuid

import pytest

from tests.conftest import REPO, read_jsonl, run_cli, write_jsonl

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed")

_CONNECT_PROBE = (
    "import glob, socket, sys\n"
    "paths = [p for pattern in sys.argv[1:] for p in (glob.glob(pattern) if '*' in pattern else [pattern])]\n"
    "for path in paths:\n"
    "    try:\n"
    "        s = socket.socket(socket.AF_UNIX)\n"
    "        s.connect(path.replace('@', '\\0', 1) if path.startswith('@') else path); print('CONNECTED', path)\n"
    "    except OSError as exc:\n"
    "        print('refused', path, exc.errno)\n"
)


def _args(dataset, server, *extra):
    return [f"--dataset_file={dataset}", "--run_name=r", "--batch_size=4", "--distribution=terminal_only",
            f"--base_url={server.base_url}", "--model=m", "--api_key=x", "--sandbox=bwrap", *extra]


def _tool_results(row: dict) -> list[dict]:
    return [json.loads(t["value"].split("<tool_response>\n", 1)[1].rsplit("\n</tool_response>", 1)[0])["content"]
            for t in row["conversations"] if t["from"] == "tool"]


def _prompt(*commands: str, tools: tuple[str, ...] = ()) -> str:
    return "\n".join([*(f"@tool terminal {json.dumps({'command': c})}" for c in commands), *tools, "Probe."])


def _host_unix_sockets() -> list[str]:
    """Every pathname socket bound on the host (as /proc/net/unix lists them)."""
    with open("/proc/net/unix") as f:
        next(f)
        return sorted({line.split()[-1] for line in f if len(line.split()) >= 8 and line.split()[-1].startswith("/")})


def _listen(path_or_abstract: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX)
    s.bind(path_or_abstract)
    s.listen()
    return s


@needs_bwrap
def test_no_host_unix_socket_is_reachable_from_the_sandbox_wherever_it_lives(model_server, tmp_path):
    # TMPDIR outside /tmp: the runner's forkserver puts its listener there, on the host's own disk.
    tmpdir = tempfile.mkdtemp(prefix="abr-tmpdir-", dir="/var/tmp")
    open_dir = os.path.join(tmpdir, "open")
    os.mkdir(open_dir)
    os.chmod(tmpdir, 0o755)
    os.chmod(open_dir, 0o777)
    anyone = os.path.join(open_dir, "anyone.sock")  # a socket any local user may connect to
    abstract = f"\0abr-test-{uuid.uuid4().hex[:8]}"
    listeners = [_listen(anyone), _listen(abstract)]
    os.chmod(anyone, 0o777)
    targets = [f"{tmpdir}/pymp-*/listener-*", anyone, "@" + abstract[1:], *_host_unix_sockets()]
    command = "python3 -c " + shlex.quote(_CONNECT_PROBE) + " " + " ".join(map(shlex.quote, targets)) + "; sleep 2"
    dataset = write_jsonl(tmp_path / "d.jsonl", [{"prompt": _prompt(command)}])
    env = {**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": tmpdir}
    env.pop("OPENAI_API_KEY", None)
    try:
        proc = subprocess.Popen([sys.executable, str(REPO / "batch_runner.py"), *_args(dataset, model_server)],
                                cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        modes = set()
        while proc.poll() is None:  # the runner's own socket folder, while it exists
            for name in os.listdir(tmpdir):
                if name.startswith("pymp-"):
                    info = os.stat(os.path.join(tmpdir, name))
                    modes.add((stat.S_IMODE(info.st_mode), info.st_uid))
            time.sleep(0.1)
        out, err = proc.communicate()
        assert proc.returncode == 0, out + err
        assert modes == {(0o700, os.getuid())}  # the forkserver's folder: the runner's alone
        (row,) = read_jsonl(tmp_path / "data" / "r" / "trajectories.jsonl")
        output = _tool_results(row)[0]["output"]
        assert f"refused {anyone}" in output and "refused @abr-test-" in output, output
        assert "CONNECTED" not in output, output
    finally:
        for s in listeners:
            s.close()
        shutil.rmtree(tmpdir, ignore_errors=True)


@needs_bwrap
def test_sandboxed_commands_leave_nothing_setuid_or_owned_by_root_and_cannot_read_root_files(model_server, tmp_path):
    workdirs = tmp_path / "workdirs"
    workdirs.mkdir()
    commands = [
        "cp /bin/sh ./rootsh && chmod 4755 ./rootsh && mkdir -p sub && cp /bin/sh sub/gsh && chmod 2755 sub/gsh; "
        "mkdir gdir && chmod 2777 gdir; ls -ln rootsh",
        # As root, commands are nobody: they cannot signal the sandbox's own processes either.
        ("kill -9 1 2 2>/dev/null; " if os.geteuid() == 0 else "") + "id -u; id -g",
        "head -c 20 /etc/shadow && echo READ_SHADOW; ls /root && echo LISTED_ROOT",
        "mkdir -p locked/inner && touch locked/inner/f && chmod 0 locked/inner locked; echo locked",
    ]
    tools = ('@tool write_file {"path": "written.txt", "content": "by the file tool"}',
             '@tool read_file {"path": "written.txt"}')
    dataset = write_jsonl(tmp_path / "d.jsonl", [{"prompt": _prompt(*commands, tools=tools)}])
    proc = run_cli(_args(dataset, model_server, "--keep_workdirs"), tmp_path, env={"TMPDIR": str(workdirs)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (row,) = read_jsonl(tmp_path / "data" / "r" / "trajectories.jsonl")
    results = _tool_results(row)
    assert "rootsh" in results[0]["output"], results[0]
    if os.geteuid() == 0:
        assert results[1]["output"].split()[:2] != ["0", "0"] and "0" not in results[1]["output"].split(), results[1]
    assert "READ_SHADOW" not in results[2]["output"] and "LISTED_ROOT" not in results[2]["output"], results[2]
    assert "by the file tool" in results[5]["content"]  # the file tools still work inside

    kept = [os.path.join(root, name) for root, dirs, files in os.walk(workdirs) for name in dirs + files]
    made = [p for p in kept if os.path.basename(p) in ("rootsh", "gsh", "sub", "gdir", "written.txt", "locked")]
    assert len(made) == 6, kept
    for path in made:
        info = os.lstat(path)
        assert not info.st_mode & (stat.S_ISUID | stat.S_ISGID), path
        if os.geteuid() == 0:
            assert info.st_uid != 0 and info.st_gid != 0, path
    sessions = list(workdirs.iterdir())
    assert len(sessions) == 1 and stat.S_IMODE(sessions[0].stat().st_mode) == 0o700  # no other user gets in
    assert sessions[0].stat().st_uid == os.geteuid()

    # Without --keep_workdirs the runner removes all of it, the locked folder included.
    (tmp_path / "w2").mkdir()
    proc = run_cli(_args(dataset, model_server, "--overwrite"), tmp_path, env={"TMPDIR": str(tmp_path / "w2")})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert list((tmp_path / "w2").iterdir()) == []


def _alive_with_argument(argument: str) -> list[int]:
    pids = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                if argument.encode() in f.read().split(b"\0"):
                    pids.append(int(name))
        except OSError:
            pass
    return pids


def _workers_of(runner_pid: int) -> list:
    import psutil

    for child in psutil.Process(runner_pid).children():
        if "forkserver" in " ".join(child.cmdline()):
            return child.children()
    return []


@needs_bwrap
def test_a_detached_process_dies_with_its_worker_under_bwrap(model_server, tmp_path):
    seconds = f"309.{uuid.uuid4().int % 10**6}"  # unique, so only ours is seen
    command = f"env -i setsid sh -c 'sleep {seconds}' >/dev/null 2>&1 & sleep 60"
    dataset = write_jsonl(tmp_path / "d.jsonl", [{"prompt": _prompt(command)}])
    proc = subprocess.Popen([sys.executable, str(REPO / "batch_runner.py"), *_args(dataset, model_server)],
                            cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not _alive_with_argument(seconds) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _alive_with_argument(seconds), "the detached process never started"
        workers = _workers_of(proc.pid)
        assert workers
        for worker in workers:
            worker.kill()
        deadline = time.monotonic() + 10
        while _alive_with_argument(seconds) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive_with_argument(seconds), "the detached process outlived its worker"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
        for pid in _alive_with_argument(seconds):
            os.kill(pid, signal.SIGKILL)


_IO_URING_PROBE = (
    "import ctypes, errno\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "params = ctypes.create_string_buffer(120)\n"
    "fd = libc.syscall(425, 4, params)\n"  # io_uring_setup: its operations would bypass a socket filter
    "print('IO_URING', 'refused' if fd < 0 else 'OPENED', errno.errorcode.get(ctypes.get_errno(), ''))\n"
)


@needs_bwrap
@pytest.mark.skipif(shutil.which("unshare") is None, reason="util-linux unshare not installed")
def test_a_socket_bound_in_a_shown_folder_from_another_network_namespace_is_not_reachable(model_server, tmp_path):
    # The kernel's list of this host's sockets (/proc/net/unix) does not show one bound by a process
    # of another network namespace, so covering the sockets it lists cannot be the whole defence.
    folder = next(f for f in ("/opt", "/etc") if os.path.isdir(f) and os.access(f, os.W_OK))
    path = os.path.join(folder, f"abr-netns-{uuid.uuid4().hex[:8]}.sock")
    bind = ("import os, socket, sys, time\n"
            "s = socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); os.chmod(sys.argv[1], 0o777); s.listen()\n"
            "print('ready', flush=True); time.sleep(600)\n")
    unshare = ["unshare", "-n"] if os.geteuid() == 0 else ["unshare", "-rn"]
    holder = subprocess.Popen([*unshare, sys.executable, "-c", bind, path], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "ready\n"
        with open("/proc/net/unix") as f:
            assert path not in f.read()  # invisible to the host's list, as in the attack
        probe = "python3 -c " + shlex.quote(_CONNECT_PROBE) + " " + shlex.quote(path)
        uring = "python3 -c " + shlex.quote(_IO_URING_PROBE)
        dataset = write_jsonl(tmp_path / "d.jsonl", [{"prompt": _prompt(probe, uring)}])
        result = run_cli(_args(dataset, model_server), tmp_path)
        assert result.returncode == 0, result.stdout + result.stderr
        (row,) = read_jsonl(tmp_path / "data" / "r" / "trajectories.jsonl")
        connect, io_uring = (r["output"] for r in _tool_results(row))
        assert f"refused {path} {errno.EACCES}" in connect, connect
        assert "CONNECTED" not in connect
        assert "IO_URING refused" in io_uring, io_uring
    finally:
        holder.kill()
        holder.wait()
        if os.path.exists(path):
            os.unlink(path)
