"""The local backend with real subprocesses: timeouts, output, working directories, cleanup, bwrap."""

from __future__ import annotations

import asyncio
import os
import shutil
import stat
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from tools.environments.base import SandboxError
from tools.environments.local import LocalConfig, LocalEnvironment

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")


@pytest.fixture
def make_env(tmp_path):
    envs = []

    def make(**overrides):
        config = {"task_id": "task-1", "workdir_root": str(tmp_path / "work"), **overrides}
        env = LocalEnvironment(LocalConfig(**config))
        env.start()
        envs.append(env)
        return env

    yield make
    for env in envs:
        env.cleanup()


@pytest.fixture(params=["execute() in a thread", "run() in the event loop"])
def make_env_both(request, make_env):
    """make_env, whose execute() is called as it is, or as run() from an event loop (the tools' way)."""

    def make(**overrides):
        env = make_env(**overrides)
        if request.param.startswith("run()"):
            env.execute = lambda command, **kw: asyncio.run(env.run(command, **kw))
        return env

    return make


def alive(pid: int) -> bool:
    """True if the process exists and is not a zombie (this container's init may not reap them)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def session_pids(env: LocalEnvironment) -> list[int]:
    marker = f"ABR_LOCAL_SESSION={env._marker}".encode()
    found = []
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if marker in f.read().split(b"\0"):
                    found.append(int(name))
        except (OSError, ValueError):
            pass
    return found


def test_output_is_interleaved_and_exit_code_kept(make_env_both):
    env = make_env_both()
    result = env.execute("echo one; echo two >&2; echo three; exit 3")
    assert result.output == "one\ntwo\nthree\n"
    assert result.exit_code == 3 and not result.timed_out
    assert env.execute("kill -9 $$").exit_code == 137  # killed by a signal: 128 + 9, as in a shell


def test_timeout_kills_the_command_and_its_children(make_env_both):
    env = make_env_both()
    began = time.monotonic()
    result = env.execute("echo started; sh -c 'sleep 30' & echo $! > child.pid; sleep 30", timeout=1)
    assert time.monotonic() - began < 5
    assert result.exit_code == 124 and result.timed_out
    assert "started" in result.output  # partial output survives the kill
    child = int(env.read_file("child.pid"))
    deadline = time.monotonic() + 3
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(child)


def test_default_timeout_comes_from_the_config(make_env_both):
    env = make_env_both(command_timeout=0.5)
    assert env.execute("sleep 10").exit_code == 124


def test_long_output_is_truncated_keeping_head_and_tail(make_env_both):
    env = make_env_both(max_output_chars=1000)
    result = env.execute("seq 1 100000")
    assert len(result.output) < 1200
    assert result.output.startswith("1\n2\n") and result.output.endswith("99999\n100000\n")
    assert "omitted" in result.output


def test_undecodable_output_is_replaced(make_env_both):
    assert "\ufffd" in make_env_both().execute(r"printf 'ok \377\n'").output


def test_cwd_argument(make_env_both):
    env = make_env_both()
    env.write_file("sub/marker.txt", b"here")
    assert env.execute("cat marker.txt", cwd="sub").output == "here"
    assert env.execute("pwd", cwd=env.workdir + "/sub").output.strip() == env.workdir + "/sub"
    missing = env.execute("pwd", cwd="nope")
    assert missing.exit_code != 0 and "nope" in missing.output


def test_workdir_is_named_after_the_task_and_removed(make_env, tmp_path):
    env = make_env(task_id="row 7/a")
    assert os.path.basename(env.workdir).startswith("row_7_a-")
    assert os.path.dirname(env.workdir) == str(tmp_path / "work")
    assert env.execute("pwd").output.strip() == env.workdir
    env.execute("mkdir -p locked/inner && touch locked/inner/f && chmod 500 locked/inner locked")
    env.cleanup()
    assert not os.path.exists(env.workdir)
    env.cleanup()  # twice is fine


def test_keep_workdir(make_env):
    env = make_env(keep_workdirs=True)
    env.write_file("result.txt", b"kept")
    env.cleanup()
    assert open(os.path.join(env.workdir, "result.txt")).read() == "kept"


def test_row_cwd_is_used_and_never_removed(make_env, tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "README").write_text("hello")
    env = make_env(cwd=str(repo))
    assert env.workdir == str(repo)
    assert env.execute("cat README").output == "hello"
    env.cleanup()
    assert (repo / "README").read_text() == "hello"


def test_missing_row_cwd_is_a_sandbox_error(tmp_path):
    env = LocalEnvironment(LocalConfig(task_id="t", cwd=str(tmp_path / "absent")))
    with pytest.raises(SandboxError, match="does not exist"):
        env.start()
    env.cleanup()  # safe after a failed start


def test_read_and_write_files(make_env):
    env = make_env()
    env.write_file("a/b/c.txt", "héllo\n".encode())
    assert env.read_file("a/b/c.txt") == "héllo\n".encode()
    assert env.read_file(os.path.join(env.workdir, "a/b/c.txt")).decode() == "héllo\n"
    assert env.execute("cat a/b/c.txt").output == "héllo\n"
    with pytest.raises(FileNotFoundError):
        env.read_file("missing.txt")


def test_cleanup_kills_background_processes(make_env_both):
    env = make_env_both()
    plain = int(env.execute("sleep 60 >/dev/null 2>&1 & echo $!").output)
    detached = int(env.execute("setsid sleep 61 >/dev/null 2>&1 & echo $!").output)  # left our group
    assert alive(plain) and alive(detached)
    env.cleanup()
    assert not alive(plain) and not alive(detached)


def test_background_child_does_not_hold_the_result(make_env_both):
    began = time.monotonic()
    result = make_env_both().execute("sleep 20 & echo quick")  # the child keeps stdout open
    assert result.output == "quick\n" and time.monotonic() - began < 5


@pytest.mark.parametrize("pidfds", ["with pidfds", "on a kernel without pidfds"])
def test_output_exit_codes_timeouts_and_held_pipes_with_and_without_pidfds(make_env_both, monkeypatch, pidfds):
    """A command's output and exit are read in one thread: by polling a pidfd of the process with
    its pipe, or on an older kernel (pidfd_open failing) by looking at the process meanwhile."""
    if pidfds != "with pidfds":
        def no_pidfds(pid):
            raise OSError(38, "Function not implemented")

        monkeypatch.setattr(os, "pidfd_open", no_pidfds)
    env = make_env_both()
    assert [env.execute(f"echo {i}").output for i in range(20)] == [f"{i}\n" for i in range(20)]
    began = time.monotonic()
    result = env.execute("sleep 20 & echo quick; exit 4")  # the child keeps the pipe open
    assert (result.output, result.exit_code, result.timed_out) == ("quick\n", 4, False)
    result = env.execute("exec >&-; sleep 0.3; exit 3")  # the pipe closes long before the exit
    assert (result.output, result.exit_code) == ("", 3)
    result = env.execute("echo a; sleep 30", timeout=0.5)
    assert (result.output, result.exit_code, result.timed_out) == ("a\n", 124, True)
    assert time.monotonic() - began < 8
    big = env.execute("head -c 3000000 /dev/zero | tr '\\0' x; echo; echo end").output
    assert big.endswith("end\n") and "omitted" in big


@pytest.mark.parametrize("timeout", [3e6, 1e10, float("inf")])
def test_a_timeout_of_days_or_more_is_a_timeout_that_does_not_come(make_env_both, timeout):
    """poll() takes at most INT_MAX milliseconds (24.8 days): a longer timeout waits in steps."""
    result = make_env_both().execute("sleep 0.2; echo hi", timeout=timeout)
    assert (result.output, result.exit_code, result.timed_out) == ("hi\n", 0, False)


def test_secrets_are_not_passed_to_commands(make_env_both, monkeypatch):
    monkeypatch.setenv("OPENROUTER_API_KEY", "sk-very-secret")
    monkeypatch.setenv("ABR_HARMLESS", "visible")
    output = make_env_both().execute("env").output
    assert "sk-very-secret" not in output and "ABR_HARMLESS=visible" in output


def test_unknown_sandbox_is_refused(tmp_path):
    """By the option's own check (the config shares it with --sandbox), before anything starts."""
    with pytest.raises(ValueError, match="bwrap"):
        LocalEnvironment(LocalConfig(task_id="t", workdir_root=str(tmp_path), sandbox="firejail")).start()


