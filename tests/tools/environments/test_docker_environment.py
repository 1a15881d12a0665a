"""The Docker backend against a real engine, with images built offline (tests/helpers/docker_support.py)."""

from __future__ import annotations

import subprocess
import threading
import time
import uuid

import pytest
from docker.errors import NotFound

from tests.helpers.docker_support import BUSYBOX_IMAGE, MARKED_CONTENT, MARKED_IMAGE, NO_PASSWD_IMAGE, ready_client
from tools.environments import create_environment
from tools.environments.base import SandboxError
from tools.environments.docker import DockerConfig, DockerEnvironment
from tools.environments.images import prepare_images, reap_stale_containers
from tools.settings import ToolSettings

pytestmark = pytest.mark.docker


@pytest.fixture(scope="module")
def client():
    client = ready_client()
    yield client
    client.close()


@pytest.fixture
def run_id(client):
    """A run id for this test; afterwards no container may carry it (each test cleans up itself)."""
    run_id = f"test-{uuid.uuid4().hex[:12]}"
    yield run_id
    leftovers = client.containers.list(all=True, filters={"label": f"abr.run_id={run_id}"})
    for container in leftovers:
        container.remove(force=True)
    assert not leftovers, f"containers leaked by the test: {[c.name for c in leftovers]}"


@pytest.fixture
def make_env(run_id):
    def make(image: str = BUSYBOX_IMAGE, **options) -> DockerEnvironment:
        config = DockerConfig(
            image=image, task_id="task-1", labels={"abr.run_name": "tests", "abr.run_id": run_id}, **options
        )
        return DockerEnvironment(config)

    return make


@pytest.fixture
def env(make_env):
    env = make_env()
    env.start()
    try:
        yield env
    finally:
        env.cleanup()


def sleeps(env: DockerEnvironment) -> list[str]:
    """`sleep` processes other than the keep-alive loop's `sleep 3600`."""
    listing = env.execute("ps -o args").output.splitlines()
    return [line for line in listing if line.startswith("sleep") and "3600" not in line]


def test_execute_echo_exit_code_and_stderr(env):
    result = env.execute("echo hello")
    assert (result.output, result.exit_code, result.timed_out) == ("hello\n", 0, False)
    assert env.execute("exit 3").exit_code == 3
    mixed = env.execute("echo out; echo err >&2; echo out2")
    assert mixed.output.split() == ["out", "err", "out2"]


def test_state_persists_between_commands(env):
    env.execute("echo 42 > counter")
    assert env.execute("cat counter").output == "42\n"


def test_default_cwd_is_created_workspace(env):
    assert env.workdir == "/workspace"
    assert env.execute("pwd").output == "/workspace\n"
    assert env.execute("pwd", cwd="/tmp").output == "/tmp\n"
    env.execute("mkdir sub")
    assert env.execute("pwd", cwd="sub").output == "/workspace/sub\n"


def test_given_cwd_is_created(make_env):
    env = make_env(cwd="/srv/project")
    env.start()
    try:
        assert env.execute("pwd").output == "/srv/project\n"
    finally:
        env.cleanup()


def test_file_write_then_read_inside_container(env):
    payload = bytes(range(256)) + "é ✓\n".encode()
    env.write_file("notes/deep/data.bin", payload)
    assert env.read_file("notes/deep/data.bin") == payload
    assert env.read_file("/workspace/notes/deep/data.bin") == payload
    assert env.execute("wc -c < notes/deep/data.bin").output.strip() == str(len(payload))

    env.execute("printf 'from shell' > /tmp/shell.txt && ln -s /tmp/shell.txt link.txt")
    assert env.read_file("/tmp/shell.txt") == b"from shell"
    assert env.read_file("link.txt") == b"from shell"

    env.write_file("/tmp/abs.txt", b"absolute")
    assert env.execute("cat /tmp/abs.txt").output == "absolute"


def test_read_missing_file_and_directory(env):
    with pytest.raises(FileNotFoundError):
        env.read_file("nope.txt")
    with pytest.raises(IsADirectoryError):
        env.read_file("/etc")


def test_timeout_really_stops_the_command(env):
    started = time.monotonic()
    result = env.execute("echo started; sleep 30", timeout=1)
    assert time.monotonic() - started < 10
    assert result.timed_out and result.exit_code == 124
    assert result.output.startswith("started\n") and "timed out after 1 s" in result.output
    assert sleeps(env) == []
    assert env.execute("echo still usable").output == "still usable\n"


