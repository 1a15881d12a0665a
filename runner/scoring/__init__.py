"""Scoring: what the run's scorers (--scorer) make of each sample, and rescoring a finished run.

A sample is scored in the worker, after its session and before its environment is removed (a
`command` scorer sees the files the agent left); the scores are part of the sample's committed
line (`metadata.scores`). `--rescore` scores the committed samples again from their lines alone.

- sample.py: `Sample`, the one object every scorer is given, and `Score`, what a scorer returns;
- scorers.py: the built-in scorers (includes, exact, command, judge), Python scorers, the choice
  of scorers from --scorer, and the rule that keeps a scorer's failure on its own entry;
- judge.py: the judge model's prompt and the grade read from its reply;
- rescore.py: `--rescore`.

May import runner.input, runner.storage and agent; never runner.execution or runner.output.
"""

from runner.scoring.sample import Sample, Score

__all__ = ["Sample", "Score"]
