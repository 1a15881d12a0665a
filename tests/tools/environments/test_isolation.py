"""Isolation through the real CLI: under --sandbox=bwrap the file tools see only what the sandbox
sees (no escape through a host symlink), a row's cwd cannot make the host writable, and an
unisolated run as root says so at start."""

from __future__ import annotations

import json
import os
import shlex
import signal
import stat
import subprocess
import sys
import time
import shutil
import uuid

import pytest

from tests.conftest import REPO, read_jsonl, run_cli, write_jsonl

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed")


def _args(dataset, server, *extra):
    return [f"--dataset_file={dataset}", "--run_name=r", "--batch_size=4", "--distribution=terminal_only",
            f"--base_url={server.base_url}", "--model=m", "--api_key=x", *extra]


def _tool_results(row: dict) -> list[dict]:
    return [json.loads(t["value"].split("<tool_response>\n", 1)[1].rsplit("\n</tool_response>", 1)[0])["content"]
            for t in row["conversations"] if t["from"] == "tool"]


@needs_bwrap
def test_file_tools_resolve_paths_inside_the_sandbox_never_through_host_symlinks(model_server, tmp_path):
    host_secret = tmp_path / "host-only.txt"
    host_secret.write_text("HOST-ONLY-CONTENT\n")
    escape = tmp_path / f"escaped-{uuid.uuid4().hex[:8]}"
    prompt = "\n".join([
        '@tool terminal {"command": "ln -s / rootlink && echo linked"}',
        f'@tool read_file {json.dumps({"path": f"rootlink{host_secret}"})}',
        f'@tool write_file {json.dumps({"path": f"rootlink{escape}", "content": "escaped"})}',
        f'@tool write_file {json.dumps({"path": "rootlink/usr/abr-escape", "content": "escaped"})}',
        '@tool write_file {"path": "inside.txt", "content": "kept inside"}',
        '@tool read_file {"path": "inside.txt"}',
        "Try to escape through a symlink.",
    ])  # fmt: skip
    dataset = write_jsonl(tmp_path / "d.jsonl", [{"prompt": prompt}])
    proc = run_cli(_args(dataset, model_server, "--sandbox=bwrap"), tmp_path)
    assert proc.returncode == 0, proc.stderr
    (row,) = read_jsonl(tmp_path / "data" / "r" / "trajectories.jsonl")
    results = _tool_results(row)
    assert "linked" in results[0]["output"]
    assert "HOST-ONLY-CONTENT" not in json.dumps(results[1]) and "error" in results[1]  # the sandbox's /tmp is its own
    assert not escape.exists()  # written, if at all, into the sandbox's private /tmp
    assert "error" in results[3] and not os.path.exists("/usr/abr-escape")  # the host is read-only
    assert "kept inside" in json.dumps(results[5])  # ordinary files in the workdir still work


@needs_bwrap
def test_an_absolute_row_cwd_is_refused_under_bwrap_before_anything_is_spent(model_server, tmp_path):
    rows = [{"prompt": '@tool terminal {"command": "touch owned"}\nA.', "cwd": "sub/dir"},
            {"prompt": '@tool terminal {"command": "touch /owned"}\nB.', "cwd": "/"},
            {"prompt": "C.", "cwd": "../up"}]
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    proc = run_cli(_args(dataset, model_server, "--sandbox=bwrap"), tmp_path)
    assert proc.returncode == 1
    assert f"{dataset}:2:" in proc.stderr and f"{dataset}:3:" in proc.stderr and f"{dataset}:1:" not in proc.stderr
    assert "relative path" in proc.stderr
    assert not model_server.requests_for("@tool")  # nothing paid for

    # A relative cwd is a folder inside the sandbox's own workdir.
    dataset = write_jsonl(tmp_path / "d2.jsonl", [{"prompt": '@tool terminal {"command": "pwd; touch made"}\nD.',
                                                   "cwd": "sub/dir"}])
    proc = run_cli(_args(dataset, model_server, "--sandbox=bwrap", "--run_name=r2"), tmp_path)
    assert proc.returncode == 0, proc.stderr
    (row,) = read_jsonl(tmp_path / "data" / "r2" / "trajectories.jsonl")
    assert _tool_results(row)[0]["output"].strip().endswith("/sub/dir")
    assert not (tmp_path / "sub").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="the warning is for runs as root")
