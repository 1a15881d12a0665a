"""A row's record leaves its session before the session's environment is removed."""

from __future__ import annotations

import asyncio

from runner.execution.task import Task
from runner.execution.worker import WorkerRuntime, process_row
from runner.input.config import RunConfig
from tools.settings import ToolSettings


def test_the_record_is_delivered_while_the_workdir_still_exists_and_the_workdir_goes_after(tmp_path):
    config = RunConfig(dataset_file="d.jsonl", run_name="r", batch_size=1, model="mock", distribution="terminal_only",
                       output_dir=str(tmp_path / "out"), tools=ToolSettings(workdir_root=str(tmp_path / "work")))
    task = Task(key="k", index=0, prompt="List the files in the terminal.", image=None, cwd=None,
                id="", attempt=1, task_id="t-p0-a1", seed=1)
    root = tmp_path / "work"
    seen = []

    def deliver(record: dict) -> None:
        seen.append(sorted(p.name for p in root.iterdir()))  # the session's working directory, if still there

    record = asyncio.run(process_row(task, WorkerRuntime(config, {}, sessions=1), deliver))
    assert not record.get("failed"), record
    [at_delivery] = seen  # delivered once
    assert len(at_delivery) == 1, "the record was delivered after the session's working directory was removed"
    assert list(root.iterdir()) == [], "the working directory outlived its session"
    assert any(turn["from"] == "tool" for turn in record["conversations"])  # the session did run a command