def test_only_a_start_without_a_sandbox_is_called_in_the_event_loop(tmp_path):
    """Without bwrap, start() makes a directory (the session calls it where it runs, no thread);
    with it, start() launches the sandbox's process and goes to a thread (runner/execution/worker.py)."""
    plain = LocalEnvironment(LocalConfig(task_id="t", workdir_root=str(tmp_path)))
    sandboxed = LocalEnvironment(LocalConfig(task_id="t", workdir_root=str(tmp_path), sandbox="bwrap"))
    assert plain.quick_start and not sandboxed.quick_start
    try:
        plain.start()
        assert os.path.isdir(plain.workdir) and plain.workdir.startswith(str(tmp_path))
    finally:
        plain.cleanup()


def test_missing_bwrap_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setattr("tools.environments.local.shutil.which", lambda name: None)
    env = LocalEnvironment(LocalConfig(task_id="t", workdir_root=str(tmp_path), sandbox="bwrap"))
    with pytest.raises(SandboxError, match="apt-get install bubblewrap"):
        env.start()


# ------------------------------------------------------------------------------------------- bwrap


@needs_bwrap
def test_bwrap_host_is_read_only_and_workdir_writable(make_env, tmp_path):
    (tmp_path / "host.txt").write_text("host")
    env = make_env(sandbox="bwrap")
    marker = "/etc/abr-sandbox-probe"
    try:
        denied = env.execute(f"touch {marker}")
        assert denied.exit_code != 0 and "Read-only" in denied.output
        assert not os.path.exists(marker)
    finally:
        if os.path.exists(marker):
            os.remove(marker)
    assert env.execute("echo made > out.txt && cat out.txt").output == "made\n"
    assert open(os.path.join(env.workdir, "out.txt")).read() == "made\n"
    # /tmp is private: the host's /tmp (where tmp_path lives) is not visible.
    assert env.execute(f"cat {tmp_path}/host.txt").exit_code != 0


