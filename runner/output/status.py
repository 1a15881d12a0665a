"""Watching a run: live spend, the forecast, the console's spend line and `<run>/status.json`.

Everything here is fed by the parent (never by reading files back): by its commit loop, and by the
workers' reports of each request's usage as it completes, so it costs a few additions per request.
Spend is what committed attempts cost, kept or not, plus what the rows in flight have spent so far.
When a request's cost is unknown (no reported cost and no price, or no reply), the total is unknown
("at least" the known part, which sums every known request cost), never $0 and never a guess; only
under a budget (--max_cost) is such a request counted at the mean cost of the requests whose cost
is known, for the budget's decision, and every figure made so is labelled an estimate. Under
a budget the workers ask before each request, and none is sent once the known spend reaches it.

status.json is rewritten atomically every few seconds while the run lives and once more at its end
(docs/cost-and-budget.md has the format); after each invocation its last state is also appended to
`status_history.jsonl`, which the report shows.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path


from agent.usage import Spend, Usage
from runner.console import plural
from runner.storage.runview import Selection, quality_outcome
from runner.storage.records import fields_of
from runner.storage.runfiles import append_status_history, read_status, write_status

STATUS_VERSION = 1
# A forecast (rate, ETA, spend to come) from fewer finished rows is mostly the first rows' start-up:
# none is made before this many rows, and never before one wave of the sessions has finished.
FORECAST_MIN_ROWS = 5
Z95 = 1.96  # two-sided 95 % normal quantile


@dataclass
class LiveSpend:
    """The run's spend: committed attempts that made model requests (`before`: what earlier
    invocations committed, `now`: this invocation), and the rows in flight, request by request."""

    scope: str = "run"  # run | invocation: what `budget_cost` covers
    # Under a budget, requests of unknown cost count at the mean request cost in every total (and
    # the figures say they are an estimate); without one, a total with such attempts is unknown.
    estimate_unknown: bool = False
    prices_given: bool = False  # --price_* flags: a request of unknown cost is one that got no reply
    before: Spend = field(default_factory=Spend)
    now: Spend = field(default_factory=Spend)
    # Rows in flight: their usage so far as the workers report it request by request, and how
    # many of their requests are still waiting for a reply (`pending`, not yet of unknown cost).
    flight: dict[str, Usage] = field(default_factory=dict)
    pending: dict[str, int] = field(default_factory=dict)

    def add(self, usage: Usage, duration: float) -> None:
        if not usage.requests:
            return  # nothing was asked of a model (e.g. its image was missing): nothing spent
        self.now.add(usage, duration)

    def report(self, key: str, usage: Usage, pending: int) -> None:
        """A row in flight spent more (its whole usage so far)."""
        self.flight[key] = usage
        self.pending[key] = pending

    def settle(self, key: str) -> None:
        """The row's record is committed: its spend is in `now` from here on."""
        self.flight.pop(key, None)
        self.pending.pop(key, None)

    def flight_known(self) -> float:
        """Known cost of the requests of the rows in flight."""
        return sum(usage.cost for usage in self.flight.values())

    def flight_unknown(self) -> int:
        """Requests of the rows in flight that ended without a known cost (pending ones excluded)."""
        return sum(usage.unpriced_requests for usage in self.flight.values()) - sum(self.pending.values())

    def requests(self) -> int:
        """Every request sent in the run so far: committed, and of the rows in flight."""
        return (self.before.usage.requests + self.now.usage.requests
                + sum(usage.requests for usage in self.flight.values()))

    def mean_request_cost(self) -> float | None:
        flight_priced = sum(u.requests - u.unpriced_requests for u in self.flight.values())
        requests = self.now.priced_requests + self.before.priced_requests + flight_priced
        known = self.now.known_cost + self.before.known_cost + self.flight_known()
        return known / requests if requests else None

    @property
    def known_attempts(self) -> int:
        """This invocation's attempts with a known cost."""
        return self.now.priced

    def mean_attempt_cost(self) -> float | None:
        attempts = self.now.priced + self.before.priced
        return (self.now.priced_cost + self.before.priced_cost) / attempts if attempts else None

    def mean_attempt_duration(self) -> float | None:
        attempts = self.now.spent_attempts
        return self.now.duration_seconds / attempts if attempts else None

    @property
    def estimated_attempts(self) -> int:
        """Attempts of the whole run without a known cost (under a budget: counted at the mean)."""
        return self.now.unpriced + self.before.unpriced

    def unpriced_requests(self) -> int:
        """Requests of the whole run whose cost is unknown (committed, and ended in flight)."""
        return self.now.usage.unpriced_requests + self.before.usage.unpriced_requests + self.flight_unknown()

    def _total(self, before: bool, estimate: bool) -> float | None:
        known = self.now.known_cost + (self.before.known_cost if before else 0.0) + self.flight_known()
        unknown = self.now.usage.unpriced_requests + (self.before.usage.unpriced_requests if before else 0)
        in_flight = self.flight_unknown()
        if not unknown and not in_flight and not self.now.unpriced and not (before and self.before.unpriced):
            return known
        if not estimate:
            return None
        # every request of unknown cost at the mean cost of the requests whose cost is known
        mean = self.mean_request_cost()
        if mean is None:
            return None if unknown else known
        return known + (unknown + in_flight) * mean

    def total(self) -> float | None:
        """Spend of the whole run (every invocation); None when it is unknown (an attempt without a
        cost, and no budget, or nothing to estimate it by)."""
        return self._total(before=True, estimate=self.estimate_unknown)

    def known_total(self) -> float:
        """The known part of the run's spend: a lower bound when some attempts have no cost."""
        return self.now.known_cost + self.before.known_cost + self.flight_known()

    @property
    def is_estimate(self) -> bool:
        """Do the totals count attempts without a cost at the mean?"""
        return self.estimate_unknown and self.estimated_attempts > 0

    def this_invocation(self) -> float | None:
        return self._total(before=False, estimate=self.estimate_unknown)

    def budget_cost(self) -> float | None:
        """What the budget compares with its limit (attempts without a cost at the mean: the budget
        must decide); None when they cannot even be estimated (no attempt has a known cost)."""
        return self._total(before=self.scope == "run", estimate=True)

    def attempt_spread(self) -> float | None:
        """Standard deviation of this invocation's known attempt costs (None below 2 attempts)."""
        n = self.now.priced
        if n < 2:
            return None
        mean = self.now.priced_cost / n
        return math.sqrt(max(0.0, (self.now.cost_squares - n * mean * mean) / (n - 1)))


