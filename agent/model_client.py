"""Access to an OpenAI-compatible chat endpoint, with the run's only retry layer.

One `ModelClient` per worker process and endpoint: it owns the way requests go (`EndpointPost`:
plain HTTP to a local http:// endpoint, else the OpenAI SDK's transport with its retries off),
the retry policy (Retry-After and x-ratelimit-reset* honoured, exponential backoff with full
jitter, a bounded total wait), an adaptive cap on requests in flight (halved on bursts of 429,
recovered slowly) and an optional requests-per-minute pace.
`SessionModel` is the per-prompt view of it that also sums usage and retries for the row.

Usage of one reply (`ModelReply.usage`): prompt, completion, reasoning, cached and total tokens,
and `cost`: the charge the endpoint reported (OpenRouter's `usage.cost`, else LiteLLM's
`x-litellm-response-cost` header), or None when it reported none (unknown, never 0.0). A row's
`CallStats.cost` is the sum, priced from the user's prices where a reply reported none, and None
as soon as one reply's cost is unknown. `cached_tokens` are the prompt tokens served from the
provider's cache (`prompt_tokens_details.cached_tokens`, else `cache_read_input_tokens`).

A failed request is classed for the run: `auth` (401/403) and `quota` (402, insufficient_quota)
stop it; `connection` (the endpoint cannot be reached: DNS, refused, closed, TLS, named from the
transport's cause chain, which the aiohttp transport reports as a timeout) is retried for a short
budget; everything else is `provider`.
"""

from __future__ import annotations

import asyncio
import email.utils
import http.client
import math
import os
import random
import re
import socket
import ssl
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import orjson

from agent.plain_http import HTTPProtocolError, PlainHttpPost, ReplyTooLarge, ServerDisconnectedError
from agent.pricing import Prices, request_cost
from agent.usage import Usage
from agent.types import REQUEST_TIMEOUT, ModelReply, ProviderError, RequestFailed, StatusError

_QUOTA_CODES = ("insufficient_quota", "insufficient_credits", "billing_hard_limit_reached")


@dataclass
class RetryPolicy:
    max_attempts: int = 8  # per request, the first try included
    base_delay: float = 1.0  # first backoff, doubled each retry
    max_delay: float = 60.0  # cap of one backoff
    max_total_wait: float = 300.0  # a request gives up once waiting more would pass this
    # ... or, while the endpoint cannot be reached at all (refused, DNS, closed), this: a brief loss
    # (a server restart) is ridden out, a dead endpoint fails the row soon enough for the run's
    # unreachable-endpoint stop to end the run instead of failing the dataset one row at a time.
    max_unreachable_wait: float = 30.0
    request_timeout: float = REQUEST_TIMEOUT  # seconds for one HTTP request


class AdaptiveLimiter:
    """Caps requests in flight. A 429 halves the cap (once per burst); each success adds 1/cap."""

    def __init__(self, maximum: int):
        self.maximum = max(1, maximum)
        self.limit = float(self.maximum)
        self.in_flight = 0
        self._cond = asyncio.Condition()
        self._last_cut = 0.0

    async def __aenter__(self):
        async with self._cond:
            while self.in_flight >= int(self.limit):
                await self._cond.wait()
            self.in_flight += 1

    async def __aexit__(self, *exc):
        async with self._cond:
            self.in_flight -= 1
            self._cond.notify_all()

    def on_throttled(self) -> None:
        now = time.monotonic()
        if now - self._last_cut > 1.0:  # many 429s from one burst count once
            self._last_cut = now
            self.limit = max(1.0, self.limit / 2)

    def on_success(self) -> None:
        if self.limit < self.maximum:
            self.limit = min(float(self.maximum), self.limit + 1.0 / self.limit)


class RequestPacer:
    """Spaces request starts evenly to stay under a requests-per-minute budget (per process)."""

    def __init__(self, per_minute: float | None):
        self.interval = 60.0 / per_minute if per_minute else 0.0
        self._next = 0.0
        self._lock = asyncio.Lock()

    async def wait(self) -> None:
        if not self.interval:
            return
        async with self._lock:
            now = time.monotonic()
            delay = self._next - now
            self._next = max(now, self._next) + self.interval
        if delay > 0:
            await asyncio.sleep(delay)