def test_timeout_kills_children_and_background_jobs(env):
    result = env.execute("sleep 31 & sh -c 'sleep 32; echo never' & sleep 33; echo never", timeout=1)
    assert result.timed_out and "never" not in result.output
    assert sleeps(env) == []


def test_timeout_returns_even_when_a_process_escapes_the_marker(env):
    started = time.monotonic()
    result = env.execute("env -i sleep 34", timeout=1)  # `env -i` drops ABR_EXEC_ID
    assert result.timed_out and time.monotonic() - started < 8
    env.execute("pkill -9 -f 'sleep 34'")


def test_default_timeout_from_config(make_env):
    env = make_env(command_timeout=1)
    env.start()
    try:
        assert env.execute("sleep 20").timed_out
        assert sleeps(env) == []
    finally:
        env.cleanup()


def test_huge_output_is_truncated(make_env):
    env = make_env(max_output_chars=2000)
    env.start()
    try:
        result = env.execute("i=0; while [ $i -lt 30000 ]; do echo line-$i; i=$((i+1)); done")
        assert result.exit_code == 0 and len(result.output) < 2200
        assert result.output.startswith("line-0\n") and result.output.endswith("line-29999\n")
        assert "omitted" in result.output
    finally:
        env.cleanup()


def test_limits_are_applied(client, make_env):
    env = make_env(container_memory="64m", container_cpus=0.5)
    env.start()
    try:
        host_config = client.containers.get(env.name).attrs["HostConfig"]
        assert host_config["Memory"] == 64 * 1024 * 1024
        assert host_config["MemorySwap"] in (64 * 1024 * 1024, -1)  # -1: kernel without swap accounting
        assert host_config["NanoCpus"] == 500_000_000
        assert host_config["NetworkMode"] == "none"
        assert host_config["Init"] is True
    finally:
        env.cleanup()


def test_no_network_only_loopback(env):
    interfaces = env.execute("ls /sys/class/net").output.split()
    assert interfaces == ["lo"]


def test_labels(client, env, run_id):
    labels = client.containers.get(env.name).labels
    assert labels["abr.run_id"] == run_id
    assert labels["abr.run_name"] == "tests"
    assert labels["abr.task_id"] == "task-1"
    assert int(labels["abr.owner_pid"]) > 0 and labels["abr.owner_host"]


def test_cleanup_removes_container_and_is_idempotent(client, make_env):
    env = make_env()
    env.start()
    client.containers.get(env.name)
    env.cleanup()
    with pytest.raises(NotFound):
        client.containers.get(env.name)
    env.cleanup()
    with pytest.raises(SandboxError):
        env.execute("true")


def test_missing_image_raises_sandbox_error(make_env):
    env = make_env(image="abr-test/does-not-exist:1")
    with pytest.raises(SandboxError, match="abr-test/does-not-exist:1"):
        env.start()
    env.cleanup()


def test_container_dying_mid_prompt_raises_sandbox_error(client, env):
    assert env.execute("true").exit_code == 0
    client.containers.get(env.name).kill()
    with pytest.raises(SandboxError, match="died mid-prompt"):
        env.execute("echo hi")
    with pytest.raises(SandboxError):
        env.read_file("x")


def test_container_killed_during_a_command_raises_sandbox_error(client, env):
    killer = threading.Timer(0.5, lambda: client.containers.get(env.name).kill())
    killer.start()
    try:
        with pytest.raises(SandboxError, match="died mid-prompt"):
            env.execute("sleep 20")
    finally:
        killer.join()


def test_command_killed_by_sigkill_is_not_a_dead_container(env):
    result = env.execute("echo before; kill -9 $$")
    assert (result.output, result.exit_code) == ("before\n", 137)
    assert env.execute("echo alive").output == "alive\n"


def test_image_per_environment(make_env):
    marked, plain = make_env(image=MARKED_IMAGE), make_env()
    marked.start()
    plain.start()
    try:
        assert marked.execute("cat /etc/abr-image").output == MARKED_CONTENT
        assert plain.execute("cat /etc/abr-image").exit_code != 0
    finally:
        marked.cleanup()
        plain.cleanup()


