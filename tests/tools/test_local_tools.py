"""The terminal and file tools against a real local environment (and busybox, when it is installed)."""

from __future__ import annotations

import asyncio
import inspect
import os
import shutil
import time

import pytest

from tools import file_tools, terminal_tool
from tools.environments.local import LocalConfig, LocalEnvironment
from tools.registry import ToolContext
from tools.settings import ToolSettings

HANDLERS = {spec.name: spec.handler for spec in terminal_tool.TOOLS + file_tools.TOOLS}


@pytest.fixture
def ctx(tmp_path):
    env = LocalEnvironment(LocalConfig(task_id="tools", workdir_root=str(tmp_path)))
    env.start()
    context = ToolContext(env=env, settings=ToolSettings(command_timeout=20), model=None, task_id="tools")
    yield context
    run_cleanups(context)
    env.cleanup()


def call(ctx: ToolContext, tool: str, **args) -> dict:
    return asyncio.run(HANDLERS[tool](args, ctx))


def run_cleanups(ctx: ToolContext) -> None:
    for cleanup in reversed(ctx.cleanups):
        result = cleanup()
        if inspect.isawaitable(result):
            asyncio.run(result)
    ctx.cleanups.clear()


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def write(ctx: ToolContext, path: str, text: str) -> None:
    ctx.env.write_file(path, text.encode())


def read(ctx: ToolContext, path: str) -> str:
    return ctx.env.read_file(path).decode()


def test_schemas_keep_the_reference_names():
    by_name = {spec.name: spec for spec in terminal_tool.TOOLS + file_tools.TOOLS}
    assert set(by_name) == {"terminal", "process", "read_file", "write_file", "patch", "search_files"}
    assert by_name["terminal"].parameters["required"] == ["command"]
    assert by_name["process"].parameters["properties"]["action"]["enum"] == [
        "list", "poll", "log", "wait", "kill", "write", "submit", "close"
    ]  # fmt: skip
    assert by_name["patch"].parameters["properties"]["mode"]["enum"] == ["replace", "patch"]
    assert by_name["search_files"].parameters["properties"]["output_mode"]["enum"] == ["content", "files_only", "count"]
    assert {spec.toolset for spec in terminal_tool.TOOLS} == {"terminal"}
    assert {spec.toolset for spec in file_tools.TOOLS} == {"file"}


# ---------------------------------------------------------------------------------------- terminal


def test_terminal_runs_commands(ctx):
    assert call(ctx, "terminal", command="echo hi") == {"output": "hi\n", "exit_code": 0}
    failed = call(ctx, "terminal", command="echo oops >&2; exit 4")
    assert failed == {"output": "oops\n", "exit_code": 4}  # a normal result, not an error
    os.makedirs(os.path.join(ctx.env.workdir, "sub"))
    assert call(ctx, "terminal", command="pwd", workdir="sub")["output"].strip().endswith("/sub")


def test_terminal_timeout(ctx):
    began = time.monotonic()
    result = call(ctx, "terminal", command="echo partial; sleep 30", timeout=1)
    assert time.monotonic() - began < 5
    assert result["exit_code"] == 124 and "partial" in result["output"] and "timed out" in result["note"]


def test_terminal_invalid_arguments(ctx):
    assert "error" in call(ctx, "terminal", command="")
    assert "error" in call(ctx, "terminal", command="true", timeout=-1)
    sid = call(ctx, "terminal", command="sleep 30", background=True)["session_id"]
    for endless in (float("nan"), float("inf"), 10**400):  # arguments handed over as an object, not as JSON text
        assert "positive number" in call(ctx, "terminal", command="touch ran", timeout=endless)["error"]
        assert "positive number" in call(ctx, "process", action="wait", session_id=sid, timeout=endless)["error"]
    assert not os.path.exists(os.path.join(ctx.env.workdir, "ran"))
    call(ctx, "process", action="kill", session_id=sid)
    assert "error" in call(ctx, "terminal", command="true", background=True, watch_patterns="x")


