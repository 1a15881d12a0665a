"""Unit tests of the agent loop, one behaviour per test, driven by a scripted in-process model.

The CLI tests drive the real server end to end; these pin down each kind of reply the loop
classifies (tool calls, unknown tool, bad JSON, think-only, empty, unclosed scratchpad, truncated,
final answer), the one retry budget, the turn-limit summary and what is recorded about dropped
replies and loop notes.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from agent.loop import MAX_SILENT_RETRIES, MAX_TOOL_RESULT_CHARS, SUMMARY_REQUEST, LoopConfig, run_conversation
from agent.trajectory import conversation_length, to_sharegpt
from agent.types import ModelReply, ProviderError
from tools.environments.base import SandboxError
from tools.registry import ToolContext, ToolSpec


async def _echo(args: dict, ctx) -> dict:
    return {"output": args.get("text", "")}


async def _upper(args: dict, ctx) -> dict:
    return {"output": args.get("text", "").upper()}


async def _broken(args: dict, ctx) -> dict:
    raise ValueError("tool bug")


async def _sandbox_gone(args: dict, ctx) -> dict:
    raise SandboxError("container died")


async def _huge(args: dict, ctx) -> str:
    return "x" * (MAX_TOOL_RESULT_CHARS + 10)


def _tool(name: str, handler) -> ToolSpec:
    return ToolSpec(name, "terminal", f"The {name} tool.", {"type": "object", "properties": {"text": {"type": "string"}}},
                    handler)


ECHO, UPPER = _tool("echo", _echo), _tool("upper", _upper)


def _calls(*calls: tuple[str, str, str], content: str | None = None) -> ModelReply:
    """A reply with tool calls, each (id, tool name, raw arguments)."""
    return ModelReply(content, None, [{"id": i, "type": "function", "function": {"name": n, "arguments": a}}
                                      for i, n, a in calls], "tool_calls")


def _call(text: str, call_id: str = "c1", tool: str = "echo") -> ModelReply:
    return _calls((call_id, tool, json.dumps({"text": text})))


def _text(content: str | None, reasoning: str | None = None, finish_reason: str = "stop") -> ModelReply:
    return ModelReply(content, reasoning, [], finish_reason)


class Scripted:
    """A model that returns the given replies in order and keeps every request it was sent."""

    def __init__(self, replies: list[ModelReply]):
        self.replies = list(replies)
        self.requests: list[dict] = []

    async def complete(self, messages, *, tools=None, tool_choice=None, **kw) -> ModelReply:
        self.requests.append({"messages": messages, "tools": tools, "tool_choice": tool_choice})
        return self.replies.pop(0)


def _run(replies: list[ModelReply], max_iterations: int = 10, tools=(ECHO,), **config):
    model = Scripted(replies)
    ctx = ToolContext(env=None, settings=None, model=model, task_id="t")
    result = asyncio.run(run_conversation("Prompt.", model=model, tools=list(tools), ctx=ctx,
                                          config=LoopConfig(max_iterations=max_iterations, **config)))
    assert not model.replies, "the loop stopped before the script's end"
    return result, model


def _roles(result) -> list[str]:
    return [m["role"] for m in result.messages]


# --- tool calls ---------------------------------------------------------------------------------


def test_tool_call_and_its_result_matched_by_id():
    result, model = _run([_call("hi", "call_7"), _text("Done.")])
    assert result.completed and not result.partial and result.error is None
    assert _roles(result) == ["user", "assistant", "tool", "assistant"]
    call, output = result.messages[1]["tool_calls"][0], result.messages[2]
    assert output == {"role": "tool", "tool_call_id": "call_7", "name": "echo", "content": '{"output": "hi"}'}
    assert call["id"] == "call_7" and json.loads(call["function"]["arguments"]) == {"text": "hi"}
    assert model.requests[1]["messages"][-1] == {"role": "tool", "content": '{"output": "hi"}', "tool_call_id": "call_7"}
    assert result.messages[-1]["content"] == "Done." and result.api_calls == 2


def test_parallel_calls_run_in_order_each_result_with_its_id():
    result, _ = _run([_calls(("a", "echo", '{"text": "one"}'), ("b", "upper", '{"text": "two"}')), _text("Done.")],
                     tools=(ECHO, UPPER))
    assert [(m["tool_call_id"], m["name"], m["content"]) for m in result.messages[2:4]] == [
        ("a", "echo", '{"output": "one"}'), ("b", "upper", '{"output": "TWO"}')]
    assert len(result.messages[1]["tool_calls"]) == 2


def test_a_call_without_id_gets_one_made_up():
    result, _ = _run([_calls(("", "echo", "{}")), _text("Done.")])
    assert result.messages[1]["tool_calls"][0]["id"] == result.messages[2]["tool_call_id"] == "call_1_0"


def test_repeated_call_ids_are_made_unique_so_each_result_matches_one_call():
    replies = [_calls(("same", "echo", '{"text": "one"}'), ("same", "upper", '{"text": "two"}')),
               _call("three", "same"), _text("Done.")]
    result, model = _run(replies, tools=(ECHO, UPPER))
    ids = [c["id"] for m in result.messages for c in m.get("tool_calls") or ()]
    assert ids[0] == "same" and len(set(ids)) == 3  # the first keeps its id, the repeats get new ones
    answered = [m["tool_call_id"] for m in result.messages if m["role"] == "tool"]
    assert answered == ids
    sent = [m.get("tool_call_id") for m in model.requests[-1]["messages"] if m["role"] == "tool"]
    assert sent == ids  # what the provider sees has no duplicate id either


def test_empty_arguments_are_an_empty_object():
    result, _ = _run([_calls(("c1", "echo", "")), _text("Done.")])
    assert result.messages[1]["tool_calls"][0]["function"]["arguments"] == "{}"
    assert result.messages[2]["content"] == '{"output": ""}'


def test_control_characters_in_arguments_are_accepted():
    raw = '{"text": "line one\nline two\tend"}'  # a raw newline and tab inside the string: not strict JSON
    result, _ = _run([_calls(("c1", "echo", raw)), _text("Done.")])
    assert result.dropped_replies == [] and result.loop_notes == []
    assert json.loads(result.messages[2]["content"]) == {"output": "line one\nline two\tend"}


def test_a_tool_that_raises_gives_the_model_its_error():
    result, _ = _run([_call("x", tool="broken"), _text("Done.")], tools=(_tool("broken", _broken),))
    assert json.loads(result.messages[2]["content"]) == {"error": "ValueError: tool bug"}
    assert result.completed


def test_a_dead_sandbox_ends_the_session():
    with pytest.raises(SandboxError):
        _run([_call("x", tool="gone")], tools=(_tool("gone", _sandbox_gone),))


def test_a_huge_tool_result_is_truncated():
    result, _ = _run([_call("x", tool="huge"), _text("Done.")], tools=(_tool("huge", _huge),))
    assert result.messages[2]["content"].endswith("\n[truncated: 10 more characters]")
    assert len(result.messages[2]["content"]) < MAX_TOOL_RESULT_CHARS + 100


# --- bad replies: dropped, retried silently, then the session ends or is repaired -------------


def test_unknown_tool_is_retried_then_the_session_is_partial():
    result, model = _run([_call("x")] + [_call("x", tool="nope")] * (MAX_SILENT_RETRIES + 1))
    assert result.partial and not result.completed
    assert result.error == "model called a tool it was not offered: nope"
    assert _roles(result) == ["user", "assistant", "tool"]
    assert result.dropped_replies == [{"call": n, "reason": "called a tool it was not offered: nope"} for n in (2, 3, 4)]
    assert all(r["messages"] == model.requests[1]["messages"] for r in model.requests[1:])  # the same request again


def test_a_session_without_a_single_kept_reply_fails_naming_the_dropped_replies():
    """Nothing but unknown-tool calls: no model turn to save, so the row fails (retried on resume)."""
    model = Scripted([_call("x", tool="nope")] * (MAX_SILENT_RETRIES + 1))
    ctx = ToolContext(env=None, settings=None, model=model, task_id="t")
    with pytest.raises(ProviderError, match=r"no usable reply.*call 1: called a tool it was not offered: nope"):
        asyncio.run(run_conversation("Prompt.", model=model, tools=[ECHO], ctx=ctx, config=LoopConfig(max_iterations=10)))
    assert all(r["messages"] == model.requests[0]["messages"] for r in model.requests)  # the same request again


def test_unknown_tool_then_a_good_call_recovers():
    result, _ = _run([_call("x", tool="nope"), _call("x"), _text("Done.")])
    assert result.completed and _roles(result) == ["user", "assistant", "tool", "assistant"]
    assert [d["call"] for d in result.dropped_replies] == [1]


def test_bad_json_is_retried_then_repaired_with_a_loop_note():
    bad = _calls(("c1", "echo", '{"text": '))
    result, model = _run([bad] * (MAX_SILENT_RETRIES + 1) + [_call("fixed"), _text("Done.")])
    assert result.completed
    assert [d["call"] for d in result.dropped_replies] == [1, 2, 3]
    note = result.messages[1]
    assert note["role"] == "user" and note["loop_note"] is True
    error = "Expecting value: line 1 column 10 (char 9)"
    assert result.dropped_replies[0]["reason"] == f"invalid JSON arguments for 'echo': {error}"
    assert note["content"] == (f"The arguments of your call to 'echo' were not valid JSON ({error}). "
                               "Call it again with a JSON object as arguments (use {} for no arguments).")
    assert result.loop_notes == [{"after_turn": 1, "note": note["content"]}]
    assert model.requests[3]["messages"][-1] == {"role": "user", "content": note["content"]}  # sent without our keys
    assert [t["from"] for t in to_sharegpt(result.messages, "Prompt.", [ECHO])] == ["system", "human", "gpt", "tool", "gpt"]


def test_bad_json_never_ends_the_session_by_itself():
    bad = _calls(("c1", "echo", "[1]"))  # valid JSON, but not an object
    result, _ = _run([bad] * 6 + [_text("Summary.")], max_iterations=6)
    assert result.hit_turn_limit and not result.partial
    assert len(result.loop_notes) == 3  # after 3 bad replies, after 6, and the summary request
    assert "arguments must be a JSON object, got list" in result.dropped_replies[0]["reason"]


def test_think_only_is_retried_then_partial_keeping_the_last_thought():
    result, _ = _run([_text(None, reasoning="hmm")] * (MAX_SILENT_RETRIES + 1))
    assert result.partial and result.error == f"the model gave no answer beyond thinking after {MAX_SILENT_RETRIES} retries"
    assert result.messages[-1] == {"role": "assistant", "content": "", "reasoning": "hmm"}
    assert [d["reason"] for d in result.dropped_replies] == ["no answer beyond thinking"] * 3


def test_inline_think_without_answer_is_think_only_not_empty():
    result, _ = _run([_text("<think>just thinking</think>"), _text("Answer.")])
    assert result.completed and result.dropped_replies == [{"call": 1, "reason": "no answer beyond thinking"}]


def test_thinking_then_an_answer_completes():
    result, _ = _run([_text("<think>plan</think>\nThe answer.", reasoning="native")])
    assert result.completed and result.messages[-1]["content"] == "<think>plan</think>\nThe answer."
    assert result.messages[-1]["reasoning"] == "native"


def test_only_empty_replies_fail_the_row():
    with pytest.raises(ProviderError, match=r"only empty replies \(3 in a row"):
        _run([_text("")] * 3)


def test_empty_replies_after_tool_calls_end_partial_without_an_empty_turn():
    result, _ = _run([_call("a"), _text(""), _text(None), _text("  ")])
    assert result.partial and not result.completed
    assert result.error == f"the model sent an empty reply after {MAX_SILENT_RETRIES} retries"
    assert _roles(result) == ["user", "assistant", "tool"]
    assert result.dropped_replies == [{"call": n, "reason": "empty reply (no content, no tool call)"} for n in (2, 3, 4)]
    assert result.api_calls == 4


def test_unclosed_scratchpad_is_retried_then_partial():
    result, _ = _run([_call("x")] + [_text("<REASONING_SCRATCHPAD>thinking forever")] * 3)
    assert result.partial and result.error == f"unclosed <REASONING_SCRATCHPAD> after {MAX_SILENT_RETRIES} retries"
    assert _roles(result) == ["user", "assistant", "tool"]
    assert [d["reason"] for d in result.dropped_replies] == ["unclosed <REASONING_SCRATCHPAD>"] * 3
    with pytest.raises(ProviderError, match="no usable reply.*call 3: unclosed <REASONING_SCRATCHPAD>"):
        _run([_text("<REASONING_SCRATCHPAD>thinking forever")] * 3)  # no model turn at all: the row fails


def test_unclosed_scratchpad_wins_over_tool_calls():
    reply = _call("x")
    reply.content = "<REASONING_SCRATCHPAD>half"
    result, _ = _run([reply, _text("Done.")])
    assert result.completed and _roles(result) == ["user", "assistant"]
    assert result.dropped_replies == [{"call": 1, "reason": "unclosed <REASONING_SCRATCHPAD>"}]


def test_truncated_first_reply_fails_the_row():
    with pytest.raises(ProviderError, match="cut at the output length limit") as caught:
        _run([_text("Half an ans", finish_reason="length")])
    assert caught.value.error_class == "truncated"


def test_truncated_later_reply_ends_partial_with_what_was_done():
    truncated = _call("x")
    truncated.finish_reason = "length"  # even with tool calls in it: they may be cut
    result, _ = _run([_call("a"), truncated])
    assert result.partial and result.error == "response truncated at the output length limit"
    assert _roles(result) == ["user", "assistant", "tool"]
    assert result.dropped_replies == [{"call": 2, "reason": "cut at the output length limit"}]


def test_the_retry_budget_is_per_kind_of_bad_reply():
    script = [_call("x", tool="nope"), _call("x", tool="nope"), _text(""), _text(""),
              _text(None, reasoning="r"), _text(None, reasoning="r"), _text("Done.")]
    result, _ = _run(script)
    assert result.completed and len(result.dropped_replies) == 6


def test_a_good_tool_call_renews_the_budget_for_bad_calls_only():
    nope = _call("x", tool="nope")
    result, _ = _run([nope, nope, _call("a"), nope, nope, _text("Done.")])
    assert result.completed
    empty = _text("")
    result, _ = _run([empty, empty, _call("a"), empty])
    assert result.partial and "empty reply" in result.error


# --- the turn limit ----------------------------------------------------------------------------


def test_turn_limit_asks_for_a_summary_with_tools_kept_and_tool_choice_none():
    result, model = _run([_call("a"), _call("b", "c2"), _text("Summary.")], max_iterations=2)
    assert result.hit_turn_limit and not result.completed and not result.partial
    assert result.api_calls == 2 and len(model.requests) == 3  # the summary call is not counted
    summary_request = model.requests[-1]
    assert summary_request["tool_choice"] == "none" and summary_request["tools"] == [ECHO.openai_schema()]
    assert summary_request["messages"][-1] == {"role": "user", "content": SUMMARY_REQUEST}
    assert all(r["tool_choice"] is None for r in model.requests[:-1])
    assert result.messages[-1] == {"role": "assistant", "content": "Summary.", "summary": True}
    assert result.loop_notes == [{"after_turn": 5, "note": SUMMARY_REQUEST}]


def test_empty_summary_is_recorded_not_fabricated():
    result, _ = _run([_call("a"), _text("")], max_iterations=1)
    assert result.hit_turn_limit
    assert [m["role"] for m in result.messages if not m.get("loop_note")] == ["user", "assistant", "tool"]
    assert result.dropped_replies == [{"call": 2, "reason": "turn-limit summary: no answer in the reply"}]


def test_summary_keeps_its_text_and_drops_any_tool_call():
    reply = _call("again")
    reply.content = "<think>wrap up</think>Here is my summary."
    result, _ = _run([_call("a"), reply], max_iterations=1)
    assert result.messages[-1]["content"] == "Here is my summary."
    assert "tool_calls" not in result.messages[-1] and result.messages[-1]["summary"] is True
    turns = to_sharegpt(result.messages, "Prompt.", [ECHO])
    assert [t["from"] for t in turns] == ["system", "human", "gpt", "tool", "gpt"]
    assert result.loop_notes[0]["after_turn"] == 3  # after the tool turn


# --- what is sent and what is kept --------------------------------------------------------------


def test_system_prompt_ephemeral_prompt_and_prefill_are_sent_not_kept():
    prefill = [{"role": "user", "content": "Example?"}, {"role": "assistant", "content": "Example."}]
    result, model = _run([_text("Done.")], ephemeral_system_prompt="Be brief.", prefill_messages=prefill)
    sent = model.requests[0]["messages"]
    assert sent[0]["role"] == "system" and sent[0]["content"].endswith("\n\nBe brief.")
    assert sent[1:] == [*prefill, {"role": "user", "content": "Prompt."}]
    assert result.messages == [{"role": "user", "content": "Prompt."}, {"role": "assistant", "content": "Done."}]


def test_no_tools_offered_sends_no_tools():
    result, model = _run([_text("Done.")], tools=())
    assert model.requests[0]["tools"] is None and result.completed


def test_conversation_shape_is_system_human_then_gpt_and_tool_turns_only():
    bad = _calls(("c1", "echo", "{"))
    script = [_call("a"), bad, bad, bad, _text(""), _call("b", "c2"), _text(None, reasoning="r"), _call("c", "c3")]
    result, _ = _run(script + [_text("Summary.")], max_iterations=len(script))
    turns = [t["from"] for t in to_sharegpt(result.messages, "Prompt.", [ECHO])]
    assert turns[:2] == ["system", "human"] and set(turns[2:]) == {"gpt", "tool"}
    assert turns == ["system", "human", "gpt", "tool", "gpt", "tool", "gpt", "tool", "gpt"]
    assert len(result.loop_notes) == 2 and [d["call"] for d in result.dropped_replies] == [2, 3, 4, 5, 7]


def test_conversation_length_matches_the_saved_turns():
    result, _ = _run([_call("a", "c1"), _call("b", "c2"), _text("Done.")])
    messages = result.messages
    for end in range(1, len(messages) + 1):
        assert conversation_length(messages[:end]) == len(to_sharegpt(messages[:end], "Prompt.", [ECHO]))


@pytest.mark.parametrize("raw", ['{"t": NaN}', '{"t": [1, {"u": -Infinity}]}', '{"t": 1e400}', '{"t": -1e999}'])
def test_arguments_holding_no_finite_number_are_bad_json(raw):
    """Python's json reads NaN, Infinity and a number too large for a float (as inf); none is JSON
    a trajectory may carry, or a number a tool may be given."""
    from agent.loop import _parse_arguments

    value, error = _parse_arguments(raw)
    assert value is None and "not a JSON" in error
