"""The terminal toolset: shell commands in the session's environment, foreground or background.

Background processes are managed with plain POSIX sh (and busybox-friendly commands) through
`env.execute`, so they work the same in every backend: a local folder, bubblewrap, or a Docker
container whose image is busybox. Each one gets a folder in the environment's /tmp holding its
log, its exit status and a FIFO that serves as its stdin.
"""

from __future__ import annotations

import functools
import re
import time
import uuid
from dataclasses import dataclass, field

from tools.environments.base import quote
from tools.registry import ToolContext, ToolSpec

_STATE_KEY = "terminal.background"
_MAX_STDIN_CHARS = 100_000  # one shell argument carries the data; the kernel caps its length
# Defined in front of every status script: a zombie still answers `kill -0`, so look at /proc too.
_ALIVE = """alive() { kill -0 "$1" 2>/dev/null && ! grep -q ') Z' "/proc/$1/stat" 2>/dev/null; }
status() { if [ -f "$1/exit" ]; then cat "$1/exit"; elif alive "$2"; then echo running; else echo gone; fi; }
"""


@dataclass
class Background:
    session_id: str
    command: str
    pid: int  # inside the environment; also the id of its own process group (setsid)
    folder: str  # inside the environment: log, exit, stdin
    watch_patterns: list[str] = field(default_factory=list)
    notify: bool = False
    started: float = field(default_factory=time.monotonic)
    status: str = "running"  # running | exited | killed
    exit_code: int | None = None
    reported: bool = False  # completion already shown to the model
    watch_offset: int = 0  # log bytes already searched for watch_patterns


def _processes(ctx: ToolContext) -> dict[str, Background]:
    procs = ctx.state.get(_STATE_KEY)
    if procs is None:
        procs = ctx.state[_STATE_KEY] = {}
        ctx.cleanups.append(functools.partial(_kill_all, ctx))
    return procs


async def _run(ctx: ToolContext, script: str, timeout: float = 30):
    return await ctx.env.run(script, timeout=timeout)


def _flag(value) -> bool:
    return value is True or (isinstance(value, str) and value.strip().lower() in ("true", "1", "yes"))


def _positive_number(args: dict, name: str) -> float | None:
    value = args.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1e9:
        # (NaN fails the comparison too; 1e9 s is 31 years, and an int of 400 digits no float)
        raise ValueError(f"{name} must be a positive number of seconds")
    return float(value)


def _kill_script(proc: Background) -> str:
    # The whole process group first (the command and its children), then the leader itself.
    return f"kill -9 -{proc.pid} 2>/dev/null; kill -9 {proc.pid} 2>/dev/null\n"


async def _refresh(ctx: ToolContext, procs: list[Background]) -> None:
    """Update the status of the processes still believed to be running (one command for all)."""
    running = [p for p in procs if p.status == "running"]
    if not running:
        return
    script = _ALIVE + "".join(f'echo "{p.session_id} $(status {quote(p.folder)} {p.pid})"\n' for p in running)
    result = await _run(ctx, script)
    seen = dict(line.split(" ", 1) for line in result.output.splitlines() if " " in line)
    for proc in running:
        value = seen.get(proc.session_id, "running").strip()
        if value.lstrip("-").isdigit():
            proc.status, proc.exit_code = "exited", int(value)
        elif value == "gone":  # vanished without writing its exit status: killed from outside
            proc.status = "killed"


def _describe(proc: Background) -> dict:
    info = {"session_id": proc.session_id, "command": proc.command, "pid": proc.pid, "status": proc.status}
    if proc.exit_code is not None:
        info["exit_code"] = proc.exit_code
    info["seconds_since_start"] = round(time.monotonic() - proc.started, 1)
    return info


async def _with_notifications(ctx: ToolContext, result: dict) -> dict:
    """notify_on_complete: report finished background processes in the next terminal/process result."""
    waiting = [p for p in ctx.state.get(_STATE_KEY, {}).values() if p.notify and not p.reported]
    if "error" in result or not waiting:
        return result
    await _refresh(ctx, waiting)
    done = [p for p in waiting if p.status != "running"]
    for proc in done:
        proc.reported = True
    if done:
        result["completed_background_processes"] = [_describe(p) for p in done]
    return result