def test_background_lifecycle(ctx):
    started = call(ctx, "terminal", command="i=0; while :; do echo tick $i; i=$((i+1)); sleep 0.1; done",
                   background=True, watch_patterns=["tick 5"])  # fmt: skip
    sid, pid = started["session_id"], started["pid"]
    assert started["status"] == "running" and alive(pid)
    assert call(ctx, "process", action="poll", session_id=sid)["status"] == "running"

    waited = call(ctx, "process", action="wait", session_id=sid, timeout=10)
    assert waited["matched_pattern"] == "tick 5" and waited["status"] == "running"
    log = call(ctx, "process", action="log", session_id=sid, offset=2, limit=3)
    assert log["output"] == "tick 2\ntick 3\ntick 4\n" and log["lines"] == 3 and log["total_lines"] >= 6
    tail = call(ctx, "process", action="log", session_id=sid, limit=1)
    assert tail["offset"] == tail["total_lines"] - 1 and tail["output"].startswith("tick ")

    listed = call(ctx, "process", action="list")["processes"]
    assert [p["session_id"] for p in listed] == [sid]
    killed = call(ctx, "process", action="kill", session_id=sid)
    assert killed["status"] == "killed"
    deadline = time.monotonic() + 3
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(pid)
    assert call(ctx, "process", action="poll", session_id=sid)["status"] == "killed"
    assert call(ctx, "process", action="close", session_id=sid) == {"session_id": sid, "closed": True, "killed": False}
    assert "error" in call(ctx, "process", action="poll", session_id=sid)


def test_background_exit_code_and_stdin(ctx):
    sid = call(ctx, "terminal", command="read line; echo got:$line; exit 7", background=True)["session_id"]
    assert call(ctx, "process", action="submit", session_id=sid, data="hello") == {
        "session_id": sid,
        "bytes_written": 6,
    }
    waited = call(ctx, "process", action="wait", session_id=sid, timeout=10)
    assert waited["status"] == "exited" and waited["exit_code"] == 7
    assert "got:hello" in waited["recent_output"]
    refused = call(ctx, "process", action="write", session_id=sid, data="late")
    assert "not running" in refused["error"]


def test_notify_on_complete_reports_in_a_later_result(ctx):
    sid = call(ctx, "terminal", command="sleep 0.3; exit 3", background=True, notify_on_complete=True)["session_id"]
    time.sleep(1)
    later = call(ctx, "terminal", command="echo next")
    assert later["completed_background_processes"][0]["session_id"] == sid
    assert later["completed_background_processes"][0]["exit_code"] == 3
    assert "completed_background_processes" not in call(ctx, "terminal", command="echo again")


def test_process_errors(ctx):
    assert "error" in call(ctx, "process", action="explode")
    assert "unknown session_id" in call(ctx, "process", action="poll", session_id="proc_nope")["error"]


def test_cleanup_kills_background_processes(ctx):
    pid = call(ctx, "terminal", command="sleep 60", background=True)["pid"]
    assert alive(pid)
    run_cleanups(ctx)
    deadline = time.monotonic() + 3
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(pid)


# ------------------------------------------------------------------------------------- file tools


def test_read_file(ctx):
    write(ctx, "lines.txt", "".join(f"line {n}\n" for n in range(1, 11)))
    result = call(ctx, "read_file", path="lines.txt", offset=3, limit=2)
    assert result["content"] == "     3\tline 3\n     4\tline 4"
    assert result["total_lines"] == 10 and result["last_line"] == 4 and "offset=5" in result["note"]
    assert call(ctx, "read_file", path="lines.txt")["last_line"] == 10


def test_read_file_errors(ctx):
    assert "not found" in call(ctx, "read_file", path="missing.txt")["error"]
    ctx.env.write_file("blob.bin", b"\x00\x01\x02binary")
    assert "binary" in call(ctx, "read_file", path="blob.bin")["error"]
    write(ctx, "short.txt", "one\n")
    assert "past the end" in call(ctx, "read_file", path="short.txt", offset=5)["error"]


def test_write_file(ctx):
    result = call(ctx, "write_file", path="deep/new/file.txt", content="héllo")
    assert result == {"path": "deep/new/file.txt", "bytes_written": 6}
    assert read(ctx, "deep/new/file.txt") == "héllo"
    assert "error" in call(ctx, "write_file", path="x.txt")


def test_patch_replace(ctx):
    write(ctx, "code.py", "a = 1\nb = 2\nb = 2\n")
    result = call(ctx, "patch", mode="replace", path="code.py", old_string="a = 1", new_string="a = 10")
    assert result["success"] and result["replacements"] == 1 and "+a = 10" in result["diff"]
    assert "not found" in call(ctx, "patch", path="code.py", old_string="c = 3", new_string="")["error"]
    ambiguous = call(ctx, "patch", path="code.py", old_string="b = 2", new_string="b = 3")
    assert "2 times" in ambiguous["error"]
    assert read(ctx, "code.py") == "a = 10\nb = 2\nb = 2\n"
    assert call(ctx, "patch", path="code.py", old_string="b = 2", new_string="b = 3", replace_all=True)["replacements"] == 2
    assert read(ctx, "code.py") == "a = 10\nb = 3\nb = 3\n"


