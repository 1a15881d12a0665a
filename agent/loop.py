"""The tool-calling loop of one agent session, asynchronous.

Each model reply is classified once (`classify` returns its `Reply` kind). A final answer ends the
session; tool calls are run and their results kept. Every other kind is a bad reply: it is dropped
(listed in `ConversationResult.dropped_replies`, so every model call is accounted for) and the same
request is sent again, up to MAX_SILENT_RETRIES times per kind; after that the session ends partial,
or fails when it made nothing worth saving. Two kinds differ: a reply cut at the output length
limit is never retried, and invalid JSON arguments get a repair note instead of an ending.

Messages kept in `ConversationResult.messages` are the conversation as the model saw it, minus
what is added at call time only (the system prompt, the ephemeral system prompt and the prefill
messages). Notes the loop itself tells the model (the turn-limit summary request, the invalid-JSON
repair note) are user messages marked `"loop_note": True`: the trajectory writer leaves them out of
the conversation, and `ConversationResult.loop_notes` says where they were.
"""

from __future__ import annotations

import enum
import json
import math
import re
from collections import Counter
from collections.abc import Container
from dataclasses import dataclass, field
from typing import Any

from agent.types import ModelMisbehaved, ModelReply, ProviderError
from agent.trajectory import conversation_length
from runner.input.secrets import redact
from tools.environments.base import SandboxError
from tools.registry import ToolContext, ToolSpec

MAX_TOOL_RESULT_CHARS = 100_000
MAX_SILENT_RETRIES = 2  # bad replies of a kind retried silently before the loop gives up or repairs

SYSTEM_PROMPT = (
    "You are a capable assistant working on a task by yourself. Use the tools you are given when "
    "they help, check their results, and finish with a clear, complete answer for the user."
)
SUMMARY_REQUEST = (
    "You have used every tool-calling turn allowed for this task. Without calling any tool, give "
    "your final answer now, summarising what you found and did."
)

_THINK_BLOCK = re.compile(r"<think>.*?</think>", re.DOTALL)
_SCRATCHPAD_OPEN, _SCRATCHPAD_CLOSE = "<REASONING_SCRATCHPAD>", "</REASONING_SCRATCHPAD>"


@dataclass
class LoopConfig:
    max_iterations: int = 10
    ephemeral_system_prompt: str | None = None
    prefill_messages: list[dict] = field(default_factory=list)


@dataclass
class ConversationResult:
    messages: list[dict]
    api_calls: int = 0
    completed: bool = False  # ended with the model's own final answer
    partial: bool = False
    error: str | None = None  # why the run stopped early (partial), if it did
    hit_turn_limit: bool = False
    dropped_replies: list[dict] = field(default_factory=list)  # [{"call": n, "reason": ...}], not saved as turns
    loop_notes: list[dict] = field(default_factory=list)  # [{"after_turn": i, "note": ...}], sent, not saved


class Reply(enum.Enum):
    """What a model reply is, as far as the loop is concerned (see `classify`)."""

    TRUNCATED = "cut at the output length limit"
    UNCLOSED_SCRATCHPAD = "unclosed scratchpad"
    UNKNOWN_TOOL = "unknown tool"
    BAD_JSON = "invalid JSON arguments"
    TOOL_CALLS = "tool calls"
    ANSWER = "final answer"
    THINK_ONLY = "thinking without an answer"
    EMPTY = "empty"


@dataclass
class Verdict:
    kind: Reply
    reason: str = ""  # why a bad reply is dropped (metadata.dropped_replies)
    tool: str = ""  # the tool a bad call named
    error: str = ""  # BAD_JSON: what is wrong with its arguments
    arguments: list[dict] = field(default_factory=list)  # TOOL_CALLS: each call's parsed arguments


