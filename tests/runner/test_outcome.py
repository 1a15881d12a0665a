"""The run's one outcome: each stop, budget and row count gives one headline, exit code and state."""

from __future__ import annotations

import pytest

from runner.outcome import Stop, decide


@pytest.mark.parametrize("stop, budget, failed, not_run, kind, code, state", [
    (None, False, 0, 0, "done", 0, "done"),
    (None, True, 0, 0, "done", 0, "done"),  # the budget was reached, but no row is left
    (None, False, 13, 0, "failed_rows", 2, "incomplete"),
    (None, True, 1, 4, "budget", 4, "stopped_budget"),
    (Stop("interrupted"), False, 0, 5, "interrupted", 130, "interrupted"),
    (Stop("fatal_provider", "auth"), False, 3, 0, "fatal_provider", 3, "stopped_provider"),
    (Stop("endpoint_lost", "down"), True, 3, 2, "endpoint_lost", 3, "stopped_provider"),
    (Stop("crash_loop", "workers died"), False, 0, 2, "crash_loop", 2, "stopped_workers"),
])
def test_one_decision(stop, budget, failed, not_run, kind, code, state):
    outcome = decide(stop, budget_reached=budget, failed=failed, not_run=not_run)
    assert (outcome.kind, outcome.exit_code, outcome.state) == (kind, code, state)
    assert outcome.as_dict() == {"kind": kind, "exit_code": code, "message": stop.message or None if stop else None}


def test_headlines_say_what_is_left():
    assert decide(None, budget_reached=False, failed=13, not_run=0).headline == (
        "FINISHED WITH 13 FAILED ROWS (retry with --resume)")
    assert decide(None, budget_reached=False, failed=1, not_run=0).headline == "FINISHED WITH 1 FAILED ROW (retry with --resume)"
    assert decide(None, budget_reached=False, failed=0, not_run=2).headline == "FINISHED WITH 2 ROWS NOT RUN (retry with --resume)"
    assert decide(None, budget_reached=False, failed=2, not_run=1).headline == (
        "FINISHED WITH 2 FAILED AND 1 UNRUN ROWS (retry with --resume)")
    assert decide(None, budget_reached=False, failed=0, not_run=0).headline == "BATCH PROCESSING COMPLETE"


def test_an_unknown_stop_is_a_bug():
    with pytest.raises(ValueError):
        Stop("bored")
