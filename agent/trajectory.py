"""Conversion of a session's messages to ShareGPT turns, and the per-row tool / reasoning stats.

Format (the original's, with its weaknesses fixed):
- turn 1 `system`: the function-calling instructions with the offered tools as JSON;
- turn 2 `human`: the dataset prompt exactly as given;
- `gpt` turns: `<think>` reasoning, the text, then one `<tool_call>` block per call;
- `tool` turns: the consecutive tool results after a call turn, each a `<tool_response>` whose
  `name` is found **by tool_call_id** (the original paired them by position);
- notes the loop told the model itself (turn-limit summary request, JSON-repair note) are not
  turns at all (they go to `metadata.loop_notes`): a conversation is system, human, then gpt and
  tool turns only, which every chat template accepts and a model trained on it never learns to
  expect such notes from a user.
"""

from __future__ import annotations

import json
from typing import Any, Iterable

from tools.registry import ALL_TOOL_NAMES, ToolSpec

_EMPTY_THINK = "<think>\n</think>\n"

_CALL_SCHEMA = {
    "title": "FunctionCall",
    "type": "object",
    "properties": {"name": {"title": "Name", "type": "string"}, "arguments": {"title": "Arguments", "type": "object"}},
    "required": ["name", "arguments"],
}


# The system turn of each tool list a process has offered: the same few lists come back row
# after row, and the JSON of their schemas was a sizeable part of building a record.
_SYSTEM_TURNS: dict[tuple[int, ...], tuple[tuple[ToolSpec, ...], str]] = {}


def system_turn(tools: list[ToolSpec]) -> str:
    key = tuple(map(id, tools))  # the specs are the registry's own objects, kept alive by the entry
    cached = _SYSTEM_TURNS.get(key)
    if cached is not None and all(a is b for a, b in zip(cached[0], tools)):
        return cached[1]
    text = _system_turn(tools)
    if len(_SYSTEM_TURNS) < 256:
        _SYSTEM_TURNS[key] = (tuple(tools), text)
    return text


def _system_turn(tools: list[ToolSpec]) -> str:
    listing = json.dumps(
        [
            {
                "name": spec.name,
                "description": spec.description,
                "parameters": spec.parameters,
                "required": spec.parameters.get("required", []),
            }
            for spec in tools
        ],
        ensure_ascii=False,
    )
    return (
        "You are a function-calling AI model. The signatures of the functions you may call are given "
        "inside <tools> </tools> XML tags. You may call one or more of them to help with the user's "
        "request, or answer directly when none is relevant. Never guess argument values the user has "
        "not given. Each function's result comes back inside <tool_response> </tool_response> tags. "
        f"The functions you can use:\n<tools>\n{listing}\n</tools>\n"
        f"Write each call as a JSON object following this schema: {json.dumps(_CALL_SCHEMA)}\n"
        "Enclose every function call in <tool_call> </tool_call> tags, for example:\n"
        '<tool_call>\n{"name": "<function-name>", "arguments": {"<arg>": "<value>"}}\n</tool_call>'
    )


def _scratchpad_to_think(text: str) -> str:
    return text.replace("<REASONING_SCRATCHPAD>", "<think>").replace("</REASONING_SCRATCHPAD>", "</think>")


def _gpt_value(message: dict) -> str:
    value = ""
    reasoning = (message.get("reasoning") or "").strip()
    if reasoning:
        value += f"<think>\n{reasoning}\n</think>\n"
    content = (message.get("content") or "").strip()
    if content:
        value += _scratchpad_to_think(content) + "\n"
    for call in message.get("tool_calls") or []:
        raw = call["function"].get("arguments")
        try:
            args = json.loads(raw) if isinstance(raw, str) else (raw or {})
        except json.JSONDecodeError:
            args = {}
        value += "<tool_call>\n" + json.dumps({"name": call["function"]["name"], "arguments": args}, ensure_ascii=False)
        value += "\n</tool_call>\n"
    if "<think>" not in value:
        value = _EMPTY_THINK + value
    return value.strip()


def _tool_response(message: dict, names_by_id: dict[str, str]) -> str:
    content: Any = message.get("content")
    if isinstance(content, str) and content.strip()[:1] in ("{", "["):
        try:
            content = json.loads(content)
        except json.JSONDecodeError:
            pass
    call_id = message.get("tool_call_id") or ""
    name = names_by_id.get(call_id) or message.get("name") or "unknown"
    body = json.dumps({"tool_call_id": call_id, "name": name, "content": content}, ensure_ascii=False)
    return f"<tool_response>\n{body}\n</tool_response>"


