"""The real CLI against a real model (SmolLM2-135M) behind a real server (llama-cpp-python).

The server is started by these tests on 127.0.0.1 (tests/helpers/real_model.py); `.ci/install-real-model`
installs it. A 135M model answers badly, so nothing here depends on the quality of its answers,
only on what a model of any quality gives: tool calls arrive and run, their results go back under
the call's id, every row ends in exactly one outcome, nothing crashes, and the dataset loads.
One run of the CLI is shared by the tests of this module, to keep the suite's wall time small.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import read_jsonl, run_cli, write_jsonl
from tests.helpers.real_model import MODEL_ALIAS, LlamaServer, RecordingProxy

# Each asks for one terminal command, in words a small model maps to a `terminal` call.
# No apostrophes: the server's template HTML-escapes the prompt.
TERMINAL_PROMPTS = [
    "Use the terminal tool to run the command `echo hello` and tell me what it printed.",
    "Use the terminal tool to run the command `ls -la` and tell me what files are there.",
    "Use the terminal tool to run the command `date` and tell me the current date.",
    "Use the terminal tool to run the command `uname -a` and tell me which system this is.",
]


@pytest.fixture(scope="session")
def real_model_server(tmp_path_factory):
    """The llama.cpp server with SmolLM2 on a free loopback port, for the whole session."""
    server = LlamaServer(tmp_path_factory.mktemp("llama-server") / "server.log")
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def terminal_run(real_model_server, tmp_path_factory):
    """One run of the CLI over TERMINAL_PROMPTS through a proxy that records the server's replies."""
    proxy = RecordingProxy(real_model_server.base_url)
    proxy.start()
    work = tmp_path_factory.mktemp("real-run")
    write_jsonl(work / "prompts.jsonl", [{"prompt": p, "id": f"terminal-{i}"} for i, p in enumerate(TERMINAL_PROMPTS)])
    try:
        result = run_cli(
            [
                "--dataset_file=prompts.jsonl", "--batch_size=2", "--run_name=real",
                f"--base_url={proxy.base_url}", f"--model={MODEL_ALIAS}",
                "--distribution=terminal_only",  # terminal, process and the file tools
                "--keep_no_reasoning",  # SmolLM2 does not reason: keep its rows instead of discarding them
                # Two tool-calling turns: a reply the loop drops (arguments that are not JSON, about
                # one row in four) leaves the row a second try; then the summary request.
                "--max_turns=2",
                # The server runs one request at a time; one session at a time keeps its prompt
                # cache warm (consecutive requests share the long tool listing).
                "--num_workers=1", "--num_processes=1", "--seed=1",
                "--command_timeout=20", "--request_timeout=300",
            ],  # fmt: skip
            cwd=work,
            timeout=1200,
        )
    finally:
        proxy.stop()
    return {"result": result, "run_dir": work / "data" / "real", "exchanges": proxy.chat_exchanges()}


def _describe(run: dict) -> str:
    result = run["result"]
    return f"exit {result.returncode}\nstdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-3000:]}"


def _committed_rows(run_dir: Path) -> list[dict]:
    return [row for shard in sorted(run_dir.glob("batch_*.jsonl")) for row in read_jsonl(shard)]


def _tool_responses(row: dict) -> list[dict]:
    """The `<tool_response>` bodies of a trajectory's tool turns, parsed."""
    bodies = []
    for turn in row["conversations"]:
        if turn["from"] == "tool":
            for block in turn["value"].split("<tool_response>\n")[1:]:
                bodies.append(json.loads(block.split("\n</tool_response>")[0]))
    return bodies


def _server_tool_calls(exchanges: list[dict]) -> dict[str, dict]:
    """Every tool call the server sent, by id."""
    calls = {}
    for exchange in exchanges:
        reply = exchange["reply"]
        if isinstance(reply, dict):
            for choice in reply.get("choices") or []:
                for call in (choice.get("message") or {}).get("tool_calls") or []:
                    calls[call["id"]] = call
    return calls


