"""Without --max_cost, a cost that is unknown stays unknown everywhere: the console, status.json and
statistics.json never put a dollar figure on it (the known part is "at least"). Only a budget
counts each request of unknown cost at the mean request cost, and then says it is an estimate."""

from __future__ import annotations

import json

import pytest

from runner.execution.budget import Budget
from agent.usage import Spend, Usage
from runner.output.status import LiveSpend
from tests.conftest import run_cli, write_jsonl

MOA = '@tool mixture_of_agents {"user_prompt": "inner q2\\n@cost none"}\nAsk the experts.'


def _run(tmp_path, server, rows, *extra):
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    return run_cli([f"--dataset_file={dataset}", "--run_name=r", "--batch_size=4", f"--base_url={server.base_url}",
                    "--model=test-model", "--api_key=x", "--num_processes=1", *extra], tmp_path)


@pytest.mark.parametrize("case", ["rows", "tool"])
def test_without_a_budget_an_unknown_cost_is_never_given_a_figure(tmp_path, model_server, case):
    if case == "rows":  # some rows report no cost, others do
        rows = [{"prompt": "@cost none\nUnpriced."}, {"prompt": "Priced."}, {"prompt": "Priced too."}]
        extra = ["--distribution=terminal_only"]
    else:  # the row's own calls report a cost, the inner call of its tool does not
        rows = [{"prompt": MOA}, {"prompt": "Priced."}]
        extra = ["--distribution=default", "--moa_reference_models=ref-a,ref-b", "--moa_aggregator_model=agg-m"]
    proc = _run(tmp_path, model_server, rows, *extra)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dir = tmp_path / "data" / "r"
    stats = json.loads((run_dir / "statistics.json").read_text())
    assert stats["cost"] is None and stats["spend"]["all"]["unpriced_attempts"] == 1
    assert "cost unknown" in proc.stdout

    status = json.loads((run_dir / "status.json").read_text())
    spend = status["spend"]
    assert spend["total_usd"] is None and spend["this_invocation_usd"] is None and spend["per_kept_row_usd"] is None
    assert spend["estimated"] is False and spend["attempts_unpriced"] == 1
    lines = [r for p in sorted(run_dir.glob("batch_*.jsonl")) for r in map(json.loads, p.read_text().splitlines())]
    # the known part: every known request cost, those of the line that also has an unknown one included
    known = [r["metadata"]["usage"]["cost"] for r in lines]
    assert spend["known_usd"] == pytest.approx(sum(known)) and spend["known_usd"] > 0  # at least this much
    assert stats["spend"]["all"]["known_cost"] == pytest.approx(sum(known))
    assert status["forecast"] is None and status["budget"] is None
    assert "counted at the mean" not in proc.stdout
    unknown = sum(r["metadata"]["usage"]["unpriced_requests"] for r in lines)
    noun = "request" if unknown == 1 else "requests"
    assert (f"Spent at least ${spend['known_usd']:.4f} (total unknown: {unknown} {noun} of unknown cost: "
            "without a reply, or a reply without a cost and no --price_* flags)") in proc.stdout


def test_under_a_budget_an_unknown_cost_counts_at_the_mean_as_an_estimate():
    spend = LiveSpend(estimate_unknown=True)  # what --max_cost sets
    spend.add(Usage.read({"requests": 1}), 1.0)
    assert spend.total() is None and spend.budget_cost() is None  # nothing to estimate it by
    budget = Budget(1.0, hard=False, spend=spend)
    assert not budget.may_start() and budget.unmeasurable and "could not be enforced" in budget.stop_message("run")
    spend.add(Usage.read({"requests": 2, "cost": 0.3}), 1.0)
    # the request of unknown cost at the mean known request cost: 0.3 + 0.15
    assert spend.total() == pytest.approx(0.45) and spend.is_estimate and spend.known_total() == pytest.approx(0.3)
    assert "(an estimate)" in Budget(0.5, hard=False, spend=spend).stop_message("run")

    plain = LiveSpend()  # no budget: the same attempts make the total unknown, the budget figure still estimates
    plain.add(Usage.read({"requests": 1}), 1.0)
    plain.add(Usage.read({"requests": 2, "cost": 0.3}), 1.0)
    assert plain.total() is None and plain.this_invocation() is None and not plain.is_estimate
    assert plain.known_total() == pytest.approx(0.3)