@dataclass
class CallStats(Usage):
    """What one row's session spent (agent.usage.Usage), priced from the user's prices where a
    reply reported no cost, counted request by request from the moment each is sent.

    A request sent is pending until it ends: a reply adds its usage and cost, an error status is
    an answer without a charge, and a request that ends with no answer (a timeout, a cancel, a body
    that cannot be read) has an unknown cost. `listener`, when set, is called after every change,
    so whoever holds the row (the runner's parent process) knows the spend as requests complete."""

    prices: Prices | None = field(default=None, repr=False, compare=False)
    listener: Callable[[CallStats], None] | None = field(default=None, repr=False, compare=False)
    # Asked before each request is sent (the run's cost budget): False and it is not sent.
    admit: Callable[[], Awaitable[bool]] | None = field(default=None, repr=False, compare=False)
    pending: dict[str, int] = field(default_factory=dict, repr=False, compare=False)  # model -> requests sent, not ended

    def count_request(self, model: str | None = None) -> None:
        super().count_request(model)
        self._pend(model, 1)

    def add_usage(self, usage: dict, model: str | None = None) -> None:
        self._pend(model, -1, notify=False)  # one report, once the reply's usage is in
        self.add_reply(usage, request_cost(usage, self.prices), model)
        self._changed()

    def answered_without_charge(self, model: str | None = None) -> None:
        """The endpoint answered with an error status: nothing to charge."""
        self._pend(model, -1)

    def unanswered(self, model: str | None = None, *, sent: bool = True) -> None:
        """The request ended with no reply: its cost is unknown; one that never left is not counted."""
        self._pend(model, -1, notify=False)
        if sent:
            self.add_unanswered(1, model)
        else:
            self.requests -= 1
            if model is not None:
                self.model(model).requests -= 1
        self._changed()

    def _pend(self, model: str | None, step: int, notify: bool = True) -> None:
        name = model or ""
        self.pending[name] = self.pending.get(name, 0) + step
        if notify:
            self._changed()

    def _changed(self) -> None:
        if self.listener is not None:
            self.listener(self)

    def as_dict(self) -> dict:
        """The record's usage: a request still pending (its session was cut off) has an unknown cost."""
        data = super().as_dict()
        data["unpriced_requests"] += sum(self.pending.values())
        for entry in data["by_model"]:
            entry["unpriced_requests"] += self.pending.get(entry["model"], 0)
        return data

    def report(self) -> dict:
        """`as_dict()` and how many of its unpriced requests are still pending (for the parent)."""
        return {**self.as_dict(), "pending": sum(self.pending.values())}


def parse_duration(text: str) -> float | None:
    """Parse '1.5', '20ms', '2s', '6m0s', '1h2m3s' (OpenAI's x-ratelimit-reset-* style)."""
    text = text.strip()
    try:
        return float(text)
    except ValueError:
        pass
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        return None
    scale = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
    return sum(float(n) * scale[u] for n, u in parts)


def server_requested_delay(headers: Any) -> float | None:
    """The wait a 429/503 response asks for, from Retry-After or x-ratelimit-reset-*."""
    if headers is None:
        return None
    retry_after = headers.get("retry-after-ms")
    if retry_after:
        try:
            return float(retry_after) / 1000.0
        except ValueError:
            pass
    retry_after = headers.get("retry-after")
    if retry_after:
        seconds = parse_duration(retry_after)
        if seconds is not None:
            return seconds
        try:
            parsed = email.utils.parsedate_to_datetime(retry_after)
        except (TypeError, ValueError):  # neither seconds nor a date: our own backoff applies
            parsed = None
        if parsed is not None:
            return max(0.0, parsed.timestamp() - time.time())
    resets = [parse_duration(headers.get(h, "")) for h in ("x-ratelimit-reset-requests", "x-ratelimit-reset-tokens")]
    resets = [r for r in resets if r is not None]
    return max(resets) if resets else None


