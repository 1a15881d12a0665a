"""A task: one attempt at one sample of a dataset row, as the parent hands it to a worker.

Tasks cross processes (pickled down a worker's pipe, or sent to a Ray actor), so they carry what a
worker needs to run the row and nothing else. They are built in the parent from a valid Row only;
a row that cannot be run at all (its image cannot be had) never becomes a task sent anywhere: the
parent commits its failed record itself.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from runner.input.dataset import Row
from runner.input.samples import sample_key, sample_seed


@dataclass(frozen=True, slots=True)
class Task:
    key: str  # the sample's identity: its row's key plus its sample index (runner/input/samples.py)
    index: int  # 0-based position among the valid rows (the record's prompt_index)
    prompt: str
    image: str | None  # the row's own container image (backends fall back to --docker_image)
    cwd: str | None  # the row's own working directory
    id: str  # the row's id as text ("" when it has none)
    attempt: int  # 1 for a row's first attempt, +1 for each failed one before it
    task_id: str  # names this attempt's sandbox and containers: <run_id>-p<index>[s<sample>]-a<attempt>
    seed: int  # the run's seed
    targets: tuple[str, ...] = ()  # what the scorers read: the row's target, verify and rubric fields
    verify: str | None = None
    rubric: str | None = None
    line: bytes = b""  # the row's dataset line, for a Python scorer's `row`
    sample: int = 0  # 0-based sample index of the row
    samples: int = 1  # --samples_per_prompt
    sample_seed: int = 0  # this sample's own seed (runner/input/samples.py), its toolset draw's

    @classmethod
    def of(cls, row: Row, *, attempt: int, run_id: str, seed: int | None, sample: int = 0, samples: int = 1) -> Task:
        """The task of attempt number `attempt` at sample `sample` of `row`. `seed` is the run's
        (BatchRunner settles one before any task is built); without one (a configuration made by
        hand) a seed is drawn for the row, and recorded in its record all the same."""
        seed = seed if seed is not None else random.randrange(2**31)
        key = sample_key(row.key, sample)
        where = f"p{row.index}" + (f"s{sample}" if sample else "")
        return cls(key=key, index=row.index, prompt=row.prompt, image=row.image, cwd=row.cwd, id=row.id,
                   attempt=attempt, task_id=f"{run_id}-{where}-a{attempt}", seed=seed, targets=row.targets,
                   verify=row.verify, rubric=row.rubric, line=row.line, sample=sample, samples=samples,
                   sample_seed=sample_seed(seed, key))
