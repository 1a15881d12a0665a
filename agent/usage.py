"""What model requests used and cost: one type for every stage that sums it.

`Usage` is the sum over model requests (one reply, a session, a committed line, per model):
requests, retries, tokens, and the cost. The cost follows one rule everywhere: `cost` is the sum of
the costs that are known, and `unpriced_requests` counts the requests whose cost is unknown (the
endpoint reported none and no price was given). `known_cost` is the cost when every request has
one, else None: an unknown cost is never 0, and the known part is a lower bound.

`Spend` is the sum over attempts (a row's session, committed or not): their summed `Usage`, how
many attempts had a known cost, and their time. The client counts a session's `Usage`; the
records carry it; the run view, the live status and the report's spend view add it up as `Spend`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

TOKEN_FIELDS = ("prompt_tokens", "completion_tokens", "reasoning_tokens", "cached_tokens", "total_tokens")
COUNT_FIELDS = ("requests", "retries", *TOKEN_FIELDS)
# The figures a record keeps per model (`usage.by_model` entries).
MODEL_FIELDS = ("requests", "prompt_tokens", "completion_tokens", "cached_tokens", "cost", "unpriced_requests")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(eq=True)
class Usage:
    """Requests, tokens and cost summed over model requests (see the module docstring)."""

    requests: int = 0
    retries: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int = 0
    cached_tokens: int = 0
    total_tokens: int = 0
    cost: float = 0.0  # the known costs: a lower bound once unpriced_requests > 0
    unpriced_requests: int = 0  # requests whose cost is unknown (none reported, no price given)
    # model -> its Usage: the run's model and the models tools call, each with its own figures
    by_model: dict[str, Usage] = field(default_factory=dict)

    @property
    def known_cost(self) -> float | None:
        """The cost when every request has one; None (unknown) otherwise."""
        return None if self.unpriced_requests else self.cost

    # --- counting requests as they are made -------------------------------------------------

    def count_request(self, model: str | None = None) -> None:
        """A request sent (before its reply: a request that never gets one is still counted)."""
        self.requests += 1
        if model is not None:
            self.model(model).requests += 1

    def add_reply(self, reply: Mapping[str, Any], cost: float | None, model: str | None = None) -> None:
        """The tokens of one reply and its cost (None: unknown)."""
        for name in TOKEN_FIELDS:
            setattr(self, name, getattr(self, name) + int(reply.get(name) or 0))
        self._add_cost(cost)
        if model is not None:
            entry = self.model(model)
            for name in ("prompt_tokens", "completion_tokens", "cached_tokens"):
                setattr(entry, name, getattr(entry, name) + int(reply.get(name) or 0))
            entry._add_cost(cost)

    def add_unanswered(self, count: int = 1, model: str | None = None) -> None:
        """Requests sent whose reply never came (abandoned, cut off): their cost is unknown."""
        self.unpriced_requests += count
        if model is not None:
            self.model(model).unpriced_requests += count

    def _add_cost(self, cost: float | None) -> None:
        if cost is None:
            self.unpriced_requests += 1
        else:
            self.cost += cost

    def model(self, name: str) -> Usage:
        entry = self.by_model.get(name)
        if entry is None:
            entry = self.by_model[name] = Usage()
        return entry

    # --- addition ---------------------------------------------------------------------------

    def __iadd__(self, other: Usage) -> Usage:
        for name in COUNT_FIELDS:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.cost += other.cost
        self.unpriced_requests += other.unpriced_requests
        for name, entry in other.by_model.items():
            self.model(name).__iadd__(entry)
        return self

    def __add__(self, other: Usage) -> Usage:
        total = Usage()
        total += self
        total += other
        return total

    def minus(self, other: Usage) -> Usage:
        """What `self` counted beyond `other` (an earlier reading of the same sums)."""
        out = Usage(**{name: getattr(self, name) - getattr(other, name) for name in COUNT_FIELDS},
                    cost=self.cost - other.cost, unpriced_requests=self.unpriced_requests - other.unpriced_requests)
        for name, entry in self.by_model.items():
            out.by_model[name] = entry.minus(other.by_model.get(name) or Usage())
        return out

    # --- as data ------------------------------------------------------------------------------

    def as_dict(self) -> dict:
        """The form a record's `usage` has: by_model a list sorted by model, so its schema is the
        same whatever models a run used."""
        data: dict[str, Any] = {name: getattr(self, name) for name in COUNT_FIELDS}
        data["cost"] = round(self.cost, 8)
        data["unpriced_requests"] = self.unpriced_requests
        data["by_model"] = [{"model": name, **entry.model_dict()} for name, entry in sorted(self.by_model.items())]
        return data

    def model_dict(self) -> dict:
        return {name: (round(self.cost, 8) if name == "cost" else getattr(self, name)) for name in MODEL_FIELDS}

    @classmethod
    def read(cls, data: Any) -> Usage:
        """A committed `usage` (or one of its `by_model` entries) as it was written, by any schema:
        what is not a number counts 0, and a cost that is not a number (schema 2 wrote null for an
        unknown cost) makes the cost unknown. Called for every line a merge reads: kept cheap."""
        if not isinstance(data, Mapping):
            return cls()
        get = data.get
        counts = [get(name) or 0 for name in COUNT_FIELDS]
        if not all(type(value) is int for value in counts):  # a hand-edited or foreign line
            counts = [int(value) if _number(value) else 0 for value in counts]
        unpriced = get("unpriced_requests") or 0
        if type(unpriced) is not int:
            unpriced = int(unpriced) if _number(unpriced) else 0
        cost = get("cost")
        if _number(cost) and math.isfinite(cost):
            cost = float(cost)
        else:
            cost, unpriced = 0.0, unpriced or 1
        usage = cls(*counts, cost, unpriced)
        by_model = get("by_model")
        if by_model:
            if isinstance(by_model, list):
                for entry in by_model:
                    if isinstance(entry, Mapping) and "model" in entry:
                        usage.by_model[str(entry["model"])] = cls.read(entry)
            elif isinstance(by_model, Mapping):  # schema 2: model -> figures
                for name, entry in by_model.items():
                    if isinstance(entry, Mapping):
                        usage.by_model[str(name)] = cls.read(entry)
        return usage


@dataclass
class Spend:
    """Usage summed over attempts, with how many of them (that made requests) had a known cost.

    The one rule again: the spend's `cost` is unknown (None) as soon as one attempt's is; its
    `known_cost` sums every known request cost (`usage.cost` holds it), those of the attempts
    whose cost is unknown included: a lower bound of the total."""

    usage: Usage = field(default_factory=Usage)
    attempts: int = 0
    priced: int = 0  # attempts that made requests and have a known cost
    unpriced: int = 0  # attempts that made requests and whose cost is unknown
    priced_requests: int = 0  # requests with a known cost (for a mean request cost)
    priced_cost: float | None = None  # the cost of the attempts whose cost is known (None: all of usage.cost)
    duration_seconds: float = 0.0
    cost_squares: float = 0.0  # sum of the squared known attempt costs, for their spread

    def __post_init__(self) -> None:
        if self.priced_cost is None:  # built from sums alone: only the priced attempts' cost is known
            self.priced_cost = 0.0 if self.unpriced else self.usage.cost

    def add(self, usage: Usage, duration: float | None = None) -> None:
        """One attempt."""
        self.attempts += 1
        self.usage.requests += usage.requests
        self.usage.retries += usage.retries
        for name in TOKEN_FIELDS:
            setattr(self.usage, name, getattr(self.usage, name) + getattr(usage, name))
        self.usage.unpriced_requests += usage.unpriced_requests
        self.usage.cost += usage.cost  # the known part, even of an attempt whose cost is unknown
        self.priced_requests += max(0, usage.requests - usage.unpriced_requests)
        cost = usage.known_cost
        if usage.requests:
            if cost is None:
                self.unpriced += 1
            else:
                self.priced += 1
                self.priced_cost += cost
                self.cost_squares += cost * cost
        if duration:
            self.duration_seconds += duration

    def __iadd__(self, other: Spend) -> Spend:
        self.usage += other.usage
        self.attempts += other.attempts
        self.priced += other.priced
        self.unpriced += other.unpriced
        self.priced_requests += other.priced_requests
        self.priced_cost += other.priced_cost
        self.duration_seconds += other.duration_seconds
        self.cost_squares += other.cost_squares
        return self

    @property
    def cost(self) -> float | None:
        """The attempts' cost; None (unknown) when any attempt's cost is unknown."""
        return None if self.unpriced else self.usage.cost

    @property
    def known_cost(self) -> float:
        """The known part: every request cost that is known (a lower bound of the total)."""
        return self.usage.cost

    @property
    def spent_attempts(self) -> int:
        """Attempts that made requests (the others spent nothing)."""
        return self.priced + self.unpriced

    def mean_cost(self) -> float | None:
        return self.priced_cost / self.priced if self.priced else None

    # --- as data ------------------------------------------------------------------------------

    def as_dict(self) -> dict:
        """The JSON form of statistics.json's spend buckets."""
        usage = self.usage
        return {
            "attempts": self.attempts,
            **{name: getattr(usage, name) for name in COUNT_FIELDS},
            "cost": None if self.cost is None else round(self.cost, 6),
            "known_cost": round(self.known_cost, 6),  # at least this much was spent
            "unpriced_requests": usage.unpriced_requests,
            "unpriced_attempts": self.unpriced,
            "priced_attempts": self.priced,
            "cache_hit_ratio": round(usage.cached_tokens / usage.prompt_tokens, 4) if usage.prompt_tokens else None,
            "duration_seconds": round(self.duration_seconds, 3),
        }

    def brief_dict(self) -> dict:
        """The report's short form (spend by model, retried attempts)."""
        usage = self.usage
        return {"attempts": self.attempts, "requests": usage.requests, "prompt_tokens": usage.prompt_tokens,
                "completion_tokens": usage.completion_tokens, "cached_tokens": usage.cached_tokens,
                "cost": None if self.cost is None else round(self.cost, 6), "unpriced_attempts": self.unpriced}

    def cache_form(self) -> dict:
        """The exact sums, for a cache (cost kept as a number even when some are unknown)."""
        return {**self.as_dict(), "cost_sum": self.usage.cost, "priced_cost_sum": self.priced_cost,
                "priced_requests": self.priced_requests}

    @classmethod
    def from_cache(cls, data: Mapping[str, Any]) -> Spend:
        usage = Usage(**{name: int(data.get(name) or 0) for name in COUNT_FIELDS},
                      cost=float(data.get("cost_sum", data.get("cost")) or 0.0),
                      unpriced_requests=int(data.get("unpriced_requests") or 0))
        unpriced = int(data.get("unpriced_attempts") or 0)
        # a cache written before the known part was kept apart: its cost_sum is the priced attempts'
        requests = data.get("priced_requests", 0 if unpriced else usage.requests)
        return cls(usage=usage, attempts=int(data.get("attempts") or 0), priced=int(data.get("priced_attempts") or 0),
                   unpriced=unpriced, priced_requests=int(requests or 0),
                   priced_cost=float(data.get("priced_cost_sum", usage.cost) or 0.0),
                   duration_seconds=float(data.get("duration_seconds") or 0.0))
