"""Plain data passed between the model client, the agent loop and the tools."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

REQUEST_TIMEOUT = 600.0  # seconds for one HTTP request to the model (--request_timeout's default)


@dataclass
class ModelReply:
    """One chat-completion choice, normalised from whatever the endpoint sent."""

    content: str | None
    reasoning: str | None  # native reasoning (reasoning / reasoning_content / reasoning_details joined)
    tool_calls: list[dict]  # [{"id", "type": "function", "function": {"name", "arguments": str}}]
    finish_reason: str | None
    reasoning_details: list | None = None
    usage: dict[str, Any] = field(default_factory=dict)  # prompt/completion/reasoning/cached/total tokens, cost


class ProviderError(Exception):
    """A model request that failed for good (after our retries, or not retryable).

    error_class: provider (429/5xx/timeout/malformed/other 4xx), model (see ModelMisbehaved), auth (401/403),
    quota (402 or an insufficient_quota code), connection (the endpoint cannot be reached: DNS,
    refused, closed, TLS), truncated (the first reply cut at max_tokens), budget (not sent: the
    run's cost budget is reached). auth and quota stop the whole run; connection and truncated stop
    it when they repeat row after row.
    """

    def __init__(self, message: str, error_class: str = "provider", status: int | None = None):
        super().__init__(message)
        self.error_class = error_class
        self.status = status


class ModelMisbehaved(ProviderError):
    """The endpoint answered, but no reply of the model could be used (all empty, or every one
    dropped): error class `model`. `dropped_replies` lists them ({"call": n, "reason": ...})."""

    def __init__(self, message: str, dropped_replies: list[dict]):
        super().__init__(message, "model")
        self.dropped_replies = list(dropped_replies)
