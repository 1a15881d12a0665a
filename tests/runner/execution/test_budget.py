"""Cost: prices, every dollar by model, the --max_cost budget, the forecast and status.json."""

from __future__ import annotations

import json
import math
from datetime import datetime

import pytest

from agent.model_client import CallStats
from agent.pricing import Prices, request_cost
from runner.execution.budget import Budget
from runner.input.config import cost_options
from runner.storage.records import known_cost
from agent.usage import Spend, Usage
from runner.output.status import LiveSpend, forecast
from tests.conftest import read_jsonl, run_cli, write_jsonl

COST = 0.0001  # the scripted server's usage.cost of every reply
TERMINAL = '@tool terminal {"command": "echo hi"}\n'


# ---------------------------------------------------------------- units


def test_prices_charge_cached_tokens_at_the_cached_price():
    prices = Prices(input_per_mtok=3.0, output_per_mtok=15.0, cached_input_per_mtok=0.3)
    usage = {"prompt_tokens": 1_000_000, "cached_tokens": 400_000, "completion_tokens": 100_000}
    assert prices.cost_of(usage) == pytest.approx(0.6 * 3 + 0.4 * 0.3 + 0.1 * 15)
    # without a cached price a hit is charged as a miss
    assert Prices(input_per_mtok=3, output_per_mtok=15).cost_of(usage) == pytest.approx(3 + 1.5)


def test_reported_cost_wins_and_unpriced_is_unknown():
    prices = Prices(input_per_mtok=1, output_per_mtok=1)
    assert request_cost({"cost": 0.25, "prompt_tokens": 10}, prices) == 0.25
    assert request_cost({"cost": 0, "prompt_tokens": 10}, None) == 0.0  # a free model says so
    assert request_cost({"prompt_tokens": 1_000_000}, prices) == pytest.approx(1.0)
    assert request_cost({"prompt_tokens": 10}, None) is None


def test_call_stats_by_model_and_unknown_is_never_zero():
    stats = CallStats(prices=None)
    stats.count_request("main")
    stats.add_usage({"prompt_tokens": 10, "completion_tokens": 2, "cost": 0.5}, "main")
    stats.count_request("tool-model")
    stats.add_usage({"prompt_tokens": 5, "completion_tokens": 1, "cost": 0.25}, "tool-model")
    data = stats.as_dict()
    assert data["cost"] == 0.75 and data["requests"] == 2
    assert data["by_model"] == [  # a list sorted by model: the same schema whatever models a run used
        {"model": "main", "requests": 1, "prompt_tokens": 10, "completion_tokens": 2, "cached_tokens": 0, "cost": 0.5,
         "unpriced_requests": 0},
        {"model": "tool-model", "requests": 1, "prompt_tokens": 5, "completion_tokens": 1, "cached_tokens": 0,
         "cost": 0.25, "unpriced_requests": 0},
    ]
    assert "prices" not in data and data["unpriced_requests"] == 0
    stats.count_request("tool-model")
    stats.add_usage({"prompt_tokens": 5, "completion_tokens": 1}, "tool-model")  # no cost, no price
    data = stats.as_dict()
    main, tool = data["by_model"]
    assert known_cost(data) is None and data["unpriced_requests"] == 1 and data["cost"] == 0.75  # a lower bound
    assert known_cost(tool) is None and tool["unpriced_requests"] == 1 and known_cost(main) == 0.5


def test_cost_flags_are_checked():
    with pytest.raises(ValueError, match="go together"):
        cost_options({"price_input_per_mtok": 3}, "m")
    with pytest.raises(ValueError, match="positive"):
        cost_options({"max_cost": 0, "price_input_per_mtok": 1, "price_output_per_mtok": 1}, "m")
    with pytest.raises(ValueError, match=">= 0"):
        cost_options({"price_input_per_mtok": -1, "price_output_per_mtok": 1}, "m")
    with pytest.raises(ValueError, match="needs --max_cost"):
        cost_options({"max_cost_hard": True}, "m")
    # Without prices a budget starts whatever the endpoint: its replies say whether it reports costs
    assert cost_options({"max_cost": 5}, "m")["max_cost"] == 5.0
    assert cost_options({"max_cost": 5}, "mock")["prices"] is None
    options = cost_options({"price_input_per_mtok": 0, "price_output_per_mtok": 2, "max_cost": 1}, "m")
    assert options["prices"] == Prices(input_per_mtok=0, output_per_mtok=2)


