"""API keys: read once, kept in memory, never in the environment or argv of anything tools start.

`protect_process_secrets()` runs first thing in main(). When a key sits in the environment
(OPENROUTER_API_KEY, TAVILY_API_KEY, ...) or on the command line (--api_key=...), the runner
re-executes itself once with both cleaned and hands the keys to its new self over an inherited
pipe. So /proc/<runner>/environ and /proc/<runner>/cmdline (what `ps` shows) hold no key, nor does
the environment of the fork server, the workers and every command they start; workers get the
keys inside their pickled configuration, over their own channel.

Defence in depth: whatever a command still manages to read (the workers' memory, a file the user
left around), every known secret value is replaced by [REDACTED] in each record before it is
committed (RunStore.commit calls `redact_bytes`) and in every line the runner prints.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
from contextlib import contextmanager

REDACTED = "[REDACTED]"
# The keys the runner itself reads from the environment (build_config): model and tool backends.
SECRET_ENV_VARS = (
    "OPENROUTER_API_KEY", "OPENAI_API_KEY", "TAVILY_API_KEY", "EXA_API_KEY", "BRAVE_API_KEY",
    "FIRECRAWL_API_KEY", "FAL_KEY", "IMAGES_API_KEY",
)  # fmt: skip
API_KEY_FLAG = "--api_key"
MIN_SECRET_LENGTH = 8  # shorter values ("x", "EMPTY") are placeholders; redacting them would mangle text
_HANDOVER_FD = "ABR_SECRETS_FD"  # names the inherited pipe; holds no secret itself
_FLAG = re.compile(r"^--?api[_-]key(=|$)")

_store: dict[str, str] = {}  # name (env var, or --api_key) -> value, for this process
_known: set[str] = set()  # every value to redact
_patterns: list[bytes] = []
_protected = False  # protect_process_secrets() has run in this process


def get(name: str) -> str | None:
    """A secret the runner was given: `--api_key` or an environment variable name."""
    value = _store.get(name)
    if value is None and name != API_KEY_FLAG:
        value = os.environ.get(name)  # used as a library, without protect_process_secrets()
    return value or None


def register(*values: object) -> None:
    """Add values (str, pydantic SecretStr or None) to the set redacted everywhere."""
    for value in values:
        if value is not None and hasattr(value, "get_secret_value"):
            value = value.get_secret_value()
        if isinstance(value, str) and len(value) >= MIN_SECRET_LENGTH and value not in _known:
            _known.add(value)
            # In a serialised record a value appears JSON-escaped (raw, for a plain key), and escaped
            # twice inside a JSON text held in a string (a tool result); \u-escaped or not.
            forms: set[bytes] = set()
            for once in (_escaped(value, ascii_only=False), _escaped(value, ascii_only=True)):
                forms.add(once.encode())
                forms.add(_escaped(once, ascii_only=False).encode())
            _patterns.extend(forms - set(_patterns))
            _patterns.sort(key=len, reverse=True)


def _escaped(text: str, ascii_only: bool) -> str:
    return json.dumps(text, ensure_ascii=ascii_only)[1:-1]


def check_header_safe(what: str, value) -> None:
    """A key goes into an HTTP header, which carries printable ASCII only: one with a stray é (or
    a control character) would fail every request. ValueError naming the character's position,
    never the key."""
    if value is not None and hasattr(value, "get_secret_value"):
        value = value.get_secret_value()
    for position, char in enumerate(value or "", start=1):
        if not " " <= char <= "~":
            kind = "not ASCII" if ord(char) > 127 else "a control character"
            raise ValueError(f"{what}: character {position} is {kind}, and an HTTP header cannot carry it; "
                             "check the key for a character copied along with it")


def register_config(config) -> None:
    """Every secret field of a RunConfig (the model key and the tool backends' keys)."""
    tools = config.tools
    register(config.api_key, tools.tavily_api_key, tools.exa_api_key, tools.brave_api_key,
             tools.firecrawl_api_key, tools.fal_key, tools.images_api_key)


def redact_bytes(data: bytes) -> bytes:
    for pattern in _patterns:
        if pattern in data:
            data = data.replace(pattern, REDACTED.encode())
    for pattern in _patterns:
        if pattern.isascii() and b"\\" not in pattern:  # a piece of an escape or of a UTF-8 character
            data = _without_pieces(data, pattern, REDACTED.encode())  # would leave the line invalid
    return data


def redact(text: str) -> str:
    """The text with every known secret replaced, and every long piece of one (what a cut left)."""
    values = sorted(_known, key=len, reverse=True)  # a key that contains another goes first
    for value in values:
        if value in text:
            text = text.replace(value, REDACTED)
    for value in values:
        text = _without_pieces(text, value, REDACTED)
    return text


def _without_pieces(data, secret, replacement):
    """`data` (str or bytes) with every run of at least half of `secret` (and MIN_SECRET_LENGTH)
    consecutive characters of it replaced: what a truncation leaves of a key (its head, its tail)
    still gives most of it away.

    Each such run holds one of the secret's aligned blocks of a quarter of its length whole, so
    only those few blocks are searched for; each hit is grown both ways while it matches."""
    least = max(MIN_SECRET_LENGTH, (len(secret) + 1) // 2)
    if len(secret) <= least:
        return data
    block = least // 2
    spans = []
    for start in range(0, len(secret) - block + 1, block):
        piece = secret[start:start + block]
        at = data.find(piece)
        while at != -1:
            left, right, first, last = at, at + block, start, start + block
            while left > 0 and first > 0 and data[left - 1:left] == secret[first - 1:first]:
                left, first = left - 1, first - 1
            while right < len(data) and last < len(secret) and data[right:right + 1] == secret[last:last + 1]:
                right, last = right + 1, last + 1
            if right - left >= least:
                spans.append((left, right))
            at = data.find(piece, at + 1)
    merged: list[list[int]] = []
    for left, right in sorted(spans):
        if merged and left <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], right)
        else:
            merged.append([left, right])
    for left, right in reversed(merged):  # from the end, so earlier offsets hold
        data = data[:left] + replacement + data[right:]
    return data


