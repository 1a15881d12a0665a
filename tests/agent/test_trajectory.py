"""Unit tests of the ShareGPT conversion and the per-row statistics, one behaviour per test.

Conversations come from the real loop driven by a scripted in-process model where the loop makes
them, and are written out by hand only for what the loop never produces itself.
"""

from __future__ import annotations

import json

from agent.trajectory import (
    conversation_length,
    extract_reasoning_stats,
    extract_tool_stats,
    is_tool_failure,
    normalise_tool_stats,
    system_turn,
    to_sharegpt,
)
from tests.agent.test_loop import ECHO, UPPER, _call, _calls, _run, _text
from tools.registry import ALL_TOOL_NAMES


def _turns(result, prompt: str = "Prompt.", tools=(ECHO,)) -> list[dict]:
    return to_sharegpt(result.messages, prompt, list(tools))


def _tool_responses(turn: dict) -> list[dict]:
    blocks = turn["value"].split("<tool_response>\n")[1:]
    return [json.loads(block.split("\n</tool_response>")[0]) for block in blocks]


def test_system_turn_lists_the_offered_tools_as_json():
    text = system_turn([ECHO, UPPER])
    listing = json.loads(text.split("<tools>\n")[1].split("\n</tools>")[0])
    assert listing == [
        {"name": "echo", "description": "The echo tool.", "parameters": ECHO.parameters, "required": []},
        {"name": "upper", "description": "The upper tool.", "parameters": UPPER.parameters, "required": []},
    ]
    assert "<tool_call>" in text and "FunctionCall" in text


def test_human_turn_is_the_prompt_exactly_as_given():
    result, _ = _run([_text("Done.")])
    turns = _turns(result, prompt="  Prompt.\n")
    assert turns[1] == {"from": "human", "value": "  Prompt.\n"}


def test_answer_without_reasoning_gets_an_empty_think_block():
    result, _ = _run([_text("Done.")])
    assert _turns(result)[2] == {"from": "gpt", "value": "<think>\n</think>\nDone."}


def test_native_reasoning_becomes_a_think_block():
    result, _ = _run([_text("Done.", reasoning="Let me see.")])
    assert _turns(result)[2]["value"] == "<think>\nLet me see.\n</think>\nDone."


def test_inline_think_is_kept_as_it_is():
    result, _ = _run([_text("<think>plan</think>\nDone.")])
    assert _turns(result)[2]["value"] == "<think>plan</think>\nDone."


def test_a_closed_scratchpad_becomes_a_think_block():
    result, _ = _run([_text("<REASONING_SCRATCHPAD>plan</REASONING_SCRATCHPAD>\nDone.")])
    assert _turns(result)[2]["value"] == "<think>plan</think>\nDone."


def test_tool_call_turn_has_one_block_per_call_with_parsed_arguments():
    result, _ = _run([_calls(("a", "echo", '{"text": "one"}'), ("b", "upper", '{"text": "two"}'), content="Two calls."),
                      _text("Done.")], tools=(ECHO, UPPER))
    value = _turns(result, tools=(ECHO, UPPER))[2]["value"]
    assert value == (
        "<think>\n</think>\nTwo calls.\n"
        '<tool_call>\n{"name": "echo", "arguments": {"text": "one"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "upper", "arguments": {"text": "two"}}\n</tool_call>'
    )


def test_parallel_results_are_one_tool_turn_in_call_order():
    result, _ = _run([_calls(("a", "echo", '{"text": "one"}'), ("b", "upper", '{"text": "two"}')), _text("Done.")],
                     tools=(ECHO, UPPER))
    turns = _turns(result, tools=(ECHO, UPPER))
    assert [t["from"] for t in turns] == ["system", "human", "gpt", "tool", "gpt"]
    assert _tool_responses(turns[3]) == [
        {"tool_call_id": "a", "name": "echo", "content": {"output": "one"}},
        {"tool_call_id": "b", "name": "upper", "content": {"output": "TWO"}},
    ]


def test_tool_response_name_is_found_by_call_id_not_position():
    messages = [
        {"role": "user", "content": "Prompt."},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "echo", "arguments": "{}"}},
            {"id": "b", "type": "function", "function": {"name": "upper", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "b", "name": "wrong", "content": "plain text"},
        {"role": "tool", "tool_call_id": "a", "name": "wrong", "content": "[1, 2]"},
    ]
    responses = _tool_responses(to_sharegpt(messages, "Prompt.", [ECHO, UPPER])[3])
    assert responses == [{"tool_call_id": "b", "name": "upper", "content": "plain text"},
                         {"tool_call_id": "a", "name": "echo", "content": [1, 2]}]


def test_loop_notes_are_not_turns():
    bad = _calls(("c1", "echo", "{"))
    result, _ = _run([bad, bad, bad, _call("a"), _text("Summary.")], max_iterations=4)
    assert len(result.loop_notes) == 2  # the JSON repair note and the summary request
    turns = _turns(result)
    assert [t["from"] for t in turns] == ["system", "human", "gpt", "tool", "gpt"]
    assert not any("not valid JSON" in t["value"] or "tool-calling turn" in t["value"] for t in turns)
    assert len(turns) == conversation_length(result.messages)


def test_the_last_thought_of_a_think_only_ending_is_a_gpt_turn():
    result, _ = _run([_text(None, reasoning="hmm")] * 3)
    assert _turns(result)[-1] == {"from": "gpt", "value": "<think>\nhmm\n</think>"}


def test_tool_stats_count_calls_and_results_by_id():
    broken = {"role": "tool", "tool_call_id": "b", "content": '{"error": "no such file"}'}
    messages = [
        {"role": "user", "content": "Prompt."},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "terminal", "arguments": "{}"}},
            {"id": "b", "type": "function", "function": {"name": "read_file", "arguments": "{}"}}]},
        broken,
        {"role": "tool", "tool_call_id": "a", "content": '{"output": "", "exit_code": 1}'},  # non-zero exit: a result
    ]
    stats = extract_tool_stats(messages)
    assert stats == {"terminal": {"count": 1, "success": 1, "failure": 0},
                     "read_file": {"count": 1, "success": 0, "failure": 1}}
    tool_stats, errors = normalise_tool_stats({**stats, "zzz_unknown": {"count": 1, "success": 1, "failure": 0}})
    assert list(tool_stats) == [*ALL_TOOL_NAMES, "zzz_unknown"] and list(errors) == list(tool_stats)
    assert errors["read_file"] == 1 and tool_stats["patch"] == {"count": 0, "success": 0, "failure": 0}


def test_what_counts_as_a_tool_failure():
    assert is_tool_failure('{"error": "x"}') and is_tool_failure('{"success": false}')
    assert is_tool_failure('{"content": {"error": "x"}}') and is_tool_failure(None)
    assert is_tool_failure("Error: boom") and is_tool_failure("")
    assert not is_tool_failure('{"output": "ok", "exit_code": 2}') and not is_tool_failure("no error here")
    assert not is_tool_failure('{"error": null}')


def test_reasoning_stats_leave_out_the_summary():
    result, _ = _run([_call("a"), _text("Summary.", reasoning="why")], max_iterations=1)
    assert extract_reasoning_stats(result.messages) == {
        "total_assistant_turns": 1, "turns_with_reasoning": 0, "turns_without_reasoning": 1}
    result, _ = _run([_text("<REASONING_SCRATCHPAD>p</REASONING_SCRATCHPAD> Done.")])
    assert extract_reasoning_stats(result.messages)["turns_with_reasoning"] == 1
