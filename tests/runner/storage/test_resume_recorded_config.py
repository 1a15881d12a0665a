"""--resume takes the run's recorded configuration: only --run_name (and the key) are needed again."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.conftest import SECRET_KEY, read_jsonl, run_cli, write_jsonl


def test_resume_with_only_the_run_name_continues_the_recorded_configuration(tmp_path, model_server, remote_args):
    rows = [{"prompt": "First?"}, {"prompt": "Second?"}, {"prompt": "Third?"}]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    first = run_cli([f"--dataset_file={data}", "--batch_size=1", "--run_name=r", *remote_args,
                     "--distribution=minimal", "--max_turns=3", "--max_samples=2"], tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    served = len(model_server.requests)

    # The key is never recorded: it comes from the environment again. --max_samples is this
    # invocation's (not fingerprinted): the third row runs now, against the recorded endpoint and model.
    again = run_cli(["--run_name=r", "--resume"], tmp_path, env={"OPENAI_API_KEY": SECRET_KEY})
    assert again.returncode == 0, again.stdout + again.stderr
    assert "Resuming: 2 of 3 rows already committed; 1 to run" in again.stdout
    chat = [r for r in model_server.requests[served:] if r.path.endswith("/chat/completions")]
    assert chat and all(r.body["model"] == "test-model" for r in chat)
    config = json.loads((tmp_path / "data" / "r" / "config.json").read_text())
    assert len(config["invocations"]) == 2
    assert (config["config"]["model"], config["config"]["max_turns"], config["config"]["distribution"]) == (
        "test-model", 3, "minimal")
    assert len(read_jsonl(tmp_path / "data" / "r" / "trajectories.jsonl")) == 3

    # A fingerprinted flag given on resume is checked against the record, naming the old and the new value.
    changed = run_cli(["--run_name=r", "--resume", "--max_turns=5", "--model=other-model"], tmp_path,
                      env={"OPENAI_API_KEY": SECRET_KEY})
    assert changed.returncode == 1, changed.stdout + changed.stderr
    assert "max_turns: 3 -> 5" in changed.stderr and "model: 'test-model' -> 'other-model'" in changed.stderr
    assert SECRET_KEY not in (tmp_path / "data" / "r" / "config.json").read_text()


def test_resume_refuses_rows_whose_config_json_cannot_be_read(tmp_path):
    """Rows without a readable config.json cannot be checked against this invocation's
    configuration (nor resampled with their seed): --resume refuses, naming the file, and keeps
    everything as it is; --allow_config_change continues with this invocation's configuration."""
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "First?"}, {"prompt": "Second?"}])
    flags = [f"--dataset_file={data}", "--batch_size=1", "--run_name=r", "--model=mock"]
    first = run_cli([*flags, "--max_samples=1"], tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    run_dir = tmp_path / "data" / "r"
    (run_dir / "config.json").write_text('{"config": {"model": "mo', encoding="utf-8")
    def files():  # (the lock records each invocation that takes it)
        return {path.name: path.read_bytes() for path in run_dir.iterdir() if path.is_file() and path.name != ".lock"}

    before = files()

    refused = run_cli([*flags, "--resume", "--max_turns=4"], tmp_path)
    assert refused.returncode == 1, refused.stdout + refused.stderr
    errors = [line for line in refused.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and "config.json" in errors[0] and "--allow_config_change" in errors[0], refused.stderr
    assert files() == before

    allowed = run_cli([*flags, "--resume", "--allow_config_change"], tmp_path)
    assert allowed.returncode == 0, allowed.stdout + allowed.stderr
    assert len(read_jsonl(run_dir / "trajectories.jsonl")) == 2


def test_resume_with_only_the_run_name_keeps_the_rows_kept_by_keep_no_reasoning(tmp_path, model_server, remote_args):
    """A run made with --keep_no_reasoning is resumed with it: its rows without reasoning stay in
    trajectories.jsonl (they were dropped from it when a resume applied the default filter again)."""
    rows = [{"prompt": f"Question {i}?\n@reasoning none"} for i in range(3)]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    first = run_cli([f"--dataset_file={data}", "--batch_size=1", "--run_name=r", *remote_args, "--keep_no_reasoning",
                     "--max_samples=2"], tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    run_dir = tmp_path / "data" / "r"
    assert len(read_jsonl(run_dir / "trajectories.jsonl")) == 2
    again = run_cli(["--run_name=r", "--resume"], tmp_path, env={"OPENAI_API_KEY": SECRET_KEY})
    assert again.returncode == 0, again.stdout + again.stderr
    assert len(read_jsonl(run_dir / "trajectories.jsonl")) == 3
    assert json.loads((run_dir / "config.json").read_text())["config"]["keep_no_reasoning"] is True
    # The filter can be turned on again explicitly.
    filtered = run_cli(["--run_name=r", "--resume", "--nokeep_no_reasoning"], tmp_path, env={"OPENAI_API_KEY": SECRET_KEY})
    assert filtered.returncode == 0, filtered.stdout + filtered.stderr
    assert read_jsonl(run_dir / "trajectories.jsonl") == []


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
def test_resume_with_only_the_run_name_keeps_the_sandbox_the_container_limits_and_the_exports(tmp_path):
    """A resume given only --run_name runs the rows left in the sandbox the run was started with (it
    ran them unsandboxed), and rebuilds the exports it was started with (they were left behind
    trajectories.jsonl)."""
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "First?"}, {"prompt": "Second?"}])
    first = run_cli([f"--dataset_file={data}", "--batch_size=1", "--run_name=r", "--model=mock", "--sandbox=bwrap",
                     "--container_network=none", "--container_memory=1g", "--export=messages", "--max_samples=1"],
                    tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    again = run_cli(["--run_name=r", "--resume"], tmp_path)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "no sandbox" not in again.stdout + again.stderr
    run_dir = tmp_path / "data" / "r"
    config = json.loads((run_dir / "config.json").read_text())["config"]
    assert (config["tools"]["sandbox"], config["tools"]["container_network"], config["tools"]["container_memory"]) == (
        "bwrap", "none", "1g")
    assert config["export"] == ["messages"]
    assert len(read_jsonl(run_dir / "export" / "messages.jsonl")) == len(read_jsonl(run_dir / "trajectories.jsonl")) == 2
