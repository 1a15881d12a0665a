"""The run's parts, grouped by the stage of a run they serve (batch_runner.py drives them in order).

    input/      the command line, the validated configuration, the dataset, the keys
    execution/  handing tasks to workers (process pool or Ray), one prompt in a worker, the budget
    storage/    the run directory: the committed records, the run view that reads them, the lock
    output/     what a run leaves for people: trajectories.jsonl, statistics.json, status, report.html
    console.py  wording shared by every stage's messages, and the log that does not tear the bar
    outcome.py  the run's one outcome (exit code, headline, last states), and its StopState

The driver's modules drive the stages and may import every one of them: batch_runner.py (the CLI
and BatchRunner), configure.py (the flags as one validated, frozen RunConfig), preflight.py (the
checks before anything is written), original_api.py (the original's constructor keywords).

Imports go one way, never back: input imports nothing of the runner's (timestamps.py aside); storage
may import input; execution may import input, storage (the records a worker writes) and scoring (the
scorers a worker runs); output may import storage and input; console.py and outcome.py import
nothing. No stage imports the driver's modules. tests/runner/test_layering.py checks these rules.
"""