def test_the_run_ends_cleanly_with_every_row_accounted_for(terminal_run):
    result, run_dir = terminal_run["result"], terminal_run["run_dir"]
    # 0: every row done; 2: some rows failed (a bad reply of the model): both are honest ends.
    assert result.returncode in (0, 2), _describe(terminal_run)
    assert "Traceback" not in result.stdout + result.stderr, _describe(terminal_run)

    trajectories = read_jsonl(run_dir / "trajectories.jsonl")
    committed = _committed_rows(run_dir)
    failed = [row for row in committed if row.get("failed")]
    discarded = [row for row in committed if row.get("discarded")]
    assert len(trajectories) + len(failed) + len(discarded) == len(TERMINAL_PROMPTS), _describe(terminal_run)
    assert sorted(row["metadata"]["id"] for row in committed) == [f"terminal-{i}" for i in range(4)]
    for row in failed:
        assert row["error_class"] and row["error"], row

    stats = json.loads((run_dir / "statistics.json").read_text())
    outcomes = stats["outcomes"]
    assert stats["total_prompts"] == len(TERMINAL_PROMPTS)
    assert (outcomes["ok"], outcomes["failed"], outcomes["discarded"], outcomes["not_run"]) == (
        len(trajectories),
        len(failed),
        len(discarded),
        0,
    )
    assert result.returncode == (0 if not failed else 2)


def test_every_request_that_offers_tools_sets_tool_choice(terminal_run):
    """The server offers tools to the model only when the request has tool_choice."""
    requests = [e["request"] for e in terminal_run["exchanges"]]
    with_tools = [r for r in requests if r.get("tools")]
    assert with_tools, "no request offered tools"
    assert all(r.get("tool_choice") for r in with_tools), [r.get("tool_choice") for r in with_tools]


def test_terminal_prompts_get_real_tool_calls_answered_by_id(terminal_run):
    """The bar: at least 3 of 4 prompts asking for a terminal command get a real tool call,
    executed, whose result goes back to the model and into the dataset under the call's id."""
    run_dir, exchanges = terminal_run["run_dir"], terminal_run["exchanges"]
    server_calls = _server_tool_calls(exchanges)
    # What the runner sent back: tool messages answering a call, in the next requests.
    answered = {
        message["tool_call_id"]: message
        for exchange in exchanges
        for message in exchange["request"]["messages"]
        if message.get("role") == "tool"
    }
    rows_with_answered_calls = 0
    for row in read_jsonl(run_dir / "trajectories.jsonl"):
        responses = _tool_responses(row)
        for response in responses:
            call = server_calls.get(response["tool_call_id"])
            assert call is not None, f"tool_call_id {response['tool_call_id']!r} is not an id the server sent"
            assert response["name"] == call["function"]["name"]
        called = sum(v["count"] for v in row["tool_stats"].values())
        assert sum(v["success"] + v["failure"] for v in row["tool_stats"].values()) == called, row["tool_stats"]
        if any(r["name"] == "terminal" and r["content"] for r in responses):
            rows_with_answered_calls += 1
    for call_id, message in answered.items():
        assert call_id in server_calls, f"a tool message answered {call_id!r}, which the server never sent"
        assert message["content"], message
    assert rows_with_answered_calls >= 3, (
        f"{rows_with_answered_calls} of {len(TERMINAL_PROMPTS)} rows got a terminal call with its result\n"
        + _describe(terminal_run)
    )


def test_the_dataset_loads_in_datasets(terminal_run, tmp_path):
    import datasets

    path = terminal_run["run_dir"] / "trajectories.jsonl"
    loaded = datasets.load_dataset("json", data_files=str(path), split="train", cache_dir=str(tmp_path / "hf"))
    assert loaded.num_rows == len(read_jsonl(path))
    assert {"conversations", "metadata", "tool_stats"} <= set(loaded.column_names)



