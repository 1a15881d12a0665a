"""Spend the run view does not keep by outcome: by model, retried, and over time.

The run view (runview.py) sums spend by what became of each line; it also hands each line to a
`SpendTally`, which adds spend by model (`usage.by_model`: the run's model and the models tools
call), the part of the failed attempts whose row a later attempt finished ("retried"), and the
cumulative spend over time. The report shows them (runner/output/spend_view.py).
"""

from __future__ import annotations

import bisect
from array import array
from datetime import datetime

from agent.usage import Spend, Usage
from runner.timestamps import iso_of

TIME_POINTS = 120  # points of the cumulative spend curve


class SpendTally:
    """Fed by the run view with the spend bucket it gave each line (kept, discarded, failed, other)."""

    def __init__(self) -> None:
        self.by_model: dict[str, Spend] = {}
        self.failed_by_row: dict[str, Spend] = {}  # row key -> spend of its failed lines, settled at the end
        self.times = array("d")  # commit time of each line with a known cost, and that cost
        self.costs = array("d")

    def add(self, bucket: str, row_key: str, timestamp: str | None, usage: Usage) -> None:
        if bucket == "failed":
            self.failed_by_row.setdefault(row_key, Spend()).add(usage)
        for model, entry in usage.by_model.items():  # attempts here: committed lines that used the model
            self.by_model.setdefault(model, Spend()).add(entry)
        cost = usage.known_cost
        if cost is not None and timestamp:
            try:
                when = datetime.fromisoformat(timestamp).timestamp()
            except ValueError:
                return
            self.times.append(when)
            self.costs.append(float(cost))

    def retried(self, finished) -> dict:
        """Spend of the failed attempts whose row a later attempt finished (`finished(key)`)."""
        total = Spend()
        for key, spend in self.failed_by_row.items():
            if finished(key):
                total += spend
        return total.brief_dict()

    def models(self) -> dict:
        return {model: spend.brief_dict() for model, spend in sorted(self.by_model.items())}

    def curve(self) -> dict | None:
        """Cumulative spend of the lines with a known cost, at up to TIME_POINTS even time steps."""
        if not self.times:
            return None
        start = min(self.times)
        return {"start": iso_of(start, "seconds"), "start_epoch": start,
                "points": spend_curve(self.times, self.costs)}


def spend_curve(times, costs, points: int = TIME_POINTS) -> list[list[float]]:
    """[[seconds since the first commit, cumulative USD], ...] at up to `points` even steps."""
    if not times:
        return []
    order = sorted(range(len(times)), key=times.__getitem__)
    sorted_times = [times[i] for i in order]
    cumulative, running = [], 0.0
    for i in order:
        running += costs[i]
        cumulative.append(running)
    start, end = sorted_times[0], sorted_times[-1]
    if end <= start:
        return [[0.0, round(cumulative[-1], 6)]]
    curve = []
    for step in range(points + 1):
        t = start + (end - start) * step / points
        position = bisect.bisect_right(sorted_times, t) - 1
        curve.append([round(t - start, 3), round(cumulative[position], 6)])
    return curve
