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


REFUSING_CLASSES = ("auth", "quota")  # ProviderError classes of an endpoint that refuses the key or the account


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


class StatusError(Exception):
    """The endpoint answered an HTTP error status (4xx or 5xx), read as the OpenAI SDK reads one:
    `body` is the JSON's `error` object (or the whole JSON, or the text when it is no JSON),
    `message` "Error code: N", with " - <the error's message>" when the body has one."""

    _UNREAD = object()

    def __init__(self, status_code: int, headers: Any, content: bytes, *, body: Any = _UNREAD,
                 message: str | None = None):
        self.status_code, self.headers, self.content = status_code, headers, content
        if body is StatusError._UNREAD:
            body, message = _error_body(status_code, content)
        self.body = body
        self.message = message or f"Error code: {status_code}"
        super().__init__(self.message)


def _error_body(status_code: int, content: bytes) -> tuple[Any, str]:
    import json

    text = content.decode("utf-8", errors="replace").strip()
    message = f"Error code: {status_code}"
    try:
        parsed = json.loads(text)
    except ValueError:
        return text, message
    inner = parsed.get("error", parsed) if isinstance(parsed, dict) else parsed
    if isinstance(inner, dict) and isinstance(inner.get("message"), str) and inner["message"]:
        message += f" - {inner['message']}"
    return inner, message


class RequestFailed(Exception):
    """A request that got no answer: the connection failed or was lost (the cause chained), or
    the transport's own timeout (`timeout`)."""

    def __init__(self, message: str, *, timeout: bool = False):
        super().__init__(message)
        self.timeout = timeout
