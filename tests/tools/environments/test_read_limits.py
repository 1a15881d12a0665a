"""The file tools read at most a documented number of bytes in every backend: an endless device
(/dev/zero) or a huge file is a clear error in the row, not the runner's memory."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.conftest import read_jsonl, run_cli, write_jsonl
from tools.settings import MAX_READ_BYTES

_BACKENDS = {
    "local": [],
    "bwrap": ["--sandbox=bwrap"],
    "docker": ["--terminal_env=docker", "--docker_image=abr-test/busybox:1"],
}


def _needs(backend: str) -> None:
    if backend == "bwrap" and shutil.which("bwrap") is None:
        pytest.skip("bubblewrap not installed")
    if backend == "docker":
        from tests.helpers.docker_support import ready_client

        ready_client()


def _tool_results(row: dict) -> list[dict]:
    return [json.loads(t["value"].split("<tool_response>\n", 1)[1].rsplit("\n</tool_response>", 1)[0])["content"]
            for t in row["conversations"] if t["from"] == "tool"]


@pytest.mark.parametrize("backend", list(_BACKENDS))
def test_reads_of_huge_or_endless_files_are_refused_with_a_clear_error(backend, model_server, tmp_path):
    _needs(backend)
    make = f"yes a-line-of-text | head -c {MAX_READ_BYTES + 1000} > big.txt && wc -c < big.txt && echo small > small.txt"
    prompt = "\n".join([
        f"@tool terminal {json.dumps({'command': make})}",
        '@tool read_file {"path": "big.txt"}',
        '@tool read_file {"path": "/dev/zero"}',
        '@tool read_file {"path": "small.txt"}',
        "Read everything.",
    ])  # fmt: skip
    dataset = write_jsonl(tmp_path / "d.jsonl", [{"prompt": prompt}])
    args = [f"--dataset_file={dataset}", f"--run_name=r-{backend}", "--batch_size=4", "--distribution=terminal_only",
            f"--base_url={model_server.base_url}", "--model=m", "--api_key=x", *_BACKENDS[backend]]
    proc = run_cli(args, tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (row,) = read_jsonl(tmp_path / "data" / f"r-{backend}" / "trajectories.jsonl")
    made, big, zero, small = _tool_results(row)
    assert int(made["output"].split()[0]) > MAX_READ_BYTES
    limit = f"{MAX_READ_BYTES // 2**20} MiB"
    assert limit in big.get("error", ""), big
    assert "content" not in zero and ("error" in zero), zero
    if backend != "docker":  # an endless device reads as too large; the archive API sees a device
        assert limit in zero["error"], zero
    assert "small" in small["content"]  # ordinary files still read
