"""report.html: the summary numbers of a hand-written run, the page's data and escaping, and the
page itself in Chromium against a real small run through the CLI."""

from __future__ import annotations

import json
import os
import re
from datetime import datetime
from pathlib import Path

import pytest

from runner.output.finalize import build_statistics, merge_run, run_time, write_statistics
from runner.output.report import choose_sample, report_details, summarise_run, write_report
from tests.conftest import REPO, read_jsonl, run_cli, write_jsonl
from tools.registry import ALL_TOOL_NAMES

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
ARTIFACTS = REPO / "tests" / "artifacts"
HOSTILE = '</script><script>window.__xss = 1</script><img src=x onerror="window.__xss = 2"> <!-- & "quotes"'


# --- a run written by hand ---------------------------------------------------------------------


def _usage(prompt: int, completion: int, cost: float, retries: int = 0) -> dict:
    return {"requests": 2 + retries, "retries": retries, "prompt_tokens": prompt, "completion_tokens": completion,
            "reasoning_tokens": completion // 2, "cached_tokens": 0, "total_tokens": prompt + completion, "cost": cost}


def _meta(key: str, ts: str, run_id: str = "run1", usage: dict | None = None, attempt: int = 1, duration: float = 2.0) -> dict:
    return {"batch_num": 0, "timestamp": ts, "model": "m", "row_key": key, "id": f"id-{key}", "run_id": run_id,
            "attempt": attempt, "duration_seconds": duration, "usage": usage or {}, "seed": None,
            "tools_offered": ["terminal"], "stop_reason": "final_answer"}


def _stats(**calls: tuple[int, int, int]) -> dict:
    stats = {name: {"count": 0, "success": 0, "failure": 0} for name in ALL_TOOL_NAMES}
    for name, (count, success, failure) in calls.items():
        stats[name] = {"count": count, "success": success, "failure": failure}
    return stats


def _ok(key, index, ts, *, prompt="Do it", tools=None, toolsets=("terminal",), turns=2, with_reasoning=None,
        completed=True, partial=False, usage=None, run_id="run1", attempt=1, extra_turns=()):
    tools = tools or {}
    conversation = [
        {"from": "system", "value": "You are a function-calling AI model. " + "<tools>[...]</tools> " * 40},
        {"from": "human", "value": prompt},
        {"from": "gpt", "value": '<think>\nI should run it.\n</think>\n<tool_call>\n{"name": "terminal", "arguments": '
                                 '{"command": "echo hi"}}\n</tool_call>'},
        {"from": "tool", "value": '<tool_response>\n{"tool_call_id": "c1", "name": "terminal", "content": '
                                  '{"output": "hi\\n", "exit_code": 0}}\n</tool_response>'},
        *extra_turns,
        {"from": "gpt", "value": "<think>\nDone.\n</think>\nAll done."},
    ]
    return {
        "prompt_index": index, "conversations": conversation,
        "metadata": _meta(key, ts, run_id, usage, attempt), "completed": completed, "partial": partial,
        "api_calls": turns, "toolsets_used": list(toolsets), "tool_stats": _stats(**tools),
        "tool_error_counts": {name: 0 for name in ALL_TOOL_NAMES},
        "reasoning_stats": {"total_assistant_turns": turns, "turns_with_reasoning": turns if with_reasoning is None else with_reasoning,
                            "turns_without_reasoning": 0 if with_reasoning is None else turns - with_reasoning},
    }


def _discarded(key, index, ts, toolsets=("terminal",)):
    return {"prompt_index": index, "discarded": "no_reasoning", "prompt": "Answer plainly",
            "metadata": _meta(key, ts, usage=_usage(50, 10, 0.001)), "api_calls": 1, "toolsets_used": list(toolsets),
            "tool_stats": _stats(), "tool_error_counts": {}, "reasoning_stats": {
                "total_assistant_turns": 1, "turns_with_reasoning": 0, "turns_without_reasoning": 1}}


def _failed(key, index, ts, error_class, run_id="run1"):
    return {"prompt_index": index, "failed": True, "error": f"HTTP 500: boom ({error_class})", "error_class": error_class,
            "prompt": f"Prompt {index}", "metadata": _meta(key, ts, run_id, usage=_usage(30, 0, 0.0005))}


KEYS = [f"k{i}" for i in range(10)]  # the dataset: 10 rows, k7..k9 never ran (k8 only as a filtered line)
DATASET = {k: i for i, k in enumerate(KEYS)}


def _lines(records) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


@pytest.fixture
def hand_run(tmp_path) -> Path:
    """3 ok (one partial, one at the turn limit), 1 discarded, 2 failed, 1 failed-then-ok, 1 filtered."""
    run = tmp_path / "hand"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({
        "config": {"run_name": "hand", "distribution": "development", "model": "m", "batch_size": 4, "report_samples": 500},
        "fingerprint": "feedfacecafebeef", "fingerprint_fields": {"model": "m", "distribution": "development"},
        "run_id": "run2", "created_at": "2026-01-01T10:00:00", "updated_at": "2026-01-01T11:00:00"}))
    batch0 = [
        _ok("k0", 0, "2026-01-01T10:00:10", tools={"terminal": (2, 1, 1)}, toolsets=("terminal", "file"), turns=3,
            usage=_usage(100, 20, 0.01, retries=1), prompt=HOSTILE),
        _ok("k1", 1, "2026-01-01T10:00:20", tools={"read_file": (1, 1, 0)}, partial=True, completed=False, turns=2,
            with_reasoning=1, usage=_usage(200, 40, 0.02)),
        _ok("k2", 2, "2026-01-01T10:00:30", toolsets=("file", "web"), completed=False, turns=10, usage=_usage(300, 60, 0.03)),
        _discarded("k3", 3, "2026-01-01T10:00:40"),
    ]
    batch1 = [
        _failed("k4", 4, "2026-01-01T10:00:50", "provider"),
        _failed("k5", 5, "2026-01-01T10:01:00", "timeout"),
        _failed("k6", 6, "2026-01-01T10:01:10", "agent"),
        _ok("k8", 8, "2026-01-01T10:01:20") | {"tool_stats": {"no_such_tool": {"count": 1, "success": 1, "failure": 0}}},
    ]
    batch2 = [  # a --resume an hour later: k6 succeeds on its second attempt
        _ok("k6", 6, "2026-01-01T11:00:05", tools={"terminal": (1, 1, 0), "write_file": (1, 0, 1)},
            toolsets=("terminal", "file"), turns=4, usage=_usage(400, 80, 0.04), run_id="run2", attempt=2),
    ]
    (run / "batch_0.jsonl").write_text(_lines(batch0) + "this is not json\n" + '{"no": "row key"}\n')
    (run / "batch_1.jsonl").write_text(_lines(batch1))
    (run / "batch_2.jsonl").write_text(_lines(batch2) + '{"prompt_index": 9, "torn')  # an unfinished last line
    return run


