"""A row's record leaves its session before the session's environment is removed."""

from __future__ import annotations

import asyncio
import json

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


def test_a_workdir_whose_removal_outlasts_the_end_of_the_run_is_still_removed(tmp_path, model_server):
    """The record goes before the clean-up, so the run can reach its end while a worker still
    removes a large working directory; the workers still busy at the end are killed (here after
    0.1 s instead of 15, so 20,000 folders are enough), and what they left is removed all the same."""
    import os
    import subprocess
    import sys

    from tests.conftest import REPO, read_jsonl, write_jsonl

    command = "python3 -c \"import os; [os.makedirs(f'd{i}/e/f') for i in range(7000)]\""
    dataset = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"@tool terminal {json.dumps({'command': command})}\nGo."}])
    workdirs = tmp_path / "workdirs"
    workdirs.mkdir()
    script = tmp_path / "run.py"  # the real CLI, with only the end-of-run wait shortened
    script.write_text("import runpy, sys\n"
                      f"sys.path.insert(0, {str(REPO)!r})\n"
                      "import runner.execution.process_pool as pool\n"
                      "pool.SHUTDOWN_WAIT = 0.1\n"
                      f"sys.argv = [{str(REPO / 'batch_runner.py')!r}, *sys.argv[1:]]\n"
                      "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    proc = subprocess.run([sys.executable, str(script), f"--dataset_file={dataset}", "--run_name=r", "--batch_size=5",
                           "--distribution=terminal_only", f"--base_url={model_server.base_url}", "--model=m"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TMPDIR": str(workdirs)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert len(read_jsonl(tmp_path / "data" / "r" / "trajectories.jsonl")) == 1
    assert [p.name for p in workdirs.iterdir() if not p.name.startswith("pymp-")] == []
    assert "still busy" in proc.stdout + proc.stderr  # the case this test is about did happen
