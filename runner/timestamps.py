"""Timestamps the runner writes: local wall-clock time with its UTC offset, so every file's times
can be compared and read without knowing the machine's time zone."""

from __future__ import annotations

from datetime import datetime


def now_iso(timespec: str = "auto") -> str:
    """Now, e.g. '2026-12-01T21:30:05.123456+01:00'."""
    return datetime.now().astimezone().isoformat(timespec=timespec)


def iso_of(epoch: float, timespec: str = "auto") -> str:
    """A Unix time as local time with its offset."""
    return datetime.fromtimestamp(epoch).astimezone().isoformat(timespec=timespec)
