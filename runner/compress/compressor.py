"""Compress the rows of JSONL files into a token budget, one file after the other.

Every input row gives exactly one output row, in input order: a row without `conversations` as
it was read, every other one with its `compression_metrics`, compressed only when a whole
summary came back; a row whose summary failed is written as it was (never a placeholder) and
counted. The rows that need a summary are sent `max_concurrent_requests` at a time; each finished
one goes to the journal first, and the output file is written (atomically) once every row is
decided; the journal is removed only once the metrics JSON of every file is written, so an
interrupted compression resumes where it stopped.
"""

from __future__ import annotations

import asyncio
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import orjson

from agent.model_client import CallStats, ModelClient, RetryPolicy
from agent.pricing import Prices
from runner.compress import metrics as m
from runner.compress.journal import Entry, Journal
from runner.compress.options import CompressOptions, same_fingerprint
from runner.compress.plan import Region, choose_region, compressed_turns
from runner.compress.rows import InputRow, read_rows, sample
from runner.compress.summariser import Summariser, SummaryFailed
from runner.compress.tokens import TokenCounter
from runner.input import secrets
from runner.storage.atomic import atomic_write_bytes

ATTEMPTS = 4  # a summary request and 3 retries (the model client backs off between them)
FATAL_FAILURES = ("auth", "quota", "connection")  # the endpoint cannot serve any row: stop


@dataclass
class Pending:
    """A row over the budget with turns to summarise."""

    index: int
    row: InputRow
    counts: list[int]
    region: Region


@dataclass
class FileResult:
    tally: m.FileTally
    usage: list[dict] = field(default_factory=list)  # every summary attempt's spend, earlier invocations' too
    stopped: str = ""  # "", interrupted or fatal: the output was not written, the journal is kept
    message: str = ""
    journal: Journal | None = None  # of a file written whole: removed once the metrics JSON is written