def classify_status(status: int, codes: tuple[str, ...] = ()) -> tuple[str, bool]:
    """(error_class, retryable) for an HTTP error status and the error's code/type strings.

    Only 402 or an explicit insufficient-quota code is a quota error (fatal for the run): a 429
    whose message merely mentions a quota ("requests per minute quota") is a rate limit.
    """
    if status in (401, 403):
        return "auth", False
    if status == 402 or any(code in _QUOTA_CODES for code in codes):
        return "quota", False
    if status in (408, 409, 425, 429) or status >= 500:
        return "provider", True
    return "provider", False


def _usage_dict(usage: Any) -> dict:
    if not isinstance(usage, dict):
        return {}
    details = usage.get("completion_tokens_details") or {}
    prompt_details = usage.get("prompt_tokens_details") or {}
    return {
        "prompt_tokens": usage.get("prompt_tokens") or 0,
        "completion_tokens": usage.get("completion_tokens") or 0,
        "total_tokens": usage.get("total_tokens") or 0,
        "reasoning_tokens": details.get("reasoning_tokens") or 0,
        # OpenAI style, else Anthropic style (what LiteLLM passes through)
        "cached_tokens": prompt_details.get("cached_tokens") or usage.get("cache_read_input_tokens") or 0,
        "cost": charge(usage.get("cost")),  # OpenRouter reports the charge here; None: not reported (or no number)
    }


def extract_reasoning(message: dict) -> tuple[str | None, list | None]:
    """Join native reasoning from `reasoning`, `reasoning_content` and `reasoning_details`."""
    pieces: list[str] = []
    for name in ("reasoning", "reasoning_content"):
        text = message.get(name)
        if isinstance(text, str) and text.strip() and text not in pieces:
            pieces.append(text)
    details = message.get("reasoning_details")
    if isinstance(details, list):
        for item in details:
            if isinstance(item, dict):
                text = item.get("summary") or item.get("content") or item.get("text")
                if isinstance(text, str) and text.strip() and text not in pieces:
                    pieces.append(text)
    return ("\n\n".join(pieces) if pieces else None), (details if isinstance(details, list) else None)


_INLINE_THINK = re.compile(r"\s*<think>(.*?)</think>\s*", re.DOTALL)


def split_inline_think(content: str | None) -> tuple[str | None, str | None]:
    """(reasoning, rest) of a content that starts with a <think>...</think> block, as many servers
    send reasoning (llama.cpp, vLLM without a reasoning parser); (None, content) otherwise."""
    if not content:
        return None, content
    match = _INLINE_THINK.match(content)
    if not match:
        return None, content
    return match.group(1).strip() or None, content[match.end():] or None


def reported_cost(usage: dict, headers: Any) -> float | None:
    """The charge the endpoint reported for one request: OpenRouter's `usage.cost`, else LiteLLM's
    `x-litellm-response-cost` header; None when neither says (unknown, not free)."""
    body = charge(usage.get("cost"))
    if body is not None:
        return body
    return charge(headers.get("x-litellm-response-cost") if headers is not None else None)


def charge(value: Any) -> float | None:
    """A reported cost as a number of USD, or None (unknown) for anything that is not one: a
    missing value, text, an object, NaN, infinity or a negative amount (none is a price, and
    one would turn every sum it enters into nonsense)."""
    if isinstance(value, bool):
        return None
    try:
        cost = float(value)
    except (TypeError, ValueError):
        return None
    return cost if math.isfinite(cost) and cost >= 0 else None


_EPHEMERAL = {"type": "ephemeral"}
MAX_CACHE_BREAKPOINTS = 4  # Anthropic's limit per request


def wants_prompt_caching(mode: str, model: str, base_url: str | None) -> bool:
    """--prompt_caching: on, off, or auto (Claude models on OpenRouter, which honour breakpoints)."""
    if mode in ("on", "off"):
        return mode == "on"
    return "claude" in model.lower() and "openrouter.ai" in _host_of(base_url)


