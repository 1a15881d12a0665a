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


def compress_run(run_dir: Path, config) -> Outcome:
    """Compress <run_dir>/trajectories.jsonl with the run's config (runner.input.config.RunConfig)."""
    mock = config.model == "mock"
    options = CompressOptions(
        input=str(run_dir / "trajectories.jsonl"), output=str(run_dir / COMPRESSED_NAME),
        target_max_tokens=config.compress_to_tokens, tokenizer=config.tokenizer,
        base_url=config.base_url or "http://127.0.0.1/offline", summary_model=config.summary_model or config.model,
        api_key=config.api_key, max_concurrent_requests=config.max_concurrent_requests,
        per_trajectory_timeout=config.per_trajectory_timeout, protect_last_n_turns=config.protect_last_n_turns,
        summary_target_tokens=config.summary_target_tokens, resume=True,
    )
    offline = None
    if mock:
        from agent.mock_model import MockModelClient

        offline = MockModelClient()
    compressor = Compressor(options, load_counter(options.tokenizer), run_dir / METRICS_NAME,
                            offline_client=offline, prices=config.prices)
    source = run_dir / "trajectories.jsonl"
    return compress_files(compressor, [(source, run_dir / COMPRESSED_NAME)])
