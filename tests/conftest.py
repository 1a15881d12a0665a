"""Shared helpers: run the real CLI in a subprocess, and a local model server per test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.model_server import ModelServer

REPO = Path(__file__).resolve().parent.parent
SECRET_KEY = "sk-test-0123456789-SECRET"


def write_jsonl(path: Path, rows: list) -> Path:
    with open(path, "w", encoding="utf-8") as handle:
        for row in rows:
            handle.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


def wait_for(condition, timeout: float, step: float = 0.05) -> bool:
    """Poll `condition()` until it is true or `timeout` seconds have passed; its last answer."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(step)
    return condition()


def run_cli(args: list[str], cwd: Path, timeout: float = 300, env: dict | None = None,
            script: str = "batch_runner.py") -> subprocess.CompletedProcess:
    """`python batch_runner.py ARGS` (or another top-level `script`) in `cwd`, as a user would run it."""
    base = {k: v for k, v in os.environ.items() if k not in ("OPENROUTER_API_KEY", "OPENAI_API_KEY", "TERMINAL_ENV")}
    base["PYTHONPATH"] = str(REPO)
    base.update(env or {})
    return subprocess.run(
        [sys.executable, str(REPO / script), *args],
        cwd=cwd,
        env=base,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture
def model_server():
    server = ModelServer(latency=0.0)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def remote_args(model_server):
    """Flags pointing the runner at the local server, with a key that must never be written."""
    return [f"--base_url={model_server.base_url}", "--model=test-model", f"--api_key={SECRET_KEY}"]



# --- the fast subset: `pytest -m "not slow"` ----------------------------------------------------
# A test is slow when it starts a process (the CLI, a worker, a server binary) or needs Docker, a
# browser, Ray or the real model. Which tests start a process is read from their code: a call of
# run_cli or of anything in subprocess, directly or through the module's own helpers and fixtures,
# so a new CLI test is marked without anyone remembering to.
import ast  # noqa: E402
import inspect  # noqa: E402

_SLOW_MARKERS = {"docker", "browser", "ray", "slow"}


def _starts_a_process(call: ast.Call) -> bool:
    func = call.func
    if isinstance(func, ast.Name):
        return func.id in ("run_cli", "Popen")
    return isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "subprocess"


def _slow_functions(module) -> set[str]:
    """The module's functions (tests, helpers, fixtures) that start a process, directly or not."""
    try:
        tree = ast.parse(inspect.getsource(module))
    except (OSError, TypeError, SyntaxError):
        return set()
    uses: dict[str, set[str]] = {}  # function -> the names it calls or takes as fixtures
    slow: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            calls = [sub for sub in ast.walk(node) if isinstance(sub, ast.Call)]
            uses[node.name] = {c.func.id for c in calls if isinstance(c.func, ast.Name)}
            uses[node.name] |= {arg.arg for arg in node.args.args}
            if any(_starts_a_process(c) for c in calls):
                slow.add(node.name)
    while grown := {name for name, used in uses.items() if used & slow} - slow:
        slow |= grown
    return slow


def pytest_collection_modifyitems(config, items):
    slow_in: dict = {}
    for item in items:
        module = getattr(item, "module", None)
        if module is None:
            continue
        if module not in slow_in:
            slow_in[module] = _slow_functions(module)
        name = getattr(item, "originalname", None) or item.name.split("[", 1)[0]
        if name in slow_in[module] or _SLOW_MARKERS & {mark.name for mark in item.iter_markers()}:
            item.add_marker(pytest.mark.slow)