def _finalize(run: Path, keys=KEYS) -> dict:
    """statistics.json as the runner writes it at the end of a run."""
    view = merge_run(run, {k: i for i, k in enumerate(keys)}, log=lambda _: None, detail=report_details())
    return write_statistics(run, build_statistics(
        view, run_name="hand", distribution="development", total_prompts=len(keys), batch_size=4, model="m",
        run_time=run_time([], view), rows_this_run=7, fingerprint="feedfacecafebeef"))


def test_summary_counts_each_row_once_by_its_best_attempt(hand_run):
    stats = _finalize(hand_run)
    s = summarise_run(hand_run, dataset=DATASET)
    assert s["rows"] == 7
    assert s["outcomes"] == {"ok": 4, "completed": 2, "partial": 1, "turn_limit": 1, "discarded": 1, "failed": 2,
                             "not_run": 3, "filtered": 1}
    assert s["failed_by_class"] == {"provider": 1, "timeout": 1}  # k6's agent failure was retried into an ok row
    assert s["retried_rows"] == 1
    assert s["total_prompts"] == 10
    assert s["files"] == {"batch_files": 3, "lines": 11, "unreadable_lines": 2, "torn_files": [], "stale_rows": 0}
    # The same numbers as statistics.json (the runner's own merge).
    assert s["outcomes"] == stats["outcomes"]
    assert s["failed_by_class"] == stats["failed_by_class"]
    assert s["reasoning_statistics"] == stats["reasoning_statistics"]
    assert s["tokens"] == stats["tokens"] and s["cost"] == stats["cost"] and s["spend"] == stats["spend"]
    assert s["retries"] == stats["retries"] == 1 and s["api_calls"] == stats["api_calls"] == 19
    assert {k: {f: v[f] for f in ("count", "success", "failure", "success_rate")} for k, v in s["tool_statistics"].items()} == {
        k: {f: v[f] for f in ("count", "success", "failure", "success_rate")} for k, v in stats["tool_statistics"].items()}
    assert s["saved_statistics"]["outcomes"] == stats["outcomes"] and s["statistics_outdated"] is False


