#!/usr/bin/env python3
"""Fit finished ShareGPT trajectories into a token budget, for training.

    python trajectory_compressor.py --input=data/demo/trajectories.jsonl --target_max_tokens=15250 \\
                                    --tokenizer=path/to/tokenizer_dir --summary_model=MODEL

A row over the budget has the middle of its conversation replaced by one summary turn written by
the summariser model; every other row is kept. The input is a JSONL file (the output defaults to
<name>_compressed.jsonl beside it) or a directory of *.jsonl (output: <dir>_compressed/). The
metrics JSON is written beside the output. docs/compressor.md describes the flags and the metrics.

Exit codes, as the runner's: 0 every row written; 1 bad input or configuration (nothing sent);
2 written, with rows whose summary failed (kept uncompressed; --resume retries them); 3 stopped:
the summariser cannot serve the rows (auth, quota, unreachable; --resume finishes); 130
interrupted (--resume finishes without paying again for the rows already summarised).
"""

from __future__ import annotations

import os
import signal
import sys


def _interrupted_before_the_requests(signum, frame):
    """Ctrl-C / SIGTERM while starting (imports, checks, the re-exec that takes the key out): no
    request was sent, so leave at once, without a traceback and without raising inside an import."""
    os.write(2, "\n⏹️  Interrupted.\n".encode())
    os._exit(130)  # EXIT_INTERRUPTED


if __name__ == "__main__":  # first thing, as batch_runner.py does
    for _signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(_signum, _interrupted_before_the_requests)
    # The re-exec (runner/input/secrets.py) blocks both signals across execve: unblock them here.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, (signal.SIGINT, signal.SIGTERM))

import inspect
from pathlib import Path

from batch_runner import EXIT_ERROR, EXIT_FATAL_PROVIDER, EXIT_INCOMPLETE, EXIT_INTERRUPTED, EXIT_OK
from runner.console import plural
from runner.input.flags import BOOL_WORDS

_LOOPBACK_PREFIXES = ("http://localhost", "http://127.", "http://[::1]", "https://localhost", "https://127.")
SHOWN_DRY_RUN_ROWS = 20  # rows listed by --dry_run (then only the totals)


class UsageError(Exception):
    """Bad input or configuration: one clear line, exit code 1."""


def main(
    input: str = None,
    output: str = None,
    target_max_tokens: int = None,
    tokenizer: str = None,
    config: str = None,
    sample_percent: float = None,
    seed: int = None,
    dry_run: bool = False,
    # Options the original does not have.
    base_url: str = None,
    summary_model: str = None,
    api_key: str = None,
    max_concurrent_requests: int = None,
    per_trajectory_timeout: float = None,
    protect_last_n_turns: int = None,
    summary_target_tokens: int = None,
    resume: bool = False,
):
    """Compress trajectories into --target_max_tokens (docs/compressor.md has every flag).

    A flag left out is None here: its default is defined once, in runner/compress/options.py, and
    a --config file's value comes before it; a flag given wins over the file."""
    flags = {name: value for name, value in locals().items() if name not in ("config", "api_key")}
    try:
        code = _run(flags, config, api_key)
    except UsageError as err:
        print(f"❌ Error: {err}", file=sys.stderr)
        code = EXIT_ERROR
    except KeyboardInterrupt:  # before the summary requests (whose Ctrl-C keeps the journal)
        print("\n⏹️  Interrupted.", file=sys.stderr)
        code = EXIT_INTERRUPTED
    raise SystemExit(code)


def _run(flags: dict, config_file: str | None, api_key: str | None) -> int:
    from runner.compress.compressor import Compressor, dry_run_file
    from runner.compress.journal import JournalError
    from runner.compress.options import OptionsError, build_options
    from runner.compress.rows import InputError, input_pairs
    from runner.compress.tokens import TokenizerError, load_counter

    flags["dry_run"] = bool(flags["dry_run"]) or None
    flags["resume"] = bool(flags["resume"]) or None
    try:
        options = build_options({**flags, "api_key": _api_key(api_key)}, config_file)
        pairs = input_pairs(options.input, options.output)
        counter = load_counter(options.tokenizer)
    except (OptionsError, InputError, TokenizerError) as err:
        raise UsageError(str(err)) from None
    compressor = Compressor(options, counter, metrics_path=_metrics_path(pairs, options))
    if counter.estimated:
        print(f"ℹ️  Token counts are an {counter.name}: pass --tokenizer=DIR_OR_NAME for a tokenizer's counts.")
    if options.dry_run:
        try:
            return _dry_run(compressor, pairs, dry_run_file)
        except InputError as err:
            raise UsageError(str(err)) from None
    _check_key(options)
    try:
        for source, target in pairs:  # every file and journal checked before the first request
            compressor.check_file(source, target)
    except (InputError, JournalError) as err:
        raise UsageError(str(err)) from None
    try:
        return _compress(compressor, pairs, options)
    except JournalError as err:  # another compression took the output after the check
        raise UsageError(str(err)) from None


def _api_key(flag) -> str | None:
    """--api_key (taken out of argv first: runner/input/secrets.py), else the environment's."""
    from runner.input import secrets

    if flag in (None, "", True):
        flag = secrets.get(secrets.API_KEY_FLAG) or secrets.get("OPENROUTER_API_KEY") or secrets.get("OPENAI_API_KEY")
    return None if flag is None else str(flag)


