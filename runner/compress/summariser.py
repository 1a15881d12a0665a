"""The summary request: one chat completion through the project's model client, which owns the
retries (Retry-After honoured, jittered backoff), the cap on requests in flight and the cost.

A summary is only used when it is whole: a request that failed, a reply cut at max_tokens
(finish_reason "length") and an empty reply are failures, and the row is then kept uncompressed.
"""

from __future__ import annotations

from dataclasses import dataclass

from agent.model_client import CallStats, ModelClient
from agent.types import ProviderError

TEMPERATURE = 0.3
MAX_TURN_CHARS = 6000  # a longer turn is sent with its middle cut out: its start and end say most

INSTRUCTION = (
    "You condense part of a conversation between a user, an AI assistant and the tools the assistant "
    "called, so that the conversation can go on without those turns. Write the summary in the language the "
    "turns are written in. Keep what the rest of the conversation may rely on: what was asked, what the "
    "assistant did (tool calls, commands, files, searches) and what came back, the facts found, the "
    "decisions taken, the errors met, and what was still to be done. Write plain prose of at most about "
    "{tokens} tokens, and nothing but the summary."
)


class SummaryFailed(Exception):
    """No usable summary; `reason` is one of: provider, auth, quota, connection, truncated, empty."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass
class Summariser:
    client: ModelClient
    model: str
    target_tokens: int

    def request_messages(self, turns: list[dict]) -> list[dict]:
        text = "\n\n".join(f"[{turn['from']}]: {_trimmed(turn['value'])}" for turn in turns)
        return [
            {"role": "system", "content": INSTRUCTION.format(tokens=self.target_tokens)},
            {"role": "user", "content": f"The turns to summarise:\n\n{text}"},
        ]

    async def summarise(self, turns: list[dict], stats: CallStats) -> str:
        try:
            reply = await self.client.complete(
                self.request_messages(turns), model=self.model, max_tokens=2 * self.target_tokens,
                extra_body={"temperature": TEMPERATURE}, stats=stats,
            )
        except ProviderError as err:
            raise SummaryFailed(err.error_class, str(err)) from None
        if reply.finish_reason == "length":
            raise SummaryFailed("truncated", f"the summary was cut at max_tokens={2 * self.target_tokens}")
        summary = (reply.content or "").strip()
        if not summary:
            raise SummaryFailed("empty", "the summariser answered with no text")
        return summary


def _trimmed(text: str) -> str:
    if len(text) <= MAX_TURN_CHARS:
        return text
    keep = MAX_TURN_CHARS // 2
    return f"{text[:keep]}\n[... {len(text) - 2 * keep:,} characters left out ...]\n{text[-keep:]}"