@needs_bwrap
def test_bwrap_private_tmp_persists_between_commands(make_env):
    env = make_env(sandbox="bwrap")
    name = f"/tmp/abr-private-{os.getpid()}"
    assert env.execute(f"echo kept > {name}").exit_code == 0
    assert env.execute(f"cat {name}").output == "kept\n"
    assert env.read_file(name) == b"kept\n"  # file access sees the sandbox's /tmp too
    env.write_file(f"{name}-2", b"from host side")
    assert env.execute(f"cat {name}-2").output == "from host side"
    assert not os.path.exists(name)
    with pytest.raises(OSError):
        env.write_file("/etc/abr-sandbox-write", b"x")


@needs_bwrap
def test_bwrap_has_no_network_and_its_own_pid_namespace(make_env):
    env = make_env(sandbox="bwrap")
    interfaces = env.execute("tail -n +3 /proc/net/dev | cut -d: -f1").output.split()
    assert interfaces == ["lo"]
    assert "bwrap" in env.execute("tr '\\0' ' ' < /proc/1/cmdline").output
    count = int(env.execute("ls /proc | grep -c '^[0-9]'").output)
    assert count < 10  # only the sandbox's own processes are visible


@needs_bwrap
def test_bwrap_timeout_and_cleanup_kill_everything(make_env):
    env = make_env(sandbox="bwrap")
    began = time.monotonic()
    result = env.execute("sleep 30 & sleep 30", timeout=1)
    assert result.exit_code == 124 and time.monotonic() - began < 5
    survivors = env.execute("cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' '").output
    assert "sleep 30" not in survivors
    env.execute("sleep 60 >/dev/null 2>&1 &")
    assert "sleep 60" in env.execute("cat /proc/[0-9]*/cmdline | tr '\\0' ' '").output  # it survived
    assert session_pids(env)
    env.cleanup()
    deadline = time.monotonic() + 3
    while session_pids(env) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert session_pids(env) == []
    assert not os.path.exists(env.workdir)


