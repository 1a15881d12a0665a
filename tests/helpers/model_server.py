"""A local OpenAI-compatible model server for the test-suite and the benchmark.

It speaks real HTTP/1.1 (keep-alive, Content-Length on every response) on
127.0.0.1, so the real ``openai`` client works against it.  One thread per
connection; latency is a plain sleep, so many slow requests overlap freely.

In-process::

    with ModelServer(latency=0.0) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="x")
        ...
        server.requests_for("my prompt")

As a subprocess (its CPU is then not counted as the caller's)::

    python -m tests.helpers.model_server --port 0 --latency 0.5 --port-file F

Unless a custom ``policy`` is given (or it returns None), the reply is decided
by directives: lines of the conversation's first user message that start with
``@`` (see ``Directives`` below and ``scripted_policy``).  The conversation key
is the text of that first user message.
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import re
import secrets
import signal
import socket
import struct
import sys
import threading
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable

CHAT_PATH = "/v1/chat/completions"
UNKNOWN_TOOL = "no_such_tool"
BROKEN_ARGS = '{"broken'
FOREVER = float("inf")


# --------------------------------------------------------------------------- #
# Data types
# --------------------------------------------------------------------------- #


@dataclass
class RecordedRequest:
    path: str
    headers: dict[str, str]  # keys lower-cased
    body: dict
    time: float


@dataclass
class Reply:
    """One HTTP response.  ``body``: dict -> JSON; str/bytes -> sent verbatim."""

    status: int = 200
    body: Any = None
    headers: dict[str, str] = field(default_factory=dict)
    latency: float | None = None  # overrides the conversation/server latency
    hang: bool = False  # never answer (until the server stops)
    close: bool = False  # close the connection without answering
    drip: float = 0.0  # send the body one byte every `drip` seconds
    endless: bool = False  # an event stream that never ends (until the server stops)


@dataclass
class Fault:
    """A request-level fault covering ``times`` consecutive requests."""

    kind: str  # "fail" | "malformed" | "empty_choices" | "hang" | "close" | "html" | "drip" | "endless"
    #          | "huge" | "gzip_bomb"
    times: float
    status: int = 200
    retry_after: str | None = None
    reset: str | None = None
    message: str | None = None
    code: str | None = None  # error.code of the body (default: the status)
    size: float = 0.0  # drip: seconds per byte; huge, gzip_bomb: megabytes of (decoded) body


@dataclass
class Directives:
    tools: list[tuple[str, str]] = field(default_factory=list)  # (name, JSON args)
    parallel: bool = False
    reasoning: str = "reasoning"  # reasoning | none | content | details | scratchpad | inline
    faults: list[Fault] = field(default_factory=list)  # applied in line order
    latency: float | None = None
    finish_length: bool = False
    summary_length: bool = False  # a request with tool_choice "none" (the turn-limit summary) is cut
    unknown_tool: int = 0
    bad_args: int = 0
    think_only: int = 0
    needs_tool_choice: bool = False  # like llama-cpp-python: tools are ignored without tool_choice
    control_chars: bool = False  # tool arguments carry raw control characters inside strings
    empty: int = 0  # the first N replies have no content, no reasoning and no tool call
    cost: str | None = "0.0001"  # usage.cost of each reply; None: not reported
    cost_header: str | None = None  # x-litellm-response-cost of each reply
    answer: str | None = None  # the final answer's text (default: "Final answer: <last tool result>")
    answers: list[str] = field(default_factory=list)  # the n-th conversation of the prompt answers the n-th (cycling)
    grade: str = "C"  # as a judge (a model named judge*): the grade it gives
    grade_if: str | None = None  # as a judge: C when the graded answer contains this text, else I
    grade_bad: int = 0  # as a judge: the first N replies have no GRADE line


@dataclass
class ConversationState:
    """Per-conversation counters; shared by all requests with the same key."""

    key: str
    directives: Directives
    requests: int = 0  # requests received, including failed ones and the current one
    replies: int = 0  # successful completions served by the scripted policy
    unknown_tool_served: int = 0
    bad_args_served: int = 0
    think_only_served: int = 0
    empty_served: int = 0
    conversations: int = 0  # conversations started (first replies served)
    grade_bad_served: int = 0
    bad_call_ids: set[str] = field(default_factory=set)  # ids that don't advance the script
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)


Policy = Callable[[dict, ConversationState], "Reply | None"]


# --------------------------------------------------------------------------- #
# Directive parsing
# --------------------------------------------------------------------------- #


def parse_directives(text: str) -> Directives:
    d = Directives()
    for raw in text.splitlines():
        line = raw.strip()
        if not line.startswith("@"):
            continue
        name, _, rest = line[1:].partition(" ")
        rest = rest.strip()
        args = rest.split()
        if name == "tool" and args:
            tool_name, _, tool_args = rest.partition(" ")
            d.tools.append((tool_name, _normalise_args(tool_args.strip())))
        elif name == "parallel":
            d.parallel = True
        elif name == "reasoning" and args:
            d.reasoning = "reasoning" if args[0] == "native" else args[0]
        elif name == "fail" and len(args) >= 2:
            d.faults.append(_parse_fail(rest))
        elif name == "malformed":
            d.faults.append(Fault("malformed", _int(args, 0, 1)))
        elif name == "empty_choices":
            d.faults.append(Fault("empty_choices", _int(args, 0, 1)))
        elif name == "hang":
            d.faults.append(Fault("hang", _int(args, 0, FOREVER)))
        elif name == "latency" and args:
            d.latency = float(args[0])
        elif name == "finish" and args and args[0] == "length":
            d.finish_length = True
        elif name == "finish" and args and args[0] == "summary_length":
            d.summary_length = True
        elif name == "unknown_tool":
            d.unknown_tool = _int(args, 0, 1)
        elif name == "bad_args":
            d.bad_args = _int(args, 0, 1)
        elif name == "think_only":
            d.think_only = _int(args, 0, 1)
        elif name == "needs_tool_choice":
            d.needs_tool_choice = True
        elif name == "control_chars":
            d.control_chars = True
        elif name == "empty":
            d.empty = _int(args, 0, 1)
        elif name == "cost" and args:
            d.cost = None if args[0] == "none" else args[0]
        elif name == "cost_header" and args:
            d.cost_header = args[0]
        elif name == "close":
            d.faults.append(Fault("close", _int(args, 0, 1)))
        elif name == "answer":
            d.answer = rest
        elif name == "answers":
            d.answers = [part.strip() for part in rest.split("|")]
        elif name == "grade" and args:
            d.grade = args[0]
        elif name == "grade_if":
            d.grade_if = rest
        elif name == "grade_bad":
            d.grade_bad = _int(args, 0, 1)
        elif name == "html":  # a proxy's welcome page, 200 text/html
            d.faults.append(Fault("html", _int(args, 0, FOREVER)))
        elif name == "endless":  # an event stream that never ends
            d.faults.append(Fault("endless", _int(args, 0, FOREVER)))
        elif name in ("drip", "huge", "gzip_bomb") and args:  # @drip SECONDS_PER_BYTE, @huge MB, @gzip_bomb MB
            d.faults.append(Fault(name, _int(args, 1, FOREVER), size=float(args[0])))
    return d


def _int(args: list[str], i: int, default: float) -> Any:
    return int(args[i]) if len(args) > i else default


def _normalise_args(text: str) -> str:
    if not text:
        return "{}"
    try:
        return json.dumps(json.loads(text))
    except ValueError:
        return text  # deliberately odd arguments are passed through verbatim


def _parse_fail(rest: str) -> Fault:
    """``<status> <times> [retry_after=S] [reset=S] [code=C] [body=<text to end of line>]``"""
    rest, _, message = rest.partition("body=")
    status, times, *options = rest.split()
    fault = Fault("fail", int(times), status=int(status), message=message.strip() or None)
    for option in options:
        key, _, value = option.partition("=")
        if key == "retry_after":
            fault.retry_after = value
        elif key == "reset":
            fault.reset = format_duration(float(value))
        elif key == "code":
            fault.code = value
    return fault


def format_duration(seconds: float) -> str:
    """OpenAI's rate-limit reset style (Go durations): ``20ms``, ``1s``, ``1.5s``, ``6m0s``."""
    if seconds < 1:
        return f"{round(seconds * 1000)}ms"
    hours, rem = divmod(seconds, 3600)
    minutes, secs = divmod(rem, 60)
    secs_text = f"{secs:g}s"
    if hours:
        return f"{int(hours)}h{int(minutes)}m{secs_text}"
    if minutes:
        return f"{int(minutes)}m{secs_text}"
    return secs_text