def protect_process_secrets() -> None:
    """Take the keys out of this process's environment and argv (re-exec once), keep them here,
    and redact them from everything printed. Call it before anything else starts; once is enough
    (a second call does nothing)."""
    global _protected
    if _protected:
        return
    _protected = True
    handed = os.environ.pop(_HANDOVER_FD, None)
    if handed is not None:
        with os.fdopen(int(handed), "r", encoding="utf-8") as pipe:
            _store.update(json.load(pipe))
    argv = list(getattr(sys, "orig_argv", None) or [sys.executable, *sys.argv])
    clean_argv, flag_value = _strip_api_key(argv)
    found = {name: os.environ[name] for name in SECRET_ENV_VARS if os.environ.get(name)}
    if flag_value is not None:
        found[API_KEY_FLAG] = flag_value
    if found:
        _reexec_without(found, clean_argv)  # does not return
    register(*_store.values())
    _redact_console()


@contextmanager
def environment_without_keys():
    """Within: os.environ holds none of the keys. Processes started here (the fork server every
    worker is forked from, a local Ray cluster) inherit that environment. For the Python API,
    where no re-exec took the keys out (the caller's own environment is restored afterwards)."""
    saved = {name: os.environ.pop(name) for name in SECRET_ENV_VARS if name in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def _strip_api_key(argv: list[str]) -> tuple[list[str], str | None]:
    """argv without `--api_key=V` / `--api_key V` (also --api-key), and the value given."""
    clean, value, i = [], None, 0
    while i < len(argv):
        match = _FLAG.match(argv[i])
        if match and i > 0:
            if match.group(1) == "=":
                value = argv[i].split("=", 1)[1]
            elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                value = argv[i + 1]
                i += 1
            else:
                value = ""
            i += 1
            continue
        clean.append(argv[i])
        i += 1
    return clean, value


def _reexec_without(found: dict[str, str], argv: list[str]) -> None:
    secrets = {**_store, **found}
    env = {k: v for k, v in os.environ.items() if k not in found and k != _HANDOVER_FD}
    read_end, write_end = os.pipe()
    payload = json.dumps(secrets).encode()
    if len(payload) > 60_000:  # a pipe buffer holds 64 KiB; nobody has keys that long
        raise SystemExit("❌ Error: the API keys given are too long")
    os.write(write_end, payload)
    os.close(write_end)
    os.set_inheritable(read_end, True)
    env[_HANDOVER_FD] = str(read_end)
    sys.stdout.flush()
    sys.stderr.flush()
    # A signal handler does not survive execve, and the new interpreter takes a while to reach its
    # own (batch_runner.py installs it first thing, then unblocks): a Ctrl-C in between stays pending.
    interrupts = (signal.SIGINT, signal.SIGTERM)
    signal.pthread_sigmask(signal.SIG_BLOCK, interrupts)
    try:
        os.execve(sys.executable, [sys.executable, *argv[1:]], env)
    finally:  # only reached when execve failed
        signal.pthread_sigmask(signal.SIG_UNBLOCK, interrupts)


class _RedactingStream:
    """A console stream that replaces every known secret before it is written."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        self._stream.write(redact(text))
        return len(text)

    def flush(self) -> None:
        self._stream.flush()

    def __getattr__(self, name):  # encoding, isatty, fileno, ...: those of the real stream
        return getattr(self._stream, name)


def _redact_console() -> None:
    if not isinstance(sys.stdout, _RedactingStream):
        sys.stdout = _RedactingStream(sys.stdout)
    if not isinstance(sys.stderr, _RedactingStream):
        sys.stderr = _RedactingStream(sys.stderr)
