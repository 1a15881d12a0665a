"""Samples: the unit of work is one (row, sample index), with its own key and seed.

`--samples_per_prompt=N` runs every dataset row N times. Each sample is committed, resumed and
budgeted on its own, exactly as a row is with N = 1: the store and the run view only ever see
sample keys. Sample 0's key is the row's key itself, so a run made with N = 1 (or before samples
existed) is the same run with N = 1, and raising N on resume adds samples 1.. to its rows.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping

_SEPARATOR = "/s"  # row keys are "<hex digest>-<occurrence>": they never hold it


def sample_key(row_key: str, sample: int) -> str:
    """The key of a row's sample: the row's key for sample 0, "<row key>/s<sample>" after it."""
    return row_key if sample == 0 else f"{row_key}{_SEPARATOR}{sample}"


def row_key_of(key: str) -> str:
    """The row a sample key belongs to."""
    return key.split(_SEPARATOR, 1)[0]


def sample_seed(seed: int, key: str) -> int:
    """The sample's own seed, from the run's seed and the sample's key, as a non-negative int64.
    It comes from the same digest as the sample's toolset draw (toolset_distributions.rng_for_row),
    so sample 0 draws what its row drew before samples existed."""
    digest = hashlib.sha256(f"{seed}:{key}".encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def sample_units(key_to_index: Mapping[str, int], samples: int) -> dict[str, int]:
    """Every sample key of the dataset -> its row's index."""
    return {sample_key(key, sample): index for key, index in key_to_index.items() for sample in range(samples)}


def sample_ids(ids: Mapping[str, str], samples: int) -> dict[str, str]:
    """Every sample key of the rows that have an id -> that id."""
    return {sample_key(key, sample): row_id for key, row_id in ids.items() for sample in range(samples)}


def keys_of_row(row_key: str, samples: int) -> Iterator[str]:
    return (sample_key(row_key, sample) for sample in range(samples))