def test_summary_tools_toolsets_histograms_and_time(hand_run):
    _finalize(hand_run)
    s = summarise_run(hand_run, dataset=DATASET)
    assert s["tool_statistics"] == {
        "terminal": {"count": 3, "success": 2, "failure": 1, "success_rate": 66.67, "rows": 2},
        "read_file": {"count": 1, "success": 1, "failure": 0, "success_rate": 100.0, "rows": 1},
        "write_file": {"count": 1, "success": 0, "failure": 1, "success_rate": 0.0, "rows": 1},
    }
    # Five rows record their toolsets (4 ok + 1 discarded); targets come from the "development" distribution.
    assert s["toolset_rows"] == 5
    # Lines without metadata.toolsets_sampled (written before it existed) count as sampled = offered.
    assert s["toolsets"] == {
        "terminal": {"rows": 4, "share": 80.0, "sampled_rows": 4, "sampled_share": 80.0, "target": 80},
        "file": {"rows": 3, "share": 60.0, "sampled_rows": 3, "sampled_share": 60.0, "target": 80},
        "moa": {"rows": 0, "share": 0.0, "sampled_rows": 0, "sampled_share": 0.0, "target": 60},
        "web": {"rows": 1, "share": 20.0, "sampled_rows": 1, "sampled_share": 20.0, "target": 30},
        "vision": {"rows": 0, "share": 0.0, "sampled_rows": 0, "sampled_share": 0.0, "target": 10},
    }
    assert s["reasoning_statistics"] == {"total_assistant_turns": 19, "turns_with_reasoning": 18, "turns_without_reasoning": 1}
    assert s["discarded_no_reasoning"] == 1
    assert s["histograms"]["turns"] == {"1": 1, "2": 1, "3": 1, "4": 1, "10": 1}
    assert s["histograms"]["tool_calls"] == {"0": 2, "1": 1, "2": 2}
    # Spend: every attempt (the discarded and failed ones included), then split.
    assert s["tokens"]["total_tokens"] == 1200 + 60 + 3 * 30 and s["cost"] == pytest.approx(0.1 + 0.001 + 3 * 0.0005)
    spend = s["spend"]
    assert spend["kept"]["total_tokens"] == 120 + 240 + 360 + 480 and spend["kept"]["cost"] == 0.1
    assert spend["discarded"]["total_tokens"] == 60 and spend["failed"]["attempts"] == 3
    assert spend["other"]["attempts"] == 1  # k8's filtered line
    assert spend["all"]["attempts"] == 9 and spend["all"]["requests"] == sum(spend[b]["requests"] for b in
                                                                              ("kept", "discarded", "failed", "other"))

    timeline = s["timeline"]
    assert timeline["start"].startswith("2026-01-01T10:00:0")  # the first invocation's start (10:00:10 minus 2 s)
    assert {k: sum(v) for k, v in timeline["series"].items()} == {"ok": 3, "partial": 1, "discarded": 1, "failed": 2}
    assert len(timeline["invocation_starts"]) == 2
    d = s["duration"]
    assert [i["run_id"] for i in d["invocations"]] == ["run1", "run2"]
    assert d["invocations"][0]["lines"] == 8 and d["invocations"][1]["lines"] == 1
    assert d["active_seconds"] == pytest.approx(72 + 2)  # 10:00:08..10:01:20, then 11:00:03..11:00:05
    assert d["span_seconds"] == pytest.approx(3595)  # first row 10:00:10, last 11:00:05
    local = lambda text: datetime.fromisoformat(text).astimezone().isoformat()  # noqa: E731 (with its offset)
    assert d["first_row_at"] == local("2026-01-01T10:00:10") and d["last_row_at"] == local("2026-01-01T11:00:05")
    assert d["invocation_count"] == 2 and d["active_seconds"] == s["statistics"]["duration_seconds"]
    assert s["fingerprint"] == "feedfacecafebeef" and s["config"]["distribution"] == "development"


