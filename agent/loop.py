"""The tool-calling loop of one agent session (reference §9.2), asynchronous.

Messages kept in `ConversationResult.messages` are the conversation as the model saw it, minus
what is added at call time only (the system prompt, the ephemeral system prompt and the prefill
messages). Notes the loop itself tells the model (the turn-limit summary request, the invalid-JSON
repair note) are user messages marked `"loop_note": True`: the trajectory writer leaves them out of
the conversation, and `ConversationResult.loop_notes` says where they were. Replies the loop drops
(retried silently: an unknown tool, invalid JSON arguments, thinking without an answer, an empty
reply) are listed in `ConversationResult.dropped_replies`, so every model call is accounted for.
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass, field
from typing import Any

from agent.types import ModelReply, ProviderError
from agent.trajectory import conversation_length
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
    tool_timeout: float | None = None  # seconds for one tool call; None: the tool's own limits


@dataclass
class ConversationResult:
    messages: list[dict]
    final_response: str | None
    api_calls: int
    completed: bool
    partial: bool = False
    error: str | None = None  # why the run stopped early (partial), if it did
    hit_turn_limit: bool = False
    dropped_replies: list[dict] = field(default_factory=list)  # [{"call": n, "reason": ...}], not saved as turns
    loop_notes: list[dict] = field(default_factory=list)  # [{"after_turn": i, "note": ...}], sent, not saved


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
        value = json.loads(raw, strict=False)
    except json.JSONDecodeError as err:
        return None, str(err)
    if not isinstance(value, dict):
        return None, f"arguments must be a JSON object, got {type(value).__name__}"
    return value, None


async def _run_tool(spec: ToolSpec, args: dict, ctx: ToolContext, timeout: float | None) -> str:
    try:
        result = await asyncio.wait_for(spec.handler(args, ctx), timeout)
    except SandboxError:
        raise  # the sandbox is gone: the row fails as 'environment', not as a tool error
    except asyncio.TimeoutError:
        result = {"error": f"tool '{spec.name}' timed out after {timeout:g}s"}
    except Exception as err:  # a tool bug must not end the session: the model sees the error
        result = {"error": f"{type(err).__name__}: {err}"}
    text = result if isinstance(result, str) else json.dumps(result, ensure_ascii=False, default=str)
    if len(text) > MAX_TOOL_RESULT_CHARS:
        text = text[:MAX_TOOL_RESULT_CHARS] + f"\n[truncated: {len(text) - MAX_TOOL_RESULT_CHARS} more characters]"
    return text


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
    messages: list[dict] = [{"role": "user", "content": prompt}]
    dropped: list[dict] = []  # replies not kept in the conversation: {"call": n, "reason": ...}
    notes: list[dict] = []  # what the loop told the model itself: {"after_turn": i, "note": ...}
    api_calls = 0
    retries = {"unknown_tool": 0, "bad_json": 0, "think_only": 0, "empty": 0, "scratchpad": 0}

    def result(final: str | None, **kw: Any) -> ConversationResult:
        return ConversationResult(messages, final, api_calls, completed=kw.pop("completed", final is not None),
                                  dropped_replies=dropped, loop_notes=notes, **kw)

    def partial(reason: str) -> ConversationResult:
        return result(None, completed=False, partial=True, error=reason)

    def drop(kind: str, reason: str) -> bool:
        """Record a dropped reply; True while this kind of bad reply may still be retried silently."""
        dropped.append({"call": api_calls, "reason": reason})
        retries[kind] += 1
        return retries[kind] <= MAX_SILENT_RETRIES

    def tell(note: str) -> None:
        notes.append({"after_turn": conversation_length(messages) - 1, "note": note})
        messages.append({"role": "user", "loop_note": True, "content": note})

    while api_calls < config.max_iterations:
        api_calls += 1
        reply = await model.complete(head + [_for_api(m) for m in messages], tools=schemas)

        if reply.finish_reason == "length":
            dropped.append({"call": api_calls, "reason": "cut at the output length limit"})
            if not any(m["role"] == "assistant" for m in messages):
                # Nothing worth saving: fail the row (retried on resume) instead of keeping an empty one.
                raise ProviderError("the first response was cut at the output length limit (--max_tokens too small?)",
                                    "truncated")
            return partial("response truncated at the output length limit")

        content = reply.content or ""
        if _SCRATCHPAD_OPEN in content and _SCRATCHPAD_CLOSE not in content:
            if not drop("scratchpad", f"unclosed {_SCRATCHPAD_OPEN}"):
                return partial(f"unclosed {_SCRATCHPAD_OPEN} after {MAX_SILENT_RETRIES} retries")
            continue

        if reply.tool_calls:
            unknown = [c["function"]["name"] for c in reply.tool_calls if c["function"]["name"] not in by_name]
            if unknown:
                if not drop("unknown_tool", f"called a tool it was not offered: {unknown[0]}"):
                    return partial(f"model called a tool it was not offered: {unknown[0]}")
                continue
            parsed = [_parse_arguments(c["function"]["arguments"]) for c in reply.tool_calls]
            broken = [(c, err) for c, (_, err) in zip(reply.tool_calls, parsed) if err]
            if broken:
                call, err = broken[0]
                if not drop("bad_json", f"invalid JSON arguments for '{call['function']['name']}': {err}"):
                    tell(
                        f"The arguments of your call to '{call['function']['name']}' were not valid JSON "
                        f"({err}). Call it again with a JSON object as arguments (use {{}} for no arguments)."
                    )
                    retries["bad_json"] = 0
                continue
            retries["unknown_tool"] = retries["bad_json"] = 0
            calls = [
                {"id": c["id"] or f"call_{api_calls}_{i}", "type": "function",
                 "function": {"name": c["function"]["name"], "arguments": json.dumps(args, ensure_ascii=False)}}
                for i, (c, (args, _)) in enumerate(zip(reply.tool_calls, parsed))
            ]
            messages.append(_assistant_message(reply, calls))
            for call, (args, _) in zip(calls, parsed):
                spec = by_name[call["function"]["name"]]
                output = await _run_tool(spec, args, ctx, config.tool_timeout)
                messages.append({"role": "tool", "tool_call_id": call["id"], "name": spec.name, "content": output})
            continue

        if not _answer_text(content):
            if reply.reasoning or content.strip():  # it thought (natively, inline or in a scratchpad)
                if not drop("think_only", "no answer beyond thinking"):
                    messages.append(_assistant_message(reply))
                    return partial(f"the model gave no answer beyond thinking after {MAX_SILENT_RETRIES} retries")
                continue
            if not drop("empty", "empty reply (no content, no tool call)"):
                if not any(m["role"] == "assistant" for m in messages):
                    raise ProviderError(f"the model sent only empty replies ({retries['empty']} in a row, no content, no tool call)")
                return partial(f"the model sent an empty reply after {MAX_SILENT_RETRIES} retries")
            continue

        messages.append(_assistant_message(reply))
        return result(content)

    # Out of turns: one extra call for a final summary (not counted in api_calls). The tools stay
    # defined, with tool_choice "none": Anthropic-family providers reject a history of tool calls
    # whose tools are not defined in the request.
    tell(SUMMARY_REQUEST)
    reply = await model.complete(head + [_for_api(m) for m in messages], tools=schemas, tool_choice="none")
    final = _answer_text(reply.content) or None
    if final is None:
        dropped.append({"call": api_calls + 1, "reason": "turn-limit summary: no answer in the reply"})
    else:
        summary = _assistant_message(reply)  # any tool call in it is not kept: none may be made now
        summary.update(content=final, summary=True)
        messages.append(summary)
    return result(final, completed=False, hit_turn_limit=True)