@needs_bwrap
def test_bwrap_sandbox_death_is_a_sandbox_error(make_env):
    env = make_env(sandbox="bwrap")
    os.kill(env._sandbox_pid, 9)  # the sandbox's init: the kernel ends everything inside
    env._holder.wait(timeout=5)
    with pytest.raises(SandboxError, match="died"):
        env.execute("true")


def test_set_id_bits_are_cleared_inside_a_folder_closed_to_its_owner():
    # What a sandboxed command of a runner that is not root leaves: a setuid file (its own uid) in
    # a folder it made mode 000. The runner owns both, so it must still reach and clear the file.
    from tools.environments.tree import clear_set_id_bits

    uid = 65534 if os.geteuid() == 0 else os.geteuid()
    top = Path(tempfile.mkdtemp(prefix="abr-kept-")) / "kept"  # a parent the owner can traverse
    top.parent.chmod(0o755)
    closed = top / "closed" / "deeper"
    closed.mkdir(parents=True)
    planted = closed / "rootsh"
    planted.write_bytes(b"#!/bin/sh\n")
    planted.chmod(0o4755)
    for path in (top, top / "closed", closed, planted):
        os.chown(path, uid, uid) if os.geteuid() == 0 else None
    closed.chmod(0o2000)
    (top / "closed").chmod(0)
    pid = os.fork()
    if pid == 0:  # the runner, as the files' owner (not root, which any mode lets through)
        try:
            if os.geteuid() == 0:
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
            clear_set_id_bits(str(top))
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    (top / "closed").chmod(0o700)
    try:
        assert not os.stat(closed).st_mode & (stat.S_ISUID | stat.S_ISGID)
        assert not os.stat(planted).st_mode & (stat.S_ISUID | stat.S_ISGID)
    finally:
        shutil.rmtree(top.parent)


def test_kept_workdirs_of_a_killed_worker_are_cleared_of_set_id_bits(tmp_path):
    # A worker killed with SIGKILL never ran its sessions' cleanup: the next clean-up of its tasks
    # does what that cleanup would have done to a kept sandbox workdir.
    from types import SimpleNamespace

    from tools.environments.local import workdir_prefix

    task = "run1-p3-a1"
    work = tmp_path / (workdir_prefix(task) + "abc123") / "work"
    work.mkdir(parents=True)
    planted = work / "rootsh"
    planted.write_bytes(b"#!/bin/sh\n")
    planted.chmod(0o4755)
    other = tmp_path / (workdir_prefix("run1-p4-a1") + "def456")
    other.mkdir()
    untouched = other / "theirs"
    untouched.write_bytes(b"")
    untouched.chmod(0o4755)
    settings = SimpleNamespace(keep_workdirs=True, sandbox="bwrap", workdir_root=str(tmp_path))
    LocalEnvironment.clean_task_leftovers(settings, [task], log=print)
    assert planted.exists() and not planted.stat().st_mode & stat.S_ISUID
    assert untouched.stat().st_mode & stat.S_ISUID  # another task's folder is not this clean-up's


def test_set_id_bits_are_cleared_deeper_than_a_path_can_name(tmp_path):
    # A command can nest folders until their full path is longer than PATH_MAX (4,096 bytes):
    # operations on full paths then fail with ENAMETOOLONG, which must not leave a setuid file.
    from tools.environments.tree import clear_set_id_bits

    name = "d" * 250
    fds = [os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)]
    for _ in range(20):
        os.mkdir(name, dir_fd=fds[-1])
        fds.append(os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fds[-1]))
    planted = os.open("sh", os.O_WRONLY | os.O_CREAT, 0o755, dir_fd=fds[-1])
    os.fchmod(planted, 0o6755)
    os.close(planted)
    os.mkdir("shared", dir_fd=fds[-1])
    os.chmod("shared", 0o2777, dir_fd=fds[-1])
    try:
        clear_set_id_bits(str(tmp_path))
        for leaf in ("sh", "shared"):
            mode = os.stat(leaf, dir_fd=fds[-1]).st_mode
            assert not mode & (stat.S_ISUID | stat.S_ISGID), (leaf, oct(mode))
    finally:
        for fd in fds:
            os.close(fd)
        shutil.rmtree(tmp_path, ignore_errors=True)