async def _tail(ctx: ToolContext, proc: Background, lines: int = 20) -> str:
    result = await _run(ctx, f"tail -n {lines} {quote(proc.folder)}/log 2>/dev/null")
    return result.output


# ---------------------------------------------------------------------------------------- terminal


async def terminal(args: dict, ctx: ToolContext) -> dict:
    command = args.get("command")
    if not isinstance(command, str) or not command.strip():
        return {"error": "command must be a non-empty string"}
    workdir = args.get("workdir")
    if workdir is not None and (not isinstance(workdir, str) or not workdir):
        return {"error": "workdir must be a path"}
    try:
        timeout = _positive_number(args, "timeout") or ctx.settings.command_timeout
    except ValueError as err:
        return {"error": str(err)}
    if _flag(args.get("background")):
        result = await _start_background(ctx, command, workdir, args)
    else:
        done = await ctx.env.run(command, cwd=workdir, timeout=timeout)
        result = {"output": done.output, "exit_code": done.exit_code}
        if done.timed_out:
            result["note"] = (
                f"timed out after {timeout:g} s; the command was killed. "
                "Run long commands with background=true and follow them with the process tool."
            )
    return await _with_notifications(ctx, result)


async def _start_background(ctx: ToolContext, command: str, workdir: str | None, args: dict) -> dict:
    patterns = args.get("watch_patterns") or []
    if not isinstance(patterns, list) or not all(isinstance(p, str) and p for p in patterns):
        return {"error": "watch_patterns must be a list of non-empty strings"}
    session_id = "proc_" + uuid.uuid4().hex[:12]
    folder = f"/tmp/abr-bg-{session_id}"
    # The wrapper writes the exit status only after the command ends, through a rename so that a
    # reader never sees half of it. stdin is the FIFO opened read-write: opening never blocks and
    # the command does not see end-of-file when one `write` finishes.
    wrapper = (
        f'sh -c {quote(command)} <>"$1/stdin" >"$1/log" 2>&1; '
        'echo $? >"$1/exit.tmp"; mv "$1/exit.tmp" "$1/exit"'
    )
    script = (
        f"d={quote(folder)}\n"
        'mkdir -p "$d" && mkfifo "$d/stdin" || exit 1\n'
        # setsid gives the command its own process group, so `kill` reaches its children too.
        "if command -v setsid >/dev/null 2>&1; then s=setsid; else s=; fi\n"
        f'$s sh -c {quote(wrapper)} sh "$d" </dev/null >/dev/null 2>&1 &\n'
        'echo "pid=$!"\n'
    )
    started = await ctx.env.run(script, cwd=workdir, timeout=30)
    found = re.search(r"pid=(\d+)", started.output)
    if started.exit_code != 0 or not found:
        return {"error": f"could not start the background process: {started.output.strip()}"}
    proc = Background(session_id, command, int(found.group(1)), folder, patterns, _flag(args.get("notify_on_complete")))
    _processes(ctx)[session_id] = proc
    return {
        "session_id": session_id,
        "pid": proc.pid,
        "status": "running",
        "log_file": f"{folder}/log",
        "note": "started in the background; use the process tool (poll, log, wait, kill, write) with this session_id",
    }


# ----------------------------------------------------------------------------------------- process

_ACTIONS = ("list", "poll", "log", "wait", "kill", "write", "submit", "close")


async def process(args: dict, ctx: ToolContext) -> dict:
    action = args.get("action")
    if action not in _ACTIONS:
        return {"error": f"action must be one of: {', '.join(_ACTIONS)}"}
    procs = _processes(ctx)
    if action == "list":
        await _refresh(ctx, list(procs.values()))
        return await _with_notifications(ctx, {"processes": [_describe(p) for p in procs.values()]})
    proc = procs.get(args.get("session_id") or "")
    if proc is None:
        known = ", ".join(procs) or "none"
        return {"error": f"unknown session_id {args.get('session_id')!r} (known: {known})"}
    try:
        result = await _ACTION_HANDLERS[action](ctx, proc, args)
    except ValueError as err:
        return {"error": str(err)}
    if proc.status != "running" and action != "close":
        proc.reported = True  # the model has just seen that it finished
    return await _with_notifications(ctx, result)


async def _poll(ctx: ToolContext, proc: Background, args: dict) -> dict:
    await _refresh(ctx, [proc])
    return {**_describe(proc), "recent_output": await _tail(ctx, proc)}


