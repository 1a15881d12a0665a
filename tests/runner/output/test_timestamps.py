"""Every time the runner writes in a run's files carries its UTC offset."""

from __future__ import annotations

import json
import re
from datetime import datetime

from tests.conftest import run_cli, write_jsonl

ISO = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d")


def _stamps(value, path=""):
    """(where, text) of every ISO date-time string in a JSON document."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _stamps(item, f"{path}.{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _stamps(item, f"{path}[{i}]")
    elif isinstance(value, str) and ISO.match(value):
        yield path, value


def test_every_timestamp_of_a_run_has_a_time_zone(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "Explain tides."}, {"prompt": "And waves?"}])
    args = [f"--dataset_file={data}", "--batch_size=1", "--run_name=r", "--model=mock", "--distribution=minimal"]
    proc = run_cli(args, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run = tmp_path / "data" / "r"
    found = {}
    for path in sorted(run.iterdir()):
        if path.suffix == ".json":
            docs = [json.loads(path.read_text())]
        elif path.suffix == ".jsonl":
            docs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        else:
            continue
        for doc in docs:
            for where, text in _stamps(doc):
                found[f"{path.name}{where}"] = text
    assert any(name.startswith("config.json.invocations") for name in found), sorted(found)
    assert any(name.startswith("batch_") for name in found), sorted(found)
    naive = {name: text for name, text in found.items() if datetime.fromisoformat(text).tzinfo is None}
    assert naive == {}
