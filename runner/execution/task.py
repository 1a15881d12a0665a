"""A task: one attempt at one dataset row, as the parent hands it to a worker.

Tasks cross processes (pickled down a worker's pipe, or sent to a Ray actor), so they carry what a
worker needs to run the row and nothing else. They are built in the parent from a valid Row only;
a row that cannot be run at all (its image cannot be had) never becomes a task sent anywhere: the
parent commits its failed record itself.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from runner.input.dataset import Row


@dataclass(frozen=True, slots=True)
class Task:
    key: str  # the row's identity (runner/input/dataset.py row_key)
    index: int  # 0-based position among the valid rows (the record's prompt_index)
    prompt: str
    image: str | None  # the row's own container image (backends fall back to --docker_image)
    cwd: str | None  # the row's own working directory
    id: str  # the row's id as text ("" when it has none)
    attempt: int  # 1 for a row's first attempt, +1 for each failed one before it
    task_id: str  # names this attempt's sandbox and containers: <run_id>-p<index>-a<attempt>
    seed: int  # the seed this row's toolset sample comes from
    targets: tuple[str, ...] = ()  # what the scorers read: the row's target, verify and rubric fields
    verify: str | None = None
    rubric: str | None = None
    line: bytes = b""  # the row's dataset line, for a Python scorer's `row`

    @classmethod
    def of(cls, row: Row, *, attempt: int, run_id: str, seed: int | None) -> Task:
        """The task of `row`'s attempt number `attempt`. `seed` is the run's (BatchRunner settles one
        before any task is built); without one (a configuration made by hand) a seed is drawn for
        the row, and recorded in its record all the same."""
        return cls(key=row.key, index=row.index, prompt=row.prompt, image=row.image, cwd=row.cwd, id=row.id,
                   attempt=attempt, task_id=f"{run_id}-p{row.index}-a{attempt}",
                   seed=seed if seed is not None else random.randrange(2**31), targets=row.targets,
                   verify=row.verify, rubric=row.rubric, line=row.line)