# How a session ends when a bad reply of this kind may not be retried again (TRUNCATED never is).
_GIVE_UP = {
    Reply.TRUNCATED: "response truncated at the output length limit",
    Reply.UNCLOSED_SCRATCHPAD: f"unclosed {_SCRATCHPAD_OPEN} after {MAX_SILENT_RETRIES} retries",
    Reply.UNKNOWN_TOOL: "model called a tool it was not offered: {tool}",
    Reply.THINK_ONLY: f"the model gave no answer beyond thinking after {MAX_SILENT_RETRIES} retries",
    Reply.EMPTY: f"the model sent an empty reply after {MAX_SILENT_RETRIES} retries",
}


def _system_prompt(config: LoopConfig) -> str:
    if config.ephemeral_system_prompt:
        return f"{SYSTEM_PROMPT}\n\n{config.ephemeral_system_prompt}".strip()
    return SYSTEM_PROMPT


def _for_api(message: dict) -> dict:
    """The wire form of a stored message: our bookkeeping keys are not sent."""
    wire = {"role": message["role"], "content": message.get("content")}
    if message.get("tool_calls"):
        wire["tool_calls"] = message["tool_calls"]
    if message.get("reasoning_details"):
        wire["reasoning_details"] = message["reasoning_details"]
    if message["role"] == "tool":
        wire["tool_call_id"] = message["tool_call_id"]
    return wire


def _answer_text(text: str | None) -> str:
    """The content without its reasoning blocks (<think> or a closed scratchpad)."""
    text = (text or "").replace(_SCRATCHPAD_OPEN, "<think>").replace(_SCRATCHPAD_CLOSE, "</think>")
    return _THINK_BLOCK.sub("", text).strip()


def _assistant_message(reply: ModelReply, tool_calls: list[dict] | None = None) -> dict:
    message: dict[str, Any] = {"role": "assistant", "content": reply.content or ""}
    if reply.reasoning:
        message["reasoning"] = reply.reasoning
    if reply.reasoning_details:
        message["reasoning_details"] = reply.reasoning_details
    if tool_calls:
        message["tool_calls"] = tool_calls
    return message


def _parse_arguments(raw: Any) -> tuple[dict | None, str | None]:
    if isinstance(raw, dict):
        return raw, None
    if raw is None or not str(raw).strip():
        return {}, None
    try:
        # strict=False: raw control characters inside strings (a literal newline in a command) are
        # common in real models' arguments and unambiguous, so they are accepted, not retried.
        value = json.loads(raw, strict=False, parse_constant=_not_json, parse_float=_finite)
    except ValueError as err:  # json.JSONDecodeError, or no finite number
        return None, str(err)
    if not isinstance(value, dict):
        return None, f"arguments must be a JSON object, got {type(value).__name__}"
    return value, None


def _not_json(name: str) -> Any:
    # Python's json reads NaN and Infinity, which JSON has not: a NaN timeout would pass every
    # comparison, and a trajectory carrying one is no longer JSON for the tools that read it.
    raise ValueError(f"{name} is not a JSON value")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400: read as inf
        raise ValueError(f"{text} is not a JSON number a float can hold")
    return value


def classify(reply: ModelReply, offered: Container[str]) -> Verdict:
    """What kind of reply this is; the first kind that applies, in the order of `Reply`."""
    content = reply.content or ""
    if reply.finish_reason == "length":
        return Verdict(Reply.TRUNCATED, "cut at the output length limit")
    if _SCRATCHPAD_OPEN in content and _SCRATCHPAD_CLOSE not in content:
        return Verdict(Reply.UNCLOSED_SCRATCHPAD, f"unclosed {_SCRATCHPAD_OPEN}")
    if reply.tool_calls:
        names = [call["function"]["name"] for call in reply.tool_calls]
        unknown = [name for name in names if name not in offered]
        if unknown:
            return Verdict(Reply.UNKNOWN_TOOL, f"called a tool it was not offered: {unknown[0]}", unknown[0])
        parsed = [_parse_arguments(call["function"]["arguments"]) for call in reply.tool_calls]
        for name, (_, err) in zip(names, parsed):
            if err:
                return Verdict(Reply.BAD_JSON, f"invalid JSON arguments for '{name}': {err}", name, err)
        return Verdict(Reply.TOOL_CALLS, arguments=[args for args, _ in parsed])
    if _answer_text(content):
        return Verdict(Reply.ANSWER)
    if reply.reasoning or content.strip():  # it thought (natively, inline or in a scratchpad)
        return Verdict(Reply.THINK_ONLY, "no answer beyond thinking")
    return Verdict(Reply.EMPTY, "empty reply (no content, no tool call)")