def _int_arg(args: dict, name: str, default: int, minimum: int) -> int:
    value = args.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}")
    return value


async def _log(ctx: ToolContext, proc: Background, args: dict) -> dict:
    limit = _int_arg(args, "limit", 200, 1)
    offset = args.get("offset")  # 0-based line offset; without one, the last `limit` lines
    if offset is not None:
        offset = _int_arg(args, "offset", 0, 0)
    first = "$((n > %d ? n - %d : 0))" % (limit, limit) if offset is None else str(offset)
    script = (
        f"f={quote(proc.folder)}/log\n"
        'n=$(awk \'END { print NR }\' "$f" 2>/dev/null || echo 0)\n'
        f"o={first}\n"
        'echo "$n $o"\n'
        f'sed -n "$((o + 1)),$((o + {limit}))p" "$f" 2>/dev/null\n'
    )
    result = await _run(ctx, script)
    header, _, text = result.output.partition("\n")
    total, start = (int(x) for x in header.split())
    await _refresh(ctx, [proc])
    shown = text.count("\n") + (1 if text and not text.endswith("\n") else 0)
    return {
        **_describe(proc),
        "output": text,
        "offset": start,
        "lines": shown,
        "total_lines": total,
    }


async def _wait(ctx: ToolContext, proc: Background, args: dict) -> dict:
    # A wait is bounded like any command, so one call cannot stall the session indefinitely.
    timeout = int(min(_positive_number(args, "timeout") or 60, ctx.settings.command_timeout))
    folder = quote(proc.folder)
    watch = ""
    if proc.watch_patterns:
        greps = " ".join(f"-e {quote(p)}" for p in proc.watch_patterns)
        # Only output written since the last match counts, so each wait finds a new event.
        watch = (
            f"  sz=$(( $( {{ wc -c < {folder}/log; }} 2>/dev/null || echo 0) ))\n"
            f"  m=$(head -c $sz {folder}/log 2>/dev/null | tail -c +{proc.watch_offset + 1}"
            f" | grep -oF {greps} | head -n 1)\n"
            '  if [ -n "$m" ]; then echo "matched $sz"; echo "$m"; exit 0; fi\n'
        )
    script = (
        _ALIVE
        + f"end=$(( $(date +%s) + {timeout} ))\n"
        + "while :; do\n"
        + f'  [ "$(status {folder} {proc.pid})" = running ] || {{ echo finished; exit 0; }}\n'
        + watch
        + '  [ "$(date +%s)" -ge "$end" ] && { echo timeout; exit 0; }\n'
        + "  sleep 0.2 2>/dev/null || sleep 1\n"
        + "done\n"
    )
    began = time.monotonic()
    result = await _run(ctx, script, timeout=timeout + 15)
    lines = result.output.splitlines()
    await _refresh(ctx, [proc])
    answer = {**_describe(proc), "waited_seconds": round(time.monotonic() - began, 1)}
    if lines and lines[0].startswith("matched ") and len(lines) > 1:
        proc.watch_offset = int(lines[0].split()[1])
        answer["matched_pattern"] = lines[1]
    elif proc.status == "running":
        answer["note"] = f"still running after {timeout} s"
    answer["recent_output"] = await _tail(ctx, proc)
    return answer


async def _kill(ctx: ToolContext, proc: Background, args: dict) -> dict:
    await _refresh(ctx, [proc])
    if proc.status == "running":
        await _run(ctx, _kill_script(proc))
        proc.status = "killed"
    return _describe(proc)


async def _write(ctx: ToolContext, proc: Background, args: dict, newline: bool = False) -> dict:
    data = args.get("data")
    if data is None and newline:
        data = ""
    if not isinstance(data, str):
        raise ValueError("data must be a string")
    if len(data) > _MAX_STDIN_CHARS:
        raise ValueError(f"data is too long (at most {_MAX_STDIN_CHARS} characters at a time)")
    data += "\n" if newline else ""
    await _refresh(ctx, [proc])
    if proc.status != "running":
        raise ValueError(f"process {proc.session_id} is not running ({proc.status}); nothing reads its stdin")
    # If the process stops reading and the pipe fills up, the timeout ends the attempt.
    result = await _run(ctx, f"printf '%s' {quote(data)} > {quote(proc.folder)}/stdin", timeout=10)
    if result.exit_code != 0:
        return {"error": f"could not write to the process's stdin: {result.output.strip() or 'timed out'}"}
    return {"session_id": proc.session_id, "bytes_written": len(data.encode())}