class Compressor:
    def __init__(self, options: CompressOptions, counter: TokenCounter, metrics_path: Path | None = None, *,
                 offline_client=None, prices: Prices | None = None):
        self.options = options
        # The runner's offline model (--model=mock) summarises in-process: its client, not an endpoint's.
        self.offline_client = offline_client
        self.prices = prices  # for replies whose endpoint reports no cost (the runner's --price_* flags)
        self.metrics_path = metrics_path  # the run's metrics JSON: --resume after a whole run reads it
        self.counter = counter
        self.stopping = ""
        self.fatal_message = ""
        self.summarising_seconds = 0.0  # from the first summary request to the last answer, every file

    # -- one row, decided without the model ------------------------------------------------

    def _metrics(self, row: InputRow, **values) -> dict:
        return m.row_metrics(row_key=row.key, target=self.options.target_max_tokens, counter_name=self.counter.name,
                             estimated=self.counter.estimated, **values)

    def _line(self, row: InputRow, turns: list[dict], metrics: dict) -> bytes:
        data = {**row.data, "conversations": turns}
        data.pop("compression_metrics", None)  # a file compressed before: this run's figures replace them
        data["compression_metrics"] = metrics
        return secrets.redact_bytes(orjson.dumps(data))

    def plan_row(self, index: int, row: InputRow) -> tuple[bytes, dict | None] | Pending:
        """The output line and metrics of a row that needs no summary, else what to summarise."""
        if row.turns is None:
            return row.raw, None
        options = self.options
        counts = self.counter.count_many([turn["value"] for turn in row.turns])
        total = sum(counts)
        status = m.UNDER_LIMIT
        if total > options.target_max_tokens:
            region = choose_region([t["from"] for t in row.turns], counts, options.target_max_tokens,
                                   options.summary_target_tokens, options.protect_last_n_turns)
            # A summary of the target size must save something, or the request is money for nothing.
            if region is not None and region.tokens > options.summary_target_tokens:
                return Pending(index, row, counts, region)
            status = m.NOTHING_TO_COMPRESS
        n = len(row.turns)
        metrics = self._metrics(row, status=status, tokens_before=total, tokens_after=total, turns_before=n, turns_after=n)
        return self._line(row, row.turns, metrics), metrics

    # -- one row, with the model ------------------------------------------------------------

    async def _summarise(self, pending: Pending, summariser: Summariser, journal: Journal) -> Entry:
        row, region = pending.row, pending.region
        # Each change of the row's spend is journaled as it happens (before a request is sent):
        # a SIGKILL loses no request already paid for.
        stats = CallStats(prices=self.prices, listener=lambda s: journal.spending(row.key, s.as_dict()))
        total, n = sum(pending.counts), len(row.turns)
        failure = error = ""
        try:
            summary = await asyncio.wait_for(summariser.summarise(row.turns[region.start:region.end], stats),
                                             self.options.per_trajectory_timeout)
        except asyncio.TimeoutError:
            failure, error = "timeout", f"no summary within --per_trajectory_timeout={self.options.per_trajectory_timeout:g}s"
        except SummaryFailed as err:
            failure, error = err.reason, secrets.redact(str(err))
        usage = stats.as_dict()
        if failure:
            if failure in FATAL_FAILURES and not self.stopping:
                self.stopping, self.fatal_message = "fatal", f"the summariser cannot serve the rows ({failure}): {error}"
            metrics = self._metrics(row, status=m.FAILED, tokens_before=total, tokens_after=total, turns_before=n,
                                    turns_after=n, failure=failure, error=error, usage=usage)
            return Entry(row.key, m.FAILED, usage, self._line(row, row.turns, metrics))
        turns = compressed_turns(row.turns, region, summary)
        after = sum(self.counter.count_many([turn["value"] for turn in turns]))
        metrics = self._metrics(row, status=m.COMPRESSED, tokens_before=total, tokens_after=after, turns_before=n,
                                turns_after=len(turns), turns_summarised=region.end - region.start,
                                summary_tokens=self.counter.count(turns[region.start]["value"]), usage=usage)
        return Entry(row.key, m.COMPRESSED, usage, self._line(row, turns, metrics))

    async def _summarise_all(self, pending: list[Pending], journal: Journal, on_done: Callable[[Entry], None]) -> None:
        options = self.options
        key = options.api_key.get_secret_value() if options.api_key else None
        policy = RetryPolicy(max_attempts=ATTEMPTS, max_total_wait=options.per_trajectory_timeout,
                             request_timeout=options.per_trajectory_timeout)
        client = self.offline_client or ModelClient(options.base_url, key, max_in_flight=options.max_concurrent_requests,
                                                    policy=policy, prompt_caching="off")
        summariser = Summariser(client, options.summary_model, options.summary_target_tokens)
        queue = iter(pending)
        started = time.monotonic()  # after the client's start-up (the SDK's import takes seconds)

        async def worker() -> None:
            for item in queue:  # one iterator shared by the workers: each row is taken once
                if self.stopping:
                    return
                entry = await self._summarise(item, summariser, journal)
                journal.add(entry)  # committed before it is counted
                on_done(entry)

        loop = asyncio.get_running_loop()
        workers = asyncio.gather(*(worker() for _ in range(min(options.max_concurrent_requests, len(pending)))))

        def interrupt() -> None:
            self.stopping = self.stopping or "interrupted"
            workers.cancel()  # the rows in flight have only their spend in the journal: --resume does them again

        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, interrupt)
        try:
            await workers
        except asyncio.CancelledError:
            pass
        finally:
            for signum in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(signum)
            self.summarising_seconds += time.monotonic() - started
            await client.close()

    # -- one file ---------------------------------------------------------------------------

    def fingerprint(self) -> dict:
        return self.options.fingerprint_fields()

    def check_file(self, source: Path, target: Path) -> None:
        """Raise InputError or JournalError for what would stop this file: before any request."""
        read_rows(source)
        Journal.check(target, self.fingerprint(), self.options.resume)

    def compress_file(self, source: Path, target: Path, bar) -> FileResult:
        rows, _ = read_rows(source)
        rows = sample(rows, self.options.sample_percent, self.options.seed)
        fingerprint = self.fingerprint()
        result = FileResult(m.FileTally(str(source), str(target), fingerprint=fingerprint))
        journal = Journal.open(target, fingerprint, self.options.resume)
        result.usage.extend(journal.earlier_usage)
        earlier = journal.entries
        if self.options.resume and not journal.earlier_usage:  # no line read: perhaps a whole run before
            spent: list[dict] = []
            earlier = self._written_before(target, fingerprint, spent)
            # Into the journal at once: a resume that is itself cut off is then resumed from the
            # journal alone, the whole run's rows and spend included.
            journal.carry_over(earlier.values(), spent)
            result.usage.extend(spent)
        decided: dict[int, tuple[bytes, dict | None]] = {}
        places: dict[str, list[int]] = {}  # the rows waiting for a summary, by key: equal rows share one
        pending: list[Pending] = []
        for index, row in enumerate(rows):
            planned = self.plan_row(index, row)
            if not isinstance(planned, Pending):
                decided[index] = planned
            elif earlier.get(row.key) and earlier[row.key].status == m.COMPRESSED:
                decided[index] = _entry_output(earlier[row.key])
                result.tally.resumed_rows += 1
            else:
                if row.key not in places:
                    pending.append(planned)
                places.setdefault(row.key, []).append(index)
        if pending:
            bar.total = (bar.total or 0) + len(pending)
            if hasattr(bar, "refresh"):  # a tqdm bar shows its new total at once
                bar.refresh()

            def on_done(entry: Entry) -> None:
                for index in places[entry.key]:
                    decided[index] = _entry_output(entry)
                result.usage.append(entry.usage)
                bar.update(1)

            asyncio.run(self._summarise_all(pending, journal, on_done))
        if self.stopping:
            journal.close()
            result.stopped, result.message = self.stopping, self.fatal_message
            return result
        journal.sync()  # kept open (and locked) until run.py removes it
        _write_atomically(target, (decided[index][0] for index in range(len(rows))))
        for index in range(len(rows)):
            result.tally.add(decided[index][1])
        result.tally.usage = m.sum_usage(result.usage)
        # The journal outlives the output until the run's metrics JSON is written (run.py removes it):
        # a kill in between, or while a later file of a directory is compressed, must not lose what
        # this file's rows were summarised for.
        result.journal = journal
        return result

    def _written_before(self, target: Path, fingerprint: dict, usage: list[dict]) -> dict[str, Entry]:
        """--resume after a whole run (its journal removed): the rows that run compressed, read from its
        output, when its metrics show the same options; its spend is added to `usage`."""
        try:
            files = orjson.loads(self.metrics_path.read_bytes())["files"] if self.metrics_path else []
            lines = target.read_bytes().splitlines()
        except (OSError, orjson.JSONDecodeError, KeyError, TypeError):
            return {}
        # The metrics JSON sits beside the output (or in its folder), so the file's name finds its entry
        # however its path was spelt (relative, absolute, from another directory).
        entry = next((f for f in files if isinstance(f, dict) and isinstance(f.get("output"), str)
                      and Path(f["output"]).name == target.name), None)
        if entry is None or not same_fingerprint(entry.get("fingerprint"), fingerprint):
            return {}
        if isinstance(entry.get("summariser"), dict):
            usage.append(entry["summariser"])
        found = {}
        for line in lines:
            try:
                metrics = orjson.loads(line).get("compression_metrics") or {}
            except (orjson.JSONDecodeError, AttributeError):
                continue
            if metrics.get("status") == m.COMPRESSED and isinstance(metrics.get("input_row_sha256"), str):
                found[metrics["input_row_sha256"]] = Entry(metrics["input_row_sha256"], m.COMPRESSED, {}, line)
        return found