def test_patch_unified_diff_with_two_hunks(ctx):
    write(ctx, "app.py", "".join(f"line {n}\n" for n in range(1, 21)))
    diff = """--- a/app.py
+++ b/app.py
@@ -2,3 +2,3 @@
 line 2
-line 3
+line three
 line 4
@@ -15,3 +15,4 @@
 line 16
 line 17
+inserted
 line 18
"""  # the second header is off by one line: hunks are located by content near the stated line
    result = call(ctx, "patch", mode="patch", patch=diff)
    assert result == {"success": True, "files": [{"path": "app.py", "action": "updated", "hunks": 2}]}
    lines = read(ctx, "app.py").splitlines()
    assert lines[2] == "line three" and lines[16:19] == ["line 17", "inserted", "line 18"] and len(lines) == 21


def test_patch_unified_multi_file_new_and_deleted(ctx):
    write(ctx, "keep.txt", "alpha\nbeta\n")
    write(ctx, "old.txt", "bye\n")
    diff = """diff --git a/keep.txt b/keep.txt
--- a/keep.txt
+++ b/keep.txt
@@ -1,2 +1,2 @@
 alpha
-beta
+gamma
\\ No newline at end of file
--- /dev/null
+++ b/pkg/new.txt
@@ -0,0 +1,2 @@
+fresh
+file
--- a/old.txt
+++ /dev/null
@@ -1 +0,0 @@
-bye
"""
    result = call(ctx, "patch", mode="patch", patch=diff)
    assert [f["action"] for f in result["files"]] == ["updated", "created", "deleted"]
    assert read(ctx, "keep.txt") == "alpha\ngamma"
    assert read(ctx, "pkg/new.txt") == "fresh\nfile\n"
    assert not os.path.exists(os.path.join(ctx.env.workdir, "old.txt"))


def test_patch_that_does_not_apply_changes_nothing(ctx):
    write(ctx, "a.txt", "one\ntwo\n")
    write(ctx, "b.txt", "three\n")
    diff = "--- a/a.txt\n+++ b/a.txt\n@@ -1 +1 @@\n-one\n+ONE\n--- a/b.txt\n+++ b/b.txt\n@@ -1 +1 @@\n-nine\n+NINE\n"
    result = call(ctx, "patch", mode="patch", patch=diff)
    assert "b.txt: hunk 1 does not match" in result["error"]
    assert read(ctx, "a.txt") == "one\ntwo\n"
    assert "error" in call(ctx, "patch", mode="patch", patch="not a diff at all")


def test_patch_v4a_blocks(ctx):
    write(ctx, "mod.py", "def f():\n    return 1\n\ndef g():\n    return 1\n")
    write(ctx, "gone.txt", "x\n")
    write(ctx, "from.txt", "move me\n")
    block = """*** Begin Patch
*** Update File: mod.py
@@ def g():
-    return 1
+    return 2
*** Add File: added.txt
+first
+second
*** Delete File: gone.txt
*** Update File: from.txt
*** Move to: to.txt
-move me
+moved
*** End Patch
"""
    result = call(ctx, "patch", mode="patch", patch=block)
    assert [f["action"] for f in result["files"]] == ["updated", "created", "deleted", "moved"]
    assert read(ctx, "mod.py") == "def f():\n    return 1\n\ndef g():\n    return 2\n"
    assert read(ctx, "added.txt") == "first\nsecond\n"
    assert read(ctx, "to.txt") == "moved\n"
    for path in ("gone.txt", "from.txt"):
        assert not os.path.exists(os.path.join(ctx.env.workdir, path))


@pytest.fixture
def tree(ctx):
    write(ctx, "src/main.py", "import os\n\ndef main():\n    value = 42\n    return value\n")
    write(ctx, "src/util.py", "def helper():\n    return 7\n")
    write(ctx, "notes.md", "value is documented here\n")
    write(ctx, ".git/config", "value = hidden\n")
    return ctx


