"""Reading the scores of committed samples: the primary score, and the run's score figures.

A scored line carries `metadata.scores`: one entry per scorer, `{"scorer", "value", "passed",
"explanation"}`, the first one the primary score (its `passed` already applies --pass_threshold).
This module only reads them: the scorers write them (runner/scoring/), the run view selects
samples by them, and statistics.json's `scoring` is `ScoreTally.as_dict()`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import comb
from typing import Any


@dataclass(frozen=True, slots=True)
class Primary:
    value: float
    passed: bool


# How a scorer's failure reads on its entry (runner/scoring/scorers.py ERROR_PREFIX; storage
# does not import the scorers).
SCORER_ERROR = "scorer error: "
# What follows it when the judge's endpoint refused the key or the account (auth, quota): every
# later grade would be refused too, so the run stops (runner/execution/dispatch.py).
JUDGE_REFUSED = "the judge's endpoint refused the request"


def score_entries(scores: Any) -> list[dict]:
    """`metadata.scores` as read from a line: its entries (none when the sample was not scored)."""
    return [entry for entry in scores if isinstance(entry, dict)] if isinstance(scores, list) else []


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def primary_score(scores: Any) -> Primary | None:
    """The sample's primary score (its first scorer's) from its `metadata.scores`, None when the
    sample was not scored."""
    entries = score_entries(scores)
    if not entries:
        return None
    value = _number(entries[0].get("value"))
    return Primary(value if value is not None else 0.0, entries[0].get("passed") is True)


def is_scorer_error(entry: dict) -> bool:
    """A score that stands for a scorer that failed (it raised, timed out, gave no grade)."""
    return str(entry.get("explanation") or "").startswith(SCORER_ERROR)


def judge_refusal(scores: Any) -> str | None:
    """The judge's refusal (JUDGE_REFUSED, its class and the endpoint's message) when a score of
    `metadata.scores` holds one, else None."""
    for entry in score_entries(scores):
        text = str(entry.get("explanation") or "")
        if text.startswith(SCORER_ERROR + JUDGE_REFUSED):
            return text[len(SCORER_ERROR):]
    return None


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimator of pass@k (Chen et al. 2021) from n samples of which c passed:
    1 - C(n - c, k) / C(n, k), the chance that k samples drawn from the n include a passing one."""
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


@dataclass
class ScoreTally:
    """The score figures over the scored samples of a run (one line per sample: its winner)."""

    scorers: list[str] = field(default_factory=list)  # in the order of the first scored line
    samples: int = 0
    passed: int = 0
    primary_sum: float = 0.0
    errors: int = 0
    by_scorer: dict[str, list[float]] = field(default_factory=dict)  # name -> [sum, count]
    rows: dict[str, list[int]] = field(default_factory=dict)  # row key -> [scored samples, passed]

    def add(self, row_key: str, scores: Any) -> None:
        entries = score_entries(scores)
        if not entries:
            return
        primary = primary_score(entries)
        self.samples += 1
        self.passed += primary.passed
        self.primary_sum += primary.value
        row = self.rows.setdefault(row_key, [0, 0])
        row[0] += 1
        row[1] += primary.passed
        for entry in entries:
            name = str(entry.get("scorer") or "")
            if name not in self.by_scorer:
                self.scorers.append(name)
                self.by_scorer[name] = [0.0, 0]
            value = _number(entry.get("value"))
            totals = self.by_scorer[name]
            totals[0] += value if value is not None else 0.0
            totals[1] += 1
            self.errors += is_scorer_error(entry)

    def as_dict(self, samples_per_prompt: int) -> dict:
        """statistics.json's `scoring`; pass@k for every k from 1 to N, averaged over the rows
        with at least k scored samples (null when no row has that many)."""
        pass_at = {}
        for k in range(1, samples_per_prompt + 1):
            values = [pass_at_k(n, c, k) for n, c in self.rows.values() if n >= k]
            pass_at[str(k)] = round(sum(values) / len(values), 6) if values else None
        return {
            "scorers": list(self.scorers),
            "samples": self.samples,
            "passed": self.passed,
            "mean": round(self.primary_sum / self.samples, 6) if self.samples else None,
            "pass_at_k": pass_at,
            "errors": self.errors,
            "by_scorer": {name: round(total / count, 6) if count else None
                          for name, (total, count) in self.by_scorer.items()},
        }
