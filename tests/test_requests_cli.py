"""What the runner sends and how it reads replies, through the real CLI against the local server
(issue 12: tool_choice, the summary request, caching, cost, replies real servers send)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import read_jsonl, run_cli, write_jsonl

TERMINAL = '@tool terminal {"command": "echo marker-$((6*7))"}\n'


def _run(tmp_path, dataset, remote_args, *extra, run_name="r", timeout=300):
    args = [f"--dataset_file={dataset}", f"--run_name={run_name}", "--batch_size=5",
            "--distribution=terminal_only", *remote_args, *extra]
    return run_cli(args, tmp_path, timeout=timeout)


def _out(tmp_path, run_name="r") -> Path:
    return tmp_path / "data" / run_name


def _chat(server):
    return [r.body for r in server.requests if r.path.endswith("/chat/completions")]


def _batch_lines(tmp_path, run_name="r") -> list[dict]:
    return [r for p in sorted(_out(tmp_path, run_name).glob("batch_*.jsonl")) for r in read_jsonl(p)]


def test_tool_choice_auto_is_sent_so_a_server_that_needs_it_calls_tools(tmp_path, model_server, remote_args):
    dataset = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "@needs_tool_choice\n" + TERMINAL + "Run it."}])
    proc = _run(tmp_path, dataset, remote_args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    bodies = _chat(model_server)
    assert bodies and all(b["tool_choice"] == "auto" for b in bodies)
    (row,) = read_jsonl(_out(tmp_path) / "trajectories.jsonl")
    assert row["tool_stats"]["terminal"] == {"count": 1, "success": 1, "failure": 0}
    config = json.loads((_out(tmp_path) / "config.json").read_text())
    assert config["config"]["tool_choice"] == "auto" and config["fingerprint_fields"]["tool_choice"] == "auto"


def test_tool_choice_flag_overrides_and_enters_the_fingerprint(tmp_path, model_server, remote_args):
    dataset = write_jsonl(tmp_path / "d.jsonl", [{"prompt": TERMINAL + "Run it."}])
    proc = _run(tmp_path, dataset, remote_args, "--tool_choice=none")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [b["tool_choice"] for b in _chat(model_server)] == ["none"]
    (row,) = read_jsonl(_out(tmp_path) / "trajectories.jsonl")
    assert row["tool_stats"]["terminal"]["count"] == 0
    assert json.loads((_out(tmp_path) / "config.json").read_text())["fingerprint_fields"]["tool_choice"] == "none"
    proc = _run(tmp_path, dataset, remote_args, "--tool_choice=required", "--resume")
    assert proc.returncode == 1 and "tool_choice" in proc.stderr
    proc = _run(tmp_path, dataset, remote_args, "--tool_choice=sometimes", run_name="bad")
    assert proc.returncode == 1 and "--tool_choice must be one of: auto, required, none" in proc.stderr


def test_turn_limit_summary_request_keeps_the_tools_with_tool_choice_none(tmp_path, model_server, remote_args):
    prompt = TERMINAL + '@tool terminal {"command": "echo second"}\nTwo calls, one turn.'
    dataset = write_jsonl(tmp_path / "d.jsonl", [{"prompt": prompt}])
    proc = _run(tmp_path, dataset, remote_args, "--max_turns=1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    first, summary = _chat(model_server)
    assert first["tool_choice"] == "auto"
    assert summary["tool_choice"] == "none" and summary["tools"] == first["tools"]
    assert any(m.get("tool_calls") for m in summary["messages"])  # the server rejects this without tools
    (row,) = read_jsonl(_out(tmp_path) / "trajectories.jsonl")
    assert row["metadata"]["stop_reason"] == "turn_limit" and row["api_calls"] == 1
    assert row["conversations"][-1]["from"] == "gpt" and "Final answer" in row["conversations"][-1]["value"]
