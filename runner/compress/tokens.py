"""Token counters: a Hugging Face fast tokenizer (a local directory, or a name on the hub), or an
estimate of one token per four characters that says it is one."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ESTIMATE = "estimate"  # --tokenizer=estimate: characters / 4, reported as an estimate
ESTIMATE_LABEL = "estimate (characters / 4)"


class TokenizerError(ValueError):
    """The tokenizer named by --tokenizer cannot be loaded."""


@dataclass
class TokenCounter:
    name: str  # what the metrics call it: the directory, the hub name, or ESTIMATE_LABEL
    estimated: bool  # True: counts are an estimate, not a tokenizer's
    _count_many: Callable[[list[str]], list[int]]

    def count_many(self, texts: list[str]) -> list[int]:
        return self._count_many(texts) if texts else []

    def count(self, text: str) -> int:
        return self.count_many([text])[0]


def _estimate(texts: list[str]) -> list[int]:
    return [len(text) // 4 for text in texts]


def _from_tokenizer(tokenizer) -> Callable[[list[str]], list[int]]:
    def count_many(texts: list[str]) -> list[int]:
        # The turns' text alone: no special tokens, which a chat template adds once per turn anyway.
        return [len(encoding.ids) for encoding in tokenizer.encode_batch(texts, add_special_tokens=False)]

    return count_many


def load_counter(spec: str) -> TokenCounter:
    """`estimate`, a directory holding tokenizer.json (or the file itself), or a hub name.

    A local path is read from disk only: nothing is asked of the hub for it."""
    if spec == ESTIMATE:
        return TokenCounter(ESTIMATE_LABEL, True, _estimate)
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise TokenizerError(f"--tokenizer={spec} needs the tokenizers package: pip install -e '.[compress]' "
                             f"(or --tokenizer={ESTIMATE} to estimate tokens as characters / 4)") from None
    path = Path(os.path.expanduser(spec))
    # A hub name is `name` or `owner/name`; anything else that looks like a path is one.
    if path.exists() or spec.startswith((".", "/", "~")) or spec.endswith("/") or spec.count("/") > 1:
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise TokenizerError(f"--tokenizer={spec}: no tokenizer.json there (a Hugging Face fast tokenizer "
                                 "directory holds one)")
        try:
            return TokenCounter(str(path), False, _from_tokenizer(Tokenizer.from_file(str(file))))
        except Exception as err:  # the tokenizers library raises its own exception type
            raise TokenizerError(f"--tokenizer={spec}: {file} is not a tokenizer the tokenizers library reads: {err}") from None
    try:
        return TokenCounter(spec, False, _from_tokenizer(Tokenizer.from_pretrained(spec)))
    except Exception as err:
        raise TokenizerError(f"--tokenizer={spec}: cannot load it from the Hugging Face hub ({err}); give a local "
                             f"directory with tokenizer.json, or --tokenizer={ESTIMATE}") from None
