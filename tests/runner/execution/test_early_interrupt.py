"""Ctrl-C / SIGTERM in the first instants of `python batch_runner.py ...`: the imports, the flag
checks, the one-time re-exec that takes the keys out of argv. No traceback, exit 130."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO, write_jsonl


def _catches_sigterm(pid: int) -> bool:
    """batch_runner.py catches SIGTERM from its first lines on (Python itself does not)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            caught = next(line for line in status if line.startswith("SigCgt:"))
    except (OSError, StopIteration):
        return False
    return bool(int(caught.split()[1], 16) & (1 << (signal.SIGTERM - 1)))


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            return cmdline.read()
    except OSError:
        return b""


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
@pytest.mark.parametrize("start", ["script", "reexec"])
def test_an_interrupt_in_the_first_instants_exits_130_without_a_traceback(model_server, tmp_path, signum, start):
    """Delays counted from the script's first line (its handler is in place), or from the re-exec
    (the new interpreter starts: the key is gone from its command line)."""
    dataset = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"@latency 5\nEarly row {i}."} for i in range(2)])
    cmd = [sys.executable, str(REPO / "batch_runner.py"), f"--dataset_file={dataset}", "--run_name=r",
           "--batch_size=5", "--distribution=terminal_only", f"--base_url={model_server.base_url}", "--model=m",
           "--api_key=sk-early-0123456789", "--num_workers=2", "--grace_period=0"]  # --api_key: the re-exec
    env = {k: v for k, v in os.environ.items() if k not in ("OPENROUTER_API_KEY", "OPENAI_API_KEY")}
    env["PYTHONPATH"] = str(REPO)
    results = []
    for delay in (0.0, 0.005, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5):
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        # The interpreter's own start-up, before the script's first line, is out of the script's
        # reach; from its first line on, every moment must be covered.
        def started() -> bool:
            if start == "script":
                return _catches_sigterm(proc.pid)
            line = _cmdline(proc.pid)
            return bool(line) and b"--api_key" not in line
        deadline = time.monotonic() + 30
        while not started() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.001)
        time.sleep(delay)
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=60)
        results.append((delay, proc.returncode, "Traceback" in err or "KeyboardInterrupt" in err, err[-300:]))
    assert all(code == 130 and not traceback for _, code, traceback, _ in results), results