# --------------------------------------------------------------------------- #
# Response builders (also handy for custom policies)
# --------------------------------------------------------------------------- #


def message_text(message: dict) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # multimodal parts
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def first_user_text(body: dict) -> str:
    for message in body.get("messages") or ():
        if isinstance(message, dict) and message.get("role") == "user":
            return message_text(message)
    return ""


def tool_call(name: str, arguments: str | dict) -> dict:
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments)
    return {
        "id": f"call_{secrets.token_hex(12)}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def chat_completion(
    request: dict,
    content: str | None,
    tool_calls: list[dict] | None = None,
    reasoning: str | None = None,
    reasoning_style: str = "reasoning",
    finish_reason: str | None = None,
) -> dict:
    """A full ``chat.completion`` object with usage, as a provider would send it."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning is not None:
        if reasoning_style == "reasoning":
            message["reasoning"] = reasoning
        elif reasoning_style == "content":
            message["reasoning_content"] = reasoning
        elif reasoning_style == "details":
            message["reasoning_details"] = [{"type": "reasoning.summary", "summary": reasoning}]
        elif reasoning_style == "scratchpad":
            scratch = f"<REASONING_SCRATCHPAD>{reasoning}</REASONING_SCRATCHPAD>"
            message["content"] = scratch + (f"\n{content}" if content else "")
        elif reasoning_style == "inline":  # llama.cpp / vLLM without a reasoning parser
            message["content"] = f"<think>\n{reasoning}\n</think>\n\n" + (content or "")
    if tool_calls:
        message["tool_calls"] = tool_calls
    if finish_reason is None:
        finish_reason = "tool_calls" if tool_calls else "stop"

    prompt_chars = sum(len(message_text(m)) for m in request.get("messages") or () if isinstance(m, dict))
    completion_chars = len(message["content"] or "") + sum(
        len(c["function"]["arguments"]) for c in tool_calls or ()
    )
    prompt_tokens = prompt_chars // 4
    completion_tokens = completion_chars // 4 + 1
    return {
        "id": f"chatcmpl-{secrets.token_hex(12)}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": request.get("model") or "mock-model",
        "choices": [{"index": 0, "message": message, "finish_reason": finish_reason, "logprobs": None}],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens_details": {"reasoning_tokens": len(reasoning or "") // 4},
            "prompt_tokens_details": {"cached_tokens": 0},
            "cost": 0.0001,
        },
    }


_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    409: "conflict_error",
    413: "request_too_large",
    422: "invalid_request_error",
    429: "rate_limit_error",
}


def error_body(status: int, message: str | None = None) -> dict:
    error_type = _ERROR_TYPES.get(status, "server_error" if status >= 500 else "api_error")
    return {
        "error": {
            "message": message or f"Simulated error {status} ({error_type})",
            "type": error_type,
            "param": None,
            "code": status,
        }
    }


def error_reply(status: int, message: str | None = None) -> Reply:
    return Reply(status=status, body=error_body(status, message))


# --------------------------------------------------------------------------- #
# The scripted policy
# --------------------------------------------------------------------------- #


def fault_reply(body: dict, state: ConversationState) -> Reply | None:
    """The request-level fault for this request (faults cover consecutive request ranges)."""
    index = state.requests - 1  # 0-based index of this request within the conversation
    for fault in state.directives.faults:
        if index >= fault.times:
            index -= fault.times
            continue
        if fault.kind == "hang":
            return Reply(hang=True)
        if fault.kind == "close":
            return Reply(close=True)
        if fault.kind == "html":
            return Reply(body=WELCOME_PAGE, headers={"Content-Type": "text/html"})
        if fault.kind == "endless":
            return Reply(endless=True)
        if fault.kind == "drip":
            return Reply(body=chat_completion(body, "Dripped answer."), drip=fault.size)
        if fault.kind == "huge":
            return Reply(body=chat_completion(body, "x" * int(fault.size * 1024 * 1024)))
        if fault.kind == "gzip_bomb":
            return Reply(body=gzip_bomb(int(fault.size)), headers={"Content-Encoding": "gzip"})
        if fault.kind == "malformed":
            return Reply(body=b'{"id": "chatcmpl-malformed", "choices": [{"index": 0, "message": ')
        if fault.kind == "empty_choices":
            completion = chat_completion(body, "")
            completion["choices"] = []
            return Reply(body=completion)
        reply = error_reply(fault.status, fault.message)
        if fault.code is not None:
            reply.body["error"]["code"] = fault.code
        if fault.retry_after is not None:
            reply.headers["Retry-After"] = fault.retry_after
        if fault.reset is not None:
            reply.headers["x-ratelimit-reset-requests"] = fault.reset
        return reply
    return None


WELCOME_PAGE = "<!DOCTYPE html>\n<html><head><title>Welcome to nginx!</title></head><body><h1>Welcome</h1></body></html>\n"
_BOMBS: dict[int, bytes] = {}


def gzip_bomb(megabytes: int) -> bytes:
    """A small gzip body that decodes to `megabytes` MB of JSON-looking text (cached per size)."""
    if megabytes not in _BOMBS:
        packer = zlib.compressobj(9, zlib.DEFLATED, 31)
        block = b"x" * (1024 * 1024)
        parts = [packer.compress(b'{"choices": [{"index": 0, "message": {"role": "assistant", "content": "')]
        parts += [packer.compress(block) for _ in range(megabytes)]
        _BOMBS[megabytes] = b"".join(parts) + packer.flush()
    return _BOMBS[megabytes]


def scripted_policy(body: dict, state: ConversationState) -> Reply:
    fault = fault_reply(body, state)
    if fault is not None:
        return fault

    d = state.directives
    if str(body.get("model") or "").startswith("judge"):
        return judge_reply(body, state)
    messages = [m for m in body.get("messages") or () if isinstance(m, dict)]
    assistant_turns = [m for m in messages if m.get("role") == "assistant"]
    conversation = _conversation_number(assistant_turns, state)
    if not body.get("tools") and any(m.get("tool_calls") or m.get("role") == "tool" for m in messages):
        # As Anthropic-family providers do: a tool history needs its tool definitions.
        return error_reply(400, "messages contain tool calls but the request defines no tools")
    tool_choice = body.get("tool_choice")
    if tool_choice == "none" or (d.needs_tool_choice and tool_choice is None):
        offered: set = set()  # the model is not offered any tool
    else:
        offered = {
            (t.get("function") or {}).get("name")
            for t in body.get("tools") or ()
            if isinstance(t, dict)
        }
    script = [(name, args) for name, args in d.tools if name in offered]
    # Script position = assistant turns that made "good" tool calls so far, so
    # unknown-tool / bad-args turns (kept in history or retried) don't advance it.
    done = sum(
        1
        for m in assistant_turns
        if m.get("tool_calls")
        and not any(
            c.get("id") in state.bad_call_ids or (c.get("function") or {}).get("name") == UNKNOWN_TOOL
            for c in m["tool_calls"]
        )
    )
    remaining = [] if (d.parallel and done) else script[done:]

    reasoning = None if d.reasoning == "none" else f"Reasoning about turn {len(assistant_turns)}."

    def reply(content: str | None, calls: list[dict] | None = None, finish: str | None = None,
              thought: str | None = reasoning) -> Reply:
        completion = chat_completion(body, content, calls, thought, d.reasoning, finish)
        if d.cost is None:
            del completion["usage"]["cost"]
        else:
            try:
                completion["usage"]["cost"] = float(d.cost)
            except ValueError:  # deliberately not a number (`@cost abc`): sent as text
                completion["usage"]["cost"] = d.cost
        headers = {"x-litellm-response-cost": d.cost_header} if d.cost_header is not None else {}
        return Reply(body=completion, headers=headers)

    def call(name: str, args: str) -> dict:
        if d.control_chars:  # a literal newline / tab inside a JSON string, as real models send
            args = args.replace("\\n", "\n").replace("\\t", "\t")
        made = tool_call(name, args)
        made["id"] = f"call_c{conversation}_{made['id'][5:]}"  # later turns know their conversation
        return made

    with state.lock:
        first_reply = state.replies == 0
        state.replies += 1
        if d.finish_length and first_reply:
            return reply("This answer was cut off because the model ran out of tok", finish="length")
        if d.summary_length and tool_choice == "none":
            return reply("You have used every tool-calling turn to achieve your goal, without using", finish="length")
        if state.empty_served < d.empty:
            state.empty_served += 1
            return reply("", thought=None)
        if state.unknown_tool_served < d.unknown_tool:
            state.unknown_tool_served += 1
            return reply(None, [tool_call(UNKNOWN_TOOL, "{}")])
        if remaining and state.bad_args_served < d.bad_args:
            state.bad_args_served += 1
            call = tool_call(remaining[0][0], BROKEN_ARGS)
            state.bad_call_ids.add(call["id"])
            return reply(None, [call])
        if remaining:
            batch = remaining if d.parallel else remaining[:1]
            return reply(None, [call(name, args) for name, args in batch])
        if state.think_only_served < d.think_only:
            state.think_only_served += 1
            return reply("<think>pondering</think>")

    if d.answers:
        return reply(d.answers[conversation % len(d.answers)])
    if d.answer is not None:
        return reply(d.answer)
    tool_results = [m for m in messages if m.get("role") == "tool"]
    answer = message_text(tool_results[-1])[:200] if tool_results else "no tools used"
    return reply(f"Final answer: {answer}")


_CONVERSATION_ID = re.compile(r"^call_c(\d+)_")


def _conversation_number(assistant_turns: list[dict], state: ConversationState) -> int:
    """Which conversation of its prompt a request belongs to (0, 1, ...): a new one when it has no
    model turn yet, else the one its first tool call's id names."""
    for message in assistant_turns:
        for call in message.get("tool_calls") or ():
            match = _CONVERSATION_ID.match(str(call.get("id") or ""))
            if match:
                return int(match.group(1))
    with state.lock:
        if assistant_turns:
            return max(0, state.conversations - 1)
        state.conversations += 1
        return state.conversations - 1


