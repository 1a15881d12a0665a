"""Isolation through the real CLI: under --sandbox=bwrap the file tools see only what the sandbox
sees (no escape through a host symlink), a row's cwd cannot make the host writable, and an
unisolated run as root says so at start."""

from __future__ import annotations

import json
import os
import shutil
import uuid

import pytest

from tests.conftest import read_jsonl, run_cli, write_jsonl

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