def test_summary_without_statistics_json_or_batch_files(tmp_path, hand_run):
    s = summarise_run(hand_run)  # never finalised: a run stopped hard; config.json names no dataset
    assert s["saved_statistics"] is None and s["statistics_outdated"] is True
    assert s["outcomes"]["not_run"] is None and s["outcomes"]["ok"] == 4
    empty = tmp_path / "empty"
    empty.mkdir()
    s = summarise_run(empty)
    assert s["rows"] == 0 and s["timeline"] is None and s["tool_statistics"] == {}
    assert write_report(empty, log=lambda _: None).exists()


def _script_json(html: str, element_id: str):
    match = re.search(rf'<script type="application/json" id="{element_id}">(.*?)</script>', html, re.S)
    assert match, element_id
    return json.loads(match.group(1))


def test_report_is_self_contained_escaped_and_atomic(hand_run):
    _finalize(hand_run)
    path = write_report(hand_run, log=lambda _: None)
    assert path == hand_run / "report.html"
    assert [p.name for p in hand_run.iterdir() if p.name.startswith(".report_")] == []  # no temp file left
    html = path.read_text(encoding="utf-8")
    assert not re.search(r"<(script|link|img|iframe)[^>]+(src|href)=", html)  # nothing loaded from anywhere
    assert "http://" not in html.replace("http://www.w3.org/2000/svg", "") and "https://" not in html
    assert html.count("</script>") == 4  # three data blocks and the program: no value closes an element
    assert "window.__xss" in html and "<script>window.__xss" not in html and "<img src=x" not in html
    assert "innerHTML" not in html
    rows = _script_json(html, "rows-data")
    assert len(rows["rows"]) == 7
    previews = {r[0]: r[7] for r in rows["rows"]}
    assert previews[0] == " ".join(HOSTILE.split())  # the hostile prompt survives intact, as data
    full = _script_json(html, "full-data")
    assert len(full["rows"]) == 7 and len(full["systems"]) == 1  # the long system prompt is stored once
    summary = _script_json(html, "summary-data")
    assert summary["sample"] == {"embedded": 7, "limit": 500, "rows": 7, "table": 7, "table_limit": 10_000}
    assert "run_dir" not in summary  # no local path in a file that gets shared