def judge_reply(body: dict, state: ConversationState) -> Reply:
    """As a judge model: a short verdict ending in a GRADE line (see the grade directives)."""
    d = state.directives
    with state.lock:
        bad = state.grade_bad_served < d.grade_bad
        state.grade_bad_served += bad
    if bad:
        return Reply(body=chat_completion(body, "I cannot decide."))
    grade = d.grade
    if d.grade_if is not None:
        graded = first_user_text(body).rpartition("[Answer to grade]")[2]
        grade = "C" if d.grade_if.lower() in graded.lower() else "I"
    return Reply(body=chat_completion(body, f"The answer was read against the task.\nGRADE: {grade}"))


# --------------------------------------------------------------------------- #
# HTTP plumbing
# --------------------------------------------------------------------------- #


def _tiny_png() -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", 1, 1, 8, 2, 0, 0, 0)  # 1x1, 8-bit RGB
    pixels = zlib.compress(b"\x00\xff\x80\x00")  # filter byte + one orange pixel
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", pixels) + chunk(b"IEND", b"")


PNG = _tiny_png()
_IMG_PATH = re.compile(r"^/img/\d+\.png$")


class _HTTPServer(http.server.ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False  # server_close() must not wait for hung handlers
    request_queue_size = 1024  # 64+ clients connect at once
    model: "ModelServer"

    def handle_error(self, request, client_address):  # noqa: D401 - quiet on disconnects
        exc = sys.exc_info()[1]
        if not isinstance(exc, OSError):  # client went away / server stopping
            super().handle_error(request, client_address)


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    server: _HTTPServer

    def log_message(self, format, *args):  # silence per-request logging
        pass

    def setup(self):
        super().setup()
        self.server.model._track(self.connection, add=True)

    def finish(self):
        try:
            super().finish()
        finally:
            self.server.model._track(self.connection, add=False)

    # -- routing -----------------------------------------------------------

    def _key_refused(self) -> bool:
        """With ``ModelServer(api_key=K)``, a request without ``Bearer K`` gets a 401."""
        key = self.server.model.api_key
        if key is None or self.headers.get("Authorization") == f"Bearer {key}":
            return False
        if self.command == "POST":
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self._send(401, error_body(401, "Incorrect API key provided"))
        return True

    def do_GET(self):
        model = self.server.model
        if self._redirect() or self._welcome_page() or self._key_refused():
            return
        path = self.path.split("?", 1)[0]
        if path in ("/v1/models", "/models"):
            # The runner's reachability probe: kept apart, so `requests` is the model traffic.
            model._record(self.path, self.headers, {}, into=model._probes)
        else:
            model._record(self.path, self.headers, {})
        if path in ("/v1/models", "/models"):
            self._send(200, {"object": "list", "data": [
                {"id": model.model, "object": "model", "created": 0, "owned_by": "tests"}
            ]})
        elif _IMG_PATH.match(path):
            self._send(200, PNG, content_type="image/png")
        else:
            self._not_found(path)

    def do_POST(self):
        model = self.server.model
        if self._redirect() or self._welcome_page() or self._key_refused():
            return
        body = self._read_json()
        if body is None:
            return
        model._record(self.path, self.headers, body)
        path = self.path.split("?", 1)[0]
        if path == CHAT_PATH:
            self._chat(body)
        elif path == "/v1/images/generations":
            count = max(1, int(body.get("n") or 1))
            urls = [{"url": f"{model.root_url}/img/{model._next_image()}.png"} for _ in range(count)]
            self._send(200, {"created": int(time.time()), "data": urls})
        else:
            self._not_found(path)

    # -- chat ----------------------------------------------------------------

    def _chat(self, body: dict) -> None:
        model = self.server.model
        state = model._state_for(body)
        try:
            reply = model.policy(body, state) if model.policy else None
            if reply is None:
                reply = scripted_policy(body, state)
        except Exception as exc:  # a policy bug should be visible, not a dropped connection
            reply = error_reply(500, f"policy error: {type(exc).__name__}: {exc}")

        if reply.status == 200 and isinstance(reply.body, dict) and isinstance(reply.body.get("usage"), dict):
            cached = model._prompt_cache(body)
            reply.body["usage"].setdefault("prompt_tokens_details", {})["cached_tokens"] = cached

        if reply.hang:
            model._stopping.wait()
            self.close_connection = True
            return
        if reply.close:
            self.close_connection = True
            return
        if reply.endless:
            self._send_endless_stream()
            return
        latency = reply.latency
        if latency is None:
            latency = state.directives.latency if state.directives.latency is not None else model.latency
        if latency > 0:
            model._stopping.wait(latency)

        if body.get("stream") and reply.status == 200 and isinstance(reply.body, dict):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            self._send(200, _as_sse(reply.body, include_usage), reply.headers, "text/event-stream")
        else:
            self._send(reply.status, reply.body, reply.headers, drip=reply.drip)

    # -- helpers -------------------------------------------------------------

    def _read_json(self) -> dict | None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            body = json.loads(raw) if raw else {}
        except ValueError:
            self._send(400, error_body(400, "request body is not valid JSON"))
            return None
        if not isinstance(body, dict):
            self._send(400, error_body(400, "request body must be a JSON object"))
            return None
        return body

    def _not_found(self, path: str) -> None:
        self._send(404, error_body(404, f"no route for {self.command} {path}"))

    def _send_endless_stream(self) -> None:
        """200 text/event-stream without a length: one event every 0.2 s until the server stops."""
        model = self.server.model
        self.close_connection = True
        try:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            while not model._stopping.wait(0.2):
                self.wfile.write(b'data: {"choices": [{"index": 0, "delta": {"content": "more"}}]}\n\n')
                self.wfile.flush()
        except OSError:
            pass

    def _welcome_page(self) -> bool:
        """With ``ModelServer(html=True)``, every request gets a web server's welcome page (recorded)."""
        model = self.server.model
        if not model.html:
            return False
        if self.command == "POST":
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
        model._record(self.path, self.headers, {})
        self._send(200, WELCOME_PAGE, content_type="text/html")
        return True

    def _redirect(self) -> bool:
        """With ``ModelServer(redirect_to=URL)``, every request is answered 307 to URL + its path."""
        target = self.server.model.redirect_to
        if target is None:
            return False
        if self.command == "POST":
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self._send(307, b"", {"Location": target.rstrip("/") + self.path})
        return True

    def _send(self, status: int, body: Any, headers: dict | None = None,
              content_type: str = "application/json", drip: float = 0.0) -> None:
        if isinstance(body, (dict, list)):
            data = json.dumps(body).encode()
        elif isinstance(body, str):
            data = body.encode()
        else:
            data = body or b""
        try:
            self.send_response(status)
            headers = dict(headers or {})
            self.send_header("Content-Type", headers.pop("Content-Type", content_type))
            self.send_header("Content-Length", str(len(data)))
            for key, value in headers.items():
                self.send_header(key, value)
            self.end_headers()
            if not drip:
                self.wfile.write(data)
            for i in range(len(data) if drip else 0):
                if self.server.model._stopping.wait(drip):
                    break
                self.wfile.write(data[i:i + 1])
                self.wfile.flush()
        except OSError:
            self.close_connection = True


def _as_sse(completion: dict, include_usage: bool) -> bytes:
    """A whole completion as a (single-delta) server-sent-events stream."""
    base = {k: completion[k] for k in ("id", "created", "model")}
    base["object"] = "chat.completion.chunk"
    choice = completion["choices"][0]
    delta = dict(choice["message"])
    for index, call in enumerate(delta.get("tool_calls") or ()):
        delta["tool_calls"][index] = {"index": index, **call}
    chunks = [
        {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]},
        {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": choice["finish_reason"]}]},
    ]
    if include_usage:
        chunks.append({**base, "choices": [], "usage": completion["usage"]})
    events = [f"data: {json.dumps(c)}\n\n" for c in chunks] + ["data: [DONE]\n\n"]
    return "".join(events).encode()


# --------------------------------------------------------------------------- #
# The server object
# --------------------------------------------------------------------------- #


class ModelServer:
    """An OpenAI-compatible server on 127.0.0.1, run in a background thread."""

    def __init__(self, latency: float = 0.0, policy: Policy | None = None, record: bool = True,
                 host: str = "127.0.0.1", port: int = 0, model: str = "mock-model", api_key: str | None = None,
                 redirect_to: str | None = None, html: bool = False):
        self.api_key = api_key  # when set, requests without it get a 401
        self.redirect_to = redirect_to  # when set, every request is answered 307 to this URL + its path
        self.html = html  # when set, every request is answered 200 with a web server's welcome page
        self.latency = latency
        self.policy = policy
        self.record = record
        self.host = host
        self.port = port
        self.model = model
        self._requests: list[RecordedRequest] = []
        self._probes: list[RecordedRequest] = []  # GET /models
        self._cache: set[str] = set()  # prompt prefixes cached by cache_control breakpoints
        self._states: dict[str, ConversationState] = {}
        self._lock = threading.Lock()
        self._connections: set[socket.socket] = set()
        self.connections_accepted = 0  # TCP connections the server took, over its life
        self._images = 0
        self._stopping = threading.Event()
        self._httpd: _HTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle -------------------------------------------------------------

    def start(self) -> "ModelServer":
        if self._httpd is not None:
            return self
        self._stopping.clear()
        self._httpd = _HTTPServer((self.host, self.port), _Handler)
        self._httpd.model = self
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05},
            name=f"model-server-{self.port}", daemon=True,
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving; hung and sleeping handlers are released, never waited for."""
        httpd, self._httpd = self._httpd, None
        if httpd is None:
            return
        self._stopping.set()
        httpd.shutdown()
        httpd.server_close()
        with self._lock:
            connections = list(self._connections)
        for conn in connections:  # wake handlers idling on keep-alive connections
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> "ModelServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def root_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        return f"{self.root_url}/v1"

    # -- inspection ------------------------------------------------------------

    @property
    def requests(self) -> list[RecordedRequest]:
        """A snapshot of the recorded requests, in arrival order."""
        with self._lock:
            return list(self._requests)

    @property
    def probes(self) -> list[RecordedRequest]:
        """The GET /models requests (reachability probes), in arrival order."""
        with self._lock:
            return list(self._probes)

    def requests_for(self, prompt_substring: str) -> list[RecordedRequest]:
        """Chat requests whose first user message contains ``prompt_substring``."""
        return [r for r in self.requests if r.path.startswith(CHAT_PATH)
                and prompt_substring in first_user_text(r.body)]

    def count(self, path: str = CHAT_PATH) -> int:
        return sum(1 for r in self.requests if r.path.split("?", 1)[0] == path)

    def state_for(self, prompt: str) -> ConversationState | None:
        return self._states.get(prompt)

    def reset(self) -> None:
        """Forget recorded requests and conversation state (for shared fixtures)."""
        with self._lock:
            self._requests.clear()
            self._probes.clear()
            self._states.clear()

    # -- internals used by the handler ------------------------------------------

    def _record(self, path: str, headers, body: dict, into: list | None = None) -> None:
        if self.record:
            entry = RecordedRequest(path, {k.lower(): v for k, v in headers.items()}, body, time.time())
            with self._lock:
                (self._requests if into is None else into).append(entry)

    def _state_for(self, body: dict) -> ConversationState:
        key = first_user_text(body)
        with self._lock:
            state = self._states.get(key)
            if state is None:
                state = self._states[key] = ConversationState(key, parse_directives(key))
            state.requests += 1
            return state

    def _prompt_cache(self, body: dict) -> int:
        """Anthropic-style prompt caching: each `cache_control` breakpoint caches the prefix up to
        it; a later request that starts with a cached prefix reads it. Returns the cached tokens."""
        messages = [m for m in body.get("messages") or () if isinstance(m, dict)]
        head = [body.get("model"), body.get("tools")]
        plain: list = []
        prefixes: list[tuple[str, int]] = []
        chars = 0
        for message in messages:
            chars += len(message_text(message))
            content = message.get("content")
            marked = isinstance(content, list) and any(isinstance(p, dict) and "cache_control" in p for p in content)
            plain.append({**message, "content": message_text(message)})  # a string and its text part are one
            if marked:
                prefixes.append((json.dumps(head + plain, sort_keys=True), chars))
        with self._lock:
            hit = max((n for key, n in prefixes if key in self._cache), default=0)
            self._cache.update(key for key, _ in prefixes)
        return hit // 4

    def _next_image(self) -> int:
        with self._lock:
            self._images += 1
            return self._images

    def _track(self, conn: socket.socket, add: bool) -> None:
        with self._lock:
            if add:
                self._connections.add(conn)
                self.connections_accepted += 1
            else:
                self._connections.discard(conn)


# --------------------------------------------------------------------------- #
# CLI
# --------------------------------------------------------------------------- #


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--latency", type=float, default=0.0)
    parser.add_argument("--port-file", help="write the bound port here once listening")
    parser.add_argument("--record", action="store_true", help="keep requests in memory (off by default)")
    args = parser.parse_args(argv)

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    server = ModelServer(latency=args.latency, record=args.record, host=args.host, port=args.port).start()
    try:
        if args.port_file:
            tmp = f"{args.port_file}.tmp{os.getpid()}"
            with open(tmp, "w") as fh:
                fh.write(f"{server.port}\n")
            os.replace(tmp, args.port_file)  # atomic: readers never see a partial file
        print(f"model server listening on {server.base_url}", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()


if __name__ == "__main__":
    main()