async def _close(ctx: ToolContext, proc: Background, args: dict) -> dict:
    await _refresh(ctx, [proc])
    was_running = proc.status == "running"
    await _run(ctx, (_kill_script(proc) if was_running else "") + f"rm -rf {quote(proc.folder)}\n")
    del _processes(ctx)[proc.session_id]
    return {"session_id": proc.session_id, "closed": True, "killed": was_running}


_ACTION_HANDLERS = {
    "poll": _poll,
    "log": _log,
    "wait": _wait,
    "kill": _kill,
    "write": _write,
    "submit": functools.partial(_write, newline=True),
    "close": _close,
}


async def _kill_all(ctx: ToolContext) -> None:
    """Session cleanup: kill every background process still running and remove its folder."""
    procs = list(ctx.state.get(_STATE_KEY, {}).values())
    if procs:
        script = "".join(_kill_script(p) + f"rm -rf {quote(p.folder)}\n" for p in procs)
        await _run(ctx, script)
        ctx.state[_STATE_KEY] = {}


# ------------------------------------------------------------------------------------------ schemas

TERMINAL_DESCRIPTION = (
    "Run a shell command (sh -c) in this task's environment and return its combined stdout/stderr "
    "and exit code. A non-zero exit code is a normal result. Commands start in the task's working "
    "directory unless `workdir` is given, and are killed when `timeout` seconds pass (exit code "
    "124). Very long output keeps its beginning and end. Each call is a new shell: `cd` and "
    "variables do not carry over. With background=true the command keeps running after the call "
    "returns; you get a session_id for the process tool (poll, log, wait, kill, write). For "
    "background commands, watch_patterns are strings that `process wait` stops at when they appear "
    "in the output, and notify_on_complete=true reports the exit in the result of a later terminal "
    "or process call. pty is accepted but commands never get a terminal."
)

PROCESS_DESCRIPTION = (
    "Manage background processes started with terminal(background=true). Actions: list (all "
    "processes of this task); poll (running or exit code, plus recent output); log (output lines: "
    "`offset` is a 0-based line number, `limit` the number of lines, default the last 200); wait "
    "(until the process exits, one of its watch_patterns appears, or `timeout` seconds pass: "
    "default 60, at most the command timeout); kill; write (send `data` to its stdin as is); "
    "submit (send `data` plus a newline); close (kill it if still running and forget it)."
)

_TERMINAL_PARAMETERS = {
    "type": "object",
    "properties": {
        "command": {"type": "string", "description": "The shell command to run."},
        "background": {"type": "boolean", "default": False, "description": "Start it in the background."},
        "timeout": {"type": "integer", "description": "Seconds before a foreground command is killed."},
        "workdir": {"type": "string", "description": "Directory to run in (default: the task's directory)."},
        "pty": {"type": "boolean", "default": False, "description": "Accepted; commands never get a terminal."},
        "notify_on_complete": {
            "type": "boolean",
            "default": False,
            "description": "Background only: report its exit in a later tool result.",
        },
        "watch_patterns": {
            "type": "array",
            "items": {"type": "string"},
            "description": "Background only: output strings that `process wait` returns on.",
        },
    },
    "required": ["command"],
}

_PROCESS_PARAMETERS = {
    "type": "object",
    "properties": {
        "action": {"type": "string", "enum": list(_ACTIONS), "description": "What to do."},
        "session_id": {"type": "string", "description": "The id returned by terminal(background=true)."},
        "data": {"type": "string", "description": "Text for write/submit."},
        "timeout": {"type": "integer", "description": "Seconds to wait (wait)."},
        "offset": {"type": "integer", "description": "First line to return, 0-based (log)."},
        "limit": {"type": "integer", "description": "Number of lines to return (log)."},
    },
    "required": ["action"],
}

TOOLS = [
    ToolSpec("terminal", "terminal", TERMINAL_DESCRIPTION, _TERMINAL_PARAMETERS, terminal, needs_sandbox=True),
    ToolSpec("process", "terminal", PROCESS_DESCRIPTION, _PROCESS_PARAMETERS, process, needs_sandbox=True),
]