def test_budget_counts_rows_in_flight_at_the_mean_attempt_cost():
    spend = LiveSpend(before=Spend(Usage(cost=0.4), priced=4))  # earlier invocations: 0.1 per attempt
    budget = Budget(1.0, hard=False, spend=spend)
    for key in "abcde":
        assert budget.may_start()
        budget.on_start(key)
    assert budget.expected_in_flight() == pytest.approx(0.5)
    budget.on_start("f")  # 0.4 + 6 * 0.1 reaches 1.0
    assert not budget.may_start() and budget.reached
    spend.scope = "invocation"  # only this invocation's spend counts: 6 in flight at 0.1 still < 1.0
    assert Budget(1.0, False, spend).may_start()


def test_budget_without_any_estimate_lets_the_first_wave_start():
    budget = Budget(0.01, hard=False, spend=LiveSpend())
    for key in range(8):
        assert budget.may_start()
        budget.on_start(str(key))


def test_unpriced_attempts_count_at_the_mean_or_make_the_total_unknown():
    spend = LiveSpend(estimate_unknown=True)  # under a budget (tests/runner/execution/test_unknown_cost.py: without one)
    spend.add(Usage.read({"requests": 1}), 1.0)
    assert spend.total() is None and spend.budget_cost() is None
    budget = Budget(1.0, hard=False, spend=spend)  # e.g. OpenRouter stopped reporting usage.cost
    assert not budget.may_start() and budget.unmeasurable and "could not be enforced" in budget.stop_message("run")
    spend.add(Usage.read({"requests": 2, "cost": 0.3}), 1.0)
    spend.add(Usage.read({"requests": 0, "cost": None}), 0.0)  # no model request: nothing spent, not an attempt
    # the request of unknown cost at the mean known request cost: 0.3 + 0.15
    assert spend.total() == pytest.approx(0.45) and spend.estimated_attempts == 1


def test_forecast_projects_the_remaining_rows_with_a_range():
    assert forecast(None, 10, 10, 5, 10, 0.1) is None
    assert forecast(1.0, 0, 0, 5, 0, None) is None
    out = forecast(2.0, 10, 8, 30, 12, None)
    assert out.per_kept_row == pytest.approx(0.25) and out.remaining == pytest.approx(6.0)
    assert out.total == pytest.approx(8.0) and out.low is None
    out = forecast(2.0, 10, 8, 30, 10, 0.05)
    half = 1.96 * 0.05 * (math.sqrt(30) + 30 / math.sqrt(10))
    assert out.low == pytest.approx(8.0 - half) and out.high == pytest.approx(8.0 + half)
    assert forecast(2.0, 10, 0, 0, 10, 0.05).per_kept_row is None


# ---------------------------------------------------------------- through the CLI


def _args(tmp_path, server, rows, *extra):
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    return [f"--dataset_file={dataset}", "--run_name=r", "--batch_size=4", "--distribution=terminal_only",
            f"--base_url={server.base_url}", "--model=test-model", "--api_key=x", "--num_processes=1", *extra]


def _lines(run_dir):
    return [r for p in sorted(run_dir.glob("batch_*.jsonl")) for r in read_jsonl(p)]


def _spent(run_dir) -> float:
    return sum(r["metadata"]["usage"]["cost"] for r in _lines(run_dir))


