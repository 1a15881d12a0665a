"""POST /chat/completions by the OpenAI SDK's transport: for the endpoints the plain path
(agent/plain_http.py) does not serve (https, a proxy in the environment, a redirect on the way).
Imported only then: a run against a plain http:// endpoint never loads the SDK.

The SDK's errors come out as the client's own (agent.types.StatusError, RequestFailed), so the
retry layer (agent/model_client.py) reads one kind of error whichever way a request went.
"""

from __future__ import annotations

from typing import Any

import openai
import orjson

from agent.model_client import MAX_REPLY_BYTES, REDIRECT_LOOP
from agent.plain_http import ReplyTooLarge
from agent.types import ProviderError, RequestFailed, StatusError

try:
    import httpx2 as _httpx
except ImportError:  # SDKs built on httpx
    import httpx as _httpx

try:
    import aiohttp

    _TRANSPORT_ERRORS: tuple[type[BaseException], ...] = (aiohttp.ClientError, _httpx.TransportError)
    _REDIRECT_LOOPS: tuple[type[BaseException], ...] = (aiohttp.TooManyRedirects, _httpx.TooManyRedirects)
except ImportError:
    _TRANSPORT_ERRORS = (_httpx.TransportError,)
    _REDIRECT_LOOPS = (_httpx.TooManyRedirects,)


def _redirect_loop(err: BaseException) -> BaseException | None:
    """The transport's "too many redirects" in an error's cause chain, if it is there."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        if isinstance(current, _REDIRECT_LOOPS):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None

# As `cast_to`, the SDK returns the raw HTTP response (its errors and retries-off still apply),
# so headers can be read.
_RESPONSE_TYPE = _httpx.Response

async def _read_bounded(response: Any) -> None:
    """Read the body before the SDK does, stopping at MAX_REPLY_BYTES of decoded bytes, so a huge
    reply or a compression bomb costs at most that much memory (the transport decodes gzip itself,
    chunk by chunk). What was read becomes the response's content, as a full read would make it."""
    chunks, size = [], 0
    async for chunk in response.aiter_bytes():
        size += len(chunk)
        if size > MAX_REPLY_BYTES:
            await response.aclose()
            raise ReplyTooLarge(f"the reply is larger than the {MAX_REPLY_BYTES // 2**20} MiB limit of a model reply "
                                f"(reading stopped there; HTTP {response.status_code}, "
                                f"{response.headers.get('content-type') or 'no content type'})")
        chunks.append(chunk)
    response._content = b"".join(chunks)  # the transport's own cache of a read body (no public setter)


def _http_client(connections: int) -> Any:
    """The SDK's aiohttp transport when installed (the default dependency set): it spends about a
    third less CPU per request than the httpx one. Redirects are followed the transport's way: the
    key is dropped when one leads to another origin (host, port or scheme), only an upgrade from
    http to https on the same host keeps it."""
    hooks = {"response": [_read_bounded]}
    try:
        return openai.DefaultAioHttpClient(event_hooks=hooks)
    except (AttributeError, RuntimeError):  # an SDK without aiohttp support, or aiohttp missing
        import httpx

        # One connection per session in flight: a larger pool only costs expiry checks per request.
        limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
        return openai.DefaultAsyncHttpxClient(limits=limits, event_hooks=hooks)


def _status_error(err: openai.APIStatusError) -> StatusError:
    response = err.response
    try:
        content = response.content
    except Exception:  # a body the SDK closed before it was read
        content = b""
    return StatusError(err.status_code, response.headers, content, body=err.body, message=err.message)


class SdkPost:
    """POST /chat/completions with the SDK's transport, but without its per-request option models
    and request builder after the first request, which cost more CPU than the transport.

    The first request that gets an answer goes the SDK's whole way; its URL and headers (key,
    client and platform headers, as the SDK built them) are kept, and every later request is sent
    with them by the SDK's own HTTP client (same transport, redirects with the key dropped on the
    way to another origin, decoding and response hook). An SDK without these pieces always goes
    its own way."""

    def __init__(self, base_url: str | None, api_key: str | None, *, timeout: float, connections: int):
        self._http = _http_client(connections)
        self._sdk = openai.AsyncOpenAI(
            base_url=base_url,
            api_key=api_key or "no-key",
            max_retries=0,  # agent.model_client.ModelClient is the only retry layer
            timeout=timeout,
            http_client=self._http,
        )
        self._url: Any = None
        self._headers: dict[str, str] | None = None
        self._extensions: dict = {}  # the request's timeouts, as the SDK set them
        try:
            from openai._httpx2 import request_exceptions, timeout_exceptions

            self._timeouts, self._failures = timeout_exceptions(), request_exceptions()
            self._usable = hasattr(self._sdk, "_make_status_error_from_response") and hasattr(self._http, "build_request")
        except ImportError:
            self._usable = False

    async def post(self, body: dict) -> Any:
        try:
            return await self._post(body)
        except openai.APIStatusError as err:
            raise _status_error(err) from None
        except openai.APITimeoutError as err:
            raise RequestFailed("request timed out", timeout=True) from err
        except (openai.APIConnectionError, *_TRANSPORT_ERRORS) as err:  # the transport's own: a bad status line
            loop = _redirect_loop(err)
            if loop is not None:  # asked again it would loop again, each hop a request: the row fails here
                raise ProviderError(f"{REDIRECT_LOOP} ({loop}); check --base_url", "provider") from None
            raise RequestFailed(f"connection error: {err.__cause__ or err}") from err
        except openai.APIResponseValidationError as err:
            raise ValueError(str(err)) from err

    async def _post(self, body: dict) -> Any:
        if self._headers is None:
            response = await self._sdk.post("/chat/completions", body=body, cast_to=_RESPONSE_TYPE)
            # Only the first answer teaches: a later one (a session's first request, sent while
            # none had come back) would learn the same again.
            if self._usable and self._headers is None:
                request = response.history[0].request if response.history else response.request
                self._url = request.url
                # What the URL and the body set is set again for each request; an idempotency key is one request's own.
                per_body = {"host", "content-length", "transfer-encoding", "idempotency-key"}
                self._headers = {k: v for k, v in request.headers.items() if k.lower() not in per_body}
                self._extensions = {k: v for k, v in request.extensions.items() if k == "timeout"}
            return response
        request = self._http.build_request("POST", self._url, content=orjson.dumps(body), headers=self._headers,
                                           extensions=dict(self._extensions))
        try:
            response = await self._http.send(request)
        except self._timeouts as err:
            raise openai.APITimeoutError(request=request) from err
        except openai.OpenAIError:
            raise
        except self._failures as err:
            raise openai.APIConnectionError(request=request) from err
        if response.status_code >= 400:
            if not response.is_closed:
                await response.aread()
            raise self._sdk._make_status_error_from_response(response) from None
        return response

    async def close(self) -> None:
        await self._sdk.close()
