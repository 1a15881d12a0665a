"""--compress_to_tokens: the runner compresses its trajectories.jsonl at the end of a run into
trajectories_compressed.jsonl beside it (trajectories.jsonl is left as it is), with the run's
model endpoint and key and the compressor's summariser options. Always resumable: a run resumed
later compresses again, and the rows already summarised (found by their content) are not paid
for twice."""

from __future__ import annotations

from pathlib import Path

from runner.compress.compressor import Compressor
from runner.compress.options import CompressOptions
from runner.compress.run import Outcome, compress_files
from runner.compress.tokens import load_counter

COMPRESSED_NAME = "trajectories_compressed.jsonl"
METRICS_NAME = "trajectories_compressed.metrics.json"


SUMMARISER_FIELDS = ("tokenizer", "summary_target_tokens", "protect_last_n_turns", "max_concurrent_requests",
                     "per_trajectory_timeout")


def compressor_for(run_dir: Path, config) -> Compressor:
    """The compressor of a run (runner.input.config.RunConfig); TokenizerError or a pydantic
    ValidationError for an option that cannot work, raised before the run starts."""
    given = {name: getattr(config, name) for name in SUMMARISER_FIELDS if getattr(config, name) is not None}
    options = CompressOptions(
        input=str(run_dir / "trajectories.jsonl"), output=str(run_dir / COMPRESSED_NAME),
        target_max_tokens=config.compress_to_tokens, base_url=config.base_url or "http://127.0.0.1/offline",
        summary_model=config.summary_model or config.model, api_key=config.api_key, resume=True, **given,
    )
    offline = None
    if config.model == "mock":  # the offline model summarises in-process
        from agent.mock_model import MockModelClient

        offline = MockModelClient()
    return Compressor(options, load_counter(options.tokenizer), run_dir / METRICS_NAME, offline_client=offline,
                      prices=config.request_prices)


def compress_run(compressor: Compressor) -> Outcome:
    """Compress <run_dir>/trajectories.jsonl into trajectories_compressed.jsonl (resumable)."""
    options = compressor.options
    return compress_files(compressor, [(Path(options.input), Path(options.output))])


def compress_after_run(run_dir: Path, config, code: int) -> int:
    """--compress_to_tokens at the end of a run: trajectories_compressed.jsonl from trajectories.jsonl
    (left as it is). Returns the run's exit code `code`, or the compression's when it stopped or
    left rows uncompressed."""
    import sys

    from runner.compress.journal import JournalError
    from runner.compress.run import stopped_message, summary_lines
    from runner.outcome import EXIT_FATAL_PROVIDER, EXIT_INCOMPLETE, EXIT_INTERRUPTED, EXIT_OK

    print(f"\n🗜️  Compressing trajectories.jsonl to --compress_to_tokens={config.compress_to_tokens:,}...")
    compressor = compressor_for(run_dir, config)
    try:
        outcome = compress_run(compressor)
    except JournalError as err:
        print(f"❌ Not compressed: {err}", file=sys.stderr)
        return code or EXIT_INCOMPLETE
    if outcome.stopped:
        print(stopped_message(outcome), file=sys.stderr)
        return EXIT_FATAL_PROVIDER if outcome.stopped == "fatal" else EXIT_INTERRUPTED
    print("\n".join(summary_lines(outcome.summary, compressor.metrics_path)))
    return EXIT_INCOMPLETE if outcome.summary["rows_failed"] and code == EXIT_OK else code