def _check_key(options) -> None:
    """A remote summariser needs a key; a server on this machine (llama.cpp, a proxy) may not."""
    from runner.input.secrets import check_header_safe, register

    if options.api_key is None and not options.base_url.startswith(_LOOPBACK_PREFIXES):
        raise UsageError(f"no API key for {options.base_url}: pass --api_key or set OPENROUTER_API_KEY (or "
                         "OPENAI_API_KEY); --dry_run needs none")
    try:
        check_header_safe("the API key (--api_key, OPENROUTER_API_KEY or OPENAI_API_KEY)", options.api_key)
    except ValueError as err:
        raise UsageError(str(err)) from None
    register(options.api_key)


def _metrics_path(pairs, options) -> Path:
    source = Path(options.input)
    if source.is_dir():
        return pairs[0][1].parent / "compression_metrics.json"
    target = pairs[0][1]
    return target.with_name(f"{target.stem}.metrics.json")


def _compress(compressor, pairs, options) -> int:
    from agent.model_client import probe_endpoint
    from runner.compress.run import compress_files, stopped_message, summary_lines

    key = options.api_key.get_secret_value() if options.api_key else None
    problem = probe_endpoint(options.base_url, key)
    if problem:
        raise UsageError(f"{problem}; nothing was started")
    outcome = compress_files(compressor, pairs)
    if outcome.stopped:
        print(stopped_message(outcome), file=sys.stderr)
        return EXIT_FATAL_PROVIDER if outcome.stopped == "fatal" else EXIT_INTERRUPTED
    print("\n".join(summary_lines(outcome.summary, compressor.metrics_path)))
    return EXIT_INCOMPLETE if outcome.summary["rows_failed"] else EXIT_OK


def _dry_run(compressor, pairs, dry_run_file) -> int:
    options = compressor.options
    print(f"🔎 Dry run: tokens counted with {compressor.counter.name}; no request is sent, nothing is written.")
    shown = 0
    for source, target in pairs:
        result = dry_run_file(compressor, source, target)
        tally = result.tally
        print(f"\n{source} ({plural(tally.rows, 'row')}; output would be {target}):")
        for row, total, region in result.would_compress:
            if shown < SHOWN_DRY_RUN_ROWS:
                print(f"   line {row.line}: {total:,} tokens > {options.target_max_tokens:,}: turns {region.start + 1}-"
                      f"{region.end} of {len(row.turns)} ({region.tokens:,} tokens) would be summarised")
            shown += 1
        print(f"   would compress: {plural(len(result.would_compress), 'row')}; under the limit: "
              f"{tally.statuses['under_limit']:,}; nothing to compress (over the limit, no turn to summarise that a summary would shorten): "
              f"{tally.statuses['nothing_to_compress']:,}; without conversations: {tally.without_conversations:,}")
        print(f"   tokens: {tally.tokens_before:,}, about {result.estimated_after:,} after")
    if shown > SHOWN_DRY_RUN_ROWS:
        print(f"   ({shown - SHOWN_DRY_RUN_ROWS:,} more rows would be compressed)")
    return EXIT_OK


def _flag_names() -> dict[str, object]:
    return {name: p.annotation for name, p in inspect.signature(main).parameters.items()}


def _check_argv(argv: list[str]) -> str | None:
    """The first argument fire would not bind to a flag of main(), named; None when all bind."""
    import difflib

    names = _flag_names()
    for index, arg in enumerate(argv):
        if not arg.startswith("--"):
            previous = argv[index - 1] if index else ""
            if previous.startswith("--") and "=" not in previous and names.get(previous[2:].replace("-", "_")) not in (
                    "bool", bool):
                continue  # the value of `--flag value`
            return f"unexpected argument {arg!r}: flags are written --flag=value (see --help)"
        key, has_value, value = arg[2:].partition("=")
        key = key.replace("-", "_")
        if has_value and names.get(key) in ("bool", bool) and value.strip().lower() not in BOOL_WORDS:
            return (f"--{key} is on or off, not {value!r}: write --{key}, --no{key} or --{key}=true/false "
                    "(yes/no, on/off, 1/0)")
        if key in names or (key.startswith("no") and names.get(key[2:]) in ("bool", bool)):
            continue
        guess = difflib.get_close_matches(key, list(names), n=1, cutoff=0.6)
        return f"unknown flag --{key}" + (f"; did you mean --{guess[0]}?" if guess else "") + " (see --help)"
    return None


def _bare_booleans(argv: list[str]) -> list[str]:
    """`--flag=WORD` of a boolean flag as fire's bare `--flag` or `--noflag` (fire alone would make
    any text true: `--dry_run=false` a dry run)."""
    names = _flag_names()
    result = []
    for arg in argv:
        key, has_value, value = arg[2:].partition("=") if arg.startswith("--") else ("", "", "")
        key = key.replace("-", "_")
        if has_value and names.get(key) in ("bool", bool):
            arg = f"--{key}" if BOOL_WORDS[value.strip().lower()] else f"--no{key}"
        result.append(arg)
    return result


def cli(argv: list[str] | None = None) -> None:
    if argv is None:  # the real command line: the key leaves our environment and argv first (may re-exec)
        from runner.input.secrets import protect_process_secrets

        protect_process_secrets()
    import fire

    argv = sys.argv[1:] if argv is None else list(argv)
    if any(arg in ("-h", "--help") for arg in argv):
        print(__doc__.strip() + "\n\nFlags: " + ", ".join(f"--{name}" for name in _flag_names()))
        raise SystemExit(EXIT_OK)
    problem = _check_argv(argv)
    if problem:
        print(f"❌ Error: {problem}", file=sys.stderr)
        raise SystemExit(EXIT_ERROR)
    strings = {name for name, kind in _flag_names().items() if kind in ("str", str)}
    fire.Fire(fire.decorators.SetParseFns(**{name: str for name in strings})(main), command=_bare_booleans(argv))


if __name__ == "__main__":
    cli()
