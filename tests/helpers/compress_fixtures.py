"""Inputs for the trajectory compressor's tests: a real Hugging Face fast tokenizer written to a
directory (built with the tokenizers library, nothing fetched), and long ShareGPT trajectories."""

from __future__ import annotations

from pathlib import Path

WORDS = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet"]


def write_tokenizer(directory: Path) -> Path:
    """A word-level fast tokenizer (tokenizer.json): each word and each punctuation mark is one
    token, so a test knows what a text counts."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{word: i + 1 for i, word in enumerate(WORDS)}}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory


def words(count: int, offset: int = 0) -> str:
    """`count` tokens of text (for write_tokenizer's tokenizer)."""
    return " ".join(WORDS[(offset + i) % len(WORDS)] for i in range(count))


def trajectory(tool_rounds: int, words_per_turn: int, marker: str = "") -> dict:
    """A row as the runner writes it: system, human, then gpt tool calls each followed by its tool
    response, then a final gpt answer. `marker` (one word) tags the row's human turn and its calls,
so a summary request names the row it is for."""
    turns = [{"from": "system", "value": "You are a helpful agent."},
             {"from": "human", "value": f"task {marker} " + words(words_per_turn)}]
    for i in range(tool_rounds):
        turns.append({"from": "gpt", "value": f"<tool_call>call {i} {marker} " + words(words_per_turn, i) + "</tool_call>"})
        turns.append({"from": "tool", "value": f"<tool_response>result {i} " + words(words_per_turn, i + 1) +
                      "</tool_response>"})
    turns.append({"from": "gpt", "value": "final answer " + words(words_per_turn)})
    return {"prompt_index": 0, "conversations": turns, "metadata": {"model": "test-model", "row_key": marker or "k"},
            "completed": True}
