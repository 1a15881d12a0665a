"""What the runner sends and how it reads replies, through the real CLI against the local server
(tool_choice, the summary request, caching, cost, replies real servers send)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import read_jsonl, run_cli, write_jsonl

TERMINAL = '@tool terminal {"command": "echo marker-$((6*7))"}\n'


def _run(tmp_path, dataset, remote_args, *extra, run_name="r", timeout=300):
    args = [f"--dataset_file={dataset}", f"--run_name={run_name}", "--batch_size=5",
            "--distribution=terminal_only", *remote_args, *extra]
    return run_cli(args, tmp_path, timeout=timeout)


def _out(tmp_path, run_name="r") -> Path:
    return tmp_path / "data" / run_name


def _chat(server):
    return [r.body for r in server.requests if r.path.endswith("/chat/completions")]


def _batch_lines(tmp_path, run_name="r") -> list[dict]:
    return [r for p in sorted(_out(tmp_path, run_name).glob("batch_*.jsonl")) for r in read_jsonl(p)]


def test_tool_choice_auto_is_sent_so_a_server_that_needs_it_calls_tools(tmp_path, model_server, remote_args):
    dataset = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "@needs_tool_choice\n" + TERMINAL + "Run it."}])
    proc = _run(tmp_path, dataset, remote_args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    bodies = _chat(model_server)
    assert bodies and all(b["tool_choice"] == "auto" for b in bodies)
    (probe,) = model_server.probes  # one cheap reachability probe before the first row, with the key
    assert probe.path == "/v1/models" and probe.headers["authorization"].startswith("Bearer ")
    (row,) = read_jsonl(_out(tmp_path) / "trajectories.jsonl")
    assert row["tool_stats"]["terminal"] == {"count": 1, "success": 1, "failure": 0}
    config = json.loads((_out(tmp_path) / "config.json").read_text())
    assert config["config"]["tool_choice"] == "auto" and config["fingerprint_fields"]["tool_choice"] == "auto"


def test_tool_choice_flag_overrides_and_enters_the_fingerprint(tmp_path, model_server, remote_args):
    dataset = write_jsonl(tmp_path / "d.jsonl", [{"prompt": TERMINAL + "Run it."}])
    proc = _run(tmp_path, dataset, remote_args, "--tool_choice=none")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [b["tool_choice"] for b in _chat(model_server)] == ["none"]
    (row,) = read_jsonl(_out(tmp_path) / "trajectories.jsonl")
    assert row["tool_stats"]["terminal"]["count"] == 0
    assert json.loads((_out(tmp_path) / "config.json").read_text())["fingerprint_fields"]["tool_choice"] == "none"
    proc = _run(tmp_path, dataset, remote_args, "--tool_choice=required", "--resume")
    assert proc.returncode == 1 and "tool_choice" in proc.stderr
    proc = _run(tmp_path, dataset, remote_args, "--tool_choice=sometimes", run_name="bad")
    assert proc.returncode == 1 and "--tool_choice must be one of: auto, required, none" in proc.stderr


def test_turn_limit_summary_request_keeps_the_tools_with_tool_choice_none(tmp_path, model_server, remote_args):
    prompt = TERMINAL + '@tool terminal {"command": "echo second"}\nTwo calls, one turn.'
    dataset = write_jsonl(tmp_path / "d.jsonl", [{"prompt": prompt}])
    proc = _run(tmp_path, dataset, remote_args, "--max_turns=1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    first, summary = _chat(model_server)
    assert first["tool_choice"] == "auto"
    assert summary["tool_choice"] == "none" and summary["tools"] == first["tools"]
    assert any(m.get("tool_calls") for m in summary["messages"])  # the server rejects this without tools
    (row,) = read_jsonl(_out(tmp_path) / "trajectories.jsonl")
    assert row["metadata"]["stop_reason"] == "turn_limit" and row["api_calls"] == 1
    assert row["conversations"][-1]["from"] == "gpt" and "Final answer" in row["conversations"][-1]["value"]


def test_raw_control_characters_in_arguments_are_accepted(tmp_path, model_server, remote_args):
    prompt = '@control_chars\n@tool terminal {"command": "echo first\\necho second"}\nTwo lines.'
    dataset = write_jsonl(tmp_path / "d.jsonl", [{"prompt": prompt}])
    proc = _run(tmp_path, dataset, remote_args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    sent = json.loads(json.dumps(_chat(model_server)[1]["messages"][-2]))  # the call as the runner sent it back
    assert json.loads(sent["tool_calls"][0]["function"]["arguments"]) == {"command": "echo first\necho second"}
    (row,) = read_jsonl(_out(tmp_path) / "trajectories.jsonl")
    assert row["api_calls"] == 2 and row["metadata"]["dropped_replies"] == ""
    assert row["tool_stats"]["terminal"] == {"count": 1, "success": 1, "failure": 0}
    assert "first\\nsecond" in row["conversations"][3]["value"]


def test_inline_think_counts_as_reasoning(tmp_path, model_server, remote_args):
    dataset = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "@reasoning inline\n" + TERMINAL + "Think inline."}])
    proc = _run(tmp_path, dataset, remote_args)  # the no-reasoning filter is on: the row must not be discarded
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (row,) = read_jsonl(_out(tmp_path) / "trajectories.jsonl")
    assert row["reasoning_stats"] == {"total_assistant_turns": 2, "turns_with_reasoning": 2, "turns_without_reasoning": 0}
    final = row["conversations"][-1]["value"]
    assert final.startswith("<think>\nReasoning about turn 1.\n</think>\nFinal answer") and final.count("<think>") == 1
    # The reply sent back to the model in the next request holds the answer, not the thinking.
    second = _chat(model_server)[1]["messages"]
    assert all("<think>" not in (m.get("content") or "") for m in second)


def test_nan_or_infinity_in_arguments_is_not_json_so_no_command_runs_and_every_line_stays_json(
        tmp_path, model_server, remote_args):
    """Python's json reads NaN and Infinity; they are not JSON (RFC 8259). A call that carries one is
    the model's bad JSON: it is retried and repaired, never run (a NaN timeout killed the command
    at once, part done) and never written into a trajectory, which `datasets` could not read."""
    marker = tmp_path / "ran"
    rows = [{"prompt": f'@tool terminal {{"command": "touch {marker}-{i}", "timeout": {value}}}\nRun it.'}
            for i, value in enumerate(["NaN", "Infinity", "-Infinity"])]
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    proc = _run(tmp_path, dataset, remote_args, "--keep_no_reasoning", "--max_turns=4")
    assert not list(tmp_path.glob("ran-*"))

    def no_constant(name):
        raise AssertionError(f"{name} written into an output line")

    lines = [json.loads(line, parse_constant=no_constant)
             for p in _out(tmp_path).glob("*.jsonl") for line in p.read_text().splitlines()]
    assert len([r for r in lines if "prompt_index" in r]) >= len(rows), proc.stdout + proc.stderr
    kept = read_jsonl(_out(tmp_path) / "trajectories.jsonl")
    for row in kept:
        assert "invalid JSON arguments for 'terminal'" in row["metadata"]["dropped_replies"]


def test_empty_replies_are_reported_as_empty_and_never_saved_as_success(tmp_path, model_server, remote_args):
    rows = [{"prompt": "@empty 1\n" + TERMINAL + "One empty reply first."},
            {"prompt": "@empty 9\nNothing but empty replies."}]
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    proc = _run(tmp_path, dataset, remote_args, "--keep_no_reasoning")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    (row,) = read_jsonl(_out(tmp_path) / "trajectories.jsonl")
    assert row["prompt_index"] == 0 and row["completed"] and row["api_calls"] == 3
    assert row["metadata"]["dropped_replies"] == "call 1: empty reply (no content, no tool call)"
    (failed,) = [r for r in _batch_lines(tmp_path) if r.get("failed")]
    assert failed["prompt_index"] == 1 and "empty replies" in failed["error"] and "thinking" not in failed["error"]


def test_every_dropped_reply_is_recorded_so_api_calls_add_up(tmp_path, model_server, remote_args):
    rows = [{"prompt": "@unknown_tool 1\n" + TERMINAL + "Unknown tool once."},
            {"prompt": "@bad_args 2\n" + TERMINAL + "Bad JSON twice."},
            {"prompt": "@think_only 1\nThink first."},
            {"prompt": "@empty 2\nEmpty twice."}]
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    proc = _run(tmp_path, dataset, remote_args, "--keep_no_reasoning")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    kept = read_jsonl(_out(tmp_path) / "trajectories.jsonl")
    dropped = [[line.split(": ", 1) for line in t["metadata"]["dropped_replies"].splitlines()] for t in kept]
    reasons = [[reason.split(":")[0] for _call, reason in lines] for lines in dropped]
    assert reasons == [["called a tool it was not offered"], ["invalid JSON arguments for 'terminal'"] * 2,
                       ["no answer beyond thinking"], ["empty reply (no content, no tool call)"] * 2]
    for row, lines in zip(kept, dropped):
        gpt_turns = sum(1 for t in row["conversations"] if t["from"] == "gpt")
        assert row["api_calls"] == gpt_turns + len(lines)
        assert [call for call, _reason in lines] == [f"call {n}" for n in range(1, len(lines) + 1)]
        assert row["metadata"]["usage"]["requests"] == row["api_calls"]
        assert [t["from"] for t in row["conversations"]][:2] == ["system", "human"]
        assert {t["from"] for t in row["conversations"][2:]} <= {"gpt", "tool"}


def test_odd_retry_after_and_quota_words_are_ordinary_backoff(tmp_path, model_server, remote_args):
    rows = [{"prompt": "@fail 429 1 retry_after=abc\nA Retry-After that is neither seconds nor a date."},
            {"prompt": "@fail 429 2 body=Rate limit reached: requests per minute quota exceeded\nA quota word."}]
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    proc = _run(tmp_path, dataset, remote_args, "--keep_no_reasoning")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    kept = read_jsonl(_out(tmp_path) / "trajectories.jsonl")
    assert [t["metadata"]["usage"]["retries"] for t in kept] == [1, 2]


def test_only_402_or_an_insufficient_quota_code_stops_the_run(tmp_path, model_server, remote_args):
    for name, fault in (("code", "@fail 429 100 code=insufficient_quota"), ("payment", "@fail 402 100")):
        rows = [{"prompt": f"{fault}\nOut of credits {name} {i}."} for i in range(6)]
        dataset = write_jsonl(tmp_path / f"{name}.jsonl", rows)
        proc = _run(tmp_path, dataset, remote_args, "--num_workers=1", run_name=name)
        assert proc.returncode == 3, proc.stdout + proc.stderr
        assert "quota" in proc.stderr
        failed = [r for r in _batch_lines(tmp_path, name) if r.get("failed")]
        assert failed and {r["error_class"] for r in failed} == {"quota"} and len(failed) < 6


def test_cost_from_usage_or_the_litellm_header_else_unknown(tmp_path, model_server, remote_args):
    rows = [{"prompt": "Reported in usage.cost."},
            {"prompt": "@cost none\n@cost_header 0.0042\nReported in the LiteLLM header."},
            {"prompt": "@cost none\nNot reported."}]
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    proc = _run(tmp_path, dataset, remote_args, "--keep_no_reasoning")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    usage = [t["metadata"]["usage"] for t in read_jsonl(_out(tmp_path) / "trajectories.jsonl")]
    assert [u["requests"] for u in usage] == [1, 1, 1]
    assert [u["cost"] for u in usage] == [0.0001, 0.0042, 0.0]
    assert [u["unpriced_requests"] for u in usage] == [0, 0, 1]  # the last cost is unknown, not 0


def test_a_reported_cost_that_is_no_amount_is_unknown_and_the_reply_kept(tmp_path, model_server, remote_args):
    rows = [{"prompt": "@cost abc\nText in usage.cost."}, {"prompt": "@cost none\n@cost_header nan\nNaN in the header."},
            {"prompt": "@cost -5\nA negative charge."}]
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    proc = _run(tmp_path, dataset, remote_args, "--keep_no_reasoning")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    usage = [t["metadata"]["usage"] for t in read_jsonl(_out(tmp_path) / "trajectories.jsonl")]
    assert [(u["requests"], u["retries"], u["cost"], u["unpriced_requests"]) for u in usage] == [(1, 0, 0.0, 1)] * 3
    stats = json.loads((_out(tmp_path) / "statistics.json").read_text())
    assert stats["cost"] is None and "nan" not in proc.stdout.lower() and "$-" not in proc.stdout


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_unreachable_endpoint_is_named_before_anything_starts(tmp_path):
    import time

    dataset = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"Row {i}."} for i in range(12)])
    for name, url, cause in (("refused", f"http://127.0.0.1:{_free_port()}/v1", "connection refused"),
                             ("dns", "http://no-such-host.invalid/v1", "DNS lookup failed")):
        started = time.monotonic()
        proc = run_cli([f"--dataset_file={dataset}", f"--run_name={name}", "--batch_size=5", "--model=m",
                        f"--base_url={url}", "--api_key=sk-x"], tmp_path)
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert cause in proc.stderr and url in proc.stderr and "timed out" not in proc.stderr
        assert time.monotonic() - started < 30
        assert not _out(tmp_path, name).exists()  # nothing written, nothing committed


def test_an_endpoint_that_accepts_and_never_answers_is_named_before_anything_starts(tmp_path):
    import socket
    import time

    dataset = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"Row {i}."} for i in range(4)])
    with socket.socket() as silent:  # accepts connections (the kernel's backlog), never replies
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/v1"
        started = time.monotonic()
        proc = run_cli([f"--dataset_file={dataset}", "--run_name=silent", "--batch_size=5", "--model=m",
                        f"--base_url={url}", "--api_key=sk-x"], tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "did not answer GET /models within 10s" in proc.stderr and url in proc.stderr
    assert time.monotonic() - started < 40  # the probe's 10 s, not 8 attempts of --request_timeout per row
    assert not _out(tmp_path, "silent").exists()


def test_an_endpoint_without_models_route_counts_as_reachable(tmp_path, model_server):
    dataset = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "Row."}])
    proc = run_cli([f"--dataset_file={dataset}", "--run_name=r", "--batch_size=5", "--model=m",
                    f"--base_url={model_server.root_url}/nowhere", "--api_key=sk-x"], tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr  # it ran: the row failed with the chat route's 404
    (failed,) = _batch_lines(tmp_path)
    assert "HTTP 404" in failed["error"]


def test_endpoint_lost_mid_run_stops_the_run_as_a_provider_error(tmp_path, model_server, remote_args):
    import threading
    import time

    rows = [{"prompt": f"@latency 0.3\nRow {i}."} for i in range(60)]
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)

    def stop_after_some_rows():
        while model_server.count() < 6:
            time.sleep(0.05)
        model_server.stop()

    threading.Thread(target=stop_after_some_rows, daemon=True).start()
    started = time.monotonic()
    proc = _run(tmp_path, dataset, remote_args, "--keep_no_reasoning", "--num_workers=3", "--num_processes=1")
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "cannot be reached" in proc.stderr and "connection refused" in proc.stderr
    assert time.monotonic() - started < 120
    lines = _batch_lines(tmp_path)
    failed = [r for r in lines if r.get("failed")]
    assert failed and {r["error_class"] for r in failed if r["error_class"] != "interrupted"} == {"connection"}
    # A request the stopping server took in and never answered (seen once in three CI runs) keeps
    # its row in flight past the grace period: that row is abandoned, its request counted.
    assert all("grace period ended" in r["error"] for r in failed if r["error_class"] == "interrupted")
    # It stopped starting rows instead of failing the dataset: at most the window (3 rows) plus the
    # rows in flight with it (3 sessions) failed, however many rows had finished before the loss.
    assert len(failed) <= 3 + 3
    stats = json.loads((_out(tmp_path) / "statistics.json").read_text())
    assert stats["outcomes"]["not_run"] > 0 and stats["outcomes"]["not_run"] + len(lines) == len(rows)


def test_brief_loss_of_the_endpoint_is_ridden_out(tmp_path, model_server, remote_args):
    import threading
    import time

    rows = [{"prompt": f"@latency 0.2\nRow {i}."} for i in range(6)] + [{"prompt": "@close 1\nClosed once."}]
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)

    def restart_briefly():
        while model_server.count() < 2:
            time.sleep(0.02)
        model_server.stop()
        time.sleep(2.0)
        model_server.start()  # the same port

    threading.Thread(target=restart_briefly, daemon=True).start()
    proc = _run(tmp_path, dataset, remote_args, "--keep_no_reasoning", "--num_workers=2", "--num_processes=1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    kept = read_jsonl(_out(tmp_path) / "trajectories.jsonl")
    assert len(kept) == 7 and sum(t["metadata"]["usage"]["retries"] for t in kept) >= 2


def test_first_reply_cut_at_max_tokens_stops_the_run_as_a_configuration_error(tmp_path, model_server, remote_args):
    rows = [{"prompt": f"@finish length\nToo long {i}."} for i in range(10)]
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    proc = _run(tmp_path, dataset, remote_args, "--max_tokens=5", "--num_workers=1")
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "--max_tokens=5" in proc.stderr and "configuration error" in proc.stderr
    failed = [r for r in _batch_lines(tmp_path) if r.get("failed")]
    assert len(failed) == 3 and {r["error_class"] for r in failed} == {"truncated"}


def test_prompt_caching_breakpoints_and_cached_tokens(tmp_path, model_server, remote_args):
    prompt = TERMINAL + '@tool terminal {"command": "echo two"}\n@tool terminal {"command": "echo three"}\nThree calls.'
    dataset = write_jsonl(tmp_path / "d.jsonl", [{"prompt": prompt}])
    proc = _run(tmp_path, dataset, remote_args, "--prompt_caching=on", "--keep_no_reasoning")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    bodies = _chat(model_server)
    assert len(bodies) == 4
    for body in bodies:
        marked = [m for m in body["messages"] if isinstance(m["content"], list)
                  and m["content"][-1].get("cache_control") == {"type": "ephemeral"}]
        assert marked[0]["role"] == "system" and len(marked) == min(4, 1 + sum(
            1 for m in body["messages"][1:] if m.get("content")))
        assert body["messages"][-1] in marked  # the newest message carries a breakpoint
    assert json.loads((_out(tmp_path) / "config.json").read_text())["config"]["prompt_caching"] == "on"
    (row,) = read_jsonl(_out(tmp_path) / "trajectories.jsonl")
    assert row["metadata"]["usage"]["cached_tokens"] > 0  # later turns read the prefix the earlier ones cached
    assert isinstance(row["conversations"][1]["value"], str)  # the saved conversation is untouched

    # auto: only Claude models on OpenRouter; this is neither, so no breakpoint and nothing cached.
    model_server.reset()
    proc = _run(tmp_path, dataset, remote_args, "--keep_no_reasoning", run_name="auto")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert all(isinstance(m["content"], (str, type(None))) for b in _chat(model_server) for m in b["messages"])
    (row,) = read_jsonl(_out(tmp_path, "auto") / "trajectories.jsonl")
    assert row["metadata"]["usage"]["cached_tokens"] == 0


def test_probe_names_a_refused_key_before_anything_starts(tmp_path):
    from tests.helpers.model_server import ModelServer

    dataset = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "Row."}])
    with ModelServer(api_key="sk-right") as server:
        proc = run_cli([f"--dataset_file={dataset}", "--run_name=r", "--batch_size=5", "--model=m",
                        f"--base_url={server.base_url}", "--api_key=sk-wrong"], tmp_path)
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert "refused the API key (HTTP 401" in proc.stderr and "sk-wrong" not in proc.stderr
        assert server.count() == 0 and not _out(tmp_path).exists()


def test_a_row_without_a_single_model_turn_is_a_failed_attempt_not_a_kept_row(tmp_path, model_server, remote_args):
    """Every reply dropped (thinking only, an unknown tool) and the turn limit reached: nothing the
    model said can be saved, so the row fails, saying why, and a resume runs it again."""
    rows = [{"prompt": "thinkonly\n@think_only 3"}, {"prompt": "unk\n@unknown_tool 3"}]
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    proc = _run(tmp_path, dataset, remote_args, "--keep_no_reasoning", "--max_turns=1")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert read_jsonl(_out(tmp_path) / "trajectories.jsonl") == []
    failed = sorted((r for r in _batch_lines(tmp_path) if r.get("failed")), key=lambda r: r["prompt_index"])
    assert [r["prompt_index"] for r in failed] == [0, 1]
    for record, reason in zip(failed, ("no answer beyond thinking", "called a tool it was not offered")):
        assert "the model gave no usable reply" in record["error"] and f"call 1: {reason}" in record["error"], record
        assert "turn-limit summary" in record["error"]
        assert record["metadata"]["usage"]["requests"] == 2  # the spend of the failed attempt is kept
    proc = _run(tmp_path, dataset, remote_args, "--keep_no_reasoning", "--max_turns=1", "--resume")
    attempts = sorted((r["prompt_index"], r["metadata"]["attempt"]) for r in _batch_lines(tmp_path))
    assert attempts == [(0, 1), (0, 2), (1, 1), (1, 2)], proc.stdout + proc.stderr  # both rows ran again
    for row in read_jsonl(_out(tmp_path) / "trajectories.jsonl"):
        assert "gpt" in [t["from"] for t in row["conversations"]]
