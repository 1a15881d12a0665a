"""A real model behind a real OpenAI-compatible server, for tests/agent/test_real_model.py.

llama-cpp-python's server with SmolLM2-135M-Instruct, both installed by `.ci/install-real-model`
into a cache outside the checkout (same rule for finding it as that script). `LlamaServer` starts
the server on 127.0.0.1 and stops it; `RecordingProxy` sits between the runner and the server and
keeps every request and reply, so a test can compare what the runner saved with what the server
really sent (tool call ids above all). When the cache is missing the tests skip, or fail when CI is
set: CI must never pass by silently not testing against the real model.
"""

from __future__ import annotations

import ctypes
import http.server
import json
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_ALIAS = "smollm2"
START_TIMEOUT = 180.0  # seconds until GET /v1/models answers; about 15 s on 2 idle cores


def cache_dir() -> Path:
    """Where .ci/install-real-model put the server's virtualenv and the model."""
    if os.environ.get("AGENT_BATCH_RUNNER_REAL_MODEL_CACHE"):
        return Path(os.environ["AGENT_BATCH_RUNNER_REAL_MODEL_CACHE"])
    if os.getuid() == 0:
        return Path("/var/cache/agent-batch-runner")
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "agent-batch-runner"


def unavailable(reason: str):
    message = f"{reason}; install it with: bash .ci/install-real-model"
    if os.environ.get("CI"):
        pytest.fail(f"the real model server is required when CI is set: {message}", pytrace=False)
    pytest.skip(message)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it when the test process dies, however it dies.

    Not SIGTERM: uvicorn then shuts down gracefully, waiting for the request in flight, and a
    runaway generation kept an orphaned server busy for minutes."""
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


class LlamaServer:
    """`python -m llama_cpp.server` from the cached virtualenv, on a free loopback port."""

    def __init__(self, log_path: Path):
        cache = cache_dir()
        self.python = cache / "llama-venv" / "bin" / "python"
        self.model = cache / "models" / MODEL_FILE
        self.log_path = log_path
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        if not self.python.exists():
            unavailable(f"no llama-cpp-python virtualenv at {self.python.parent.parent}")
        if not self.model.is_file():
            unavailable(f"no model at {self.model}")
        command = [
            str(self.python), "-m", "llama_cpp.server",
            "--model", str(self.model), "--model_alias", MODEL_ALIAS,
            "--host", "127.0.0.1", "--port", str(self.port),
            # Offers the request's tools to the model, but only when the request has tool_choice.
            "--chat_format", "chatml-function-calling",
            # A small context bounds a runaway reply: the server ignores max_tokens when tools are
            # offered, and one tool call once ran on for 6,900 tokens (6 minutes) until it hit the
            # context (HTTP 400). 2048 holds the tool listing (about 1,300 tokens) and a reply.
            "--n_ctx", "2048",
            # One thread: llama.cpp's OpenMP threads spin at their barriers, and on a busy machine
            # (2 cores shared by other work) two threads ran about twice as slow as one.
            "--n_threads", "1",
        ]  # fmt: skip
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent
            )
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"llama_cpp.server exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.base_url}/models", timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"llama_cpp.server did not answer GET /v1/models in {START_TIMEOUT:g}s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


class RecordingProxy:
    """A loopback HTTP pass-through to `upstream` that records each request and reply as JSON.

    `exchanges` holds `{"path", "request", "status", "reply"}` dicts in arrival order; `reply` is
    the parsed JSON body, or the raw text when the body is not JSON.
    """

    def __init__(self, upstream: str):
        self.upstream = upstream.rstrip("/")  # http://127.0.0.1:PORT/v1
        self.exchanges: list[dict] = []
        self._lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self._forward(None)

            def do_POST(self):
                self._forward(self.rfile.read(int(self.headers.get("Content-Length") or 0)))

            def _forward(self, body: bytes | None):
                path = self.path[len("/v1") :] if self.path.startswith("/v1") else self.path
                headers = {k: v for k, v in self.headers.items() if k.lower() in ("content-type", "authorization")}
                request = urllib.request.Request(proxy.upstream + path, data=body, headers=headers)
                try:
                    with urllib.request.urlopen(request, timeout=600) as response:
                        status, data, content_type = response.status, response.read(), response.headers.get("Content-Type")
                except urllib.error.HTTPError as err:
                    status, data, content_type = err.code, err.read(), err.headers.get("Content-Type")
                except (urllib.error.URLError, OSError) as err:  # the server closed or died: say so
                    status, content_type = 502, "application/json"
                    data = json.dumps({"error": {"message": f"proxy: upstream failed: {err!r}"}}).encode()
                proxy._record(path, body, status, data)
                self.send_response(status)
                self.send_header("Content-Type", content_type or "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):  # no per-request lines on stderr
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.base_url = f"http://127.0.0.1:{self._server.server_address[1]}/v1"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def _record(self, path: str, body: bytes | None, status: int, data: bytes) -> None:
        def parse(raw: bytes | None):
            if raw is None:
                return None
            try:
                return json.loads(raw)
            except ValueError:
                return raw.decode("utf-8", "replace")

        with self._lock:
            self.exchanges.append({"path": path, "request": parse(body), "status": status, "reply": parse(data)})

    def chat_exchanges(self) -> list[dict]:
        with self._lock:
            return [e for e in self.exchanges if e["path"].startswith("/chat/completions")]

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
