"""The report's spend panel, besides what the run view sums (runner/storage/spendtally.py: spend
by model, retried attempts, spend over time): the forecast each invocation ended with."""

from __future__ import annotations

from pathlib import Path

from runner.storage.runfiles import read_status_history


def read_invocations(run_dir: Path) -> list[dict]:
    """The last status of each invocation (status_history.jsonl), reduced to what the report shows."""
    out = []
    for status in read_status_history(run_dir):
        spend, rows, forecast = status.spend, status.rows, status.forecast or {}
        out.append({
            "started_at": status.started_at,
            "ended_at": status.updated_at,
            "state": status.state,
            "rows_done": rows.get("done"),
            "rows_total": rows.get("total"),
            "spent_usd": spend.get("total_usd"),
            "this_invocation_usd": spend.get("this_invocation_usd"),
            "per_kept_row_usd": spend.get("per_kept_row_usd"),
            "forecast_total_usd": forecast.get("total_usd"),
            "forecast_low_usd": forecast.get("total_low_usd"),
            "forecast_high_usd": forecast.get("total_high_usd"),
            "max_cost_usd": (status.budget or {}).get("max_cost_usd"),
        })
    return out
