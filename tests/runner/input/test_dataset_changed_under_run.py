"""A dataset rewritten in place (same inode) while the run reads it.

The run validates the whole file at start, then reads it again row by row as sessions free up. A
rewrite under that second read shifts what the open handle sees: rows it already handed out come
back, and would run (and be paid) twice. The run notices that the file no longer reads as it did,
stops reading it with a message, and --resume picks the rest up from the file as it is now;
no row ever starts twice.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections import Counter

from tests.conftest import REPO, read_jsonl, write_jsonl
from tests.helpers.model_server import first_user_text

FILLER = "x" * 2000  # lines larger than the reader's buffer share, so the handle really is mid-file


def _row(tag: str) -> dict:
    return {"prompt": f"@latency 0.3\nRow {tag}. {FILLER}", "id": tag}


def _args(dataset, server, *extra):
    return [sys.executable, str(REPO / "batch_runner.py"), f"--dataset_file={dataset}", "--run_name=r",
            "--batch_size=4", "--num_workers=2", "--num_processes=1", "--distribution=terminal_only",
            f"--base_url={server.base_url}", "--model=m", "--api_key=x", *extra]


def _starts(server) -> Counter:
    """How often each row's conversation was started (its first request: the user message alone)."""
    first = [r for r in server.requests if r.path.endswith("/chat/completions")
             and not any(m.get("role") in ("assistant", "tool") for m in r.body.get("messages", []))]
    return Counter(re.search(r"Row (\w+)\.", first_user_text(r.body)).group(1) for r in first)


def test_a_dataset_rewritten_in_place_during_the_run_never_starts_a_row_twice(tmp_path, model_server):
    rows = [_row(f"{i:02d}") for i in range(40)]
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    inode = os.stat(dataset).st_ino
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(_args(dataset, model_server), cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    run = tmp_path / "data" / "r"
    deadline = time.monotonic() + 90
    while not (run / "batch_0.jsonl").exists() or not (run / "batch_0.jsonl").read_text():
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    # The same rows with one more in front, written over the same file: every line moves down one.
    with open(dataset, "r+", encoding="utf-8") as handle:
        handle.write("".join(json.dumps(r) + "\n" for r in [_row("XX"), *rows]))
    assert os.stat(dataset).st_ino == inode
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2, out[-3000:]  # incomplete: the rows it did not read are left for --resume
    assert "d.jsonl:" in out and "the file changed during the run" in out, out[-3000:]
    starts = _starts(model_server)
    assert all(n == 1 for n in starts.values()), [k for k, n in starts.items() if n > 1]

    again = subprocess.run(_args(dataset, model_server, "--resume"), cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=180)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    starts = _starts(model_server)
    assert sorted(starts) == sorted(["XX"] + [f"{i:02d}" for i in range(40)])  # every row, once
    assert all(n == 1 for n in starts.values()), [k for k, n in starts.items() if n > 1]
    kept = read_jsonl(run / "trajectories.jsonl")
    assert sorted(t["metadata"]["id"] for t in kept) == sorted(["XX"] + [f"{i:02d}" for i in range(40)])