def _entry_output(entry: Entry) -> tuple[bytes, dict]:
    return entry.row, orjson.loads(entry.row)["compression_metrics"]


def _write_atomically(path: Path, lines) -> None:
    """The whole file or nothing, private like every file the runner creates."""
    atomic_write_bytes(path, b"".join(line + b"\n" for line in lines))



@dataclass
class DryRunFile:
    tally: m.FileTally
    would_compress: list[tuple[InputRow, int, Region]] = field(default_factory=list)  # row, its tokens, the region
    estimated_after: int = 0  # tokens once the regions are replaced by summaries of the target size


def dry_run_file(compressor: Compressor, source: Path, target: Path) -> DryRunFile:
    """What compress_file would do, from the token counts alone: no request, nothing written."""
    rows, _ = read_rows(source)
    rows = sample(rows, compressor.options.sample_percent, compressor.options.seed)
    result = DryRunFile(m.FileTally(str(source), str(target)))
    for index, row in enumerate(rows):
        planned = compressor.plan_row(index, row)
        if isinstance(planned, Pending):
            total = sum(planned.counts)
            result.would_compress.append((row, total, planned.region))
            result.tally.rows += 1
            result.tally.tokens_before += total
            result.estimated_after += total - planned.region.tokens + compressor.options.summary_target_tokens
        else:
            result.tally.add(planned[1])
            result.estimated_after += planned[1]["tokens_after"] if planned[1] else 0
    return result