def test_report_bounds_the_full_conversations(hand_run):
    write_report(hand_run, max_full_conversations=3, log=lambda _: None)
    html = (hand_run / "report.html").read_text(encoding="utf-8")
    full = _script_json(html, "full-data")["rows"]
    assert len(full) == 3
    rows = _script_json(html, "rows-data")["rows"]
    outcomes = {rows[int(pos)][1] for pos in full}
    assert len(outcomes) == 3  # spread over classes, not the first three rows
    write_report(hand_run, max_full_conversations=3, log=lambda _: None)
    assert _script_json((hand_run / "report.html").read_text(encoding="utf-8"), "full-data")["rows"].keys() == full.keys()
    write_report(hand_run, max_full_conversations=0, log=lambda _: None)
    assert _script_json((hand_run / "report.html").read_text(encoding="utf-8"), "full-data")["rows"] == {}


def test_long_values_are_clipped_in_the_report_only(hand_run):
    huge = "x" * 200_000
    record = _ok("k9", 9, "2026-01-01T11:00:09", extra_turns=[{"from": "tool", "value": huge}])
    with open(hand_run / "batch_2.jsonl", "r+", encoding="utf-8") as handle:  # replace the torn tail by a full line
        text = handle.read()
        handle.seek(0)
        handle.write(text[: text.rindex("\n") + 1] + json.dumps(record) + "\n")
        handle.truncate()
    html = write_report(hand_run, log=lambda _: None).read_text(encoding="utf-8")
    rows = _script_json(html, "rows-data")["rows"]
    position = next(i for i, r in enumerate(rows) if r[0] == 9)
    turns = _script_json(html, "full-data")["rows"][str(position)]["turns"]
    clipped = next(t[1] for t in turns if t[0] == "tool" and t[1].startswith("xxx"))
    assert len(clipped) < 20_000 and "characters left out of this report" in clipped
    assert len(read_jsonl(hand_run / "batch_2.jsonl")[-1]["conversations"][4]["value"]) == 200_000


class _FakeRow:
    def __init__(self, key, sample_class):
        self.key, self.sample_class = key, sample_class


def test_sample_shares_the_budget_between_classes():
    rows = ([_FakeRow(f"ok{i}", "ok") for i in range(1000)] + [_FakeRow(f"d{i}", "discarded") for i in range(3)]
            + [_FakeRow(f"p{i}", "failed:provider") for i in range(40)] + [_FakeRow(f"t{i}", "failed:timeout") for i in range(7)])
    chosen = choose_sample(rows, 60)
    assert len(chosen) == 60 and chosen == sorted(set(chosen))
    by_class = {}
    for pos in chosen:
        by_class[rows[pos].sample_class] = by_class.get(rows[pos].sample_class, 0) + 1
    assert by_class == {"discarded": 3, "failed:timeout": 7, "failed:provider": 25, "ok": 25}
    assert choose_sample(rows, 60) == chosen  # deterministic
    ok_positions = [p for p in chosen if rows[p].sample_class == "ok"]
    assert max(ok_positions) - min(ok_positions) > 500  # spread over the run, not its first rows
    assert choose_sample(rows, 0) == [] and len(choose_sample(rows, 10_000)) == len(rows)


# --- the page in a browser, on a real run through the CLI --------------------------------------


def _require_chromium():
    reason = None
    if not Path(CHROMIUM).exists():
        reason = f"Chromium not found at {CHROMIUM}"
    else:
        try:
            import playwright.sync_api  # noqa: F401
        except ImportError:
            reason = "the playwright package is not installed"
    if reason and os.environ.get("CI"):
        pytest.fail(f"the report browser test needs Chromium under CI: {reason}")
    if reason:
        pytest.skip(reason)


TERMINAL = '@tool terminal {"command": "echo report-$((6*7))"}\n'