def with_cache_breakpoints(messages: list[dict]) -> list[dict]:
    """The messages with Anthropic `cache_control` breakpoints on the system message and the last
    messages (at most MAX_CACHE_BREAKPOINTS in all), so each turn reads the prefix the previous
    one cached. The stored messages are not changed; a message without text is skipped, since an
    empty text part is refused."""
    marked = list(messages)
    system = next((i for i, m in enumerate(marked) if m.get("role") == "system" and m.get("content")), None)
    chosen = [] if system is None else [system]
    for i in range(len(marked) - 1, -1, -1):
        if len(chosen) >= MAX_CACHE_BREAKPOINTS:
            break
        if i != system and marked[i].get("content"):
            chosen.append(i)
    for i in chosen:
        message = dict(marked[i])
        content = message["content"]
        if isinstance(content, str):
            message["content"] = [{"type": "text", "text": content, "cache_control": _EPHEMERAL}]
        elif isinstance(content, list) and content and isinstance(content[-1], dict):
            message["content"] = [*content[:-1], {**content[-1], "cache_control": _EPHEMERAL}]
        marked[i] = message
    return marked


def reply_from_completion(completion: Any) -> ModelReply:
    """Normalise a chat-completion body (a dict, as the endpoint sent it)."""
    choices = completion.get("choices") if isinstance(completion, dict) else None
    if not choices or not isinstance(choices[0], dict) or not isinstance(choices[0].get("message"), dict):
        raise ValueError("the response has no choices")
    choice = choices[0]
    message = choice["message"]
    reasoning, details = extract_reasoning(message)
    tool_calls = []
    for call in message.get("tool_calls") or []:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            continue
        tool_calls.append(
            {
                "id": call.get("id") or "",
                "type": "function",
                "function": {"name": function.get("name") or "", "arguments": function.get("arguments") or ""},
            }
        )
    content = message.get("content")
    content = content if isinstance(content, str) or content is None else str(content)
    inline, content = split_inline_think(content)
    if inline and inline != reasoning:
        reasoning = f"{reasoning}\n\n{inline}" if reasoning else inline
    return ModelReply(
        content=content,
        reasoning=reasoning,
        tool_calls=tool_calls,
        finish_reason=choice.get("finish_reason"),
        reasoning_details=details,
        usage=_usage_dict(completion.get("usage")),
    )


MAX_REPLY_BYTES = 16 * 1024 * 1024  # a model reply, decoded; real replies are a few kB to a few hundred
USER_AGENT = "agent-batch-runner (OpenAI-compatible client)"  # the plain path's
REDIRECT_LOOP = "the endpoint's redirects never end"  # how a row's error starts (a run stops on it)


def _proxied(hostname: str) -> bool:
    proxies = urllib.request.getproxies()
    return ("http" in proxies or "all" in proxies) and not urllib.request.proxy_bypass(hostname)


def _safe_header(value: str) -> bool:
    """A value a header line can carry as it is (the SDK's transport refuses the others itself)."""
    return "\r" not in value and "\n" not in value and value.isprintable() and value.isascii()


def _plain_text(text: str) -> bool:
    """Printable ASCII without spaces: what a request line carries as it is (no escaping needed)."""
    return all("!" <= char <= "~" for char in text)


def plain_post_for(base_url: str | None, api_key: str | None) -> PlainHttpPost | None:
    """The plain path to `{base_url}/chat/completions` when it can serve it: an http:// URL that
    no proxy of the environment stands before, whose host, port, path and query a request line
    carries as they are (no user info, nothing to escape), and a key a header carries as it is.
    None: the SDK's transport serves the endpoint (agent/sdk_transport.py), and says what it
    makes of the rest."""
    parts = urllib.parse.urlsplit(base_url or "")
    key = api_key or "no-key"
    if parts.scheme != "http" or not parts.hostname or "@" in parts.netloc or not _safe_header(key) \
            or not _plain_text(parts.netloc + parts.path + parts.query):
        return None
    try:
        port = 80 if parts.port is None else parts.port
    except ValueError:  # a port that is no number or out of range
        return None
    if port == 0 or _proxied(parts.hostname):
        return None
    headers = [("Authorization", f"Bearer {key}"), ("Content-Type", "application/json"), ("Accept", "application/json"),
               ("User-Agent", USER_AGENT), ("Accept-Encoding", "identity")]
    # What the SDK would send besides, from the same environment variables.
    for name, variable in (("OpenAI-Organization", "OPENAI_ORG_ID"), ("OpenAI-Project", "OPENAI_PROJECT_ID")):
        value = os.environ.get(variable)
        if value and _safe_header(value):
            headers.append((name, value))
    path = parts.path.rstrip("/") + "/chat/completions" + (f"?{parts.query}" if parts.query else "")
    return PlainHttpPost(parts.hostname, port, path, headers, MAX_REPLY_BYTES)