def _terminal_trajectory(work: Path) -> dict:
    """A trajectory as the runner writes it, whose tool responses hold what real commands printed
    (a directory listing, a file), so the summariser reads real tool output."""
    import subprocess

    (work / "notes.txt").write_text("Deploy on Friday. The staging server is slow.\n")
    # 1,200 characters: with the prompt around it the request stays well inside the server's
    # 2,048-token context, leaving room for the whole summary (2,400 left 185 tokens on a machine
    # with a long /usr/lib, and the summary was cut there).
    listing = subprocess.run(["ls", "-la", "/usr/lib"], capture_output=True, text=True, timeout=30).stdout[:1200]

    def call(command: str) -> str:
        return "<tool_call>\n" + json.dumps({"name": "terminal", "arguments": {"command": command}}) + "\n</tool_call>"

    def response(output: str) -> str:
        return "<tool_response>\n" + json.dumps({"output": output, "exit_code": 0}) + "\n</tool_response>"

    turns = [
        {"from": "system", "value": "You are a function calling AI model with a terminal tool."},
        {"from": "human", "value": "Look around the machine and tell me what the notes say."},
        {"from": "gpt", "value": call("pwd")}, {"from": "tool", "value": response(str(work))},
        {"from": "gpt", "value": call("ls -la /usr/lib")}, {"from": "tool", "value": response(listing)},
        {"from": "gpt", "value": call("cat notes.txt")},
        {"from": "tool", "value": response((work / "notes.txt").read_text())},
        {"from": "gpt", "value": "The notes say to deploy on Friday, and that the staging server is slow."},
    ]
    return {"prompt_index": 0, "conversations": turns, "metadata": {"row_key": "real-0", "model": MODEL_ALIAS}}


def test_the_compressor_summarises_a_trajectory_with_the_real_model(real_model_server, tmp_path):
    """trajectory_compressor.py with the real model as summariser: the row comes back compressed
    (or, when the small model's summary is unusable, whole and counted), and the metrics count the
    requests the server saw."""
    row = _terminal_trajectory(tmp_path)
    write_jsonl(tmp_path / "runs.jsonl", [row, {"prompt": "a row without conversations"}])
    proxy = RecordingProxy(real_model_server.base_url)
    proxy.start()
    try:
        result = run_cli(
            ["--input=runs.jsonl", "--tokenizer=estimate", f"--base_url={proxy.base_url}",
             f"--summary_model={MODEL_ALIAS}",
             # Over a budget of 50 tokens; the head (the first system, human, gpt and tool turns) and
             # the last turn are kept, the listing and the file in between are summarised.
             "--target_max_tokens=50", "--protect_last_n_turns=1", "--summary_target_tokens=120",
             "--max_concurrent_requests=1", "--per_trajectory_timeout=600"],
            tmp_path, timeout=900, script="trajectory_compressor.py",
        )
    finally:
        proxy.stop()
    assert result.returncode in (0, 2), f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    output = read_jsonl(tmp_path / "runs_compressed.jsonl")
    assert len(output) == 2 and output[1] == {"prompt": "a row without conversations"}
    metrics = output[0]["compression_metrics"]
    exchanges = proxy.chat_exchanges()
    turns = output[0]["conversations"]
    if metrics["status"] == "compressed":
        assert turns[:1] != row["conversations"][:1] and turns[1:4] == row["conversations"][1:4]
        assert turns[4]["from"] == "human" and len(turns[4]["value"]) > len("[CONTEXT SUMMARY]: ")
        assert turns[5:] == row["conversations"][-1:] and metrics["turns_summarised"] == 4
    else:  # the small model's summary was unusable (it rambled past max_tokens): the row stays whole
        assert metrics["status"] == "failed" and metrics["failure"] in ("truncated", "empty"), metrics
        assert turns == row["conversations"] and metrics["summary_requests"] == len(exchanges)
    totals = json.loads((tmp_path / "runs_compressed.metrics.json").read_text())
    assert totals["summariser"]["requests"] == len(exchanges) >= 1
    assert totals["summariser"]["completion_tokens"] > 0