def _deep_tree(top: Path, depth: int, leaf: str = "f") -> list[int]:
    """Folders `depth` deep under `top`, made by descriptor (no path names them whole); returns the
    descriptors of every level, the deepest last (closed by the caller)."""
    fds = [os.open(top, os.O_RDONLY | os.O_DIRECTORY)]
    for _ in range(depth):
        os.mkdir("d", dir_fd=fds[-1])
        fds.append(os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fds[-1]))
    os.close(os.open(leaf, os.O_WRONLY | os.O_CREAT, 0o755, dir_fd=fds[-1]))
    return fds


def test_a_tree_deeper_than_the_interpreter_can_recurse_is_removed_and_cleared(tmp_path):
    """shutil.rmtree and os.fwalk recurse: a command's 3,000 nested folders made them raise
    RecursionError, which left the folder (and a setuid file in it) and failed every --resume."""
    from tools.environments.tree import clear_set_id_bits, remove_tree as remove_workdir

    top = tmp_path / "kept"
    top.mkdir()
    fds = _deep_tree(top, 3000, leaf="sh")
    os.chmod("sh", 0o4755, dir_fd=fds[-1])
    try:
        assert clear_set_id_bits(str(top)) is True
        assert not os.stat("sh", dir_fd=fds[-1]).st_mode & stat.S_ISUID
        assert remove_workdir(str(top)) is True
        assert not top.exists()
    finally:
        for fd in fds:
            os.close(fd)


def test_the_kept_folder_itself_is_cleared_of_set_id_bits(tmp_path):
    from tools.environments.tree import clear_set_id_bits

    top = tmp_path / "work"
    top.mkdir()
    top.chmod(0o2755)  # `chmod g+s .` in the sandbox
    clear_set_id_bits(str(top))
    assert stat.S_IMODE(top.stat().st_mode) == 0o755


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting needs root")
def test_the_removal_never_goes_into_a_mount_point_a_command_made(tmp_path):
    from tools.environments.tree import remove_tree as remove_workdir

    decoy = tmp_path / "decoy"
    (decoy / "sub").mkdir(parents=True)
    (decoy / "keep.txt").write_text("mine")
    decoy.chmod(0o755)
    top = tmp_path / "session"
    (top / "m").mkdir(parents=True)
    (top / "other.txt").write_text("the session's")
    subprocess.run(["mount", "--bind", str(decoy), str(top / "m")], check=True)
    try:
        assert remove_workdir(str(top)) is False  # the mount point (and the folders above it) stay
        assert (decoy / "keep.txt").read_text() == "mine" and (decoy / "sub").is_dir()
        assert stat.S_IMODE(decoy.stat().st_mode) == 0o755
        assert not (top / "other.txt").exists()
    finally:
        subprocess.run(["umount", "-l", str(top / "m")], check=False)


@pytest.mark.skipif(os.geteuid() != 0, reason="planting an entry of another user needs root")
def test_leftovers_of_another_user_named_like_the_run_are_not_touched(tmp_path):
    """Anyone can read a run id from its workdirs' names in /tmp and plant an entry so named: the
    runner removes only what it owns."""
    from tools.environments.local import remove_workdirs

    root = tmp_path / "shared"
    root.mkdir()
    root.chmod(0o1777)
    planted = root / "run1-p9-a1-planted"
    (planted / "inner").mkdir(parents=True)
    for path in (planted, planted / "inner"):
        os.chown(path, 65534, 65534)
    ours = root / "run1-p1-a1-ours"
    ours.mkdir()
    assert remove_workdirs(str(root), "run1-p") == 1
    assert planted.is_dir() and (planted / "inner").is_dir() and not ours.exists()
