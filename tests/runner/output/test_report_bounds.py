"""report.html stays bounded as the rows grow: every count over all rows, a sample in its table."""

from __future__ import annotations

import json
import re

import orjson

from runner.output import report


def _run(run_dir, rows: int) -> dict[str, int]:
    """A run of `rows` committed rows, one in ten failed (provider), with no output written yet."""
    run_dir.mkdir()
    units = {}
    with open(run_dir / "batch_0.jsonl", "wb") as handle:
        for i in range(rows):
            key = f"{i:040x}-0"
            units[key] = i
            metadata = {"timestamp": f"2026-01-01T10:{i // 60 % 60:02d}:{i % 60:02d}+00:00", "model": "m",
                        "row_key": key, "run_id": "r1", "attempt": 1, "duration_seconds": 1.0, "batch_num": 0,
                        "usage": {"requests": 1, "prompt_tokens": 10, "cost": 0.0}}
            if i % 10 == 0:
                record = {"failed": True, "error": "boom", "error_class": "provider", "prompt": f"p{i}"}
            else:
                record = {"conversations": [{"from": "human", "value": f"Say hello to number {i}."},
                                            {"from": "gpt", "value": "Hello " * 20}],
                          "completed": True, "partial": False, "api_calls": 1, "toolsets_used": ["web"],
                          "tool_stats": {}, "tool_error_counts": {},
                          "reasoning_stats": {"total_assistant_turns": 1, "turns_with_reasoning": 1,
                                              "turns_without_reasoning": 0}}
            handle.write(orjson.dumps({"prompt_index": i, **record, "metadata": metadata}) + b"\n")
    return units


def _block(html: str, element_id: str):
    return json.loads(re.search(rf'<script[^>]*id="{element_id}"[^>]*>(.*?)</script>', html, re.S).group(1))


def test_the_page_keeps_every_count_and_a_bounded_sample_of_rows(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "TABLE_ROWS", 60)
    sizes = {}
    for rows in (200, 2_000):
        run_dir = tmp_path / f"run{rows}"
        units = _run(run_dir, rows)
        page = report.write_report(run_dir, max_full_conversations=20, dataset=units, log=lambda _: None)
        html = page.read_text(encoding="utf-8")
        sizes[rows] = len(html)
        summary, table = _block(html, "summary-data"), _block(html, "rows-data")["rows"]
        assert summary["outcomes"]["ok"] == rows - rows // 10 and summary["outcomes"]["failed"] == rows // 10
        assert summary["rows"] == rows and summary["toolsets"]["web"]["rows"] == rows - rows // 10
        assert sum(sum(s) for s in summary["timeline"]["series"].values()) == rows  # the chart: every row
        assert len(table) == 60 and summary["sample"]["table"] == 60 and summary["sample"]["rows"] == rows
        assert sum(1 for r in table if r[1] == report.FAILED) == min(rows // 10, 30)  # a fair share each
        assert len(_block(html, "full-data")["rows"]) == 20
        assert [r[0] for r in table] == sorted(r[0] for r in table)  # in dataset order
    assert sizes[2_000] < sizes[200] * 1.2, sizes  # ten times the rows, about the same page
