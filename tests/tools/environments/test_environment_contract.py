"""One contract every environment backend keeps, run against each backend that can run here.

local and local+bwrap run for real; docker runs against the real engine with the offline busybox
image (tests/helpers/docker_support.py). Apptainer and Modal cannot run here, so they run against stand-ins
that execute on this machine: a fake `apptainer` executable on PATH (the backend's own subprocess
code runs unchanged) and a fake `modal` module whose sandbox runs commands locally. The stand-ins
behave as the real tools are documented to (and are written to be no kinder than them: a command
exec'd into the fake instance outlives a killed `apptainer exec`, as in-instance processes do); they
cannot prove the real tools do.

Every backend is built through the registry from ToolSettings, as a run builds it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import types
import uuid

import pytest

from tools.environments import create_environment
from tools.environments.base import FileTooLargeError, SandboxError
from tools.settings import MAX_READ_BYTES, ToolSettings

MAX_OUTPUT = 1000

BACKENDS = [
    "local",
    pytest.param("bwrap", marks=pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")),
    pytest.param("docker", marks=pytest.mark.docker),
    "singularity",
    "modal",
]


# -- the stand-ins ------------------------------------------------------------------------------

FAKE_APPTAINER = '''\
#!{python}
"""Stands in for the apptainer CLI: instances are directories on this machine."""
import json, os, signal, subprocess, sys

STATE = os.environ["FAKE_APPTAINER_STATE"]
args = sys.argv[1:]


def state_file(name):
    return os.path.join(STATE, name + ".json")


def instance_pids(name):
    mark = f"FAKE_APPTAINER_INSTANCE={{name}}".encode()
    for pid in os.listdir("/proc"):
        try:
            if pid.isdigit() and mark in open(f"/proc/{{pid}}/environ", "rb").read().split(b"\\0"):
                yield int(pid)
        except OSError:
            pass


if args[:2] == ["instance", "start"]:
    host, inside = args[args.index("--bind") + 1].split(":")
    json.dump({{"host": host, "inside": inside}}, open(state_file(args[-1]), "w"))
    sys.exit(0)
if args[:2] == ["instance", "stop"]:
    if not os.path.exists(state_file(args[2])):
        print(f"FATAL: no instance found with name {{args[2]}}")
        sys.exit(255)
    os.remove(state_file(args[2]))
    for pid in instance_pids(args[2]):  # stopping an instance ends everything in it
        os.kill(pid, signal.SIGKILL)
    sys.exit(0)
if args[:2] == ["instance", "list"]:
    if os.path.exists(state_file(args[2])):
        print("INSTANCE NAME    PID    IP    IMAGE")
        print(f"{{args[2]}}    1    -    fake.sif")
    sys.exit(0)
if args[0] == "exec":
    rest, pwd, env = args[1:], None, dict(os.environ)
    while rest[0].startswith("--"):
        option, value, rest = rest[0], rest[1], rest[2:]
        if option == "--pwd":
            pwd = value
        elif option == "--env":
            key, _, val = value.partition("=")
            env[key] = val
    name, command = rest[0].removeprefix("instance://"), rest[1:]
    if not os.path.exists(state_file(name)):
        print(f"FATAL: no instance found with name {{name}}")
        sys.exit(255)
    bound = json.load(open(state_file(name)))
    pwd = pwd or bound["inside"]
    if pwd == bound["inside"] or pwd.startswith(bound["inside"] + "/"):
        pwd = bound["host"] + pwd[len(bound["inside"]):]
    env["FAKE_APPTAINER_INSTANCE"] = name
    # Its own session: killing this `apptainer exec` does not kill what runs in the instance.
    child = subprocess.Popen(command, cwd=pwd, env=env, start_new_session=True)
    code = child.wait()
    sys.exit(128 - code if code < 0 else code)
print("fake apptainer: unsupported command", args, file=sys.stderr)
sys.exit(2)
'''


class LocalModalSandbox:
    """Stands in for modal.Sandbox: the sandbox's workdir is a local folder; exec runs locally and
    is killed at its timeout (server-side in Modal); a signal death reads 128+n, as from a container."""

    def __init__(self, workdir: str, root: str):
        self.workdir, self.root, self.alive = workdir, root, True
        os.makedirs(root, exist_ok=True)

    def _host(self, arg: str) -> str:
        if arg == self.workdir or arg.startswith(self.workdir + "/"):
            return self.root + arg[len(self.workdir):]
        return arg

    def _check(self) -> None:
        if not self.alive:
            raise RuntimeError("Sandbox has already terminated")

    def exec(self, *argv: str, timeout: int):
        self._check()
        proc = subprocess.Popen([self._host(arg) for arg in argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, cwd=self.root)
        timer = threading.Timer(timeout, _killpg, (proc.pid,))
        timer.start()
        return LocalModalProcess(proc, timer)

    def open(self, path: str, mode: str):
        self._check()
        return open(self._host(path), mode)

    def terminate(self) -> None:
        self.alive = False


class LocalModalProcess:
    def __init__(self, proc: subprocess.Popen, timer: threading.Timer):
        self._proc, self._timer, self.returncode = proc, timer, None
        self.stdout = types.SimpleNamespace(read=lambda: proc.stdout.read().decode(errors="replace"))

    def wait(self) -> int:
        code = self._proc.wait()
        self._timer.cancel()
        self._proc.stdout.close()
        self.returncode = 128 - code if code < 0 else code
        return self.returncode


def _killpg(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass


@pytest.fixture
def fake_apptainer(tmp_path, monkeypatch):
    bin_dir, state = tmp_path / "fake-bin", tmp_path / "fake-apptainer-state"
    bin_dir.mkdir()
    state.mkdir()
    exe = bin_dir / "apptainer"
    exe.write_text(FAKE_APPTAINER.format(python=sys.executable))
    exe.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_APPTAINER_STATE", str(state))
    return str(exe)


@pytest.fixture
def fake_modal(tmp_path, monkeypatch):
    def create(*command, app, image, workdir, **options):
        return LocalModalSandbox(workdir, str(tmp_path / f"modal-sandbox-{uuid.uuid4().hex[:6]}"))

    module = types.ModuleType("modal")
    module.App = types.SimpleNamespace(lookup=lambda name, create_if_missing: "app")
    module.Image = types.SimpleNamespace(from_registry=lambda image: "image")
    module.Sandbox = types.SimpleNamespace(create=create)
    monkeypatch.setitem(sys.modules, "modal", module)
    return module


# -- one started environment per backend ----------------------------------------------------------


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


@pytest.fixture
def make_env(backend, request, tmp_path):
    """make_env(**settings) -> a started environment of `backend`; all are cleaned up afterwards."""
    base = {"workdir_root": str(tmp_path / "work"), "max_output_chars": MAX_OUTPUT, "run_name": "contract",
            "run_id": f"contract-{uuid.uuid4().hex[:8]}"}
    if backend == "local":
        base["terminal_env"] = "local"
    elif backend == "bwrap":
        base.update(terminal_env="local", sandbox="bwrap")
    elif backend == "docker":
        from tests.helpers.docker_support import BUSYBOX_IMAGE, ready_client

        client = ready_client()
        request.addfinalizer(client.close)
        base.update(terminal_env="docker", docker_image=BUSYBOX_IMAGE)
    elif backend == "singularity":
        request.getfixturevalue("fake_apptainer")
        base.update(terminal_env="singularity", docker_image="busybox:1")
    else:
        request.getfixturevalue("fake_modal")
        base.update(terminal_env="modal", docker_image="busybox:1")
    made = []

    def make(start: bool = True, **overrides):
        env = create_environment(ToolSettings(**{**base, **overrides}), task_id="contract-p0-a1", image=None, cwd=None)
        made.append(env)
        if start:
            env.start()
        return env

    yield make
    for env in made:
        env.cleanup()
    if backend == "docker":
        leftovers = client.containers.list(all=True, filters={"label": f"abr.run_id={base['run_id']}"})
        for container in leftovers:
            container.remove(force=True)
        assert not leftovers, "cleanup() left containers behind"


def kill_sandbox(backend: str, env) -> None:
    """End the sandbox behind the environment's back, as a crash or the OOM killer would."""
    if backend == "bwrap":
        os.kill(env._sandbox_pid, signal.SIGKILL)
        env._holder.wait(10)
    elif backend == "docker":
        env._container.kill()
    elif backend == "singularity":
        subprocess.run(["apptainer", "instance", "stop", env.name], check=True, capture_output=True)
    elif backend == "modal":
        env._sandbox.terminate()
    else:
        pytest.skip("the local backend without a sandbox has nothing that can die")


