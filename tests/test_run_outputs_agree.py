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