@dataclass(frozen=True)
class Forecast:
    per_kept_row: float | None  # spend so far / rows kept
    remaining: float  # expected spend of the rows not yet finished
    total: float  # spend so far + remaining
    low: float | None  # approximate 95 % range of the total (None until two attempts are priced)
    high: float | None


def forecast(spent: float | None, finished_rows: int, kept_rows: int, remaining_rows: int,
             attempts: int, attempt_sd: float | None) -> Forecast | None:
    """Project the run's total from what finished rows cost so far.

    A finished (kept or discarded) row costs spent / finished_rows on average: failed attempts and
    discarded rows are paid for too, so they are spread over the rows that finished. The range is a
    normal approximation: the spread of a sum of `remaining_rows` row costs plus the uncertainty of
    the mean itself, from the per-attempt standard deviation scaled to attempts per finished row.
    """
    if spent is None or finished_rows <= 0:
        return None
    per_row = spent / finished_rows
    remaining = remaining_rows * per_row
    low = high = None
    if attempt_sd is not None:
        row_sd = attempt_sd * math.sqrt(max(1.0, attempts / finished_rows))
        half = Z95 * row_sd * (math.sqrt(remaining_rows) + remaining_rows / math.sqrt(finished_rows))
        low, high = spent + max(0.0, remaining - half), spent + remaining + half
    return Forecast(spent / kept_rows if kept_rows else None, remaining, spent + remaining, low, high)


# Throughput, the same in the console, the summary and the report: rows that got an outcome (kept,
# discarded or failed) per minute of running time (from an invocation's start to its end).
THROUGHPUT_DEFINITION = "rows with an outcome per minute of running time"


def rows_per_minute(rows: int, seconds: float | None) -> float | None:
    return rows / seconds * 60 if seconds and seconds > 0 and rows else None


def throughput_text(rate: float | None) -> str:
    return "unknown" if rate is None else f"{rate:,.1f} rows/min"


def money(value: float | None) -> str:
    if value is None:
        return "unknown"
    if value == 0:
        return "$0"
    return f"${value:.4f}" if abs(value) < 10 else f"${value:,.2f}"


def duration_text(seconds: float | None) -> str:
    if seconds is None:
        return "unknown"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else (f"{minutes}m{secs:02d}s" if minutes else f"{secs}s")


def _round(value: float | None, digits: int = 6) -> float | None:
    return None if value is None else round(value, digits)


