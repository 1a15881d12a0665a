"""Unit tests of the backends that cannot run here (apptainer, Modal) and of the backend registry.

Singularity: an injected runner records the exact command lines. Modal: a fake `modal` module in
sys.modules records the SDK calls. Neither proves the real tool behaves as assumed.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import types

import pytest

from tools.environments import create_environment
from tools.environments import modal as modal_backend
from tools.environments import singularity as singularity_backend
from tools.environments.base import EXEC_MARK, SandboxError, kill_marked_processes_script
from tools.environments.modal import IN_DIR, KEEP_ALIVE, PROBE, ModalConfig, ModalEnvironment
from tools.environments.singularity import SingularityConfig, SingularityEnvironment, run_command
from tools.settings import MAX_READ_BYTES, ToolSettings

# -- singularity ------------------------------------------------------------------------------


class Recorder:
    """Stands in for subprocess: records argv, answers from a queue (default: success, no output)."""

    def __init__(self):
        self.calls: list[tuple[list[str], dict]] = []
        self.answers: list = []

    def __call__(self, argv, **options):
        self.calls.append((list(argv), options))
        answer = self.answers.pop(0) if self.answers else (0, b"")
        if isinstance(answer, Exception):
            raise answer
        return answer

    @property
    def argvs(self):
        return [argv for argv, _ in self.calls]


@pytest.fixture
def runner():
    return Recorder()


def singularity(runner, tmp_path, **options) -> SingularityEnvironment:
    config = SingularityConfig(
        image=options.pop("image", "python:3.11-slim"), task_id="task 7", executable="apptainer",
        workdir_root=str(tmp_path / "work"), **options,
    )
    return SingularityEnvironment(config, runner=runner)


def test_singularity_start_command_line(runner, tmp_path):
    env = singularity(runner, tmp_path)
    env.start()
    assert re.fullmatch(r"abr-task-7-[0-9a-f]{8}", env.name)
    assert env.host_dir.startswith(str(tmp_path / "work")) and os.path.isdir(env.host_dir)
    assert runner.argvs == [[
        "apptainer", "instance", "start", "--containall", "--no-home", "--writable-tmpfs",
        "--bind", f"{env.host_dir}:/workspace", "--net", "--network", "none",
        "docker://python:3.11-slim", env.name,
    ]]


def test_singularity_limits_network_and_cwd(runner, tmp_path):
    env = singularity(runner, tmp_path, container_memory="2g", container_cpus=1.5, container_network="host", cwd="/testbed")
    env.start()
    assert runner.argvs[0] == [
        "apptainer", "instance", "start", "--containall", "--no-home", "--writable-tmpfs",
        "--bind", f"{env.host_dir}:/testbed", "--memory", "2g", "--cpus", "1.5",
        "docker://python:3.11-slim", env.name,
    ]


@pytest.mark.parametrize(
    "image, uri",
    [("ubuntu:22.04", "docker://ubuntu:22.04"), ("library://alpine:3", "library://alpine:3"),
     ("docker://x/y:1", "docker://x/y:1"), ("/images/tool.sif", "/images/tool.sif")],
)
def test_singularity_image_uri(runner, tmp_path, image, uri):
    assert singularity(runner, tmp_path, image=image).image_uri == uri


def test_singularity_execute_command_line(runner, tmp_path):
    env = singularity(runner, tmp_path)
    env.start()
    runner.answers = [(0, b"hi\n"), (3, b"")]
    assert (env.execute("echo hi").output, env.execute("exit 3", cwd="sub").exit_code) == ("hi\n", 3)
    (first, first_options), (second, _) = runner.calls[1:]
    token = first[5].split("=", 1)[1]
    assert first == ["apptainer", "exec", "--pwd", "/workspace", "--env", f"{EXEC_MARK}={token}",
                     f"instance://{env.name}", "sh", "-c", "echo hi"]
    assert re.fullmatch(r"[0-9a-f]{32}", token)
    assert first_options == {"timeout": 180.0, "limit": 200_000}
    assert second[:4] == ["apptainer", "exec", "--pwd", "/workspace/sub"]


def test_singularity_timeout_kills_marked_processes(runner, tmp_path):
    env = singularity(runner, tmp_path)
    env.start()
    runner.answers = [subprocess.TimeoutExpired(["apptainer"], 2, output=b"partial\n")]
    result = env.execute("sleep 30", timeout=2)
    assert (result.exit_code, result.timed_out) == (124, True)
    assert result.output.startswith("partial\n") and "timed out after 2 s" in result.output
    token = runner.argvs[1][5].split("=", 1)[1]
    assert runner.argvs[2] == ["apptainer", "exec", f"instance://{env.name}", "sh", "-c",
                               kill_marked_processes_script(token)]


def test_singularity_files_in_workdir_use_the_bound_host_directory(runner, tmp_path):
    env = singularity(runner, tmp_path)
    env.start()
    env.write_file("notes/a.txt", b"data")
    assert open(os.path.join(env.host_dir, "notes", "a.txt"), "rb").read() == b"data"
    assert env.read_file("/workspace/notes/a.txt") == b"data"
    with pytest.raises(FileNotFoundError):
        env.read_file("missing.txt")
    assert len(runner.calls) == 1  # only `instance start`: no exec for files in the workdir


def test_singularity_files_elsewhere_go_through_exec(runner, tmp_path):
    env = singularity(runner, tmp_path)
    env.start()
    runner.answers = [(0, b"root:x:0:0\n"), (0, b""), (1, b"cat: /nope: No such file")]
    assert env.read_file("/etc/passwd") == b"root:x:0:0\n"
    env.write_file("/opt/tool/cfg", b"x=1")
    with pytest.raises(FileNotFoundError):
        env.read_file("/nope")
    instance = f"instance://{env.name}"
    assert runner.argvs[1] == ["apptainer", "exec", instance, "head", "-c", str(MAX_READ_BYTES + 1), "/etc/passwd"]
    assert runner.argvs[2] == ["apptainer", "exec", instance, "sh", "-c",
                               'mkdir -p "$(dirname "$1")" && cat > "$1"', "sh", "/opt/tool/cfg"]
    assert runner.calls[2][1]["input"] == b"x=1"


def test_singularity_symlink_out_of_workdir_is_resolved_inside_the_instance(runner, tmp_path):
    env = singularity(runner, tmp_path)
    env.start()
    secret = tmp_path / "host-secret"
    secret.write_bytes(b"host only")
    os.symlink(secret, os.path.join(env.host_dir, "link"))
    runner.answers = [(0, b"instance file")]
    assert env.read_file("link") == b"instance file"
    assert runner.argvs[1] == ["apptainer", "exec", f"instance://{env.name}", "head", "-c", str(MAX_READ_BYTES + 1),
                               "/workspace/link"]


def test_singularity_cleanup_stops_instance_once_and_removes_host_dir(runner, tmp_path):
    env = singularity(runner, tmp_path)
    env.start()
    host_dir = env.host_dir
    env.cleanup()
    env.cleanup()
    assert runner.argvs[1:] == [["apptainer", "instance", "stop", env.name]]
    assert not os.path.exists(host_dir)
    with pytest.raises(SandboxError):
        env.execute("true")


def test_singularity_start_failure(runner, tmp_path):
    env = singularity(runner, tmp_path)
    runner.answers = [(255, b"FATAL: could not pull docker://python:3.11-slim\n")]
    with pytest.raises(SandboxError, match="FATAL: could not pull"):
        env.start()
    assert os.listdir(tmp_path / "work") == []
    assert len(runner.calls) == 1  # nothing to stop


def test_singularity_missing_cli(monkeypatch, tmp_path):
    monkeypatch.setattr(singularity_backend.shutil, "which", lambda name: None)
    env = SingularityEnvironment(SingularityConfig(image="x", task_id="t", workdir_root=str(tmp_path)))
    with pytest.raises(SandboxError, match="apptainer or singularity"):
        env.start()


def test_run_command_merges_output_feeds_input_and_kills_on_timeout():
    assert run_command(["sh", "-c", "echo out; echo err >&2"]) == (0, b"out\nerr\n")
    assert run_command(["cat"], input=b"piped") == (0, b"piped")
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired) as caught:
        run_command(["sh", "-c", "echo early; sleep 30 & sleep 31"], timeout=0.5)
    assert time.monotonic() - started < 5
    assert caught.value.output == b"early\n"
    with pytest.raises(subprocess.TimeoutExpired):  # the shell exits, its background job holds stdout
        run_command(["sh", "-c", "sleep 30 & echo bg"], timeout=0.5)


@pytest.mark.parametrize("shell", ["sh", "bash", "busybox"])
def test_kill_script_kills_every_marked_process_and_nothing_else(shell):
    """The script Docker and Singularity use on timeout, run for real against local processes."""
    argv = ["busybox", "sh"] if shell == "busybox" else [shell]
    if subprocess.run(["sh", "-c", f"command -v {argv[0]}"], capture_output=True).returncode:
        pytest.skip(f"{argv[0]} is not installed")
    token, other = os.urandom(8).hex(), os.urandom(8).hex()
    marked = subprocess.Popen(["sh", "-c", "sleep 60 & sh -c 'sleep 61' & sleep 62"],
                              env={**os.environ, EXEC_MARK: token}, start_new_session=True)
    bystander = subprocess.Popen(["sleep", "63"], env={**os.environ, EXEC_MARK: other})
    try:
        time.sleep(0.3)
        subprocess.run([*argv, "-c", kill_marked_processes_script(token)], check=True, timeout=30)
        # The shell is killed itself (-9) or, if its foreground `sleep` dies first, exits 137 (128 + 9):
        # either way it ended within 5 s; the survivors check below is what proves the kill.
        assert marked.wait(5) in (-9, 137)
        survivors = [p for p in os.listdir("/proc") if p.isdigit() and _has_marker(p, token)]
        assert survivors == []
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()
        if marked.poll() is None:
            os.killpg(marked.pid, 9)


def _has_marker(pid: str, token: str) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as environ:
            return f"{EXEC_MARK}={token}".encode() in environ.read()
    except OSError:
        return False


# -- modal ------------------------------------------------------------------------------------


class FakeProcess:
    def __init__(self, output: str = "", code: int = 0, error: Exception | None = None):
        self.stdout = types.SimpleNamespace(read=lambda: output)
        self.returncode = None
        self._code, self._error = code, error

    def wait(self):
        if self._error:
            raise self._error
        self.returncode = self._code
        return self._code


class FakeFile:
    def __init__(self, files: dict, path: str, mode: str):
        self.files, self.path, self.mode = files, path, mode

    def read(self, n=None):
        return self.files[self.path][:n]

    def write(self, data):
        self.files[self.path] = data

    def close(self):
        pass


class ExecTimeoutError(Exception):
    """Same name as modal.exception.ExecTimeoutError."""


class FakeSandbox:
    def __init__(self, log):
        self.log, self.processes, self.files = log, [], {}

    def exec(self, *args, **kwargs):
        self.log.append(("exec", args, kwargs))
        process = self.processes.pop(0) if self.processes else FakeProcess()
        if isinstance(process, Exception):
            raise process
        return process

    def open(self, path, mode):
        self.log.append(("open", (path, mode), {}))
        return FakeFile(self.files, path, mode)

    def terminate(self):
        self.log.append(("terminate", (), {}))


@pytest.fixture
def fake_modal(monkeypatch):
    log: list = []
    sandbox = FakeSandbox(log)

    def record(name, result):
        def call(*args, **kwargs):
            log.append((name, args, kwargs))
            if isinstance(result, Exception):
                raise result
            return result
        return call

    module = types.ModuleType("modal")
    module.App = types.SimpleNamespace(lookup=record("App.lookup", "APP"))
    module.Image = types.SimpleNamespace(from_registry=record("Image.from_registry", "IMAGE"))
    module.Sandbox = types.SimpleNamespace(create=record("Sandbox.create", sandbox))
    module.log, module.sandbox, module.record = log, sandbox, record
    monkeypatch.setitem(sys.modules, "modal", module)
    return module


def started_modal(**options) -> ModalEnvironment:
    env = ModalEnvironment(ModalConfig(image="python:3.11-slim", task_id="t", **options))
    env.start()
    return env


def test_modal_start_calls(fake_modal):
    started_modal(container_memory="2g", container_cpus=2)
    assert fake_modal.log == [
        ("App.lookup", ("agent-batch-runner",), {"create_if_missing": True}),
        ("Image.from_registry", ("python:3.11-slim",), {}),
        ("Sandbox.create", ("sh", "-c", KEEP_ALIVE), {
            "app": "APP", "image": "IMAGE", "timeout": 3600, "workdir": "/workspace",
            "block_network": True, "cpu": 2.0, "memory": 2048,
        }),
    ]


def test_modal_network_and_cwd(fake_modal):
    started_modal(container_network="bridge", cwd="/testbed")
    options = fake_modal.log[-1][2]
    assert options["block_network"] is False and options["workdir"] == "/testbed"


def test_modal_execute(fake_modal):
    env = started_modal()
    fake_modal.sandbox.processes = [FakeProcess("hi\n", 0), FakeProcess("", 2)]
    assert env.execute("echo hi").output == "hi\n"
    assert env.execute("false", cwd="sub", timeout=7.5).exit_code == 2
    execs = [entry for entry in fake_modal.log if entry[0] == "exec"]
    assert execs == [
        ("exec", ("sh", "-c", IN_DIR, "sh", "/workspace", "echo hi"), {"timeout": 180}),
        ("exec", ("sh", "-c", IN_DIR, "sh", "/workspace/sub", "false"), {"timeout": 8}),
    ]


def test_modal_timeout(fake_modal, monkeypatch):
    env = started_modal()
    fake_modal.sandbox.processes = [FakeProcess(error=ExecTimeoutError("too slow"))]
    result = env.execute("sleep 30", timeout=2)
    assert (result.exit_code, result.timed_out) == (124, True)

    clock = iter([100.0, 103.0])  # a non-zero exit once the deadline has passed is a timeout too
    monkeypatch.setattr(modal_backend.time, "monotonic", lambda: next(clock))
    fake_modal.sandbox.processes = [FakeProcess("partial", -1)]
    result = env.execute("sleep 30", timeout=2)
    assert (result.exit_code, result.timed_out) == (124, True) and result.output.startswith("partial")


def test_modal_files(fake_modal):
    env = started_modal()
    env.write_file("a/b.txt", b"data")
    assert fake_modal.sandbox.files == {"/workspace/a/b.txt": b"data"}
    assert env.read_file("/workspace/a/b.txt") == b"data"
    fake_modal.sandbox.processes = [FakeProcess(code=1), FakeProcess(code=2)]
    with pytest.raises(FileNotFoundError):
        env.read_file("missing")
    with pytest.raises(IsADirectoryError):
        env.read_file("/etc")
    calls = [entry[:2] for entry in fake_modal.log[3:]]
    assert calls[:4] == [
        ("exec", ("sh", "-c", 'mkdir -p "$(dirname "$1")"', "sh", "/workspace/a/b.txt")),
        ("open", ("/workspace/a/b.txt", "wb")),
        ("exec", ("sh", "-c", PROBE, "sh", "/workspace/a/b.txt")),
        ("open", ("/workspace/a/b.txt", "rb")),
    ]


def test_modal_cleanup_terminates_once(fake_modal):
    env = started_modal()
    env.cleanup()
    env.cleanup()
    assert [entry[0] for entry in fake_modal.log].count("terminate") == 1
    with pytest.raises(SandboxError):
        env.execute("true")


def test_modal_dead_sandbox_raises_sandbox_error(fake_modal):
    env = started_modal()
    fake_modal.sandbox.processes = [RuntimeError("Sandbox has already terminated")]
    with pytest.raises(SandboxError, match="already terminated"):
        env.execute("true")


def test_modal_create_failure(fake_modal):
    fake_modal.Sandbox.create = fake_modal.record("Sandbox.create", RuntimeError("image build failed"))
    with pytest.raises(SandboxError, match="image build failed"):
        started_modal()


def test_modal_not_installed(monkeypatch):
    monkeypatch.setitem(sys.modules, "modal", None)
    with pytest.raises(SandboxError, match="pip install modal"):
        started_modal()


# -- registry ---------------------------------------------------------------------------------


def settings(backend: str, **options) -> ToolSettings:
    return ToolSettings(terminal_env=backend, run_name="r", run_id="id1", **options)


def test_registry_container_backends_take_row_image_then_default():
    env = create_environment(settings("singularity", docker_image="base:1", container_memory="1g"),
                             task_id="t", image="row:2", cwd="/src")
    assert isinstance(env, SingularityEnvironment)
    assert (env.config.image, env.config.cwd, env.config.container_memory) == ("row:2", "/src", "1g")
    modal_settings = settings("modal", docker_image="base:1", command_timeout=9)
    env = create_environment(modal_settings, task_id="t", image=None, cwd=None)
    assert isinstance(env, ModalEnvironment)
    assert (env.config.image, env.config.command_timeout) == ("base:1", 9)


def test_registry_docker_labels_and_limits():
    from tools.environments.docker import DockerEnvironment

    env = create_environment(settings("docker", container_cpus=0.5, container_network="bridge"),
                             task_id="t9", image="img:1", cwd=None)
    assert isinstance(env, DockerEnvironment)
    assert env.config.labels == {"abr.run_name": "r", "abr.run_id": "id1"}
    assert (env.config.container_cpus, env.config.container_network, env.config.task_id, env.workdir) == (0.5, "bridge", "t9", "/workspace")


@pytest.mark.parametrize("backend", ["docker", "singularity", "modal"])
def test_registry_container_backend_without_image(backend):
    with pytest.raises(SandboxError, match=f"terminal_env={backend} needs a container image"):
        create_environment(settings(backend), task_id="t", image=None, cwd=None)


def test_registry_local_ignores_image(tmp_path):
    local = pytest.importorskip("tools.environments.local")
    env = create_environment(settings("local", workdir_root=str(tmp_path)), task_id="t", image="ignored:1", cwd=None)
    assert isinstance(env, local.LocalEnvironment)
    assert env.config.workdir_root == str(tmp_path)


def test_registry_unknown_backend():
    # The settings refuse the name (what the CLI reports), and the registry refuses it on its own too.
    with pytest.raises(ValueError, match="--terminal_env must be local, docker, singularity or modal .got 'daytona'."):
        settings("daytona")
    unchecked = ToolSettings.model_construct(terminal_env="daytona", run_name="r", run_id="id1")
    with pytest.raises(ValueError, match="unknown terminal_env 'daytona'"):
        create_environment(unchecked, task_id="t", image="x", cwd=None)


def test_registry_names_every_backend_module_and_class():
    from tools.environments import BACKENDS, backend_class
    from tools.environments.base import Backend

    assert list(BACKENDS) == ["local", "docker", "singularity", "modal"]
    for name in BACKENDS:
        assert issubclass(backend_class(name), Backend)


def test_cli_choices_of_terminal_env_come_from_the_registry(monkeypatch):
    """--help and the error for an unknown --terminal_env list the registered backends."""
    from runner.input.flags import FLAGS
    from tools import environments

    help_line = next(flag.help for flag in FLAGS if flag.name == "terminal_env")
    assert help_line == "Where commands run: local, docker, singularity or modal."
    monkeypatch.setitem(environments.BACKENDS, "firecracker", "local:LocalEnvironment")
    assert environments.backend_choices() == "local, docker, singularity, modal or firecracker"


def test_no_backend_imports_another_and_none_imports_an_sdk_it_does_not_use():
    """Each backend module imports only base (and its own SDK): singularity never drags in docker."""
    import ast
    from pathlib import Path

    from tools.environments import BACKENDS

    folder = Path(create_environment.__code__.co_filename).parent
    modules = {target.partition(":")[0] for target in BACKENDS.values()}
    for module in modules:
        tree = ast.parse((folder / f"{module}.py").read_text())
        imported = {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        siblings = {name.lstrip(".").removeprefix("tools.environments.") for name in imported} & (modules - {module})
        assert not siblings, f"{module}.py imports {siblings}"
    probe = ("import sys; from tools.environments import backend_class; "
             "[backend_class(n) for n in ('local', 'singularity', 'modal')]; print('docker' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                         cwd=folder.parent.parent).stdout
    assert out.strip() == "False"