async def run_conversation(
    prompt: str,
    *,
    model: Any,  # SessionModel
    tools: list[ToolSpec],
    ctx: ToolContext,
    config: LoopConfig,
) -> ConversationResult:
    """Run one session. Provider failures (ProviderError) and SandboxError propagate to the caller."""
    by_name = {spec.name: spec for spec in tools}
    schemas = [spec.openai_schema() for spec in tools] or None
    head = [{"role": "system", "content": _system_prompt(config)}, *config.prefill_messages]
    result = ConversationResult(messages=[{"role": "user", "content": prompt}])
    # The one retry budget: MAX_SILENT_RETRIES bad replies of each kind are dropped and asked again.
    retries: Counter[Reply] = Counter()

    while result.api_calls < config.max_iterations:
        result.api_calls += 1
        reply = await model.complete(head + [_for_api(m) for m in result.messages], tools=schemas)
        verdict = classify(reply, by_name)
        if verdict.kind is Reply.ANSWER:
            result.messages.append(_assistant_message(reply))
            result.completed = True
            return result
        if verdict.kind is Reply.TOOL_CALLS:
            retries[Reply.UNKNOWN_TOOL] = retries[Reply.BAD_JSON] = 0  # it can call tools properly again
            await _run_calls(reply, verdict.arguments, by_name, ctx, result)
            continue
        result.dropped_replies.append({"call": result.api_calls, "reason": verdict.reason})
        retries[verdict.kind] += 1
        if verdict.kind is not Reply.TRUNCATED and retries[verdict.kind] <= MAX_SILENT_RETRIES:
            continue
        if verdict.kind is Reply.BAD_JSON:  # silent retries did not help: say what was wrong, then go on
            _tell(result, f"The arguments of your call to '{verdict.tool}' were not valid JSON "
                          f"({verdict.error}). Call it again with a JSON object as "
                          "arguments (use {} for no arguments).")
            retries[Reply.BAD_JSON] = 0
            continue
        return _give_up(verdict, reply, result, retries[verdict.kind], getattr(model, "max_tokens", None))
    return await _turn_limit_summary(model, head, schemas, result)


def _give_up(verdict: Verdict, reply: ModelReply, result: ConversationResult, count: int,
             max_tokens: int | None = None) -> ConversationResult:
    """End the session on a bad reply: partial, or a failed row when there is nothing worth saving."""
    answered = any(m["role"] == "assistant" for m in result.messages)
    if verdict.kind is Reply.TRUNCATED and not answered:  # failed, so retried on resume, not kept empty
        limit = (f"--max_tokens={max_tokens} too small?" if max_tokens else
                 "the server's default output limit, as no --max_tokens was given: pass a larger one")
        raise ProviderError(f"the first response was cut at the output length limit ({limit})", "truncated")
    if verdict.kind is Reply.EMPTY and not answered:
        raise ModelMisbehaved(f"the model sent only empty replies ({count} in a row, no content, no tool call)",
                              result.dropped_replies)
    if verdict.kind is Reply.THINK_ONLY:
        result.messages.append(_assistant_message(reply))  # its last thought is the final turn
    result.partial, result.error = True, _GIVE_UP[verdict.kind].format(tool=verdict.tool)
    return _with_a_model_turn(result)


def _with_a_model_turn(result: ConversationResult) -> ConversationResult:
    """A session that ends without a single model turn has nothing to train on: it fails (so a
    resume runs it again) instead of being kept as [system, human], saying which replies were dropped."""
    if any(m["role"] == "assistant" for m in result.messages):
        return result
    why = "; ".join(f"call {d['call']}: {d['reason']}" for d in result.dropped_replies) or "no reply was kept"
    raise ModelMisbehaved(f"the model gave no usable reply, every reply was dropped ({why})", result.dropped_replies)


