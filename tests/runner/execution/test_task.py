"""The typed task: built from a dataset row in the parent, frozen, and all a worker gets."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from runner.input.dataset import iter_rows
from runner.execution.task import Task
from tests.conftest import write_jsonl


def _row(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a"}, {"prompt": "b", "image": "img:1", "cwd": "/w", "id": 7}])
    return list(iter_rows(path))[1]


def test_task_is_built_from_its_row_and_attempt(tmp_path):
    row = _row(tmp_path)
    task = Task.of(row, attempt=3, run_id="run1", seed=42)
    assert (task.key, task.index, task.prompt, task.image, task.cwd, task.id) == (row.key, 1, "b", "img:1", "/w", "7")
    assert (task.attempt, task.task_id, task.seed) == (3, "run1-p1-a3", 42)


def test_task_is_frozen_and_carries_no_failure(tmp_path):
    task = Task.of(_row(tmp_path), attempt=1, run_id="r", seed=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        task.prompt = "other"  # type: ignore[misc]
    # A row that cannot run (its image cannot be had) fails in the parent: no task field says so.
    assert {f.name for f in dataclasses.fields(Task)} == {"key", "index", "prompt", "image", "cwd", "id", "attempt",
                                                           "task_id", "seed", "targets", "verify", "rubric", "line",
                                                           "sample", "samples", "sample_seed"}


def test_task_crosses_processes_unchanged(tmp_path):
    task = Task.of(_row(tmp_path), attempt=2, run_id="r", seed=5)
    assert pickle.loads(pickle.dumps(task)) == task


def test_a_configuration_without_a_seed_still_gives_each_task_one(tmp_path):
    task = Task.of(_row(tmp_path), attempt=1, run_id="r", seed=None)
    assert isinstance(task.seed, int)


def test_each_sample_of_a_row_is_its_own_unit_with_its_own_seed(tmp_path):
    row = _row(tmp_path)
    tasks = [Task.of(row, attempt=1, run_id="r", seed=5, sample=s, samples=3) for s in range(3)]
    assert tasks[0].key == row.key  # sample 0 is the row as it was before samples existed
    assert len({t.key for t in tasks}) == len({t.task_id for t in tasks}) == len({t.sample_seed for t in tasks}) == 3
    assert [(t.sample, t.samples) for t in tasks] == [(0, 3), (1, 3), (2, 3)]
    assert tasks[0].task_id == "r-p1-a1" and tasks[2].task_id == "r-p1s2-a1"
    assert all(0 <= t.sample_seed < 2**63 for t in tasks)
    # the seed depends on the run's seed, the row and the sample only
    assert Task.of(row, attempt=4, run_id="x", seed=5, sample=2, samples=9).sample_seed == tasks[2].sample_seed
    assert Task.of(row, attempt=1, run_id="r", seed=6, sample=2, samples=3).sample_seed != tasks[2].sample_seed