def test_budget_stops_starting_rows_and_a_resume_finishes_each_row_once(tmp_path, model_server):
    rows = [{"prompt": f"@latency 0.3\nAnswer {i}."} for i in range(16)]  # one request each: 0.0001
    args = _args(tmp_path, model_server, rows, "--num_workers=2", "--price_input_per_mtok=1",
                 "--price_output_per_mtok=1", "--max_cost=0.0005")
    proc = run_cli(args, tmp_path)
    assert proc.returncode == 4, proc.stdout + proc.stderr
    assert "--resume --max_cost=" in proc.stderr and "Stopped at the cost budget" in proc.stderr
    run_dir = tmp_path / "data" / "r"
    spent = _spent(run_dir)
    # no row starts once the budget is reached; at most the 2 rows in flight go past it
    assert 0.0005 - COST <= spent <= 0.0005 + 2 * COST + 1e-9
    assert len(model_server.requests) == len(_lines(run_dir)) < 16  # nothing ran without being committed
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "stopped_budget" and status["budget"]["reached"]
    assert status["spend"]["total_usd"] == pytest.approx(spent)
    assert status["rows"]["done"] == len(_lines(run_dir)) and status["rows"]["in_flight"] == 0

    # the budget is per run: the same budget again starts nothing
    proc = run_cli(args + ["--resume"], tmp_path)
    assert proc.returncode == 4 and len(model_server.requests) == len(_lines(run_dir))

    proc = run_cli([a for a in args if not a.startswith("--max_cost")] + ["--resume", "--max_cost=1"], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    keys = [r["metadata"]["row_key"] for r in _lines(run_dir)]
    assert len(keys) == len(set(keys)) == 16  # every row exactly once
    assert len(model_server.requests) == 16
    assert len(read_jsonl(run_dir / "trajectories.jsonl")) == 16
    history = read_jsonl(run_dir / "status_history.jsonl")
    assert [h["state"] for h in history] == ["stopped_budget", "stopped_budget", "done"]
    # the report shows spend over time, by outcome and model, and each invocation's closing forecast
    from tests.runner.output.test_report import _script_json

    summary = _script_json((run_dir / "report.html").read_text(encoding="utf-8"), "summary-data")
    view = summary["spend_view"]
    assert [i["state"] for i in view["invocations"]] == ["stopped_budget", "stopped_budget", "done"]
    assert view["invocations"][0]["forecast_total_usd"] == pytest.approx(16 * COST)
    assert view["curve"]["points"][-1][1] == pytest.approx(16 * COST)
    assert view["by_model"]["test-model"]["requests"] == 16
    assert summary["spend"]["kept"]["cost"] == pytest.approx(16 * COST)


def test_scope_invocation_ignores_earlier_spend(tmp_path, model_server):
    rows = [{"prompt": f"Answer {i}."} for i in range(6)]
    base = _args(tmp_path, model_server, rows, "--num_workers=1", "--price_input_per_mtok=1", "--price_output_per_mtok=1")
    assert run_cli(base + ["--max_samples=3"], tmp_path).returncode == 0
    proc = run_cli(base + ["--resume", "--max_cost=0.00035", "--max_cost_scope=invocation"], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr  # 3 more rows cost 0.0003 < 0.00035
    assert len(read_jsonl(tmp_path / "data" / "r" / "trajectories.jsonl")) == 6


def test_hard_budget_cancels_rows_in_flight(tmp_path, model_server):
    rows = [{"prompt": f"@latency 1.5\nSlow {i}."} for i in range(6)]
    args = _args(tmp_path, model_server, rows, "--num_workers=2", "--price_input_per_mtok=1",
                 "--price_output_per_mtok=1", "--max_cost=0.00025", "--max_cost_hard")
    proc = run_cli(args, tmp_path)
    assert proc.returncode == 4, proc.stdout + proc.stderr
    assert "cancelled" in proc.stderr
    run_dir = tmp_path / "data" / "r"
    ok = [r for r in _lines(run_dir) if not r.get("failed")]
    assert len(ok) == 2 and sum(r["metadata"]["usage"]["cost"] for r in ok) == pytest.approx(0.0002)
    budget = json.loads((run_dir / "status.json").read_text())["budget"]
    assert budget["cancelled_rows"] == 1 and 0 < budget["cancelled_estimated_usd"] <= COST
    # a third row started (committed plus expected spend was still under 0.00025) and was cancelled in
    # flight (under heavy load its request may not have reached the server yet); what it sent is
    # committed with it, a failed attempt whose request got no reply: of unknown cost
    assert len(model_server.requests) in (2, 3)
    cancelled = [r for r in _lines(run_dir) if r.get("failed")]
    assert all(r["error_class"] == "budget" and r["metadata"]["usage"]["unpriced_requests"] == 1 for r in cancelled)
    stats = json.loads((run_dir / "statistics.json").read_text())
    assert stats["spend"]["all"]["requests"] == len(model_server.requests)
    proc = run_cli([a for a in args if not a.startswith("--max_cost")] + ["--resume"], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    kept = [r["metadata"]["row_key"] for r in _lines(run_dir) if not r.get("failed")]
    assert len(kept) == len(set(kept)) == 6  # each row kept once; a cancelled attempt stays, as a failed line


def test_max_cost_without_prices_runs_on_an_endpoint_that_reports_its_costs(tmp_path, model_server):
    rows = [{"prompt": f"Answer {i}."} for i in range(3)] + [{"prompt": "@cost none\n@cost_header 0.0002\nLiteLLM."}]
    proc = run_cli(_args(tmp_path, model_server, rows, "--max_cost=1", "--num_workers=1"), tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr  # usage.cost and LiteLLM's header both count
    assert _spent(tmp_path / "data" / "r") == pytest.approx(3 * COST + 0.0002)


def test_max_cost_stops_before_the_next_request_once_a_reply_has_no_cost(tmp_path, model_server):
    rows = [{"prompt": "Priced 0."}, {"prompt": TERMINAL + "@cost none\nUnpriced."}]
    rows += [{"prompt": f"Priced {i}."} for i in range(1, 6)]
    args = _args(tmp_path, model_server, rows, "--max_cost=1", "--num_workers=1")
    proc = run_cli(args, tmp_path)
    assert proc.returncode == 4, proc.stdout + proc.stderr
    assert "a reply came without a cost" in proc.stderr and "--resume" in proc.stderr
    assert len(model_server.requests_for("Unpriced.")) == 1  # its second request (after the tool) was not sent
    assert model_server.requests_for("Priced 1.") == []  # nor any row after it
    lines = _lines(tmp_path / "data" / "r")
    (unpriced,) = [r for r in lines if r.get("failed")]
    assert unpriced["error_class"] == "unpriced" and unpriced["metadata"]["usage"]["unpriced_requests"] == 1
    status = json.loads((tmp_path / "data" / "r" / "status.json").read_text())
    assert status["state"] == "stopped_budget"

    proc = run_cli(args + ["--resume", "--price_input_per_mtok=1", "--price_output_per_mtok=1"], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert len(read_jsonl(tmp_path / "data" / "r" / "trajectories.jsonl")) == 7


def test_tokens_are_priced_when_the_endpoint_reports_no_cost(tmp_path, model_server):
    rows = [{"prompt": "@cost none\nPriced from tokens."}]
    proc = run_cli(_args(tmp_path, model_server, rows, "--price_input_per_mtok=2", "--price_output_per_mtok=10"), tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (line,) = _lines(tmp_path / "data" / "r")
    usage = line["metadata"]["usage"]
    assert usage["cost"] == pytest.approx((usage["prompt_tokens"] * 2 + usage["completion_tokens"] * 10) / 1e6)


def test_a_reported_cost_wins_over_the_price_flags(tmp_path, model_server):
    rows = [{"prompt": "@cost none\n@cost_header 0.0042\nLiteLLM says what it cost."}]
    proc = run_cli(_args(tmp_path, model_server, rows, "--price_input_per_mtok=1000", "--price_output_per_mtok=1000",
                         "--max_cost=1"), tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (line,) = _lines(tmp_path / "data" / "r")
    assert line["metadata"]["usage"]["cost"] == pytest.approx(0.0042)


def test_tool_model_calls_are_counted_by_model(tmp_path, model_server):
    prompt = ('@tool mixture_of_agents {"user_prompt": "What is 2+2?"}\n'
              '@tool vision_analyze {"image_url": "https://example.com/cat.png", "question": "What is it?"}\n'
              "Ask the experts, then look.")
    args = _args(tmp_path, model_server, [{"prompt": prompt}], "--moa_reference_models=ref/a,ref/b",
                 "--moa_aggregator_model=agg/judge", "--vision_model=vis/eye")
    args = [a for a in args if not a.startswith("--distribution")] + ["--distribution=default"]
    proc = run_cli(args, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (line,) = _lines(tmp_path / "data" / "r")
    usage = line["metadata"]["usage"]
    by_model = {e["model"]: e for e in usage["by_model"]}
    assert {m: e["requests"] for m, e in by_model.items()} == {
        "test-model": 3, "ref/a": 1, "ref/b": 1, "agg/judge": 1, "vis/eye": 1}
    assert usage["requests"] == 7 == len(model_server.requests)
    assert usage["cost"] == pytest.approx(7 * COST) and usage["unpriced_requests"] == 0
    assert sum(e["prompt_tokens"] for e in by_model.values()) == usage["prompt_tokens"]
    stats = json.loads((tmp_path / "data" / "r" / "statistics.json").read_text())
    assert {m: e["requests"] for m, e in stats["spend_by_model"].items()} == {m: e["requests"] for m, e in by_model.items()}
    assert stats["spend_by_model"]["ref/a"]["cost"] == pytest.approx(COST)
    assert "by model:" in proc.stdout and "agg/judge 1 requests" in proc.stdout


def test_unpriced_run_says_unknown(tmp_path, model_server):
    rows = [{"prompt": f"@cost none\nUnpriced {i}."} for i in range(2)]
    proc = run_cli(_args(tmp_path, model_server, rows), tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dir = tmp_path / "data" / "r"
    for line in _lines(run_dir):  # every row's cost is a number, and says it is not the whole cost
        usage = line["metadata"]["usage"]
        assert usage["cost"] == 0.0 and usage["unpriced_requests"] == usage["requests"] > 0
        assert known_cost(usage) is None
    assert "Spend: unknown" in proc.stdout
    status = json.loads((run_dir / "status.json").read_text())
    assert status["spend"]["total_usd"] is None and status["forecast"] is None
    stats = json.loads((run_dir / "statistics.json").read_text())
    assert stats["cost"] is None and stats["spend"]["all"]["unpriced_attempts"] == 2
    assert stats["spend_by_model"]["test-model"]["cost"] is None
    assert "cost unknown" in proc.stdout


def test_spend_view_splits_by_model_retried_and_time(tmp_path):
    from runner.output.spend_view import read_invocations
    from runner.storage.spendtally import SpendTally

    tally = SpendTally()
    def usage(cost, model="m"):
        figures = {"requests": 1, "prompt_tokens": 100, "cached_tokens": 25, "cost": cost or 0.0,
                   "unpriced_requests": int(cost is None)}
        return Usage.read({**figures, "by_model": [{"model": model, **figures}]})

    tally.add("failed", "a", "2026-12-01T10:00:10", usage(0.1))
    tally.add("kept", "a", "2026-12-01T10:00:20", usage(0.2))  # a: failed once, then kept: retried
    tally.add("failed", "b", "2026-12-01T10:00:30", usage(0.3, "tool"))  # b: still failed
    tally.add("discarded", "c", "2026-12-01T10:00:40", usage(None))  # unpriced
    retried = tally.retried(finished=lambda key: key in ("a", "c"))
    assert retried["cost"] == 0.1 and retried["attempts"] == 1
    models = tally.models()
    assert models["m"]["requests"] == 3 and models["m"]["cost"] is None  # one attempt unpriced: unknown, not 0.3
    assert models["m"]["unpriced_attempts"] == 1 and models["tool"]["cost"] == 0.3
    curve = tally.curve()
    assert curve["start"] == datetime.fromisoformat("2026-12-01T10:00:10").astimezone().isoformat()  # with its offset
    assert curve["points"][0] == [0.0, 0.1] and curve["points"][-1] == [20.0, pytest.approx(0.6)]
    (tmp_path / "status_history.jsonl").write_text(
        json.dumps({"state": "stopped_budget", "spend": {"total_usd": 0.5}, "forecast": {"total_usd": 2.0},
                    "budget": {"max_cost_usd": 0.5}}) + "\n{torn")
    (inv,) = read_invocations(tmp_path)
    assert inv["state"] == "stopped_budget" and inv["forecast_total_usd"] == 2.0 and inv["max_cost_usd"] == 0.5


def test_spend_of_failed_attempts_that_were_retried(tmp_path, model_server):
    rows = [{"prompt": "@fail 400 1\nFails once, then works."}, {"prompt": "Works."}]
    args = _args(tmp_path, model_server, rows)
    assert run_cli(args, tmp_path).returncode == 2
    assert run_cli(args + ["--resume"], tmp_path).returncode == 0
    stats = json.loads((tmp_path / "data" / "r" / "statistics.json").read_text())
    failed, retried = stats["spend"]["failed"], stats["spend_retried"]
    assert failed["attempts"] == retried["attempts"] == 1 and retried["requests"] == 1