def test_search_content_with_glob_and_context(tree):
    result = call(tree, "search_files", pattern=r"value = \d+", file_glob="*.py", context=1)
    assert result["matches"] == "src/main.py-3-def main():\nsrc/main.py:4:    value = 42\nsrc/main.py-5-    return value"
    assert result["total"] == 3
    everywhere = call(tree, "search_files", pattern="value")
    assert "notes.md:1:value is documented here" in everywhere["matches"]
    assert ".git" not in everywhere["matches"]


def test_search_output_modes_and_paging(tree):
    files = call(tree, "search_files", pattern="return", output_mode="files_only")
    assert files["files"] == ["src/main.py", "src/util.py"]
    counts = call(tree, "search_files", pattern="value", output_mode="count", path="src")
    assert counts["counts"] == {"src/main.py": 2}
    page = call(tree, "search_files", pattern="return", output_mode="files_only", limit=1, offset=1)
    assert page["files"] == ["src/util.py"] and page["total"] == 2 and "next_offset" not in page
    first = call(tree, "search_files", pattern="return", output_mode="files_only", limit=1)
    assert first["next_offset"] == 1
    names = call(tree, "search_files", pattern="*.py", target="files")
    assert names["files"] == ["src/main.py", "src/util.py"]
    assert call(tree, "search_files", pattern="nothing-like-this")["total"] == 0


def test_search_errors(tree):
    assert "invalid regular expression" in call(tree, "search_files", pattern="(unclosed")["error"]
    assert "no such file" in call(tree, "search_files", pattern="x", path="nowhere")["error"]
    assert "error" in call(tree, "search_files", pattern="x", output_mode="lines")


# ------------------------------------------------------------------------------------------ busybox


@pytest.mark.skipif(not os.path.exists("/bin/busybox"), reason="busybox is not installed")
def test_tools_work_with_only_busybox(ctx, tmp_path, monkeypatch):
    """The scripts must run in a busybox container: here every command comes from busybox."""
    applets = tmp_path / "busybox-bin"
    applets.mkdir()
    for name in os.popen("/bin/busybox --list").read().split():
        if name != "busybox":
            os.symlink("/bin/busybox", applets / name)
    monkeypatch.setenv("PATH", str(applets))
    assert "busybox" in call(ctx, "terminal", command="readlink /proc/$$/exe")["output"]

    sid = call(ctx, "terminal", command="read x; echo got $x; sleep 60", background=True, watch_patterns=["got"])[
        "session_id"
    ]
    call(ctx, "process", action="submit", session_id=sid, data="it")
    assert call(ctx, "process", action="wait", session_id=sid, timeout=10)["matched_pattern"] == "got"
    assert call(ctx, "process", action="log", session_id=sid)["output"] == "got it\n"
    assert call(ctx, "process", action="kill", session_id=sid)["status"] == "killed"
    assert call(ctx, "process", action="poll", session_id=sid)["status"] == "killed"

    write(ctx, "src/a.py", "x = 1\ny = 22\n")
    found = call(ctx, "search_files", pattern=r"\d\d", file_glob="*.py", context=1)
    assert found["matches"] == "src/a.py-1-x = 1\nsrc/a.py:2:y = 22"
    assert call(ctx, "search_files", pattern="*.py", target="files")["files"] == ["src/a.py"]
    assert call(ctx, "search_files", pattern="=", output_mode="count")["counts"] == {"src/a.py": 2}


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
def test_tools_under_bwrap(tmp_path):
    env = LocalEnvironment(LocalConfig(task_id="sandboxed", workdir_root=str(tmp_path), sandbox="bwrap"))
    env.start()
    ctx = ToolContext(env=env, settings=ToolSettings(), model=None, task_id="sandboxed")
    try:
        sid = call(ctx, "terminal", command="echo up; sleep 60", background=True, watch_patterns=["up"])["session_id"]
        assert call(ctx, "process", action="wait", session_id=sid, timeout=10)["matched_pattern"] == "up"
        assert call(ctx, "process", action="poll", session_id=sid)["status"] == "running"  # outlived its command
        assert call(ctx, "process", action="kill", session_id=sid)["status"] == "killed"
        assert call(ctx, "write_file", path="/tmp/notes.txt", content="a\nb\n")["bytes_written"] == 4
        assert call(ctx, "patch", path="/tmp/notes.txt", old_string="b", new_string="c")["success"]
        assert call(ctx, "terminal", command="cat /tmp/notes.txt")["output"] == "a\nc\n"
        assert "cannot write" in call(ctx, "write_file", path="/etc/abr-probe", content="x")["error"]
    finally:
        run_cleanups(ctx)
        env.cleanup()