def needs_sdk(base_url: str | None, api_key: str | None) -> bool:
    """Will requests to this endpoint go by the SDK's transport (no plain path serves it)?"""
    return plain_post_for(base_url, api_key) is None


class EndpointPost:
    """POST /chat/completions to the run's endpoint, one way or the other.

    To a plain `http://` endpoint with no proxy on the way (a local server: llama.cpp, vLLM,
    LiteLLM, the test servers), by `PlainHttpPost`: one write of bytes and one future a request,
    about a third of the SDK transport's CPU, and no SDK loaded at all. To any other, and after a
    redirect (the plain path follows none: it is given up, and the SDK follows it its way, the key
    dropped on the way to another origin), by the OpenAI SDK's transport (agent/sdk_transport.py).
    An error status comes out as a StatusError, a request without an answer as a RequestFailed
    (the cause chained), whichever way it went."""

    def __init__(self, base_url: str | None, api_key: str | None, *, timeout: float, connections: int):
        self._plain = plain_post_for(base_url, api_key)
        self._sdk: Any = None
        self._sdk_args = (base_url, api_key)
        self._timeout, self._connections = timeout, connections

    async def post(self, body: dict) -> Any:
        plain = self._plain
        if plain is not None:
            response = await self._post_plain(plain, orjson.dumps(body))
            if not 300 <= response.status_code < 400:
                return response
            if self._plain is plain:  # the sessions that met the redirect meanwhile found it given up
                plain.close()
                self._plain = None
        if self._sdk is None:
            from agent.sdk_transport import SdkPost

            self._sdk = SdkPost(*self._sdk_args, timeout=self._timeout, connections=self._connections)
        return await self._sdk.post(body)

    @staticmethod
    async def _post_plain(plain: PlainHttpPost, content: bytes) -> Any:
        try:
            response = await plain.post(content)
        except (OSError, ServerDisconnectedError, HTTPProtocolError) as err:
            raise RequestFailed(f"connection error: {err}") from err
        if response.status_code >= 400:
            raise StatusError(response.status_code, response.headers, response.content)
        return response

    async def close(self) -> None:
        if self._plain is not None:
            self._plain.close()
        if self._sdk is not None:
            await self._sdk.close()