def test_a_model_without_reasoning_is_named_and_its_rows_kept_on_resume_with_no_new_request(
        real_model_server, tmp_path):
    """SmolLM2 gives no reasoning: with the no-reasoning filter on (the default) every row is
    discarded. The run says so while it runs and in its summary, and a resume with
    --keep_no_reasoning keeps the rows it already has, with no new request to the model."""
    proxy = RecordingProxy(real_model_server.base_url)
    proxy.start()
    write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": p} for p in TERMINAL_PROMPTS[:2]])
    args = ["--dataset_file=prompts.jsonl", "--batch_size=2", "--run_name=plain", f"--base_url={proxy.base_url}",
            f"--model={MODEL_ALIAS}", "--distribution=terminal_only", "--max_turns=1", "--num_workers=1",
            "--num_processes=1", "--seed=1", "--command_timeout=20", "--request_timeout=300"]
    try:
        first = run_cli(args, cwd=tmp_path, timeout=900)
        requests = len(proxy.chat_exchanges())
        resumed = run_cli([*args, "--resume", "--keep_no_reasoning"], cwd=tmp_path, timeout=300)
        assert len(proxy.chat_exchanges()) == requests  # nothing asked again
    finally:
        proxy.stop()
    out = first.stdout
    assert first.returncode in (0, 2), out + first.stderr
    run_dir = tmp_path / "data" / "plain"
    done = [row for row in _committed_rows(run_dir) if not row.get("failed")]
    assert done and all(row["reasoning_stats"]["turns_with_reasoning"] == 0 for row in done)
    assert "were all discarded for no reasoning" in out and "--keep_no_reasoning" in out
    assert f"0 of {len(done)} kept: all discarded for no reasoning (pass --keep_no_reasoning" in out
    assert "No assistant turns recorded" not in out
    assert resumed.returncode in (0, 2), resumed.stdout + resumed.stderr
    kept = read_jsonl(run_dir / "trajectories.jsonl")
    assert sorted(t["prompt_index"] for t in kept) == sorted(row["prompt_index"] for row in done)


@pytest.mark.timeout(1500)  # two rows of two requests each, on a server that runs one at a time
def test_a_turn_limit_summary_cut_at_the_length_limit_is_marked_not_kept(real_model_server, tmp_path):
    """One tool-calling turn, then the summary request with --max_tokens=5: the server honours
    max_tokens when tool_choice is "none" (it ignores it while tools may be called), so the summary
    comes back cut (finish_reason "length"). Such a row is partial and says so; the cut text is not
    saved as the model's final answer."""
    proxy = RecordingProxy(real_model_server.base_url)
    proxy.start()
    write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": p} for p in TERMINAL_PROMPTS[:2]])
    try:
        result = run_cli(["--dataset_file=prompts.jsonl", "--batch_size=4", "--run_name=cut",
                          f"--base_url={proxy.base_url}", f"--model={MODEL_ALIAS}", "--distribution=terminal_only",
                          "--keep_no_reasoning", "--max_turns=1", "--max_tokens=5", "--num_workers=1",
                          "--num_processes=1", "--seed=1", "--command_timeout=20", "--request_timeout=300"],
                         cwd=tmp_path, timeout=1200)
    finally:
        proxy.stop()
    assert result.returncode in (0, 2), result.stdout[-3000:] + result.stderr[-3000:]
    cut = {}  # prompt -> the cut summary text the server sent
    for exchange in proxy.chat_exchanges():
        request, reply = exchange["request"], exchange["reply"]
        if request.get("tool_choice") == "none" and isinstance(reply, dict) and reply.get("choices"):
            choice = reply["choices"][0]
            if choice.get("finish_reason") == "length":
                first_user = next(m["content"] for m in request["messages"] if m["role"] == "user")
                cut[first_user] = choice["message"].get("content") or ""
    assert cut, "no turn-limit summary came back cut at the length limit"
    rows = {r["conversations"][1]["value"]: r for r in read_jsonl(tmp_path / "data" / "cut" / "trajectories.jsonl")}
    kept = [(rows[prompt], text) for prompt, text in cut.items() if prompt in rows]  # others failed: no turn kept
    assert kept, f"no kept row had its summary cut: {result.stdout[-2000:]}"
    for row, text in kept:
        assert row["partial"] and not row["completed"], row["metadata"]
        assert row["metadata"]["stop_reason"] == "response truncated at the output length limit"
        assert "turn-limit summary: cut at the output length limit" in row["metadata"]["dropped_replies"]
        assert not any(t["from"] == "gpt" and text.strip() and text.strip() in t["value"] for t in row["conversations"])
