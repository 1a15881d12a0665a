"""Shared helpers: run the real CLI in a subprocess, and a local model server per test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
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


def run_cli(args: list[str], cwd: Path, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python batch_runner.py ARGS` in `cwd`, as a user would run it."""
    base = {k: v for k, v in os.environ.items() if k not in ("OPENROUTER_API_KEY", "OPENAI_API_KEY", "TERMINAL_ENV")}
    base["PYTHONPATH"] = str(REPO)
    base.update(env or {})
    return subprocess.run(
        [sys.executable, str(REPO / "batch_runner.py"), *args],
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