class ModelClient:
    """One endpoint, shared by all sessions of a worker process."""

    def __init__(
        self,
        base_url: str | None,
        api_key: str | None,
        *,
        max_in_flight: int = 64,
        requests_per_minute: float | None = None,
        policy: RetryPolicy | None = None,
        prompt_caching: str = "auto",  # on | off | auto (see wants_prompt_caching)
        stop_after_unpriced: bool = False,  # a budget without prices: no request after a reply without a cost
    ):
        self.policy = policy or RetryPolicy()
        self._direct = EndpointPost(base_url, api_key, timeout=self.policy.request_timeout, connections=max_in_flight)
        self.endpoint = _host_of(base_url)
        self.base_url = base_url
        self.prompt_caching = prompt_caching
        self.limiter = AdaptiveLimiter(max_in_flight)
        self.pacer = RequestPacer(requests_per_minute)
        self.stop_after_unpriced = stop_after_unpriced
        self.unpriced_reply = False  # a reply came without a cost (what stop_after_unpriced waits for)

    async def complete(
        self,
        messages: list[dict],
        *,
        model: str,
        tools: list[dict] | None = None,
        tool_choice: str | None = None,
        max_tokens: int | None = None,
        extra_body: dict | None = None,
        stats: CallStats | None = None,
    ) -> ModelReply:
        policy = self.policy
        if wants_prompt_caching(self.prompt_caching, model, self.base_url):
            messages = with_cache_breakpoints(messages)
        body: dict[str, Any] = {"model": model, "messages": messages}
        if tools:
            body["tools"] = tools
            # Always explicit: some servers (llama-cpp-python) offer the tools only when it is sent.
            body["tool_choice"] = tool_choice or "auto"
        if max_tokens:
            body["max_tokens"] = max_tokens
        if extra_body:
            body.update(extra_body)
        if self.unpriced_reply:  # its spend could not be known: the run's budget stops here
            raise ProviderError("not sent: an earlier reply came without a cost, and --max_cost needs one (or the "
                                "--price_* flags)", "unpriced")
        waited = 0.0
        for attempt in range(1, policy.max_attempts + 1):
            requested: float | None = None
            unreachable: str | None = None
            try:
                await self.pacer.wait()
                async with self.limiter:
                    reply = await self._request(body, model, stats)
                self.limiter.on_success()
                return reply
            except StatusError as err:
                message, codes = _error_fields(err)
                error_class, retryable = classify_status(err.status_code, codes)
                failure = f"HTTP {err.status_code}: {message or '(no message)'}{_status_hint(err.status_code, body)}"
                if err.status_code == 429:
                    self.limiter.on_throttled()
                requested = server_requested_delay(err.headers)
                if not retryable:
                    raise ProviderError(failure, error_class, err.status_code) from None
                status = err.status_code
            except ReplyTooLarge as err:  # asked again, it would be as large again (and paid again)
                raise ProviderError(str(err), "provider") from None
            except asyncio.TimeoutError:
                failure, status = f"request timed out after {policy.request_timeout:g}s", None
            except RequestFailed as err:
                # The aiohttp transport reports a refused connection or a failed DNS lookup as a
                # timeout: the cause chain says what really happened.
                unreachable = connection_failure(err)
                if unreachable:
                    failure, status = f"cannot reach {self.endpoint}: {unreachable}", None
                elif err.timeout:
                    failure, status = f"request timed out after {policy.request_timeout:g}s", None
                else:
                    failure, status = str(err), None
            except (ValueError, TypeError) as err:
                failure, status = f"malformed response: {err}", None
            if attempt == policy.max_attempts:
                break
            delay = requested if requested is not None else min(policy.max_delay, policy.base_delay * 2 ** (attempt - 1))
            delay = delay + random.uniform(0, 0.25 * delay + 0.05) if requested is not None else random.uniform(0, delay)
            budget = policy.max_unreachable_wait if unreachable else policy.max_total_wait
            if requested is not None and waited + delay > budget:  # asking sooner would be refused again
                failure += f" (gave up: the server asks for {delay:.1f}s more, past the {budget:g}s budget)"
                break
            if waited >= budget:
                failure += f" (gave up: the {budget:g}s budget of waiting is spent)"
                break
            # The budget bounds the waiting, not the luck of the draw: our own backoff is cut to what
            # is left of it, so an outage shorter than the budget is always ridden out.
            delay = min(delay, budget - waited)
            if stats is not None:
                stats.retries += 1
            waited += delay
            await asyncio.sleep(delay)
        raise ProviderError(f"{failure} after {attempt} attempt(s)", "connection" if unreachable else "provider", status)

    async def _request(self, body: dict, model: str, stats: CallStats | None) -> ModelReply:
        """One HTTP request, counted in `stats` from the moment it is sent to the moment it ends."""
        if stats is not None:
            if stats.admit is not None and not await stats.admit():
                raise ProviderError("the cost budget (--max_cost) is reached: no new request is sent", "budget")
            stats.count_request(model)
        try:
            # The SDK's transport and errors, without its typed request/response models:
            # the body is already plain JSON, and converting it costs more CPU than the rest.
            # The raw response, because some endpoints report the cost in a header.
            # One limit for the whole request (connection, headers and body): the transport's own
            # timeouts bound each wait for bytes, so a body dripped byte by byte or an event
            # stream that never ends would hold the session for good.
            response = await asyncio.wait_for(self._direct.post(body), self.policy.request_timeout)
            if _is_html(response.headers.get("content-type"), response.content):
                raise ProviderError(f"HTTP {response.status_code}: {ANSWERS_HTML} (is --base_url the API's "
                                    "address, such as http://host:port/v1?)", "provider", response.status_code)
            reply = reply_from_completion(orjson.loads(response.content))
            reply.usage["cost"] = reported_cost(reply.usage, response.headers)
            self.unpriced_reply = self.unpriced_reply or (self.stop_after_unpriced and reply.usage["cost"] is None)
        except StatusError:
            if stats is not None:
                stats.answered_without_charge(model)
            raise
        except BaseException as err:  # a cancel too: a request abandoned mid-flight may still be billed
            if stats is not None:
                stats.unanswered(model, sent=not never_sent(err))
            raise
        if stats is not None:
            stats.add_usage(reply.usage, model)
        return reply

    async def close(self) -> None:
        await self._direct.close()


