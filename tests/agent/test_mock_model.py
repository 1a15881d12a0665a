"""The offline model (--model=mock) plans in linear time on a bounded prefix: huge prompts are cheap."""

from __future__ import annotations

import json
import time

import pytest

from agent.mock_model import plan_tool_calls
from tests.conftest import read_jsonl, run_cli

OFFERED = {"terminal", "write_file", "read_file", "patch", "vision_analyze", "web_extract", "search_files"}


def test_plan_reads_urls_images_and_file_names():
    plan = plan_tool_calls("Describe https://x.org/cat.png (or /tmp/a.JPG) and fix src/notes.md, please.", OFFERED)
    assert plan[0] == ("web_extract", {"urls": ["https://x.org/cat.png"], "char_limit": 2000})
    assert plan[1][0] == "vision_analyze" and plan[1][1]["image_url"] == "https://x.org/cat.png"
    assert [name for name, _ in plan[2:]] == ["write_file", "patch", "read_file"]
    assert plan[2][1]["path"] == "notes.md"


@pytest.mark.parametrize("body", ["a" * 1_000_000, "a-" * 500_000, "/" * 1_000_000, "x." * 500_000, "word " * 200_000])
def test_planning_a_megabyte_prompt_takes_milliseconds(body):
    started = time.perf_counter()
    plan_tool_calls("List the files. " + body, OFFERED)
    assert time.perf_counter() - started < 0.5  # was minutes: unanchored searches restarted at every position


def test_a_megabyte_prompt_runs_through_the_cli_quickly(tmp_path):
    prompt = "List the files here. " + "a-" * 500_000
    (tmp_path / "big.jsonl").write_text(json.dumps({"prompt": prompt}) + "\n", encoding="utf-8")
    started = time.monotonic()
    proc = run_cli(["--dataset_file=big.jsonl", "--batch_size=1", "--run_name=big", "--model=mock",
                    "--distribution=terminal_only"], tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert time.monotonic() - started < 60
    [row] = read_jsonl(tmp_path / "data" / "big" / "trajectories.jsonl")
    assert row["conversations"][1]["value"] == prompt


def test_tool_models_answered_by_the_mock_are_labelled_as_the_mock(tmp_path):
    """mixture_of_agents under --model=mock asks the offline model in the reference and aggregator
    models' place: the spend lists those requests as the mock's, so nothing reads as paid traffic."""
    (tmp_path / "d.jsonl").write_text(json.dumps({"prompt": "Give your opinion: compare the pros and cons of tabs"}) + "\n")
    proc = run_cli(["--dataset_file=d.jsonl", "--batch_size=5", "--run_name=moa", "--model=mock",
                    "--distribution=default"], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    row = read_jsonl(tmp_path / "data" / "moa" / "trajectories.jsonl")[0]
    assert "mixture_of_agents" in row["metadata"]["tools_offered"] and row["tool_stats"]["mixture_of_agents"]["count"] == 1
    models = {entry["model"]: entry["requests"] for entry in row["metadata"]["usage"]["by_model"]}
    assert models["mock (for anthropic/claude-sonnet-4.6)"] == 2  # a reference model and the aggregator
    assert models["mock (for openai/gpt-5)"] == 1
    assert all(name == "mock" or name.startswith("mock (for ") for name in models), models
    stats = json.loads((tmp_path / "data" / "moa" / "statistics.json").read_text())
    assert set(stats["spend_by_model"]) == set(models)
    by_model = next(line for line in proc.stdout.splitlines() if "by model:" in line)
    assert "mock (for anthropic/claude-sonnet-4.6) 2 requests" in by_model
    assert "; anthropic/" not in by_model and ": anthropic/" not in by_model
