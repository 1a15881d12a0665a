"""Imported by the fork server before anything else: from then on it, and every worker it forks,
ignores the signals sent to the run's whole process group (see group_signals.py). Nothing else
imports this module: in the runner it would silence Ctrl-C."""

from runner.execution.group_signals import shield

shield()