ANSWERS_HTML = "the endpoint answers HTML, not an OpenAI-compatible API"


def _is_html(content_type: str | None, body: bytes) -> bool:
    """A web page where JSON was expected: a proxy's welcome page, a login portal, a wrong path."""
    return "html" in (content_type or "").lower() or body.lstrip()[:15].lower().startswith((b"<!doctype", b"<html"))


def _host_of(url: str | None) -> str:
    parts = urllib.parse.urlsplit(url or "https://api.openai.com/v1")
    return parts.netloc or url or "the endpoint"


def connection_failure(err: BaseException) -> str | None:
    """What keeps the endpoint from being reached, named (DNS failure, connection refused, closed,
    TLS), from an exception's cause chain; None when the endpoint was reached (a slow answer)."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, socket.gaierror):
            return f"DNS lookup failed ({current.strerror or current})"
        if isinstance(current, ConnectionRefusedError):
            return "connection refused (nothing listens on that port)"
        if isinstance(current, (ConnectionResetError, BrokenPipeError, http.client.RemoteDisconnected)) or type(
            current
        ).__name__ in ("ServerDisconnectedError", "RemoteProtocolError"):
            return "connection closed by the server before it answered"
        if isinstance(current, ssl.SSLError):
            return f"TLS error ({current.reason or current})"
        if isinstance(current, OSError) and current.errno in (101, 113):  # network / host unreachable
            return f"network unreachable ({current.strerror})"
        current = current.__cause__ or current.__context__
    return None


def never_sent(err: BaseException) -> bool:
    """Did the request fail before reaching the endpoint (no DNS answer, nothing listening, TLS)?"""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, (socket.gaierror, ConnectionRefusedError, ssl.SSLError)):
            return True
        if isinstance(current, OSError) and current.errno in (101, 113):  # network / host unreachable
            return True
        current = current.__cause__ or current.__context__
    return False


class _KeyStaysHome(urllib.request.HTTPRedirectHandler):
    """Follows a redirect, but without the key when it leads to another origin (host, port, or
    scheme; only an upgrade from http to https on the same host keeps it): urllib itself would
    send it wherever the redirect points."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None and not _same_origin(req.full_url, new.full_url):
            new.remove_header("Authorization")
        return new


def _same_origin(old: str, new: str) -> bool:
    """True when `new` is on the host and port of `old` by the same scheme, or an http -> https upgrade."""
    before, after = urllib.parse.urlsplit(old), urllib.parse.urlsplit(new)
    if (before.hostname or "").lower() != (after.hostname or "").lower():
        return False
    default = {"http": 80, "https": 443}
    ports = (before.port or default.get(before.scheme), after.port or default.get(after.scheme))
    if before.scheme == after.scheme:
        return ports[0] == ports[1]
    return (before.scheme, after.scheme) == ("http", "https") and ports == (80, 443)


_PROBE_READ = 64 * 1024  # enough of GET /models to tell JSON from a web page