class RunMonitor:
    """One invocation's live figures: fed on every start and commit, ticked by the dispatch loop."""

    STATUS_EVERY = 5.0  # seconds between status.json rewrites
    LINE_EVERY = 60.0  # seconds between console spend lines

    def __init__(self, run_dir: Path, run_name: str, *, total_rows: int, finished_before: int, kept_before: int,
                 to_run: int, spend: LiveSpend, budget=None, budget_limit: float | None = None, log=print,
                 clock=time.monotonic, forecast_after: int = FORECAST_MIN_ROWS, t0: float | None = None):
        self.run_dir = run_dir
        self.run_name = run_name
        self.total_rows = total_rows
        self.finished_before = finished_before
        self.kept_before = kept_before
        self.to_run = to_run  # rows this invocation set out to run
        self.forecast_after = forecast_after  # rows finished before the rate and the forecasts show
        self.spend = spend
        self.budget = budget  # runner.execution.budget.Budget or None
        self.budget_limit = budget_limit
        self.log = log
        self.clock = clock
        self.started_at = datetime.now(timezone.utc)
        # the invocation's start (its running time, as the summary and the report count it)
        self.t0 = clock() if t0 is None else t0
        self.counts = {"ok": 0, "discarded": 0, "failed": 0}
        self.selection = Selection()  # the quality filters, applied to the live counts as the merge does
        self.in_flight = 0
        # Row in flight -> when its current request was sent (its start, or the report of its last
        # reply, after which the next request goes out): how long the oldest one has waited.
        self._waiting_since: dict[str, float] = {}
        self._next_status = 0.0
        self._next_line: float | None = None  # set by the first commit

    # --- feeding ----------------------------------------------------------------------------

    def on_start(self, task) -> None:  # a runner.execution.task.Task
        self.in_flight += 1
        self._waiting_since[task.key] = self.clock()
        if self.budget is not None:
            self.budget.on_start(task.key)

    def on_usage(self, key: str, usage: dict) -> None:
        """A worker reported a row's usage so far (runner.execution.executor.SpendWatcher)."""
        self.spend.report(key, Usage.read(usage), int(usage.get("pending") or 0))
        if key in self._waiting_since:
            self._waiting_since[key] = self.clock()

    def oldest_wait(self) -> float | None:
        """Seconds the longest-waiting request in flight has waited (None: nothing in flight)."""
        if not self._waiting_since:
            return None
        return self.clock() - min(self._waiting_since.values())

    def may_send(self) -> bool:
        """May a worker send another model request? Not once the known spend reaches the budget."""
        if self.budget is None:
            return True
        was_reached = self.budget.reached
        allowed = self.budget.may_send()
        if not allowed and not was_reached:
            self.log(f"💸 Budget reached: ${self.spend.budget_cost():.4f} spent >= --max_cost=${self.budget.limit:g}; "
                     "no new request is sent, the rows in flight stop")
        return allowed

    def on_commit(self, records: list[dict]) -> None:
        for record in records:
            fields = fields_of(record)
            self.spend.settle(fields.key)
            self._waiting_since.pop(fields.key, None)
            self.spend.add(fields.usage, fields.duration or 0.0)
            self.counts[quality_outcome(record, fields.outcome, self.selection)] += 1
            if self.budget is not None and fields.key in self.budget.started:
                self.budget.on_commit(fields.key)
            if self.budget is not None and self.budget.on_failure(fields.error_class):
                self.log("💸 A reply came without a cost and no prices were given, so --max_cost cannot be "
                         "enforced: no new rows start (give --price_input_per_mtok and --price_output_per_mtok)")
        if self._next_line is None and records:
            self._next_line = self.clock()  # the first commit prints a line at the next tick

    def on_abandoned(self) -> None:
        """The rows in flight were given up (grace period over, or --max_cost_hard)."""
        self.in_flight = 0
        self._waiting_since.clear()
        self.spend.flight.clear()  # what they spent is committed with their failed records
        self.spend.pending.clear()
        if self.budget is not None:
            self.budget.started.clear()

    # --- the budget -------------------------------------------------------------------------

    @property
    def budget_reached(self) -> bool:
        return self.budget is not None and self.budget.reached

    def may_start(self) -> bool:
        if self.budget is None:
            return True
        if self.budget.reached:
            return False
        if self.budget.may_start():
            return True
        if self.budget.unmeasurable:
            self.log("💸 The endpoint reported no cost for the committed attempts, so --max_cost cannot be "
                     "enforced: no new rows start (give --price_input_per_mtok and --price_output_per_mtok)")
        else:
            self.log(f"💸 Budget reached: ${self.spend.budget_cost():.4f} committed + "
                     f"${self.budget.expected_in_flight():.4f} expected of {len(self.budget.started)} row(s) in "
                     f"flight >= --max_cost=${self.budget.limit:g}; no new rows start"
                     + ("" if self.budget.hard else ", the rows in flight go on until the spend reaches it"))
        return False

    def cancel_now(self) -> bool:
        return self.budget is not None and self.budget.cancel_now()

    # --- reporting --------------------------------------------------------------------------

    def tick(self, in_flight: int) -> None:
        """Called every loop turn: cheap unless a status write or a console line is due."""
        self.in_flight = in_flight
        now = self.clock()
        if now >= self._next_status:
            self._next_status = now + self.STATUS_EVERY
            self.write_status("running")
        if self._next_line is not None and now >= self._next_line:
            self._next_line = now + self.LINE_EVERY
            self.log(self.spend_line())

    def snapshot(self, state: str) -> dict:
        """The status.json document."""
        now = self.clock()
        elapsed = now - self.t0
        finished_now = self.counts["ok"] + self.counts["discarded"]
        committed_now = finished_now + self.counts["failed"]
        finished = self.finished_before + finished_now
        kept = self.kept_before + self.counts["ok"]
        remaining = max(0, self.total_rows - finished)
        # While running, a rate and forecasts only from enough rows; at the end the rate is the run's.
        early = state == "running" and committed_now < self.forecast_after
        rate = committed_now / elapsed if elapsed > 0 and committed_now and not early else None
        left_this_run = max(0, self.to_run - committed_now)
        spend = self.spend
        total = spend.total()
        measured = forecast(total, finished, kept, remaining, spend.known_attempts, spend.attempt_spread())
        outlook = None if state == "running" and finished < self.forecast_after else measured
        return {
            "version": STATUS_VERSION,
            "run_name": self.run_name,
            "state": state,
            "pid": os.getpid(),
            "started_at": self.started_at.isoformat(timespec="seconds"),
            "updated_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "elapsed_seconds": round(elapsed, 1),
            "rows": {
                "total": self.total_rows,
                "done": finished,
                "kept": kept,
                "discarded": self.counts["discarded"],  # this invocation
                "failed": self.counts["failed"],  # failed attempts of this invocation (retried on resume)
                "in_flight": self.in_flight,
                "remaining": remaining,
            },
            "rate_rows_per_second": _round(rate, 4),
            "eta_seconds": round(left_this_run / rate, 1) if rate and state == "running" else None,
            "spend": {
                "total_usd": _round(total),  # null: unknown (an attempt without a cost, no budget)
                "known_usd": _round(spend.known_total()),  # the known part: at least this much
                "estimated": spend.is_estimate,  # totals count attempts without a cost at the mean
                "this_invocation_usd": _round(spend.this_invocation()),
                "per_kept_row_usd": _round(measured.per_kept_row) if measured else None,
                "attempts_priced": spend.now.priced + spend.before.priced,
                "attempts_unpriced": spend.estimated_attempts,
                "requests_unpriced": spend.unpriced_requests(),  # requests of unknown cost
                "requests": spend.requests(),  # every request sent: committed rows' and those in flight
            },
            "budget": None if self.budget_limit is None else {
                "max_cost_usd": self.budget_limit,
                "scope": spend.scope,
                "counted_usd": _round(spend.budget_cost()),  # None: spend cannot be measured
                "reached": bool(self.budget is not None and self.budget.reached),
                # --max_cost_hard: rows cancelled in flight (not committed) and their estimated spend
                "cancelled_rows": self.budget.cancelled if self.budget is not None else 0,
                "cancelled_estimated_usd": _round(self.budget.cancelled_estimate) if self.budget is not None else 0.0,
            },
            "forecast": None if outlook is None else {
                "remaining_usd": _round(outlook.remaining),
                "total_usd": _round(outlook.total),
                "total_low_usd": _round(outlook.low),
                "total_high_usd": _round(outlook.high),
            },
        }

    def spend_line(self, snapshot: dict | None = None) -> str:
        s = snapshot or self.snapshot("running")
        spend, rows, outlook = s["spend"], s["rows"], s["forecast"]
        if spend["total_usd"] is None and not spend["known_usd"] and not self.spend.prices_given:
            return "💰 Spend: unknown (the endpoint reports no cost and no --price_* flags were given)"
        if spend["total_usd"] is None:
            why = ("without a reply, e.g. timed out" if self.spend.prices_given
                   else "without a reply, or a reply without a cost and no --price_* flags")
            text = (f"💰 Spent at least {money(spend['known_usd'])} (total unknown: "
                    f"{plural(spend['requests_unpriced'], 'request')} of unknown cost: {why})")
        elif spend["estimated"]:
            text = f"💰 Spent about {money(spend['total_usd'])} (estimate)"
        else:
            text = f"💰 Spent {money(spend['total_usd'])}"
        if spend["per_kept_row_usd"] is not None:
            text += f" ({money(spend['per_kept_row_usd'])} per kept row)"
        if outlook is not None and rows["remaining"]:
            text += f"; {rows['remaining']:,} row(s) left: about {money(outlook['remaining_usd'])} more, {money(outlook['total_usd'])} in all"
            if outlook["total_low_usd"] is not None:
                text += f" ({money(outlook['total_low_usd'])} to {money(outlook['total_high_usd'])})"
        if outlook is None and rows["remaining"] and s["state"] == "running":
            text += f"; {rows['remaining']:,} row(s) left, forecast after {self.forecast_after:,} rows"
        if s["rate_rows_per_second"] and s["state"] == "running":  # at the end the summary states it
            text += f"; {throughput_text(s['rate_rows_per_second'] * 60)}"
        if s["eta_seconds"] is not None:
            text += f", ETA {duration_text(s['eta_seconds'])}"
        if spend["estimated"]:
            text += (f" [estimate: {plural(spend['requests_unpriced'], 'request')} of unknown cost counted at the "
                     "mean request cost, for --max_cost]")
        return text

    def write_status(self, state: str) -> dict:
        snapshot = self.snapshot(state)
        try:
            write_status(self.run_dir, snapshot)
        except OSError as err:  # a view for watchers: never let it stop the run
            self.log(f"⚠️  Could not write status.json: {err}")
        return snapshot

    def close(self, state: str) -> dict:
        """The invocation's last status: status.json, one line of status_history.jsonl."""
        snapshot = self.write_status(state)
        try:
            append_status_history(self.run_dir, snapshot)
        except OSError as err:
            self.log(f"⚠️  Could not append to status_history.jsonl: {err}")
        return snapshot