@pytest.mark.browser
def test_report_page_in_chromium(tmp_path, model_server, remote_args):
    _require_chromium()
    from playwright.sync_api import sync_playwright

    rows = [{"prompt": TERMINAL + f"Run the command, case {i}.", "id": f"row-{i}"} for i in range(6)]
    rows[2]["prompt"] = HOSTILE + "\n" + TERMINAL + '@tool write_file {"path": "a.txt", "content": "<b>hi</b>"}\n'
    rows += [
        {"prompt": "@reasoning none\nAnswer plainly.", "id": "plain"},
        {"prompt": "@fail 400 1\nA bad request.", "id": "bad-1"},
        {"prompt": "@fail 400 1\nAnother bad request.", "id": "bad-2"},
    ]
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    proc = run_cli([f"--dataset_file={dataset}", "--run_name=r", "--batch_size=4", "--distribution=terminal_only",
                    "--num_workers=3", *remote_args], tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr  # finished, with failed rows
    run = tmp_path / "data" / "r"
    assert "Report: report.html" in proc.stdout
    stats = json.loads((run / "statistics.json").read_text())
    assert stats["outcomes"]["ok"] == 6 and stats["outcomes"]["discarded"] == 1 and stats["outcomes"]["failed"] == 2
    failed_indexes = sorted(r["prompt_index"] for p in run.glob("batch_*.jsonl") for r in read_jsonl(p) if r.get("failed"))
    assert failed_indexes == [7, 8]

    proc = run_cli(["--report", "--run_name=r", "--report_samples=100"], tmp_path)  # rebuilt on demand, nothing run
    assert proc.returncode == 0 and "Report written to" in proc.stdout, proc.stdout + proc.stderr

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1360, "height": 900})
            problems: list[str] = []
            page.on("pageerror", lambda err: problems.append(f"page error: {err}"))
            page.on("dialog", lambda dialog: (problems.append(f"dialog: {dialog.message}"), dialog.dismiss()))
            page.on("request", lambda req: None if req.url.startswith(("file:", "data:", "about:")) else problems.append(req.url))
            page.goto((run / "report.html").as_uri())
            page.wait_for_selector("body[data-ready=true]", timeout=30_000)

            def kpi(name: str) -> int:
                return int(page.text_content(f'.card[data-kpi="{name}"] .num').replace(",", ""))

            outcomes = stats["outcomes"]
            assert kpi("ok") == outcomes["ok"] and kpi("discarded") == outcomes["discarded"]
            assert kpi("failed") == outcomes["failed"] and kpi("not_run") == outcomes["not_run"]
            assert kpi("partial") == outcomes["partial"] and kpi("total") == stats["total_prompts"]
            assert page.text_content('.card[data-kpi="failed"] .detail') == "provider 2 · retry with --resume"
            terminal = stats["tool_statistics"]["terminal"]
            assert f"{terminal['count']} calls" in page.text_content('#chart-tools g[data-label="terminal"]')
            assert page.locator("#chart-timeline svg path").count() >= 2
            assert page.locator("#chart-toolsets .marker").count() == 2  # terminal_only: terminal and file targets
            assert page.locator("#warnings .warn").count() == 0
            assert page.get_attribute("#result-count", "data-count") == str(len(rows))

            page.screenshot(path=str(ARTIFACTS / "report.png"), full_page=True)

            # Filter by outcome: exactly the failed rows.
            page.select_option("#f-outcome", "failed")
            shown = page.locator("#rows tbody tr")
            assert shown.count() == outcomes["failed"]
            assert sorted(int(i) for i in shown.evaluate_all("rows => rows.map(r => r.dataset.index)")) == failed_indexes
            assert set(shown.evaluate_all("rows => rows.map(r => r.dataset.outcome)")) == {"failed"}
            page.select_option("#f-class", label="provider (2)")
            assert page.locator("#rows tbody tr").count() == 2
            page.click("#btn-reset")

            page.fill("#f-text", "__xss")  # free text finds the hostile prompt, shown as text
            assert page.locator("#rows tbody tr").count() == 1
            assert "</script><script>" in page.text_content("#rows tbody tr td.preview")
            page.click("#btn-reset")
            page.select_option("#f-tool", label="write_file")
            assert page.get_attribute("#result-count", "data-count") == "1"
            page.click("#btn-reset")

            # Open a trajectory: its tool call and result are there and readable.
            page.click('#rows tbody tr[data-index="0"]')
            page.wait_for_selector("#viewer:not([hidden])")
            calls = page.locator("#viewer details.tool-call")
            assert calls.count() == 1 and "Tool call · terminal" in calls.first.text_content()
            assert "echo report-$((6*7))" in calls.first.text_content()
            page.click("#viewer details.tool-response summary")
            assert "report-42" in page.text_content("#viewer details.tool-response")
            assert page.locator("#viewer details.think").count() >= 1
            page.keyboard.press("ArrowRight")
            assert "Prompt #1" in page.text_content("#viewer-title")
            page.keyboard.press("Escape")
            assert page.is_hidden("#viewer")

            page.click('#rows tbody tr[data-index="2"]')  # the hostile prompt, rendered as text
            assert HOSTILE.split("\n")[0] in page.text_content("#viewer .turn.human")
            page.click("#viewer-close")

            # A failed row shows its error.
            page.select_option("#f-outcome", "failed")
            page.click("#rows tbody tr >> nth=0")
            assert "HTTP 400" in page.text_content("#viewer .error-box")
            page.click("#viewer-close")
            page.click("#btn-reset")

            # Random sample per class: every class present, at most 5 rows each.
            page.click("#btn-sample")
            assert page.locator("#sample-banner .banner").count() == 1
            sampled = page.locator("#rows tbody tr").evaluate_all("rows => rows.map(r => r.dataset.outcome)")
            assert set(sampled) == {"ok", "discarded", "failed"}
            assert sampled.count("ok") == 5 and sampled.count("discarded") == 1 and sampled.count("failed") == 2
            page.click("#sample-banner button:has-text('Back to the list')")
            assert page.get_attribute("#result-count", "data-count") == str(len(rows))

            assert page.evaluate("window.__xss") is None
            assert problems == []
        finally:
            browser.close()
    assert (ARTIFACTS / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.browser
def test_report_cards_legend_backends_and_throughput(tmp_path, model_server, remote_args):
    """The resume hint is on the failed card, the dashed invocation marks of the spend chart are in
    its legend, tool_backends reads as options (not a JSON blob), and the report's throughput is the
    console summary's, in the same unit and with the same stated definition."""
    _require_chromium()
    from playwright.sync_api import sync_playwright

    rows = [{"prompt": f"Answer {i}.", "id": f"row-{i}"} for i in range(4)]
    rows.append({"prompt": "@fail 400 1\nA bad request.", "id": "bad"})
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    proc = run_cli([f"--dataset_file={dataset}", "--run_name=r", "--batch_size=2", "--distribution=minimal",
                    "--price_input_per_mtok=1", "--price_output_per_mtok=2", *remote_args], tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    console_rate = re.search(r"throughput ([\d,.]+ rows/min) \(([^)]*)\)", proc.stdout)
    assert console_rate, proc.stdout
    run = tmp_path / "data" / "r"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1360, "height": 900})
            page.goto((run / "report.html").as_uri())
            page.wait_for_selector("body[data-ready=true]", timeout=30_000)
            assert "--resume" in page.text_content('.card[data-kpi="failed"] .detail')
            assert "retry" not in page.text_content('.card[data-kpi="not_run"] .detail')
            legend = page.locator("#chart-spend .legend")
            assert legend.locator(".dash-sw").count() == 1 and "an invocation ended" in legend.text_content()
            config = page.text_content("#config")
            assert "tool_backends.moa_aggregator_model" in config and '{"' not in config
            duration = page.text_content("#duration")
            assert f"{console_rate.group(1)} ({console_rate.group(2)})" in duration, (duration, console_rate.group(0))
        finally:
            browser.close()
