"""The cost budget (`--max_cost`): when to stop starting rows, and when to cancel the ones in flight.

Spend is only known for committed attempts, so the decision uses committed spend plus the expected
spend of the rows in flight (each at the mean cost of a committed attempt that reached the model).
Once that reaches the budget no new row starts; the rows in flight finish and are committed, so the
run ends within the budget plus what those rows cost. Before the first attempt commits there is no
estimate: the first wave of rows (at most --num_workers) starts, which is the same bound.

With `--max_cost_hard` the rows in flight are cancelled (not committed; they run again on resume)
as soon as committed spend plus an estimate of what they have spent so far (the mean attempt cost,
in proportion to how long each has run of the mean attempt duration) reaches the budget.

Whether the endpoint reports each request's cost is decided by its replies, not by its name: a
budget without prices starts, and the first reply that comes without a cost stops the run (no
request starts after it in its worker, no row starts anywhere), since its spend can no longer be
known; a resume with --price_input_per_mtok / --price_output_per_mtok goes on.

The budget is for the run across invocations (`--max_cost_scope=run`, the default: the spend of
earlier invocations, read from the committed lines, counts) or for this invocation alone
(`--max_cost_scope=invocation`).
"""

from __future__ import annotations

import time


UNPRICED = "unpriced"  # the error class of a request refused after a reply without a cost (under a budget)
UNPRICED_REASON = ("a reply came without a cost (the endpoint reports none: no usage.cost, no "
                   "x-litellm-response-cost header) and no prices were given, so --max_cost cannot be enforced")


class Budget:
    """Decides, from the live spend figures, whether a row may start and whether to cancel."""

    def __init__(self, limit: float, hard: bool, spend):
        self.limit = limit
        self.hard = hard
        self.spend = spend  # runner.output.status.LiveSpend: committed spend in the budget's scope
        self.started: dict[str, float] = {}  # row key -> monotonic start, of the rows in flight
        self.reached = False  # the budget stopped the run from starting rows
        self.unmeasurable = False  # ... because no committed attempt had a known cost
        self.unpriced_reply = False  # ... because a reply came without a cost, and no prices were given
        self.cancelled = 0  # rows in flight cancelled at the budget (--max_cost_hard)
        self.cancelled_estimate = 0.0  # what they had spent, by the estimate that cancelled them

    def on_start(self, key: str) -> None:
        self.started[key] = time.monotonic()

    def on_commit(self, key: str) -> None:
        self.started.pop(key, None)

    def on_failure(self, error_class: str | None) -> bool:
        """A committed failed attempt: True when it says a reply came without a cost and no prices
        were given (its worker then sent nothing more: class UNPRICED), which stops the run."""
        if self.unpriced_reply or error_class != UNPRICED:
            return False
        self.reached = self.unmeasurable = self.unpriced_reply = True
        return True

    def expected_in_flight(self) -> float:
        return len(self.started) * (self.spend.mean_attempt_cost() or 0.0)

    def may_start(self) -> bool:
        """False once committed spend plus the expected spend of the rows in flight reaches the limit."""
        spent = self.spend.budget_cost()
        if spent is None:  # attempts without a cost and nothing to estimate them by: stop, do not guess 0
            self.reached = self.unmeasurable = True
        elif spent + self.expected_in_flight() >= self.limit:
            self.reached = True
        return not self.reached

    def may_send(self) -> bool:
        """May a row in flight send another model request? False once the spend known so far (the
        replies that came, in every worker) reaches the limit: from then on only the requests
        already sent can go past it."""
        if self.unpriced_reply:
            return False
        spent = self.spend.budget_cost()
        if spent is not None and spent >= self.limit:
            self.reached = True
            return False
        return True

    def cancel_now(self) -> bool:
        """--max_cost_hard: the rows in flight have (by estimate) used up what the budget has left."""
        if not self.hard or not self.started:
            return False
        mean_cost = self.spend.mean_attempt_cost() or 0.0
        mean_duration = self.spend.mean_attempt_duration()
        now = time.monotonic()
        so_far = sum(mean_cost * (min(1.0, (now - t) / mean_duration) if mean_duration else 1.0)
                     for t in self.started.values())
        if (self.spend.budget_cost() or 0.0) + so_far >= self.limit:
            self.reached = True
            self.cancelled = len(self.started)
            self.cancelled_estimate = so_far
            return True
        return False

    def stop_message(self, scope: str, forecast_high: float | None = None) -> str:
        spent = self.spend.budget_cost()
        if self.unpriced_reply:
            return (f"💸 Stopped: {UNPRICED_REASON}.\n   To continue: run again with --resume and "
                    "--price_input_per_mtok / --price_output_per_mtok (USD per million tokens; a cost the endpoint "
                    "reports still wins).")
        if spent is None:
            return ("💸 Stopped: the endpoint reported no cost for the committed attempts, so --max_cost could not be "
                    "enforced.\n   To continue: run again with --resume and --price_input_per_mtok / "
                    "--price_output_per_mtok (USD per million tokens).")
        where = "across this run's invocations" if scope == "run" else "in this invocation"
        unknown = self.spend.unpriced_requests()
        about = " (an estimate)" if unknown else ""
        lines = [f"💸 Stopped at the cost budget: ${spent:.4f}{about} spent {where} of --max_cost=${self.limit:g}."]
        if self.cancelled:
            lines.append(f"   {self.cancelled} row(s) in flight were cancelled (--max_cost_hard); what they had "
                         "spent is in these figures (a request cut off without its reply at the mean request "
                         "cost), and they run again on resume.")
        if unknown:
            lines.append(f"   {unknown} request(s) of unknown cost (no reply, e.g. timed out, or no cost reported) were "
                         "counted at the mean request cost (an estimate: the budget must decide; statistics.json "
                         "says the cost is unknown).")
        hint = f"; the forecast for every row is up to ${forecast_high:.4f}" if forecast_high else ""
        lines.append(f"   To continue: run the same command with --resume --max_cost=HIGHER (more than {spent:.4f}{hint}).")
        return "\n".join(lines)