def settle_status(run_dir: Path, view, stats: dict, config: dict, log=print) -> None:
    """After a command that runs no prompt rebuilt statistics.json (--report, --rescore; under the
    run lock, so no runner is alive): a status.json that still says `running` was left by a runner
    that was killed, and one whose request count differs missed what its workers' journals held.
    Either is rewritten the way an invocation's end writes it, from the run's committed lines as
    statistics.json counts them: state `interrupted` for the killed one (an ended state is kept),
    no rows in flight, and nothing spent by this invocation."""
    saved = read_status(run_dir)
    requests = view.total_spend().usage.requests
    if saved is None or (saved.state != "running" and saved.spend.get("requests") == requests):
        return
    dataset = view.dataset if view.dataset is not None else {}
    max_cost = config.get("max_cost")
    max_cost = float(max_cost) if isinstance(max_cost, (int, float)) and not isinstance(max_cost, bool) else None
    spend = LiveSpend(scope="invocation" if config.get("max_cost_scope") == "invocation" else "run",
                      estimate_unknown=max_cost is not None, prices_given=config.get("prices") is not None,
                      before=view.total_spend())
    elapsed = saved.data.get("elapsed_seconds")
    elapsed = float(elapsed) if isinstance(elapsed, (int, float)) and not isinstance(elapsed, bool) else 0.0
    monitor = RunMonitor(run_dir, str(saved.data.get("run_name") or run_dir.name), total_rows=len(dataset),
                         finished_before=sum(1 for key in dataset if view.is_committed(key)),
                         kept_before=stats["outcomes"]["ok"], to_run=0, spend=spend, budget_limit=max_cost, log=log,
                         t0=time.monotonic() - max(0.0, elapsed))
    started = _parsed_time(saved.started_at)
    if started is not None:  # the killed invocation's start, as its own status said
        monitor.started_at = started
    monitor.write_status("interrupted" if saved.state in (None, "running") else saved.state)


def _parsed_time(text: str | None) -> datetime | None:
    try:
        return datetime.fromisoformat(text) if text else None
    except ValueError:
        return None
