"""Tests for the local OpenAI-compatible model server, driven by the real openai client."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from tests.helpers.model_server import ModelServer, Reply, chat_completion, format_duration, parse_directives

ROOT = Path(__file__).resolve().parents[2]


def tool_spec(*names: str) -> list[dict]:
    return [
        {"type": "function", "function": {"name": n, "description": n, "parameters": {"type": "object"}}}
        for n in names
    ]


TOOLS = tool_spec("web_search", "terminal", "read_file")


@pytest.fixture
def server():
    with ModelServer() as s:
        yield s


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)


def chat(client, prompt: str, history: list[dict] | None = None, tools=TOOLS, **kw):
    messages = [{"role": "user", "content": prompt}] + (history or [])
    if tools is not None:
        kw["tools"] = tools
    return client.chat.completions.create(model="test-model", messages=messages, **kw)


def as_history(message) -> dict:
    """The assistant message in request form, as an agent would append it."""
    return message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"})


def run_agent(client, prompt: str, tools=TOOLS, max_turns: int = 10) -> tuple[list[dict], object]:
    """A minimal agent loop: answers every tool call with 'result of <name>'."""
    history: list[dict] = []
    for _ in range(max_turns):
        response = chat(client, prompt, history, tools=tools)
        message = response.choices[0].message
        history.append(as_history(message))
        if not message.tool_calls:
            return history, response
        for call in message.tool_calls:
            history.append({"role": "tool", "tool_call_id": call.id, "content": f"result of {call.function.name}"})
    raise AssertionError("agent loop did not terminate")


# --------------------------------------------------------------------------- #
# Basics
# --------------------------------------------------------------------------- #


def test_tool_call_then_final_answer_with_reasoning_and_usage(server, client):
    prompt = 'Look it up.\n@tool web_search {"query": "python"}'
    first = chat(client, prompt)
    assert first.object == "chat.completion"
    assert first.model == "test-model"
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.function.name == "web_search"
    assert json.loads(call.function.arguments) == {"query": "python"}
    assert call.id.startswith("call_")
    assert choice.message.model_extra["reasoning"] == "Reasoning about turn 0."
    assert first.usage.prompt_tokens == len(prompt) // 4
    assert first.usage.completion_tokens == len(call.function.arguments) // 4 + 1
    assert first.usage.total_tokens == first.usage.prompt_tokens + first.usage.completion_tokens
    assert first.usage.completion_tokens_details.reasoning_tokens == len("Reasoning about turn 0.") // 4
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert first.usage.model_extra["cost"] == 0.0001

    history = [as_history(choice.message),
               {"role": "tool", "tool_call_id": call.id, "content": "x" * 300}]
    second = chat(client, prompt, history)
    assert second.choices[0].finish_reason == "stop"
    assert second.choices[0].message.content == "Final answer: " + "x" * 200
    assert second.choices[0].message.tool_calls is None
    assert second.choices[0].message.model_extra["reasoning"] == "Reasoning about turn 1."

    recorded = server.requests_for("Look it up.")
    assert len(recorded) == 2 and server.count() == 2
    assert recorded[0].path == "/v1/chat/completions"
    assert recorded[0].body["model"] == "test-model"
    assert recorded[0].headers["authorization"] == "Bearer x"
    assert recorded[1].body["messages"][-1]["role"] == "tool"


def test_no_tool_directive_answers_immediately(client):
    response = chat(client, "Just say hi.")
    assert response.choices[0].message.content == "Final answer: no tools used"
    assert response.choices[0].finish_reason == "stop"


def test_tool_calls_follow_the_script_and_skip_unoffered_tools(server, client):
    prompt = "Script.\n@tool terminal {\"command\": \"ls\"}\n@tool image_generate {}\n@tool read_file {\"path\": \"a\"}"
    history, final = run_agent(client, prompt)
    called = [c["function"]["name"] for m in history if m["role"] == "assistant" for c in m.get("tool_calls", [])]
    assert called == ["terminal", "read_file"]  # image_generate is not in the tools list
    assert final.choices[0].message.content == "Final answer: result of read_file"
    ids = [c["id"] for m in history if m["role"] == "assistant" for c in m.get("tool_calls", [])]
    assert len(set(ids)) == len(ids)
    assert len(server.requests_for("Script.")) == 3


def test_without_tools_in_request_goes_straight_to_final(client):
    response = chat(client, "No tools.\n@tool terminal {}", tools=None)
    assert response.choices[0].message.content == "Final answer: no tools used"


def test_parallel_tool_calls(client):
    prompt = "Both.\n@parallel\n@tool web_search {\"query\": \"a\"}\n@tool terminal {\"command\": \"b\"}"
    history, final = run_agent(client, prompt)
    assert [c["function"]["name"] for c in history[0]["tool_calls"]] == ["web_search", "terminal"]
    assert len(history) == 4  # assistant(2 calls), tool, tool, final
    assert final.choices[0].message.content == "Final answer: result of terminal"


@pytest.mark.parametrize(
    "mode, check",
    [
        ("none", lambda m, extra: "reasoning" not in extra and "reasoning_content" not in extra),
        ("content", lambda m, extra: extra["reasoning_content"] == "Reasoning about turn 0."
            and "reasoning" not in extra),
        ("details", lambda m, extra: extra["reasoning_details"]
            == [{"type": "reasoning.summary", "summary": "Reasoning about turn 0."}]),
        ("scratchpad", lambda m, extra: not extra and m.content
            == "<REASONING_SCRATCHPAD>Reasoning about turn 0.</REASONING_SCRATCHPAD>\nFinal answer: no tools used"),
    ],
)
def test_reasoning_modes(client, mode, check):
    response = chat(client, f"Reason.\n@reasoning {mode}")
    message = response.choices[0].message
    assert check(message, message.model_extra or {})
    if mode == "none":
        assert response.usage.completion_tokens_details.reasoning_tokens == 0


# --------------------------------------------------------------------------- #
# Faults
# --------------------------------------------------------------------------- #


def test_rate_limit_with_retry_after(client):
    prompt = "Limited.\n@fail 429 1 retry_after=2 reset=90 body=slow down please"
    with pytest.raises(openai.RateLimitError) as info:
        chat(client, prompt)
    err = info.value
    assert err.status_code == 429
    assert err.response.headers["retry-after"] == "2"
    assert err.response.headers["x-ratelimit-reset-requests"] == "1m30s"
    assert err.body["message"] == "slow down please"
    assert err.body["code"] == 429
    assert chat(client, prompt).choices[0].message.content == "Final answer: no tools used"


def test_fail_sequence_then_success(server, client):
    prompt = "Flaky.\n@fail 500 2\n@fail 429 1\n@fail 503 1 body=overloaded"
    errors = []
    for _ in range(4):
        with pytest.raises(openai.APIStatusError) as info:
            chat(client, prompt)
        errors.append(info.value)
    assert [e.status_code for e in errors] == [500, 500, 429, 503]
    assert isinstance(errors[0], openai.InternalServerError)
    assert isinstance(errors[2], openai.RateLimitError)
    assert "retry-after" not in errors[2].response.headers
    assert errors[3].body["message"] == "overloaded"
    assert chat(client, prompt).choices[0].finish_reason == "stop"
    assert len(server.requests_for("Flaky.")) == 5


def test_fault_counts_are_per_conversation(client):
    with pytest.raises(openai.RateLimitError):
        chat(client, "A\n@fail 429 1")
    with pytest.raises(openai.RateLimitError):
        chat(client, "B\n@fail 429 1")  # a different prompt has its own counter
    chat(client, "A\n@fail 429 1")


def test_malformed_body_then_success(server, client):
    prompt = "Garbled.\n@malformed 2"
    for _ in range(2):
        with pytest.raises(ValueError):  # json.JSONDecodeError from the SDK
            chat(client, prompt)
    raw = urllib.request.urlopen(urllib.request.Request(
        f"{server.base_url}/chat/completions", method="POST",
        data=json.dumps({"model": "m", "messages": [{"role": "user", "content": "Raw.\n@malformed 1"}]}).encode(),
        headers={"Content-Type": "application/json"}))
    assert raw.status == 200
    with pytest.raises(ValueError):
        json.loads(raw.read())
    assert chat(client, prompt).choices[0].message.content == "Final answer: no tools used"


def test_empty_choices(client):
    prompt = "Empty.\n@empty_choices 1"
    assert chat(client, prompt).choices == []
    assert len(chat(client, prompt).choices) == 1


def test_hang_times_out_and_server_stops_fast():
    server = ModelServer().start()
    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=0.5)
    started = time.monotonic()
    with pytest.raises(openai.APITimeoutError):
        chat(client, "Hang.\n@hang")
    assert time.monotonic() - started < 3
    stopping = time.monotonic()
    server.stop()
    assert time.monotonic() - stopping < 1.0


def test_stop_releases_a_hung_request_and_keepalive_connections():
    server = ModelServer().start()
    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=10)
    chat(client, "warm the keep-alive pool")
    with ThreadPoolExecutor(1) as pool:
        hung = pool.submit(chat, client, "Hang forever.\n@hang")
        time.sleep(0.2)
        stopping = time.monotonic()
        server.stop()
        with pytest.raises(openai.APIConnectionError):
            hung.result(timeout=5)
        assert time.monotonic() - stopping < 1.0


def test_hang_with_count_then_answers():
    with ModelServer() as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=0.3)
        with pytest.raises(openai.APITimeoutError):
            chat(client, "Hang once.\n@hang 1")
        assert chat(client, "Hang once.\n@hang 1").choices[0].finish_reason == "stop"


def test_latency_directive(client):
    started = time.monotonic()
    chat(client, "Slow.\n@latency 0.3")
    assert 0.3 <= time.monotonic() - started < 2


# --------------------------------------------------------------------------- #
# Misbehaving model replies
# --------------------------------------------------------------------------- #


def test_finish_length_first(client):
    prompt = "Long.\n@finish length\n@tool terminal {}"
    first = chat(client, prompt)
    assert first.choices[0].finish_reason == "length"
    assert first.choices[0].message.tool_calls is None
    assert first.choices[0].message.content
    second = chat(client, prompt)  # a retry proceeds with the script
    assert second.choices[0].message.tool_calls[0].function.name == "terminal"


def test_unknown_tool_then_script(client):
    history, final = run_agent(client, "Unknown.\n@unknown_tool 2\n@tool terminal {}")
    called = [c["function"]["name"] for m in history if m["role"] == "assistant" for c in m.get("tool_calls", [])]
    assert called == ["no_such_tool", "no_such_tool", "terminal"]
    assert final.choices[0].message.content == "Final answer: result of terminal"


def test_unknown_tool_retried_without_history(client):
    """An agent that re-asks without recording the bad turn still makes progress."""
    prompt = "Unknown retry.\n@unknown_tool 1\n@tool terminal {}"
    assert chat(client, prompt).choices[0].message.tool_calls[0].function.name == "no_such_tool"
    assert chat(client, prompt).choices[0].message.tool_calls[0].function.name == "terminal"


def test_bad_args_then_good_args(client):
    history, final = run_agent(client, "Bad args.\n@bad_args 1\n@tool terminal {\"command\": \"ls\"}")
    calls = [c for m in history if m["role"] == "assistant" for c in m.get("tool_calls", [])]
    assert [c["function"]["name"] for c in calls] == ["terminal", "terminal"]
    assert calls[0]["function"]["arguments"] == '{"broken'
    assert json.loads(calls[1]["function"]["arguments"]) == {"command": "ls"}
    assert final.choices[0].message.content == "Final answer: result of terminal"


def test_think_only_final_answers(client):
    prompt = "Think.\n@think_only 2"
    contents = [chat(client, prompt).choices[0].message.content for _ in range(3)]
    assert contents == ["<think>pondering</think>", "<think>pondering</think>", "Final answer: no tools used"]


# --------------------------------------------------------------------------- #
# Other endpoints, custom policy, streaming
# --------------------------------------------------------------------------- #


def test_models_images_and_404(server, client):
    assert [m.id for m in client.models.list()] == ["mock-model"]

    image = client.images.generate(model="img", prompt="a cat")
    url = image.data[0].url
    assert url.startswith(f"http://127.0.0.1:{server.port}/img/") and url.endswith(".png")
    png = urllib.request.urlopen(url)
    assert png.headers["Content-Type"] == "image/png"
    assert png.read().startswith(b"\x89PNG\r\n\x1a\n")
    assert server.count("/v1/images/generations") == 1
    assert server.requests_for("a cat") == []  # only chat requests match prompts
    assert [r.body for r in server.requests if r.path == "/v1/images/generations"] == [
        {"model": "img", "prompt": "a cat"}
    ]

    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(f"{server.base_url}/nope")
    assert info.value.code == 404
    assert "error" in json.loads(info.value.read())


def test_custom_policy_and_fallback():
    def policy(body, state):
        if "custom" in state.key:
            return Reply(body=chat_completion(body, f"custom #{state.requests}"))
        return None  # fall back to the scripted policy

    with ModelServer(policy=policy) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
        assert chat(client, "custom").choices[0].message.content == "custom #1"
        assert chat(client, "custom").choices[0].message.content == "custom #2"
        assert chat(client, "scripted").choices[0].message.content == "Final answer: no tools used"


def test_policy_error_is_a_500():
    with ModelServer(policy=lambda body, state: 1 / 0) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
        with pytest.raises(openai.InternalServerError, match="ZeroDivisionError"):
            chat(client, "boom")


def test_record_false():
    with ModelServer(record=False) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
        chat(client, "not recorded")
        assert server.requests == [] and server.count() == 0


def test_streaming(client):
    stream = chat(client, "Stream.\n@tool terminal {}", stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    delta = chunks[0].choices[0].delta
    assert delta.tool_calls[0].function.name == "terminal"
    assert chunks[1].choices[0].finish_reason == "tool_calls"
    assert chunks[-1].usage.total_tokens > 0


def test_directive_parsing_and_duration_format():
    d = parse_directives("text\n@fail 429 2 retry_after=1 reset=360\n@malformed\n@tool x {\"a\":1}\n@reasoning details")
    assert [(f.kind, f.times) for f in d.faults] == [("fail", 2), ("malformed", 1)]
    assert d.faults[0].reset == "6m0s" and d.faults[0].retry_after == "1"
    assert d.tools == [("x", '{"a": 1}')] and d.reasoning == "details"
    assert [format_duration(s) for s in (0.02, 1, 1.5, 90, 3725)] == ["20ms", "1s", "1.5s", "1m30s", "1h2m5s"]


# --------------------------------------------------------------------------- #
# Concurrency and subprocess mode
# --------------------------------------------------------------------------- #


def test_64_concurrent_requests_overlap():
    with ModelServer(latency=0.3, record=False) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
        started = time.monotonic()
        with ThreadPoolExecutor(64) as pool:
            results = list(pool.map(lambda i: chat(client, f"prompt {i}\n@tool terminal {{}}"), range(64)))
        elapsed = time.monotonic() - started
    assert all(r.choices[0].finish_reason == "tool_calls" for r in results)
    assert elapsed < 3, f"64 requests at 0.3 s latency took {elapsed:.2f} s"


def test_cli_subprocess(tmp_path):
    port_file = tmp_path / "port"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.helpers.model_server", "--port", "0", "--latency", "0.05",
         "--port-file", str(port_file)],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        deadline = time.monotonic() + 10
        while not port_file.exists():
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline, "server did not write its port file"
            time.sleep(0.02)
        port = int(port_file.read_text())
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=5)
        assert [m.id for m in client.models.list()] == ["mock-model"]
        assert chat(client, "via subprocess\n@tool terminal {}").choices[0].finish_reason == "tool_calls"
    finally:
        proc.terminate()
        assert proc.wait(timeout=5) == 0


# --------------------------------------------------------------------------- #
# Answers per conversation, and the judge
# --------------------------------------------------------------------------- #


def test_each_new_conversation_of_a_prompt_gets_the_next_answer(client):
    prompt = '@tool terminal {"command": "ls"}\n@answers first | second\nSample me.'
    interleaved = []
    for _ in range(2):  # two conversations started before either finishes
        history: list[dict] = []
        first = chat(client, prompt, history).choices[0].message
        history.append(as_history(first))
        history.append({"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "files"})
        interleaved.append(history)
    answers = [chat(client, prompt, history).choices[0].message.content for history in interleaved]
    assert answers == ["first", "second"]
    third, _ = run_agent(client, prompt)
    assert third[-1]["content"] == "first"  # cycling
    assert chat(client, "@answer Just this.\nQ", tools=None).choices[0].message.content == "Just this."


def test_a_judge_model_grades(client):
    def judge(text: str) -> str:
        return client.chat.completions.create(model="judge-x", messages=[{"role": "user", "content": text}]).choices[0].message.content

    assert judge("[Task]\nQ\n[Answer to grade]\nA").endswith("GRADE: C")
    assert judge("[Task]\n@grade P\nQ\n[Answer to grade]\nA").endswith("GRADE: P")
    assert judge("[Task]\n@grade_if paris\nQ\n[Answer to grade]\nIt is Paris.").endswith("GRADE: C")
    assert judge("[Task]\n@grade_if paris\nQ?\n[Answer to grade]\nLyon.").endswith("GRADE: I")
    bad = "[Task]\n@grade_bad 1\nQ\n[Answer to grade]\nA"
    assert "GRADE" not in judge(bad) and judge(bad).endswith("GRADE: C")
