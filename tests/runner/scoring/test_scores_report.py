"""report.html shows the scores: their distribution, pass@k, and each sample's scores beside its
conversation (in the page's data, and drawn in a real browser)."""

from __future__ import annotations

import json
import re

import pytest

from tests.conftest import run_cli, write_jsonl
from tests.runner.output.test_report import CHROMIUM_ARGS, CHROMIUM, _require_chromium

ROWS = [
    {"prompt": "@answer Paris\nFirst?", "target": "paris"},
    {"prompt": "@answer Lyon\nSecond?", "target": "paris"},
    {"prompt": "@answer paris, surely\nThird?", "target": "paris"},
    {"prompt": "@fail 400 1\nFails.", "target": "x"},
]


def _embedded(run, element_id):
    html = (run / "report.html").read_text(encoding="utf-8")
    return json.loads(re.search(rf'<script type="application/json" id="{element_id}">(.*?)</script>', html, re.S).group(1))


def _scored_run(tmp_path, remote_args):
    dataset = write_jsonl(tmp_path / "d.jsonl", ROWS)
    proc = run_cli([f"--dataset_file={dataset}", "--run_name=r", "--batch_size=5", "--distribution=terminal_only",
                    *remote_args, "--scorer=includes,exact"], tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    return tmp_path / "data" / "r"


def test_report_data_carries_the_scores(tmp_path, model_server, remote_args):
    run = _scored_run(tmp_path, remote_args)
    summary = _embedded(run, "summary-data")
    scoring = summary["scoring"]
    assert scoring["distribution"] == [[0.0, 1], [1.0, 2]]
    assert scoring["samples"] == 3 and scoring["passed"] == 2 and scoring["scorers"][:2] == ["includes", "exact"]
    assert scoring["pass_at_k"]["1"] == pytest.approx(2 / 3, abs=1e-6)
    rows = _embedded(run, "rows-data")
    fields = rows["fields"]
    by_index = {r[0]: dict(zip(fields, r)) for r in rows["rows"]}
    assert [(by_index[i]["score"], by_index[i]["passed"]) for i in range(4)] == [(1.0, 1), (0.0, 0), (1.0, 1), (None, None)]
    full = _embedded(run, "full-data")["rows"]
    first = next(entry for entry in full.values() if entry["meta"].get("scores") and "First?" in entry["turns"][1][1])
    assert [(e["scorer"], e["value"], e["passed"]) for e in first["meta"]["scores"]] == [("includes", 1.0, True),
                                                                                     ("exact", 1.0, True)]
    # Without scorers the page has no scores panel data.
    dataset = write_jsonl(tmp_path / "plain.jsonl", [{"prompt": "Q"}])
    assert run_cli([f"--dataset_file={dataset}", "--run_name=plain", "--batch_size=5", *remote_args], tmp_path).returncode == 0
    assert _embedded(tmp_path / "data" / "plain", "summary-data")["scoring"] is None


@pytest.mark.browser
def test_scores_in_the_browser(tmp_path, model_server, remote_args):
    _require_chromium()
    from playwright.sync_api import sync_playwright

    run = _scored_run(tmp_path, remote_args)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1360, "height": 900})
            problems: list[str] = []
            page.on("pageerror", lambda err: problems.append(f"page error: {err}"))
            page.goto((run / "report.html").as_uri())
            page.wait_for_selector("body[data-ready=true]", timeout=30_000)
            assert page.is_visible("#scoring-panels")
            assert page.locator('#chart-scores g[data-label="value 1"]').count() == 1
            assert "2 · 66.7%" in page.text_content('#chart-scores g[data-label="value 1"]')
            assert "pass@1" in page.text_content("#scoring-figures") and "66.7%" in page.text_content("#scoring-figures")
            assert page.text_content('#rows tbody tr[data-index="1"] td.score') == "0 ✗"
            assert page.text_content('#rows tbody tr[data-index="0"] td.score') == "1 ✓"
            page.click('#rows tbody tr[data-index="1"]')
            page.wait_for_selector("#viewer:not([hidden])")
            box = page.text_content('#viewer .scores [data-scorer="includes"]')
            assert "includes (primary): 0 ✗ not passed" in box and "no target" in box
            assert problems == []
        finally:
            browser.close()
