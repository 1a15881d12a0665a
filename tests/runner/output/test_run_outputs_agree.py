"""After a dataset edit, report.html, statistics.json and trajectories.jsonl say the same: ids and
positions are the current dataset's in all of them, and `--report` rebuilds the run's outputs."""

from __future__ import annotations

import json
import re
from pathlib import Path

from tests.conftest import read_jsonl, run_cli, write_jsonl

SAME = "The same question."


def _embedded(run: Path, element_id: str):
    html = (run / "report.html").read_text(encoding="utf-8")
    match = re.search(rf'<script type="application/json" id="{element_id}">(.*?)</script>', html, re.S)
    assert match, element_id
    return json.loads(match.group(1))


def _report_ids(run: Path) -> tuple[list, list]:
    rows = _embedded(run, "rows-data")
    at = rows["fields"].index("id")
    full = _embedded(run, "full-data")["rows"]
    return [r[at] for r in rows["rows"]], [full[k]["meta"]["id"] for k in sorted(full, key=int)]


def _run(tmp_path, dataset, remote_args, *extra):
    return run_cli([f"--dataset_file={dataset}", "--run_name=r", "--batch_size=2", *remote_args, *extra], tmp_path)


def test_report_ids_are_the_current_datasets_after_an_edit(tmp_path, model_server, remote_args):
    dataset = write_jsonl(tmp_path / "d.jsonl", [
        {"prompt": SAME, "id": "x"}, {"prompt": SAME, "id": "y"}, {"prompt": SAME, "id": "z"},
        {"prompt": "Alone.", "id": "old"},
    ])
    proc = _run(tmp_path, dataset, remote_args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run = tmp_path / "data" / "r"
    assert _report_ids(run) == (["x", "y", "z", "old"], ["x", "y", "z", "old"])

    # The first twin leaves, an id changes alone: nothing runs, the outputs are rebuilt.
    write_jsonl(dataset, [{"prompt": SAME, "id": "y"}, {"prompt": SAME, "id": "z"}, {"prompt": "Alone.", "id": "new"}])
    proc = _run(tmp_path, dataset, remote_args, "--resume")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    kept = read_jsonl(run / "trajectories.jsonl")
    assert [(t["prompt_index"], t["metadata"]["id"]) for t in kept] == [(0, "y"), (1, "z"), (2, "new")]
    rows = _embedded(run, "rows-data")
    assert [r[rows["fields"].index("index")] for r in rows["rows"]] == [0, 1, 2]
    assert _report_ids(run) == (["y", "z", "new"], ["y", "z", "new"])


def _assert_report_is_statistics(run: Path) -> dict:
    stats = json.loads((run / "statistics.json").read_text())
    summary = _embedded(run, "summary-data")
    for key in ("outcomes", "failed_by_class", "retried_rows", "tokens", "cost", "spend", "requests", "api_calls",
                "total_prompts"):
        assert summary[key] == stats[key], key
    assert summary["files"]["stale_rows"] == stats["stale_rows"]
    return stats


def test_report_after_a_dataset_edit_rebuilds_statistics_and_trajectories(tmp_path, model_server, remote_args):
    from runner.storage.lock import RunLock

    rows = [{"prompt": f"Question {i}.", "id": f"q{i}"} for i in range(4)]
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    proc = _run(tmp_path, dataset, remote_args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run = tmp_path / "data" / "r"
    assert _assert_report_is_statistics(run)["outcomes"]["ok"] == 4

    # A row leaves, one is added (never run), an id changes; then only --report.
    write_jsonl(dataset, [rows[0], {"prompt": "Question 1.", "id": "renamed"}, rows[3], {"prompt": "New.", "id": "n"}])
    proc = run_cli(["--report", "--run_name=r"], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    stats = _assert_report_is_statistics(run)
    assert stats["outcomes"]["ok"] == 3 and stats["outcomes"]["not_run"] == 1 and stats["stale_rows"] == 1
    assert stats["total_prompts"] == 4
    kept = read_jsonl(run / "trajectories.jsonl")
    assert [(t["prompt_index"], t["metadata"]["id"]) for t in kept] == [(0, "q0"), (1, "renamed"), (2, "q3")]

    # While a run holds the lock, --report refuses and changes nothing.
    before = {name: (run / name).read_bytes() for name in ("statistics.json", "trajectories.jsonl", "report.html")}
    write_jsonl(dataset, rows)
    lock = RunLock(run)
    lock.acquire(lambda _: None)
    try:
        proc = run_cli(["--report", "--run_name=r"], tmp_path)
    finally:
        lock.release()
    assert proc.returncode == 1 and "in use by another batch_runner" in proc.stderr, proc.stdout + proc.stderr
    assert {name: (run / name).read_bytes() for name in before} == before


def test_report_refuses_when_the_dataset_cannot_be_read(tmp_path, model_server, remote_args):
    dataset = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "Question.", "id": "q"}])
    assert _run(tmp_path, dataset, remote_args).returncode == 0
    dataset.unlink()
    proc = run_cli(["--report", "--run_name=r"], tmp_path)
    assert proc.returncode == 1 and "cannot be read" in proc.stderr and str(dataset) in proc.stderr, proc.stderr
    assert _assert_report_is_statistics(tmp_path / "data" / "r")["outcomes"]["ok"] == 1