def test_registry_builds_from_row_image_then_run_default(client, run_id):
    settings = ToolSettings(terminal_env="docker", docker_image=BUSYBOX_IMAGE, run_name="tests", run_id=run_id)
    row_image = create_environment(settings, task_id="t1", image=MARKED_IMAGE, cwd="/data")
    default = create_environment(settings, task_id="t2", image=None, cwd=None)
    for env in (row_image, default):
        env.start()
    try:
        assert row_image.execute("cat /etc/abr-image; pwd").output == MARKED_CONTENT + "/data\n"
        assert default.execute("cat /etc/abr-image").exit_code != 0
        labels = client.containers.get(default.name).labels
        assert (labels["abr.run_id"], labels["abr.run_name"]) == (run_id, "tests")
    finally:
        row_image.cleanup()
        default.cleanup()


def test_prepare_images_checks_each_image_once(client):
    events: list[tuple[str, str]] = []
    missing = "localhost:1/abr-missing:1"  # no registry there: the pull fails at once
    result = prepare_images(
        {BUSYBOX_IMAGE, MARKED_IMAGE, missing, ""}, progress=lambda image, status: events.append((image, status))
    )
    assert result[BUSYBOX_IMAGE] is None and result[MARKED_IMAGE] is None
    assert result[missing].startswith(f"image '{missing}' not found locally and pull failed:")
    assert "" not in result
    assert sorted(events) == sorted(
        [(BUSYBOX_IMAGE, "present"), (MARKED_IMAGE, "present"), (missing, "pulling"), (missing, "failed")]
    )

    no_pull = prepare_images({missing}, pull=False)
    assert no_pull == {missing: f"image '{missing}' not found locally (pulling is disabled)"}
    assert prepare_images(set()) == {}


def test_reap_stale_containers(client, run_id):
    import os
    import socket

    finished = subprocess.Popen(["true"])
    finished.wait()
    host = socket.gethostname()

    def create(pid: int):
        labels = {"abr.run_id": run_id, "abr.owner_pid": str(pid), "abr.owner_host": host, "abr.task_id": "t"}
        return client.containers.create(BUSYBOX_IMAGE, ["true"], labels=labels, network_mode="none")

    stale, live = create(finished.pid), create(os.getpid())
    elsewhere = client.containers.create(
        BUSYBOX_IMAGE, ["true"], network_mode="none",
        labels={"abr.run_id": run_id, "abr.owner_pid": str(finished.pid), "abr.owner_host": "another-host"},
    )
    try:
        lines: list[str] = []
        assert reap_stale_containers(client, log=lines.append) >= 1
        with pytest.raises(NotFound):
            client.containers.get(stale.id)
        client.containers.get(live.id)
        client.containers.get(elsewhere.id)
        assert any(stale.name in line and str(finished.pid) in line for line in lines)
        assert not any(live.name in line for line in lines)
    finally:
        for container in (stale, live, elsewhere):
            try:
                container.remove(force=True)
            except NotFound:
                pass


def test_image_without_etc_passwd_works(make_env):
    """Setup, chown and kills run as uid 0: no user name has to resolve inside the image."""
    env = make_env(NO_PASSWD_IMAGE, cwd="/srv/app", command_timeout=1)
    env.start()
    try:
        assert env.execute("ls /etc/passwd").exit_code != 0  # really no passwd file
        assert env.execute("id -u; pwd").output.split() == ["0", "/srv/app"]
        env.write_file("sub/out.txt", b"inside")
        assert env.read_file("sub/out.txt") == b"inside"
        result = env.execute("sleep 30")
        assert result.timed_out and result.exit_code == 124
        assert not sleeps(env)  # the kill exec (as uid 0) found and killed it
    finally:
        env.cleanup()


def test_a_failed_setup_never_has_an_empty_message(make_env):
    """A working directory that cannot be made, with a command that prints nothing, still says why."""
    from tools.environments.docker import exec_failure

    assert exec_failure(1, b"  \n", ["mkdir", "-p", "/x"]) == "exit code 1 from 'mkdir -p /x', no output"
    env = make_env(BUSYBOX_IMAGE, cwd="/bin/sh/work")  # under a file: mkdir fails
    with pytest.raises(SandboxError) as caught:
        env.start()
    message = str(caught.value)
    assert message.startswith("could not create /bin/sh/work in ")
    assert message.split(": ", 1)[1].strip()
