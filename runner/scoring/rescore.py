"""`--rescore`: the committed samples of a run scored again, without running the agent.

Each committed ok line (every row's winning line) is scored from what it holds (its conversation,
its metadata) and its dataset row as the dataset is now. The scores go to rescores.jsonl, one line
per sample, which the run view puts in place of the line's own scores: the batch files are never
rewritten. Then trajectories.jsonl, statistics.json and report.html are rebuilt, all under the
run lock. Only the judge makes requests; a scorer that needs the sample's environment (command,
a Python scorer that calls `exec`) cannot run once the environment is gone, and is refused before
anything is read or written.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from pathlib import Path
from typing import Any, Callable

from runner.scoring.sample import NoEnvironment, Sample
from runner.scoring.scorers import Scorer, ScoringContext, resolve, row_rule, run_scorers
from runner.timestamps import now_iso

CONCURRENT = 16  # samples scored at once (only the judge waits on anything)


class RescoreError(ValueError):
    """The run cannot be rescored as asked (one line for the CLI); nothing was changed."""


def check_scorers(names: list[str]) -> list[Scorer]:
    if not names:
        raise RescoreError("--rescore needs --scorer=NAME[,NAME...]: the scorers to score the committed samples with")
    scorers = [resolve(name) for name in names]
    for scorer in scorers:
        if scorer.needs_environment:
            what = "runs its command" if scorer.name == "command" else "calls sample.exec"
            raise RescoreError(f"--rescore cannot use --scorer={scorer.name}: it {what} in the sample's environment, "
                               "which was removed when the sample finished; nothing was changed")
    return scorers


def rescore_run(run_dir: Path, options: Any, *, make_judge: Callable[[], Any] | None, log=print) -> int:
    """Score every committed ok sample of `run_dir` with `options.scorer` into rescores.jsonl; returns
    how many were scored. The caller holds the run lock and rebuilds the outputs after."""
    from runner.input.dataset import iter_rows, scan_dataset
    from runner.input.samples import row_key_of, sample_ids, sample_units
    from runner.input.secrets import redact, redact_bytes
    from runner.storage.runfiles import ConfigFile, read_config
    from runner.storage.records import RESCORES_FILE, RescoreRecord, UsageRecord, read_line
    from runner.storage.runview import OK_RANK, RunView, read_run
    from runner.storage.scores import judge_refusal
    from runner.storage.store import batch_files

    scorers = check_scorers(options.scorer)
    config = (read_config(run_dir) or ConfigFile()).config
    dataset_file, max_samples = config.get("dataset_file"), config.get("max_samples")
    if not isinstance(dataset_file, str) or not Path(dataset_file).is_file():
        raise RescoreError(f"--rescore reads the rows' targets and rubrics from the run's dataset, and {dataset_file!r} "
                           f"(dataset_file in {run_dir / 'config.json'}) cannot be read; nothing was changed")
    rule = row_rule(options)
    scan = scan_dataset(dataset_file, max_samples, row_error=rule)
    if scan.errors:
        line_no, reason = scan.errors[0]
        raise RescoreError(f"{dataset_file}:{line_no}: {reason} ({len(scan.errors)} row(s) in all); nothing was changed")
    rows = {row.key: row for row in iter_rows(dataset_file, max_samples)}
    # every sample of every row (--samples_per_prompt), those the no-reasoning filter discards too
    samples_per_prompt = config.get("samples_per_prompt")
    samples_per_prompt = samples_per_prompt if isinstance(samples_per_prompt, int) and samples_per_prompt > 1 else 1
    units = sample_units(scan.key_to_index, samples_per_prompt)
    view = read_run(batch_files(run_dir), RunView(units, ids=sample_ids(scan.ids, samples_per_prompt), tally=False,
                                                  log=log))
    winners = [(key, entry) for key, entry in view.rows.items() if entry.rank == OK_RANK]
    samples = []
    handles: dict[int, Any] = {}
    try:
        for key, entry in winners:
            handle = handles.get(entry.file_no) or handles.setdefault(entry.file_no, open(view.files[entry.file_no], "rb"))
            handle.seek(entry.offset)
            fields = read_line(handle.read(entry.length))
            if fields is not None:
                samples.append((key, rows[row_key_of(key)], fields))
    finally:
        for handle in handles.values():
            handle.close()
    rescore_id = uuid.uuid4().hex[:12]
    results = asyncio.run(_score_all([(row, fields) for _key, row, fields in samples], scorers, options, make_judge))
    refused = next((r for r in (judge_refusal(scores) for scores, _usage in results) if r), None)
    if refused:  # every grade would be: the samples keep the scores they have
        raise RescoreError(f"--rescore: {redact(refused)}; nothing was changed")
    lines = []
    for (key, _row, fields), (scores, usage) in zip(samples, results):
        # the sample's own key: every sample of a row is a line of its own
        lines.append(RescoreRecord(row_key=key, run_id=fields.run_id, attempt=fields.meta.attempt,
                                   scores=scores, usage=UsageRecord.of(usage), rescore_id=rescore_id,
                                   timestamp=now_iso()).model_dump_json().encode() + b"\n")
    _append(run_dir / RESCORES_FILE, redact_bytes(b"".join(lines)))  # as every committed line
    return len(lines)


async def _score_all(samples: list, scorers: list[Scorer], options: Any, make_judge) -> list[tuple[list, Any]]:
    from agent.model_client import CallStats, SessionModel

    client = make_judge() if make_judge else None
    gate = asyncio.Semaphore(CONCURRENT)

    async def one(row, fields) -> tuple[list, Any]:
        stats = CallStats(prices=options.request_prices)
        judge = SessionModel(client, options.judge_model, stats=stats) if client is not None else None
        metadata = {k: v for k, v in fields.meta.present().items() if k != "scores"}
        sample = Sample(prompt=row.prompt, conversation=fields.get("conversations") or [], metadata=metadata,
                        targets=row.targets, verify=row.verify, rubric=row.rubric, row_line=row.line)
        context = ScoringContext(judge=judge, rubric=options.judge_rubric, verify_timeout=options.verify_timeout)
        async with gate:
            scores = await run_scorers(scorers, sample, context, options.pass_threshold)
        return scores, stats

    try:
        return await asyncio.gather(*(one(row, fields) for row, fields in samples))
    except NoEnvironment:
        raise RescoreError("--rescore: a scorer called sample.exec, and the samples' environments were removed "
                           "when they finished; nothing was changed") from None
    finally:
        if client is not None:
            await client.close()


def _append(path: Path, data: bytes) -> None:
    """Append whole lines and fsync them (an unfinished tail of an earlier crash is cut first)."""
    from runner.storage.store import private_opener

    with open(path, "ab+", opener=private_opener) as handle:
        size = handle.seek(0, os.SEEK_END)
        if size:
            handle.seek(size - 1)
            if handle.read(1) != b"\n":
                handle.seek(0)
                keep = handle.read().rpartition(b"\n")[0]
                handle.truncate(len(keep) + 1 if keep else 0)
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