def _unique_ids(reply: ModelReply, result: ConversationResult) -> list[str]:
    """The ids of the reply's calls, unique in the conversation: results are matched to calls by
    id, and strict providers refuse a history with two calls of one id. A missing or repeated id
    is made up (call_<model call>_<position>)."""
    used = {c["id"] for m in result.messages for c in m.get("tool_calls") or ()}
    ids = []
    for i, call in enumerate(reply.tool_calls):
        call_id = call["id"]
        if not call_id or call_id in used:
            call_id = f"call_{result.api_calls}_{i}"
            while call_id in used:
                call_id += "_"
        used.add(call_id)
        ids.append(call_id)
    return ids


async def _run_calls(reply: ModelReply, arguments: list[dict], by_name: dict[str, ToolSpec], ctx: ToolContext,
                     result: ConversationResult) -> None:
    """Keep the reply with its calls (arguments re-serialised as parsed, ids made unique), then run each."""
    calls = [
        {"id": call_id, "type": "function",
         "function": {"name": call["function"]["name"], "arguments": json.dumps(args, ensure_ascii=False)}}
        for call_id, call, args in zip(_unique_ids(reply, result), reply.tool_calls, arguments)
    ]
    result.messages.append(_assistant_message(reply, calls))
    for call, args in zip(calls, arguments):
        spec = by_name[call["function"]["name"]]
        output = await _run_tool(spec, args, ctx)
        result.messages.append({"role": "tool", "tool_call_id": call["id"], "name": spec.name, "content": output})


async def _run_tool(spec: ToolSpec, args: dict, ctx: ToolContext) -> str:
    try:
        result = await spec.handler(args, ctx)
    except SandboxError:
        raise  # the sandbox is gone: the row fails as 'environment', not as a tool error
    except Exception as err:  # a tool bug must not end the session: the model sees the error
        result = {"error": f"{type(err).__name__}: {err}"}
    text = result if isinstance(result, str) else json.dumps(result, ensure_ascii=False, default=str)
    if len(text) > MAX_TOOL_RESULT_CHARS:
        text = redact(text)  # before the cut, which could go through a key and leave a piece of it
        text = text[:MAX_TOOL_RESULT_CHARS] + f"\n[truncated: {len(text) - MAX_TOOL_RESULT_CHARS} more characters]"
    return text


def _tell(result: ConversationResult, note: str) -> None:
    """A note the loop itself sends the model: a user message, recorded in loop_notes, never a turn."""
    result.loop_notes.append({"after_turn": conversation_length(result.messages) - 1, "note": note})
    result.messages.append({"role": "user", "loop_note": True, "content": note})


async def _turn_limit_summary(model: Any, head: list[dict], schemas: list[dict] | None,
                              result: ConversationResult) -> ConversationResult:
    # Out of turns: one extra call for a final summary (not counted in api_calls). The tools stay
    # defined, with tool_choice "none": Anthropic-family providers reject a history of tool calls
    # whose tools are not defined in the request.
    result.hit_turn_limit = True
    _tell(result, SUMMARY_REQUEST)
    reply = await model.complete(head + [_for_api(m) for m in result.messages], tools=schemas, tool_choice="none")
    final = _answer_text(reply.content)
    if reply.finish_reason == "length":  # as any reply cut there: not an answer, and the row says so
        result.dropped_replies.append({"call": result.api_calls + 1,
                                       "reason": "turn-limit summary: cut at the output length limit"})
        result.partial, result.error = True, _GIVE_UP[Reply.TRUNCATED]
    elif final:
        summary = _assistant_message(reply)  # any tool call in it is not kept: none may be made now
        summary.update(content=final, summary=True)
        result.messages.append(summary)
    else:
        result.dropped_replies.append({"call": result.api_calls + 1, "reason": "turn-limit summary: no answer in the reply"})
    return _with_a_model_turn(result)