def test_root_without_sandbox_is_told_at_start(model_server, tmp_path):
    dataset = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "Hello."}])
    proc = run_cli(_args(dataset, model_server), tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "Running as root with --terminal_env=local and no sandbox" in proc.stdout
    assert "--sandbox=bwrap or --terminal_env=docker" in proc.stdout
    if shutil.which("bwrap"):
        proc = run_cli(_args(dataset, model_server, "--sandbox=bwrap", "--overwrite"), tmp_path)
        assert proc.returncode == 0, proc.stderr
        assert "Running as root" not in proc.stdout


@needs_bwrap
def test_the_environment_itself_refuses_an_absolute_cwd_under_bwrap(tmp_path):
    """Validation refuses such rows; the sandbox refuses them too (Ray nodes, library callers)."""
    from tools.environments.base import SandboxError
    from tools.environments.local import LocalConfig, LocalEnvironment

    for cwd in ("/", str(tmp_path), "a/../../b"):
        env = LocalEnvironment(LocalConfig(task_id="t", workdir_root=str(tmp_path), cwd=cwd, sandbox="bwrap"))
        with pytest.raises(SandboxError, match="relative path"):
            env.start()
        env.cleanup()
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing left behind


def _host_sockets(*folders: str) -> list[str]:
    found = []
    for folder in folders:
        for root, _dirs, files in os.walk(folder):
            found += [p for p in (os.path.join(root, f) for f in files) if stat.S_ISSOCK(os.lstat(p).st_mode)]
    return sorted(set(found))


@needs_bwrap
@pytest.mark.skipif(os.geteuid() != 0, reason="the runner's capabilities are root's")
def test_commands_in_the_sandbox_have_no_capabilities_and_cannot_remount_the_host(model_server, tmp_path):
    escape = f"/var/tmp/abr-escaped-{uuid.uuid4().hex[:8]}"  # on the host's /, outside the private /tmp
    remount = f"mount -o remount,bind,rw / && echo pwned > {escape} && echo WROTE_HOST_FILE"
    commands = [
        "grep -E '^Cap(Eff|Prm|Bnd)' /proc/self/status; hostname",
        remount,
        f"unshare -m sh -c '{remount}'",
        "echo 1 > /proc/sys/vm/drop_caches && echo WROTE_PROC_SYS; echo x > /proc/sys/kernel/core_pattern && echo WROTE_PROC_SYS",
        # A user and mount namespace of its own may be made (a tmpfs in it is its own affair), but
        # what the sandbox shows read-only stays so in it, and the host's / cannot be bound.
        "unshare -Urm sh -c 'mount -t tmpfs x /tmp && echo OWN_TMPFS; mount -o remount,rw /usr && echo REMOUNTED_USR; "
        "mount --bind / /tmp && ls /tmp/root >/dev/null && echo BOUND_HOST_ROOT'",
    ]
    prompt = "\n".join([*(f"@tool terminal {json.dumps({'command': c})}" for c in commands),
                        '@tool read_file {"path": "/proc/self/status"}', "Escape."])
    dataset = write_jsonl(tmp_path / "d.jsonl", [{"prompt": prompt}])
    try:
        proc = run_cli(_args(dataset, model_server, "--sandbox=bwrap"), tmp_path)
        assert proc.returncode == 0, proc.stderr
        (row,) = read_jsonl(tmp_path / "data" / "r" / "trajectories.jsonl")
        results = _tool_results(row)
        caps = results[0]["output"]
        for name in ("CapEff", "CapPrm", "CapBnd"):
            assert f"{name}:\t0000000000000000" in caps, caps
        assert os.uname().nodename not in caps.split("\n")  # its own UTS namespace
        assert "WROTE_HOST_FILE" not in json.dumps(results) and not os.path.exists(escape)
        assert "WROTE_PROC_SYS" not in results[3]["output"]
        assert "REMOUNTED_USR" not in results[4]["output"] and "BOUND_HOST_ROOT" not in results[4]["output"], results[4]
        assert "CapEff:\t0000000000000000" in results[5]["content"]  # the file tools drop them too
    finally:
        if os.path.exists(escape):
            os.remove(escape)


@needs_bwrap
@pytest.mark.skipif(not os.path.exists("/run/docker.sock"), reason="needs a running Docker engine")
def test_no_host_socket_is_reachable_from_the_sandbox(model_server, tmp_path):
    sockets = _host_sockets("/run", "/var/run")
    assert "/run/docker.sock" in sockets
    probe = ("import socket, sys\n"
             "for path in sys.argv[1:]:\n"
             "    try:\n"
             "        s = socket.socket(socket.AF_UNIX)\n"
             "        s.connect(path); print('CONNECTED', path)\n"
             "    except OSError as exc:\n"
             "        print('refused', path, exc.errno)\n")
    command = "python3 -c " + shlex.quote(probe) + " " + " ".join(map(shlex.quote, sockets))
    prompt = f"@tool terminal {json.dumps({'command': command})}\nTalk to the Docker engine."
    dataset = write_jsonl(tmp_path / "d.jsonl", [{"prompt": prompt}])
    proc = run_cli(_args(dataset, model_server, "--sandbox=bwrap"), tmp_path)
    assert proc.returncode == 0, proc.stderr
    (row,) = read_jsonl(tmp_path / "data" / "r" / "trajectories.jsonl")
    output = _tool_results(row)[0]["output"]
    assert "refused /run/docker.sock" in output and "CONNECTED" not in output, output


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


def test_commands_that_drop_the_session_marker_do_not_outlive_the_run(model_server, tmp_path):
    seconds = [f"30{i}.{uuid.uuid4().int % 10**6}" for i in (1, 2)]  # unique, so only ours are counted
    commands = [f"env -i setsid sleep {seconds[0]} >/dev/null 2>&1 &",
                f"unset ABR_TASK_ID ABR_LOCAL_SESSION ABR_EXEC_ID; setsid sleep {seconds[1]} >/dev/null 2>&1 &"]
    prompt = "\n".join([*(f"@tool terminal {json.dumps({'command': c})}" for c in commands), "Detach."])
    dataset = write_jsonl(tmp_path / "d.jsonl", [{"prompt": prompt}])
    try:
        proc = run_cli(_args(dataset, model_server), tmp_path)
        assert proc.returncode == 0, proc.stderr
        deadline = time.monotonic() + 5
        while any(_alive_with_argument(s) for s in seconds) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [s for s in seconds if _alive_with_argument(s)]
    finally:
        for s in seconds:
            for pid in _alive_with_argument(s):
                os.kill(pid, signal.SIGKILL)


def test_a_session_ending_kills_only_its_own_orphans(tmp_path):
    """In a subreaper (as a worker is), session B's cleanup kills what B detached, never the
    background process session A left running (reparented too, but still carrying A's marker)."""
    seconds = [f"30{i}.{uuid.uuid4().int % 10**6}" for i in (3, 4)]
    script = f"""
import os, sys
from tools.environments.base import become_subreaper
from tools.environments.local import LocalConfig, LocalEnvironment
from tests.conftest import wait_for
from tests.tools.environments.test_isolation import _alive_with_argument as alive
become_subreaper()
a, b = (LocalEnvironment(LocalConfig(task_id=t, workdir_root={str(tmp_path)!r})) for t in "ab")
a.start(); b.start()
a.execute("sleep {seconds[0]} >/dev/null 2>&1 &")
b.execute("env -i setsid sleep {seconds[1]} >/dev/null 2>&1 &")
# A command's background process may not have exec'd its sleep yet when execute() returns.
assert wait_for(lambda: alive("{seconds[0]}") and alive("{seconds[1]}"), 10)
b.cleanup()
assert alive("{seconds[0]}") and not alive("{seconds[1]}"), "after B"
assert a.execute("echo still here").output.strip() == "still here"
a.cleanup()
assert not alive("{seconds[0]}"), "after A"
print("OK")
"""
    try:
        proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
        assert proc.stdout.strip() == "OK", proc.stderr
    finally:
        for s in seconds:
            for pid in _alive_with_argument(s):
                os.kill(pid, signal.SIGKILL)


@needs_bwrap
@pytest.mark.skipif(not os.access("/opt", os.W_OK), reason="needs a folder of its own in /opt")
def test_a_tmpdir_inside_a_folder_the_sandbox_shows_read_only_still_works(model_server, tmp_path):
    # /opt is shown read-only in the sandbox: the session's 0700 folder must not show through it.
    root = f"/opt/abr-tmp-{uuid.uuid4().hex[:8]}"
    os.makedirs(root)
    try:
        dataset = write_jsonl(tmp_path / "d.jsonl", [{"prompt": _prompt_of("echo inside > f && cat f && pwd")}])
        proc = run_cli(_args(dataset, model_server, "--sandbox=bwrap"), tmp_path, env={"TMPDIR": root})
        assert proc.returncode == 0, proc.stdout + proc.stderr
        (row,) = read_jsonl(tmp_path / "data" / "r" / "trajectories.jsonl")
        (result,) = _tool_results(row)
        assert result["exit_code"] == 0 and result["output"].startswith(f"inside\n{root}/"), result
        assert os.listdir(root) == []  # the session's folder is removed
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _prompt_of(command: str) -> str:
    return f"@tool terminal {json.dumps({'command': command})}\nRun it."


def _alive_mentioning(text: str) -> list[int]:
    """Processes whose command line holds `text` anywhere (a python -c script, a sleep's argument)."""
    pids = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                if text.encode() in f.read() and int(name) != os.getpid():
                    pids.append(int(name))
        except OSError:
            pass
    return pids


ESCAPES = {  # each leaves a process outside the command's group, with its ancestor line broken
    "setsid": "setsid sleep {s} >/dev/null 2>&1 &",
    "a group of its own, parent gone": ("(python3 -c 'import os, time; os.setpgid(0, 0); time.sleep({s})' "
                                        ">/dev/null 2>&1 &) ; true"),
    "two levels, middle gone": "sh -c 'setsid sh -c \"sleep {s}\" >/dev/null 2>&1 & exit 0' &",
    "a subreaper of its own": ("python3 -c 'import ctypes, os, subprocess, time; os.setsid(); "
                               "ctypes.CDLL(None).prctl(36, 1, 0, 0, 0); "
                               "subprocess.run([\"sh\", \"-c\", \"setsid sleep {s} &\"]); time.sleep({s})' "
                               ">/dev/null 2>&1 &"),
    "still in its group": "sleep {s} >/dev/null 2>&1 &",
}


@pytest.mark.parametrize("escape", sorted(ESCAPES))
def test_a_cleanup_without_a_sweep_still_kills_whatever_a_command_left(tmp_path, escape):
    """The cleanup skips reading the process table only when nothing can be left (every command's
    group gone, no unexplained child of the subreaper): each way out of the group is still found."""
    s = f"30{len(escape)}.{uuid.uuid4().int % 10**6}"
    script = f"""
import time
from tools.environments import base
from tools.environments.local import LocalConfig, LocalEnvironment
from tests.conftest import wait_for
from tests.tools.environments.test_isolation import _alive_mentioning as alive
base.become_subreaper()
env = LocalEnvironment(LocalConfig(task_id="t", workdir_root={str(tmp_path)!r}))
env.start()
env.execute({ESCAPES[escape].format(s=s)!r})
assert wait_for(lambda: alive("{s}"), 10), "never started"
time.sleep(0.3)  # the middle processes are gone
assert not env.quick_cleanup(), "no quick cleanup with a process left"
env.cleanup()
assert wait_for(lambda: not alive("{s}"), 5), "left alive"
clean = LocalEnvironment(LocalConfig(task_id="u", workdir_root={str(tmp_path)!r}))
clean.start()
assert clean.execute("echo hi; (sleep 0.1; true) & wait").output == "hi\\n"
def no_table():
    raise AssertionError("the process table was read")
base.process_table = no_table
clean.cleanup()
# The same in the event loop, the way a worker ends a session: an empty workdir goes with one rmdir.
import asyncio, os
quick = LocalEnvironment(LocalConfig(task_id="v", workdir_root={str(tmp_path)!r}))
quick.start()
assert asyncio.run(quick.run("echo hi")).output == "hi\\n"
assert quick.quick_cleanup() and not os.path.exists(quick.workdir)
full = LocalEnvironment(LocalConfig(task_id="w", workdir_root={str(tmp_path)!r}))
full.start()
asyncio.run(full.run("echo data > f"))
assert not full.quick_cleanup() and os.path.exists(full.workdir + "/f"), "a workdir with files: rmtree in a thread"
full.cleanup()
assert not os.path.exists(full.workdir)
print("OK")
"""
    try:
        proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
        assert proc.stdout.strip() == "OK", proc.stderr
    finally:
        for pid in _alive_mentioning(s):
            os.kill(pid, signal.SIGKILL)


# What a command can make of its own working directory (no sandbox): whatever it is at the end,
# the clean-up removes that entry alone; it never follows a symlink, and never changes the mode of
# the folder the working directories are made in (TMPDIR: /tmp, 1777, by default).
WORKDIR_REPLACED = {
    "symlink": 'W=$PWD; cd /; rm -rf "$W"; ln -s {outside} "$W"',
    "file": 'W=$PWD; cd /; rm -rf "$W"; echo hello > "$W"',
    "fifo": 'W=$PWD; cd /; rm -rf "$W"; mkfifo "$W"',
    "removed": 'W=$PWD; cd /; rm -rf "$W"',
    "closed": 'touch f; chmod 000 "$PWD"',
    "locked inside": "mkdir -p a/b && touch a/b/f && chmod 0 a/b a",
    "deeper than a recursion": "python3 -c \"import os; [(os.mkdir('d'), os.chdir('d')) for _ in range(3000)]\"",
}


def _outside_and_shared_root(tmp_path):
    """A folder no session owns (0755, a file in it), and a folder to make workdirs in, 1777 as /tmp."""
    outside = tmp_path / "outside"
    outside.mkdir(mode=0o755)
    (outside / "kept.txt").write_text("not the session's\n")
    root = tmp_path / "workdirs"
    root.mkdir()
    root.chmod(0o1777)
    return outside, root


def _untouched(outside, root) -> bool:
    return (stat.S_IMODE(root.lstat().st_mode) == 0o1777 and stat.S_IMODE(outside.lstat().st_mode) == 0o755
            and (outside / "kept.txt").read_text() == "not the session's\n")


def test_whatever_a_command_makes_of_its_workdir_only_that_entry_is_removed(model_server, tmp_path):
    outside, workdirs = _outside_and_shared_root(tmp_path)
    rows = [{"prompt": _prompt_of(c.format(outside=shlex.quote(str(outside))))} for c in WORKDIR_REPLACED.values()]
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    proc = run_cli(_args(dataset, model_server), tmp_path, env={"TMPDIR": str(workdirs)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert len(read_jsonl(tmp_path / "data" / "r" / "trajectories.jsonl")) == len(rows)
    assert sorted(p.name for p in workdirs.iterdir()) == [] and _untouched(outside, workdirs)


def test_leftover_workdirs_of_a_killed_run_are_unlinked_not_followed(tmp_path):
    from tools.environments.local import remove_workdirs

    outside, root = _outside_and_shared_root(tmp_path)
    (root / "run1-p1-a1-x").symlink_to(outside)
    (root / "run1-p2-a1-y").write_text("a file where a folder was")
    locked = root / "run1-p3-a1-z"
    (locked / "in").mkdir(parents=True)
    locked.chmod(0)
    (root / "other-p1").mkdir()  # not this run's
    assert remove_workdirs(str(root), "run1-p") == 3
    assert sorted(p.name for p in root.iterdir()) == ["other-p1"] and _untouched(outside, root)
