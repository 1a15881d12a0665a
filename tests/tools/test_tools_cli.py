"""Web and browser tools through the CLI with the offline model, against local pages."""

from __future__ import annotations

import json
import os

import pytest

from tests.conftest import read_jsonl, run_cli, write_jsonl
from tests.helpers.web_fixtures import FixtureSite


@pytest.fixture
def site():
    with FixtureSite() as site:
        yield site


def _args(dataset, *extra):
    return [f"--dataset_file={dataset}", "--run_name=r", "--batch_size=4", "--model=mock", *extra]


def test_unconfigured_tools_are_not_offered_and_warned_once(tmp_path):
    dataset = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"Research the latest news item {i}."} for i in range(3)])
    proc = run_cli(_args(dataset, "--distribution=minimal"), tmp_path, env={"SEARXNG_URL": ""})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("Not offered to the model in this run: web_search (no search backend configured") == 1
    for row in read_jsonl(tmp_path / "data" / "r" / "trajectories.jsonl"):
        assert row["toolsets_used"] == ["web"]
        assert row["metadata"]["tools_offered"] == ["web_extract"]
        assert row["tool_stats"]["web_search"]["count"] == 0


@pytest.mark.browser
def test_offline_model_browses_and_searches_local_pages(tmp_path, site):
    if not os.path.exists("/usr/bin/chromium") and not os.environ.get("CI"):
        pytest.skip("chromium is not installed")
    prompt = f"Research the latest about the page at {site.url('/')} and tell me what it offers."
    dataset = write_jsonl(tmp_path / "d.jsonl", [{"prompt": prompt}])
    proc = run_cli(_args(dataset, "--distribution=default"), tmp_path,
                   env={"SEARXNG_URL": site.url("")})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (row,) = read_jsonl(tmp_path / "data" / "r" / "trajectories.jsonl")
    assert "web_search" in row["metadata"]["tools_offered"] and "browser_navigate" in row["metadata"]["tools_offered"]
    for tool in ("browser_navigate", "browser_snapshot", "web_search"):
        assert row["tool_stats"][tool] == {"count": 1, "success": 1, "failure": 0}, tool
    responses = [t["value"] for t in row["conversations"] if t["from"] == "tool"]
    assert any("[@e" in r for r in responses)  # the snapshot lists interactive elements with refs
    assert any("Result 1 for" in r for r in responses)  # the SearXNG stand-in answered the search
    assert site.requests_to("/search")