def probe_endpoint(base_url: str, api_key: str | None, timeout: float = 10.0) -> str | None:
    """One cheap request (GET {base_url}/models) before a run starts: None when the endpoint
    answers (any HTTP status but 401/403: some servers have no /models), else what is wrong
    (no connection, a refused key, a web page instead of an API, or no answer within `timeout`)."""
    parts = urllib.parse.urlsplit(base_url)  # the path gets /models, a query string stays a query string
    url = urllib.parse.urlunsplit(parts._replace(path=parts.path.rstrip("/") + "/models", fragment=""))
    request = urllib.request.Request(url, method="GET")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    opener = urllib.request.build_opener(_KeyStaysHome)
    deadline = time.monotonic() + timeout
    try:
        with opener.open(request, timeout=timeout) as response:
            body = _read_until(response, deadline)
        if _is_html(response.headers.get("content-type"), body):
            return (f"{ANSWERS_HTML}: GET {base_url.rstrip('/')}/models returned a web page (is --base_url the "
                    "API's address, such as http://host:port/v1?)")
        return None
    except urllib.error.HTTPError as err:
        if err.code in (401, 403):
            return f"the endpoint {base_url} refused the API key (HTTP {err.code} on GET /models)"
        return None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as err:
        cause = connection_failure(err) or connection_failure(getattr(err, "reason", None) or err)
        if cause is None and isinstance(getattr(err, "reason", err), (TimeoutError, socket.timeout)):
            # A port that accepts and never answers (or drops packets) would make every row wait
            # --request_timeout per attempt, 8 attempts: say so now instead of burning the dataset.
            return (f"the model endpoint {base_url} did not answer GET /models within {timeout:g}s "
                    "(it accepted no connection, or accepted one and never replied)")
        return f"cannot reach the model endpoint {base_url}: {cause or err}"


def _read_until(response: Any, deadline: float) -> bytes:
    """Up to _PROBE_READ bytes of a body, stopping at `deadline` (a body may drip)."""
    data = b""
    while len(data) < _PROBE_READ and time.monotonic() < deadline:
        chunk = response.read1(_PROBE_READ - len(data))
        if not chunk:
            break
        data += chunk
    return data


def _status_hint(status: int, body: dict) -> str:
    """What an error status likely means for the request that got it, when it is not in the message."""
    if status >= 500 and body.get("tool_choice") == "required":
        return ("; some servers fail every request that sends tool_choice=required (llama.cpp's server "
                "takes --tool_choice=auto or none)")
    return ""


def _error_fields(err: Any) -> tuple[str, tuple[str, ...]]:
    """The error's message, and its `code` and `type` strings (lower case) when the body has them."""
    if _is_html(err.headers.get("content-type"), err.content):
        return ANSWERS_HTML, ()  # the page itself says nothing the user needs
    body = getattr(err, "body", None)
    inner = body.get("error", body) if isinstance(body, dict) else None
    if not isinstance(inner, dict):
        return str(getattr(err, "message", err))[:500], ()
    codes = tuple(str(inner[k]).lower() for k in ("code", "type") if isinstance(inner.get(k), str))
    message = str(inner.get("message") or getattr(err, "message", err))[:500]
    return message, codes


@dataclass
class SessionModel:
    """The per-prompt view of a model client: default model and request options, summed stats."""

    client: Any  # ModelClient or agent.mock_model.MockModelClient
    model: str
    max_tokens: int | None = None
    extra_body: dict | None = None
    tool_choice: str = "auto"  # sent whenever tools are offered (--tool_choice)
    stats: CallStats = field(default_factory=CallStats)

    async def complete(
        self,
        messages: list[dict],
        *,
        model: str | None = None,
        tools: list[dict] | None = None,
        tool_choice: str | None = None,
        max_tokens: int | None = None,
        extra_body: dict | None = None,
    ) -> ModelReply:
        return await self.client.complete(
            messages,
            model=model or self.model,
            tools=tools,
            tool_choice=tool_choice or self.tool_choice,
            max_tokens=max_tokens if max_tokens is not None else self.max_tokens,
            extra_body=extra_body if extra_body is not None else self.extra_body,
            stats=self.stats,
        )
