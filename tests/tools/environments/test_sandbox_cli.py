"""The local backend through the CLI: per-prompt workdirs and the bubblewrap sandbox."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from tests.conftest import read_jsonl, run_cli, write_jsonl


def _terminal_output(row: dict) -> str:
    turn = next(t for t in row["conversations"] if t["from"] == "tool")
    return json.loads(turn["value"].split("<tool_response>\n", 1)[1].rsplit("\n</tool_response>", 1)[0])["content"]["output"]


def _args(dataset, server, *extra):
    return [f"--dataset_file={dataset}", "--run_name=r", "--batch_size=4", "--distribution=terminal_only",
            f"--base_url={server.base_url}", "--model=m", "--api_key=x", *extra]


def test_each_prompt_gets_a_fresh_workdir_removed_afterwards(model_server, tmp_path):
    root = tmp_path / "workdirs"
    root.mkdir()
    probe = '@tool terminal {"command": "pwd; ls -A | wc -l; touch left-behind"}\nWhere am I?'
    dataset = write_jsonl(tmp_path / "d.jsonl", [{"prompt": probe + " 1"}, {"prompt": probe + " 2"},
                                                 {"prompt": probe + " 3", "cwd": str(tmp_path)}])
    proc = run_cli(_args(dataset, model_server), tmp_path, env={"TMPDIR": str(root)})
    assert proc.returncode == 0, proc.stderr
    rows = read_jsonl(tmp_path / "data" / "r" / "trajectories.jsonl")
    dirs = [_terminal_output(r).split()[0] for r in rows]
    assert dirs[0] != dirs[1] and all(d.startswith(str(root)) for d in dirs[:2])
    assert [_terminal_output(r).split()[1] for r in rows[:2]] == ["0", "0"]  # empty at start
    assert dirs[2] == str(tmp_path) and (tmp_path / "left-behind").exists()  # the row's cwd is kept
    assert list(root.iterdir()) == []  # per-prompt workdirs are removed

    proc = run_cli(_args(dataset, model_server, "--overwrite", "--keep_workdirs"), tmp_path, env={"TMPDIR": str(root)})
    assert proc.returncode == 0
    assert len(list(root.iterdir())) == 2


@pytest.mark.skipif(shutil.which("bwrap") is None and not os.environ.get("CI"), reason="bubblewrap not installed")
def test_bwrap_sandbox_isolates_commands(model_server, tmp_path):
    command = ("touch /usr/abr-escape 2>&1 || echo host-read-only; echo data > in-workdir && cat in-workdir; "
               "tail -n +3 /proc/net/dev | cut -d: -f1; echo pid-$$")
    dataset = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f'@tool terminal {{"command": "{command}"}}\nProbe.'}])
    proc = run_cli(_args(dataset, model_server, "--sandbox=bwrap"), tmp_path)
    assert proc.returncode == 0, proc.stderr
    (row,) = read_jsonl(tmp_path / "data" / "r" / "trajectories.jsonl")
    output = _terminal_output(row)
    assert "host-read-only" in output and not os.path.exists("/usr/abr-escape")
    assert "data" in output
    interfaces = output.split("in-workdir")[-1].split("data", 1)[1].split("pid-")[0].split()
    assert interfaces == ["lo"]  # no network but loopback
    assert int(output.rsplit("pid-", 1)[1].split()[0]) < 100  # its own PID namespace


def test_bwrap_without_bubblewrap_is_a_clear_error(model_server, tmp_path):
    dataset = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "hi"}])
    proc = run_cli(_args(dataset, model_server, "--sandbox=bwrap"), tmp_path, env={"PATH": str(tmp_path)})
    assert proc.returncode == 1
    assert "--sandbox=bwrap needs bubblewrap" in proc.stderr


def test_a_relative_row_cwd_is_refused_without_a_sandbox(model_server, tmp_path):
    """"../.." meant a folder relative to wherever the runner was started."""
    dataset = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "A.", "cwd": str(tmp_path)}, {"prompt": "B.", "cwd": "../.."},
                                                 {"prompt": "C.", "cwd": "~"}])
    proc = run_cli(_args(dataset, model_server), tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"{dataset}:2:" in proc.stderr and f"{dataset}:3:" in proc.stderr and f"{dataset}:1:" not in proc.stderr
    assert "'cwd' must be an absolute path under --terminal_env=local" in proc.stderr
    assert not model_server.requests_for(".")  # nothing paid for
