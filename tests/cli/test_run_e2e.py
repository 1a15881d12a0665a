"""Whole runs through the real CLI against the local OpenAI-compatible server."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from tests.conftest import SECRET_KEY, read_jsonl, run_cli, write_jsonl
from tools.registry import ALL_TOOL_NAMES


def _run(tmp_path, dataset, remote_args, *extra, run_name="r", timeout=300):
    args = [f"--dataset_file={dataset}", f"--run_name={run_name}", "--batch_size=3", *remote_args, *extra]
    return run_cli(args, tmp_path, timeout=timeout)


def _files(tmp_path, run_name="r") -> Path:
    return tmp_path / "data" / run_name


TERMINAL_PROMPT = '@tool terminal {"command": "echo marker-$((6*7))"}\nPlease run the command.'


def test_full_run_files_and_schema(tmp_path, model_server, remote_args):
    rows = [{"prompt": TERMINAL_PROMPT + f" #{i}", "id": f"row-{i}"} for i in range(5)]
    rows.append({"prompt": '@tool write_file {"path": "a.txt", "content": "hello"}\n@tool read_file {"path": "a.txt"}\nWrite then read.'})
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    proc = _run(tmp_path, dataset, remote_args, "--distribution=terminal_only", "--num_workers=3")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = _files(tmp_path)
    trajectories = read_jsonl(out / "trajectories.jsonl")
    assert [t["prompt_index"] for t in trajectories] == list(range(6))
    for row, traj in zip(rows, trajectories):
        assert list(traj)[:9] == ["prompt_index", "conversations", "metadata", "completed", "partial", "api_calls",
                                  "toolsets_used", "tool_stats", "tool_error_counts"]
        conv = traj["conversations"]
        assert conv[0]["from"] == "system" and "<tools>" in conv[0]["value"]
        assert conv[1] == {"from": "human", "value": row["prompt"]}
        assert all("<think>" in t["value"] for t in conv if t["from"] == "gpt")
        assert list(traj["tool_stats"]) == list(ALL_TOOL_NAMES)
        assert list(traj["tool_error_counts"]) == list(ALL_TOOL_NAMES)
        assert traj["completed"] is True and traj["partial"] is False
        assert traj["toolsets_used"] == ["terminal", "file"]
        assert traj["metadata"]["model"] == "test-model"
        assert traj["metadata"]["id"] == row.get("id", "")  # always a string
        assert traj["metadata"]["schema_version"] == 3 and isinstance(traj["metadata"]["seed"], int)
    first = trajectories[0]
    tool_turn = next(t for t in first["conversations"] if t["from"] == "tool")["value"]
    response = json.loads(tool_turn.split("<tool_response>\n", 1)[1].split("\n</tool_response>")[0])
    assert response["name"] == "terminal" and "marker-42" in response["content"]["output"]
    assert first["tool_stats"]["terminal"] == {"count": 1, "success": 1, "failure": 0}
    assert first["api_calls"] == 2
    last = trajectories[5]
    assert last["tool_stats"]["write_file"]["success"] == 1 and last["tool_stats"]["read_file"]["success"] == 1
    assert "hello" in last["conversations"][-1]["value"]

    stats = json.loads((out / "statistics.json").read_text())
    assert stats["total_prompts"] == 6 and stats["outcomes"]["ok"] == 6 and stats["outcomes"]["failed"] == 0
    assert stats["tool_statistics"]["terminal"]["count"] == 5
    assert stats["tool_statistics"]["terminal"]["success_rate"] == 100.0
    assert stats["api_calls"] == sum(t["api_calls"] for t in trajectories)
    assert stats["tokens"]["total_tokens"] == sum(t["metadata"]["usage"]["total_tokens"] for t in trajectories) > 0
    checkpoint = json.loads((out / "checkpoint.json").read_text())
    assert checkpoint["run_name"] == "r" and checkpoint["completed_prompts"] == list(range(6))
    batch_files = sorted(out.glob("batch_*.jsonl"))
    assert [p.name for p in batch_files] == ["batch_0.jsonl", "batch_1.jsonl"]  # batch_size=3
    config = json.loads((out / "config.json").read_text())
    assert config["config"]["model"] == "test-model" and len(config["fingerprint"]) == 16
    # The API key reached the server, and no file.
    assert model_server.requests[0].headers["authorization"] == f"Bearer {SECRET_KEY}"
    for path in out.rglob("*"):
        if path.is_file():
            assert SECRET_KEY not in path.read_text(errors="replace"), path
    assert SECRET_KEY not in proc.stdout + proc.stderr


def test_request_fields_and_call_time_only_messages(tmp_path, model_server, remote_args):
    (tmp_path / "prefill.json").write_text(json.dumps([
        {"role": "user", "content": "PREFILL-USER"}, {"role": "assistant", "content": "PREFILL-ASSISTANT"}]))
    dataset = write_jsonl(tmp_path / "d.jsonl", [{"prompt": TERMINAL_PROMPT}])
    proc = _run(
        tmp_path, dataset, remote_args, "--distribution=terminal_only",
        "--providers_allowed=anthropic,openai", "--providers_ignored=deepinfra", "--providers_order=openai,anthropic",
        "--provider_sort=price", "--reasoning_effort=high", "--max_tokens=777",
        "--ephemeral_system_prompt=EPHEMERAL-RULES", "--prefill_messages_file=prefill.json",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    chat = [r for r in model_server.requests if r.path.endswith("/chat/completions")]
    assert len(chat) == 1  # the server keys its script on the first user message: the prefill one
    for request in chat:
        body = request.body
        assert body["provider"] == {"only": ["anthropic", "openai"], "ignore": ["deepinfra"],
                                    "order": ["openai", "anthropic"], "sort": "price"}
        assert body["reasoning"] == {"enabled": True, "effort": "high"}
        assert body["max_tokens"] == 777
        messages = body["messages"]
        assert messages[0]["role"] == "system" and messages[0]["content"].endswith("EPHEMERAL-RULES")
        assert messages[1] == {"role": "user", "content": "PREFILL-USER"}
        assert messages[2] == {"role": "assistant", "content": "PREFILL-ASSISTANT"}
        assert messages[3] == {"role": "user", "content": TERMINAL_PROMPT}
        assert {t["function"]["name"] for t in body["tools"]} == {"terminal", "process", "read_file", "write_file",
                                                                 "patch", "search_files"}
    saved = (_files(tmp_path) / "trajectories.jsonl").read_text()
    assert "EPHEMERAL-RULES" not in saved and "PREFILL-USER" not in saved and "PREFILL-ASSISTANT" not in saved


def test_single_provider_and_reasoning_disabled(tmp_path, model_server, remote_args):
    dataset = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "@reasoning none\nJust answer."}])
    proc = _run(tmp_path, dataset, remote_args, "--distribution=terminal_only", "--providers_allowed=anthropic",
                "--reasoning_disabled")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    body = model_server.requests[0].body
    assert body["provider"] == {"only": ["anthropic"]}
    assert body["reasoning"] == {"effort": "none"}
    assert "max_tokens" not in body
    # With reasoning disabled the no-reasoning filter is off: the row is kept.
    assert len(read_jsonl(_files(tmp_path) / "trajectories.jsonl")) == 1


def test_no_reasoning_filter_is_applied_when_the_outputs_are_built(tmp_path, model_server, remote_args):
    rows = [{"prompt": "@reasoning none\nAnswer plainly."}, {"prompt": "Answer with reasoning."},
            {"prompt": "@reasoning scratchpad\nThink in a scratchpad."}, {"prompt": "@reasoning details\nDetails."}]
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    proc = _run(tmp_path, dataset, remote_args, "--distribution=terminal_only")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = _files(tmp_path)
    kept = read_jsonl(out / "trajectories.jsonl")
    assert [t["prompt_index"] for t in kept] == [1, 2, 3]
    assert "<think>" in kept[1]["conversations"][2]["value"]  # scratchpad converted
    assert "REASONING_SCRATCHPAD" not in json.dumps(kept[1])
    lines = [r for p in out.glob("batch_*.jsonl") for r in read_jsonl(p)]
    # The discarded row's batch line keeps its whole conversation: the filter is the merge's.
    without = [r for r in lines if r["reasoning_stats"]["turns_with_reasoning"] == 0]
    assert len(without) == 1 and without[0]["prompt_index"] == 0
    assert [t["from"] for t in without[0]["conversations"]][1:] == ["human", "gpt"]
    assert without[0]["conversations"][1]["value"] == rows[0]["prompt"]
    stats = json.loads((out / "statistics.json").read_text())
    assert stats["discarded_no_reasoning"] == 1 and stats["outcomes"]["discarded"] == 1
    # A resume does not pay for the discarded row again.
    before = model_server.count()
    proc = _run(tmp_path, dataset, remote_args, "--distribution=terminal_only", "--resume")
    assert proc.returncode == 0 and model_server.count() == before
    assert len(read_jsonl(out / "trajectories.jsonl")) == 3
    # With --keep_no_reasoning it is kept, still with no new request, as made the first time.
    proc = _run(tmp_path, dataset, remote_args, "--distribution=terminal_only", "--resume", "--keep_no_reasoning")
    assert proc.returncode == 0 and model_server.count() == before, proc.stderr
    kept = read_jsonl(out / "trajectories.jsonl")
    assert [t["prompt_index"] for t in kept] == [0, 1, 2, 3] and kept[0] == without[0]
    assert json.loads((out / "statistics.json").read_text())["outcomes"]["discarded"] == 0

    # --keep_no_reasoning keeps such rows.
    proc = _run(tmp_path, dataset, remote_args, "--distribution=terminal_only", "--keep_no_reasoning", run_name="k")
    assert proc.returncode == 0
    assert len(read_jsonl(_files(tmp_path, "k") / "trajectories.jsonl")) == 4


def test_provider_errors_fail_rows_and_resume_retries_them(tmp_path, model_server, remote_args):
    rows = [
        {"prompt": "@fail 429 1 retry_after=1\nRate limited once."},
        {"prompt": "@fail 500 2\nTwo server errors."},
        {"prompt": "@fail 400 1\nA bad request once."},
        {"prompt": "Fine."},
    ]
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    proc = _run(tmp_path, dataset, remote_args, "--distribution=terminal_only", "--num_workers=4")
    assert proc.returncode == 2, proc.stdout + proc.stderr  # finished, with a failed row
    out = _files(tmp_path)
    kept = {t["prompt_index"]: t for t in read_jsonl(out / "trajectories.jsonl")}
    assert sorted(kept) == [0, 1, 3]
    assert kept[0]["metadata"]["usage"]["retries"] == 1
    assert kept[1]["metadata"]["usage"]["retries"] == 2
    failed = [r for p in out.glob("batch_*.jsonl") for r in read_jsonl(p) if r.get("failed")]
    assert len(failed) == 1 and failed[0]["prompt_index"] == 2
    assert failed[0]["error_class"] == "provider" and "HTTP 400" in failed[0]["error"]
    assert "conversations" not in failed[0]
    stats = json.loads((out / "statistics.json").read_text())
    assert stats["outcomes"]["failed"] == 1 and stats["failed_by_class"] == {"provider": 1}
    assert stats["retries"] == 3

    proc = _run(tmp_path, dataset, remote_args, "--distribution=terminal_only", "--resume")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    kept = read_jsonl(out / "trajectories.jsonl")
    assert [t["prompt_index"] for t in kept] == [0, 1, 2, 3]
    assert kept[2]["metadata"]["attempt"] == 2
    assert sorted(p.name for p in out.glob("batch_*.jsonl")) == ["batch_0.jsonl", "batch_1.jsonl", "batch_2.jsonl"]
    assert json.loads((out / "statistics.json").read_text())["outcomes"]["failed"] == 0


def test_auth_error_stops_the_run_early(tmp_path, model_server, remote_args):
    rows = [{"prompt": f"@fail 401 100\nUnauthorized {i}."} for i in range(12)]
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    proc = _run(tmp_path, dataset, remote_args, "--distribution=terminal_only", "--num_workers=2")
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "Stopped early" in proc.stderr and "auth" in proc.stderr
    assert model_server.count() < 12  # it did not try every row
    stats = json.loads((_files(tmp_path) / "statistics.json").read_text())
    assert stats["outcomes"]["not_run"] > 0 and stats["failed_by_class"].get("auth", 0) >= 1


def test_agent_loop_edge_cases(tmp_path, model_server, remote_args):
    rows = [
        {"prompt": '@unknown_tool 1\n@tool terminal {"command": "echo ok"}\nUnknown tool once.'},
        {"prompt": '@unknown_tool 5\nAlways unknown.'},
        {"prompt": '@bad_args 3\n@tool terminal {"command": "echo fixed"}\nBad JSON thrice.'},
        {"prompt": "@think_only 1\nThink first."},
        {"prompt": "@finish length\nToo long."},
        {"prompt": '@tool terminal {"command": "echo 1"}\n@tool terminal {"command": "echo 2"}\n'
                   '@tool terminal {"command": "echo 3"}\nThree calls but two turns.'},
    ]
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    proc = _run(tmp_path, dataset, remote_args, "--distribution=terminal_only", "--max_turns=3", "--keep_no_reasoning")
    assert proc.returncode == 2, proc.stdout + proc.stderr  # the cut-off first response failed its row
    kept = {t["prompt_index"]: t for t in read_jsonl(_files(tmp_path) / "trajectories.jsonl")}
    assert kept[0]["completed"] and kept[0]["tool_stats"]["terminal"]["count"] == 1
    assert 1 not in kept  # nothing but unknown-tool calls: no model turn to keep, so the row failed
    repaired = kept[2]["conversations"]
    repair, summary = kept[2]["metadata"]["loop_notes"].splitlines()  # the notes are not turns of the conversation
    assert repair.startswith("after turn 1: ") and "not valid JSON" in repair
    assert summary.startswith("after turn 1: ") and "final answer" in summary
    assert [t["from"] for t in repaired] == ["system", "human", "gpt"]  # the summary
    dropped = kept[2]["metadata"]["dropped_replies"].splitlines()
    assert [line.split(": ", 1)[1][:12] for line in dropped] == ["invalid JSON"] * 3
    assert kept[3]["completed"] and kept[3]["api_calls"] == 2
    assert 4 not in kept
    failed = {r["prompt_index"]: r for p in _files(tmp_path).glob("batch_*.jsonl") for r in read_jsonl(p) if r.get("failed")}
    assert sorted(failed) == [1, 4] and "output length limit" in failed[4]["error"]
    assert "no usable reply" in failed[1]["error"] and "called a tool it was not offered: no_such_tool" in failed[1]["error"]
    limited = kept[5]
    assert limited["api_calls"] == 3 and limited["completed"] is False
    assert [t["from"] for t in limited["conversations"]] == ["system", "human"] + ["gpt", "tool"] * 3 + ["gpt"]
    (note,) = limited["metadata"]["loop_notes"].splitlines()  # the summary request, after the last tool turn
    assert note.startswith("after turn 7: ") and "final answer" in note


def test_final_answer_on_last_permitted_call_is_completed(tmp_path, model_server, remote_args):
    dataset = write_jsonl(tmp_path / "d.jsonl", [{"prompt": TERMINAL_PROMPT}])
    proc = _run(tmp_path, dataset, remote_args, "--distribution=terminal_only", "--max_turns=2")
    assert proc.returncode == 0
    (row,) = read_jsonl(_files(tmp_path) / "trajectories.jsonl")
    assert row["api_calls"] == 2 and row["completed"] is True


def test_duplicates_are_distinct_rows(tmp_path, model_server, remote_args):
    rows = [{"prompt": "Same question."}] * 3 + [{"prompt": "Other question."}]
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    proc = _run(tmp_path, dataset, remote_args, "--distribution=terminal_only")
    assert proc.returncode == 0
    kept = read_jsonl(_files(tmp_path) / "trajectories.jsonl")
    assert [t["prompt_index"] for t in kept] == [0, 1, 2, 3]
    assert len({t["metadata"]["row_key"] for t in kept}) == 4


def test_seed_makes_sampling_reproducible_whatever_the_workers(tmp_path):
    rows = [{"prompt": f"Explain topic number {i}."} for i in range(40)]
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    sampled = []
    for run_name, workers in (("a", 1), ("b", 6)):
        proc = run_cli([f"--dataset_file={dataset}", f"--run_name={run_name}", "--batch_size=7", "--model=mock",
                        "--distribution=balanced", "--seed=1234", f"--num_workers={workers}"], tmp_path)
        assert proc.returncode == 0, proc.stderr
        kept = read_jsonl(tmp_path / "data" / run_name / "trajectories.jsonl")
        sampled.append({t["prompt_index"]: t["toolsets_used"] for t in kept})
    assert sampled[0] == sampled[1] and len(sampled[0]) == 40
    assert len({tuple(v) for v in sampled[0].values()}) > 5  # really sampled, not constant
    counts = Counter(ts for v in sampled[0].values() for ts in v)
    assert 8 <= counts["terminal"] <= 32  # 50% of 40, loosely


def test_fifty_prompts_eight_workers_load_with_datasets(tmp_path, model_server, remote_args):
    rows = [{"prompt": TERMINAL_PROMPT + f" ({i})", "id": i} for i in range(50)]
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    proc = _run(tmp_path, dataset, remote_args, "--distribution=terminal_only", "--num_workers=8")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = _files(tmp_path)
    assert len(read_jsonl(out / "trajectories.jsonl")) == 50
    datasets = pytest.importorskip("datasets")
    loaded = datasets.load_dataset("json", data_files=str(out / "trajectories.jsonl"), split="train",
                                   cache_dir=str(tmp_path / "hf"))
    assert loaded.num_rows == 50
    assert loaded[0]["conversations"][1]["from"] == "human"
    assert sorted(loaded.column_names)[:3] == ["api_calls", "completed", "conversations"]


def test_unknown_tool_rows_are_filtered_at_merge(tmp_path, model_server, remote_args):
    dataset = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "One."}, {"prompt": "Two."}])
    assert _run(tmp_path, dataset, remote_args, "--distribution=terminal_only").returncode == 0
    out = _files(tmp_path)
    batch = out / "batch_0.jsonl"
    lines = batch.read_text().splitlines()
    row = json.loads(lines[0])
    row["tool_stats"]["hallucinated_tool"] = {"count": 1, "success": 0, "failure": 1}
    lines[0] = json.dumps(row)
    batch.write_text("\n".join(lines) + "\n")
    (out / "checkpoint.json").unlink()
    proc = _run(tmp_path, dataset, remote_args, "--distribution=terminal_only", "--resume")
    assert "invalid tool 'hallucinated_tool'" in proc.stdout + proc.stderr
    stats = json.loads((out / "statistics.json").read_text())
    # The filtered line is no outcome: resume, merge and statistics agree that the row was not
    # done, so the resume ran it again (once) and its new line is kept.
    assert stats["outcomes"]["filtered"] == 1 and stats["outcomes"]["ok"] == 2 and stats["outcomes"]["not_run"] == 0
    assert stats["spend"]["other"]["attempts"] == 1 and stats["spend"]["kept"]["attempts"] == 2
    assert sorted(t["prompt_index"] for t in read_jsonl(out / "trajectories.jsonl")) == [0, 1]


def test_moa_models_come_from_flags_and_enter_the_fingerprint(tmp_path, model_server, remote_args):
    prompt = '@tool mixture_of_agents {"user_prompt": "Is 91 prime?"}\nAsk the panel.'
    dataset = write_jsonl(tmp_path / "d.jsonl", [{"prompt": prompt}])
    proc = _run(tmp_path, dataset, remote_args, "--distribution=default",
                "--moa_reference_models=ref/one,ref/two", "--moa_aggregator_model=agg/judge")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    models = {r.body["model"] for r in model_server.requests if r.path.endswith("/chat/completions")}
    assert {"ref/one", "ref/two", "agg/judge", "test-model"} <= models
    (row,) = read_jsonl(_files(tmp_path) / "trajectories.jsonl")
    assert row["tool_stats"]["mixture_of_agents"]["success"] == 1
    config = json.loads((_files(tmp_path) / "config.json").read_text())
    assert config["fingerprint_fields"]["tool_backends"]["moa_reference_models"] == ["ref/one", "ref/two"]