# -- the contract ---------------------------------------------------------------------------------


def test_exit_codes(make_env):
    env = make_env()
    ok = env.execute("true")
    assert (ok.exit_code, ok.timed_out) == (0, False)
    assert env.execute("exit 3").exit_code == 3
    assert env.execute("kill -9 $$").exit_code == 137  # killed by a signal: 128 + 9, as a shell says
    assert env.execute("no-such-command-abr").exit_code == 127


def test_stdout_and_stderr_arrive_interleaved_in_order(make_env):
    env = make_env()
    result = env.execute("echo one; echo two >&2; echo three; echo four >&2")
    assert result.output == "one\ntwo\nthree\nfour\n"


def test_long_output_keeps_head_and_tail(make_env):
    env = make_env()
    result = env.execute("echo START; seq 1 20000; echo END")
    assert result.exit_code == 0
    assert result.output.startswith("START\n1\n2\n")
    assert result.output.endswith("19999\n20000\nEND\n")
    assert "omitted" in result.output
    assert len(result.output) < MAX_OUTPUT + 100


def test_timeout_kills_the_command_and_its_background_children(make_env):
    env = make_env()
    started = time.monotonic()
    result = env.execute("sleep 300 & echo $! > bg.pid; echo started; sleep 300", timeout=1)
    assert (result.exit_code, result.timed_out) == (124, True)
    assert "started" in result.output  # what it printed before the deadline is kept
    assert time.monotonic() - started < 15
    check = ('p=$(cat bg.pid); if [ -r /proc/$p/stat ] && ! grep -q ") Z" /proc/$p/stat; '
             "then echo alive; else echo gone; fi")
    deadline = time.monotonic() + 5
    while (state := env.execute(check).output.strip()) != "gone" and time.monotonic() < deadline:
        time.sleep(0.2)
    assert state == "gone", "the background child of the timed-out command is still running"


