"""Unit tests of the agent loop with a scripted reply list (the CLI tests drive the real server;
these pin down endings that script can't easily reach: empty replies after tool calls, the summary)."""

from __future__ import annotations

import asyncio

import pytest

from agent.loop import LoopConfig, run_conversation
from agent.trajectory import conversation_length, to_sharegpt
from agent.types import ModelReply, ProviderError
from tools.registry import ToolContext, ToolSpec


async def _echo(args: dict, ctx) -> dict:
    return {"output": args.get("text", "")}


ECHO = ToolSpec("echo", "terminal", "Echo text.", {"type": "object", "properties": {"text": {"type": "string"}}}, _echo)


def _call(text: str, call_id: str = "c1") -> ModelReply:
    return ModelReply(None, None, [{"id": call_id, "type": "function",
                                    "function": {"name": "echo", "arguments": f'{{"text": "{text}"}}'}}], "tool_calls")


def _text(content: str | None, reasoning: str | None = None) -> ModelReply:
    return ModelReply(content, reasoning, [], "stop")


class Scripted:
    def __init__(self, replies: list[ModelReply]):
        self.replies = list(replies)
        self.requests: list[dict] = []

    async def complete(self, messages, *, tools=None, tool_choice=None, **kw) -> ModelReply:
        self.requests.append({"messages": messages, "tools": tools, "tool_choice": tool_choice})
        return self.replies.pop(0)


def _run(replies: list[ModelReply], max_iterations: int = 10):
    model = Scripted(replies)
    ctx = ToolContext(env=None, settings=None, model=model, task_id="t")
    result = asyncio.run(run_conversation("Prompt.", model=model, tools=[ECHO], ctx=ctx,
                                          config=LoopConfig(max_iterations=max_iterations)))
    return result, model


def test_empty_replies_after_tool_calls_end_partial_without_an_empty_turn():
    result, _ = _run([_call("a"), _text(""), _text(None), _text("  ")])
    assert result.partial and not result.completed and "empty reply" in result.error
    assert [m["role"] for m in result.messages] == ["user", "assistant", "tool"]
    assert [d["call"] for d in result.dropped_replies] == [2, 3, 4]
    assert result.api_calls == 4


def test_only_empty_replies_fail_the_row():
    with pytest.raises(ProviderError, match="only empty replies"):
        _run([_text("")] * 3)


def test_thinking_without_answer_is_not_called_empty():
    result, _ = _run([_text(None, reasoning="hmm")] * 3)
    assert result.partial and "beyond thinking" in result.error
    assert result.messages[-1]["reasoning"] == "hmm"  # the last thought is kept as the final turn


def test_empty_summary_is_recorded_not_fabricated():
    result, model = _run([_call("a"), _text("")], max_iterations=1)
    assert result.hit_turn_limit and result.final_response is None
    assert [m["role"] for m in result.messages if not m.get("loop_note")] == ["user", "assistant", "tool"]
    assert result.dropped_replies == [{"call": 2, "reason": "turn-limit summary: no answer in the reply"}]
    summary_request = model.requests[-1]
    assert summary_request["tool_choice"] == "none" and summary_request["tools"]


def test_summary_keeps_its_text_and_drops_any_tool_call():
    reply = _call("again")
    reply.content = "Here is my summary."
    result, _ = _run([_call("a"), reply], max_iterations=1)
    assert result.final_response == "Here is my summary."
    assert "tool_calls" not in result.messages[-1] and result.messages[-1]["summary"] is True
    turns = to_sharegpt(result.messages, "Prompt.", [ECHO])
    assert [t["from"] for t in turns] == ["system", "human", "gpt", "tool", "gpt"]
    assert result.loop_notes[0]["after_turn"] == 3  # after the tool turn


def test_conversation_length_matches_the_saved_turns():
    result, _ = _run([_call("a", "c1"), _call("b", "c2"), _text("Done.")])
    messages = result.messages
    for end in range(1, len(messages) + 1):
        assert conversation_length(messages[:end]) == len(to_sharegpt(messages[:end], "Prompt.", [ECHO]))