def to_sharegpt(messages: list[dict], prompt: str, tools: list[ToolSpec]) -> list[dict]:
    turns = [{"from": "system", "value": system_turn(tools)}, {"from": "human", "value": prompt}]
    names_by_id: dict[str, str] = {}
    pending_tool_results: list[str] = []

    def flush_tools() -> None:
        if pending_tool_results:
            turns.append({"from": "tool", "value": "\n".join(pending_tool_results)})
            pending_tool_results.clear()

    for message in messages[1:]:  # messages[0] is the prompt, saved above exactly as given
        role = message.get("role")
        if role == "tool":
            pending_tool_results.append(_tool_response(message, names_by_id))
            continue
        flush_tools()
        if role == "assistant":
            for call in message.get("tool_calls") or []:
                names_by_id[call.get("id") or ""] = call["function"]["name"]
            turns.append({"from": "gpt", "value": _gpt_value(message)})
        elif role == "user" and not message.get("loop_note"):
            turns.append({"from": "human", "value": message.get("content") or ""})
    flush_tools()
    return turns


def conversation_length(messages: list[dict]) -> int:
    """How many turns `to_sharegpt` makes of these messages (the system and human turns included)."""
    turns, in_tool_group = 2, False
    for message in messages[1:]:
        role = message.get("role")
        if role == "tool":
            turns += 0 if in_tool_group else 1
            in_tool_group = True
            continue
        in_tool_group = False
        if role == "assistant" or (role == "user" and not message.get("loop_note")):
            turns += 1
    return turns


# --- statistics -----------------------------------------------------------------------------

_FAILURE_PREFIXES = ("error:", "error ", "[error]", "error\n")


def is_tool_failure(content: Any) -> bool:
    """A tool result is a failure when it reports an error (a non-zero exit code is not one)."""
    if content is None:
        return True
    if isinstance(content, str):
        try:
            parsed: Any = json.loads(content)
        except (json.JSONDecodeError, ValueError):
            text = content.strip().lower()
            return not text or (text.startswith(_FAILURE_PREFIXES) and not text.startswith("no error"))
    else:
        parsed = content
    if isinstance(parsed, dict):
        inner = parsed.get("content")
        return (
            parsed.get("error") is not None
            or parsed.get("success") is False
            or (isinstance(inner, dict) and inner.get("error") is not None)
        )
    return False


def extract_tool_stats(messages: Iterable[dict]) -> dict[str, dict[str, int]]:
    """Per tool: calls made, and how many of their results succeeded or failed (matched by id)."""
    stats: dict[str, dict[str, int]] = {}
    names_by_id: dict[str, str] = {}
    for message in messages:
        if message.get("role") == "assistant":
            for call in message.get("tool_calls") or []:
                name = call["function"]["name"]
                stats.setdefault(name, {"count": 0, "success": 0, "failure": 0})["count"] += 1
                names_by_id[call.get("id") or ""] = name
        elif message.get("role") == "tool":
            name = names_by_id.get(message.get("tool_call_id") or "")
            if name:
                stats[name]["failure" if is_tool_failure(message.get("content")) else "success"] += 1
    return stats


def normalise_tool_stats(raw: dict[str, dict[str, int]]) -> tuple[dict, dict]:
    """Every known tool in sorted order (stable Arrow schema), then any unexpected name, sorted."""
    names = list(ALL_TOOL_NAMES) + sorted(set(raw) - set(ALL_TOOL_NAMES))
    zero = {"count": 0, "success": 0, "failure": 0}
    tool_stats = {name: dict(raw.get(name, zero)) for name in names}
    return tool_stats, {name: tool_stats[name]["failure"] for name in names}


def has_reasoning(message: dict) -> bool:
    return "<REASONING_SCRATCHPAD>" in (message.get("content") or "") or bool((message.get("reasoning") or "").strip())


def extract_reasoning_stats(messages: Iterable[dict]) -> dict[str, int]:
    """Reasoning coverage over the model's own turns (the turn-limit summary is not counted)."""
    turns = [m for m in messages if m.get("role") == "assistant" and not m.get("summary")]
    with_reasoning = sum(1 for m in turns if has_reasoning(m))
    return {
        "total_assistant_turns": len(turns),
        "turns_with_reasoning": with_reasoning,
        "turns_without_reasoning": len(turns) - with_reasoning,
    }