def test_files_round_trip_and_missing_file(make_env):
    env = make_env()
    data = bytes(range(256)) * 3
    env.write_file("deep/er/data.bin", data)  # parent directories are created
    assert env.read_file("deep/er/data.bin") == data
    assert env.execute("wc -c < deep/er/data.bin").output.strip() == str(len(data))  # commands see it too
    env.write_file(f"{env.workdir}/absolute.txt", b"abs")
    assert env.read_file("absolute.txt") == b"abs"
    env.execute("printf made > by-command.txt")
    assert env.read_file("by-command.txt") == b"made"
    with pytest.raises(FileNotFoundError):
        env.read_file("no/such/file.txt")
    with pytest.raises(IsADirectoryError):
        env.read_file("deep")


def test_reads_stop_at_the_size_limit(make_env):
    env = make_env()
    env.execute(f"head -c {MAX_READ_BYTES} /dev/zero > at-limit.bin && head -c {MAX_READ_BYTES + 1} /dev/zero > over.bin")
    assert len(env.read_file("at-limit.bin")) == MAX_READ_BYTES
    with pytest.raises(FileTooLargeError, match="larger than the 16 MiB"):
        env.read_file("over.bin")


def test_commands_run_in_the_workdir_or_the_given_cwd(make_env):
    env = make_env()
    env.write_file("sub/inside.txt", b"in sub\n")
    assert env.execute("cat inside.txt", cwd="sub").output == "in sub\n"
    assert env.execute("pwd", cwd="sub").output.rstrip("\n").endswith("/sub")
    env.execute("cd sub; echo moved")  # a cd does not outlive its command
    assert env.execute("cat sub/inside.txt").output == "in sub\n"
    missing = env.execute("echo never", cwd="does-not-exist")  # the model's mistake, not a dead sandbox
    assert missing.exit_code != 0 and "never" not in missing.output


def test_cleanup_is_idempotent(make_env):
    env = make_env()
    env.execute("echo hi > file.txt")
    env.cleanup()
    env.cleanup()
    make_env(start=False).cleanup()  # also before (or after a failed) start


def test_a_dead_sandbox_raises_sandbox_error(make_env, backend):
    env = make_env()
    assert env.execute("echo alive").output == "alive\n"
    kill_sandbox(backend, env)
    with pytest.raises(SandboxError):
        env.execute("echo still here?")


def test_every_registered_backend_is_in_the_contract():
    from tools.environments import BACKENDS as REGISTERED

    covered = {"local", "docker", "singularity", "modal"}  # bwrap is the local backend's option
    assert set(REGISTERED) == covered, "a new backend needs a way to run in this suite"


