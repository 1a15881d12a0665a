"""What the compressor says about each row (`compression_metrics`) and about the whole run (the
metrics JSON beside the output). Each field has one type in every row, so a compressed file
loads in Hugging Face `datasets` like the runner's files do."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from agent.usage import Usage

# A row's status. Rows without `conversations` get none: they are written as they were read.
COMPRESSED = "compressed"
UNDER_LIMIT = "under_limit"  # already within the budget: left alone
# over the budget, but every turn is protected, or the turns that may go hold no more than a summary would
NOTHING_TO_COMPRESS = "nothing_to_compress"
FAILED = "failed"  # no usable summary: written uncompressed
STATUSES = (COMPRESSED, UNDER_LIMIT, NOTHING_TO_COMPRESS, FAILED)


def row_metrics(*, status: str, tokens_before: int, tokens_after: int, target: int, turns_before: int,
                turns_after: int, turns_summarised: int = 0, summary_tokens: int = 0, failure: str = "",
                error: str = "", counter_name: str, estimated: bool, usage: dict | None = None,
                row_key: str) -> dict:
    usage = usage or {}
    return {
        "status": status,
        "input_row_sha256": row_key,  # of the input line (its first 32 hex digits): --resume finds the row by it
        "tokens_before": tokens_before,
        "tokens_after": tokens_after,
        "target_max_tokens": target,
        "over_limit": tokens_after > target,
        "compression_ratio": round(tokens_after / tokens_before, 4) if tokens_before else 1.0,
        "turns_before": turns_before,
        "turns_after": turns_after,
        "turns_summarised": turns_summarised,
        "summary_tokens": summary_tokens,
        "failure": failure,  # "" or: timeout, truncated, empty, provider, auth, quota, connection
        "error": error,
        "tokenizer": counter_name,
        "tokens_estimated": estimated,
        "summary_requests": int(usage.get("requests") or 0),
        "summary_cost": float(usage.get("cost") or 0.0),
    }


@dataclass
class FileTally:
    """The figures of one input file, summed as its rows are decided."""

    input: str
    output: str
    rows: int = 0
    without_conversations: int = 0
    statuses: Counter = field(default_factory=Counter)
    failures: Counter = field(default_factory=Counter)
    over_limit: int = 0
    tokens_before: int = 0
    tokens_after: int = 0
    resumed_rows: int = 0  # compressed by an earlier invocation: not asked for again
    fingerprint: dict = field(default_factory=dict)  # the options that shape a row (options.fingerprint_fields)
    usage: dict = field(default_factory=dict)  # sum_usage() of this file's summary requests, earlier ones too

    def add(self, metrics: dict | None) -> None:
        self.rows += 1
        if metrics is None:
            self.without_conversations += 1
            return
        self.statuses[metrics["status"]] += 1
        if metrics["failure"]:
            self.failures[metrics["failure"]] += 1
        self.over_limit += bool(metrics["over_limit"])
        self.tokens_before += metrics["tokens_before"]
        self.tokens_after += metrics["tokens_after"]

    def as_dict(self) -> dict:
        return {
            "input": self.input,
            "output": self.output,
            "rows": self.rows,
            "rows_without_conversations": self.without_conversations,
            **{f"rows_{status}": self.statuses[status] for status in STATUSES},
            "rows_over_limit": self.over_limit,
            "rows_resumed": self.resumed_rows,
            "failures": dict(sorted(self.failures.items())),
            "tokens_before": self.tokens_before,
            "tokens_after": self.tokens_after,
            "tokens_saved": self.tokens_before - self.tokens_after,
            "compression_ratio": round(self.tokens_after / self.tokens_before, 4) if self.tokens_before else 1.0,
            "summariser": self.usage,
            "fingerprint": self.fingerprint,
        }


def sum_usage(usages: list[dict]) -> dict:
    """The summariser's spend over every request of every attempt (resumed invocations' too), in
    the records' `usage` form, with `cost_known`: false when some reply reported no cost."""
    total = Usage()
    for usage in usages:
        total += Usage.read(usage)
    return {**total.as_dict(), "cost_known": total.known_cost is not None}


def _rate(totals: FileTally, seconds: float) -> float:
    asked = totals.statuses[COMPRESSED] + totals.statuses[FAILED] - totals.resumed_rows
    return asked / seconds if seconds > 0 else 0.0


def run_metrics(files: list[FileTally], usage: dict, *, tokenizer: str, estimated: bool, options: dict,
                duration: float, summarising: float) -> dict:
    totals = FileTally("", "")
    for tally in files:
        totals.rows += tally.rows
        totals.without_conversations += tally.without_conversations
        totals.statuses.update(tally.statuses)
        totals.failures.update(tally.failures)
        totals.over_limit += tally.over_limit
        totals.tokens_before += tally.tokens_before
        totals.tokens_after += tally.tokens_after
        totals.resumed_rows += tally.resumed_rows
    summary = {k: v for k, v in totals.as_dict().items() if k not in ("input", "output", "summariser", "fingerprint")}
    return {
        **summary,
        "tokenizer": tokenizer,
        "tokens_estimated": estimated,
        "summariser": usage,
        "duration_seconds": round(duration, 3),
        "rows_per_second": round(totals.rows / duration, 2) if duration > 0 else 0.0,
        # the summary requests alone: from the first one sent to the last answer
        "summarising_seconds": round(summarising, 3),
        "summarised_rows_per_second": round(_rate(totals, summarising), 2),
        "options": options,
        "files": [tally.as_dict() for tally in files],
    }
