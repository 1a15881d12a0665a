"""How a session ends on replies it cannot use, through the real CLI against the scripted server:
a turn-limit summary cut at the length limit, every reply dropped, and the hints of such failures."""

from __future__ import annotations

from tests.conftest import read_jsonl, write_jsonl
from tests.helpers.model_server import Reply, error_body
from tests.runner.execution.test_requests_cli import TERMINAL, _batch_lines, _out, _run


def test_a_turn_limit_summary_cut_at_the_length_limit_is_not_a_final_answer(tmp_path, model_server, remote_args):
    dataset = write_jsonl(tmp_path / "d.jsonl", [{"prompt": TERMINAL + "@finish summary_length\nRun it."}])
    proc = _run(tmp_path, dataset, remote_args, "--max_turns=1", "--keep_no_reasoning")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (row,) = read_jsonl(_out(tmp_path) / "trajectories.jsonl")
    assert row["partial"] is True and row["completed"] is False
    assert row["metadata"]["stop_reason"] == "response truncated at the output length limit"
    assert "call 2: turn-limit summary: cut at the output length limit" in row["metadata"]["dropped_replies"]
    assert not any("without using" in t["value"] for t in row["conversations"])  # the cut text is not kept
    assert row["conversations"][-1]["from"] == "tool"


def test_a_row_whose_every_reply_was_dropped_records_the_drops_as_a_model_failure(tmp_path, model_server,
                                                                                    remote_args):
    rows = [{"prompt": "thinkonly\n@think_only 3"}, {"prompt": "empty\n@empty 5"}]
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    proc = _run(tmp_path, dataset, remote_args, "--keep_no_reasoning", "--max_turns=1")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    failed = sorted((r for r in _batch_lines(tmp_path) if r.get("failed")), key=lambda r: r["prompt_index"])
    assert [r["error_class"] for r in failed] == ["model", "model"]
    thinking, empty = (r["metadata"]["dropped_replies"].splitlines() for r in failed)
    assert thinking == ["call 1: no answer beyond thinking", "call 2: turn-limit summary: no answer in the reply"]
    assert empty == ["call 1: empty reply (no content, no tool call)", "call 2: turn-limit summary: no answer in the reply"]
    assert all("the model gave no usable reply" in r["error"] for r in failed)


def test_a_first_reply_cut_without_max_tokens_names_the_servers_default_limit(tmp_path, model_server, remote_args):
    rows = [{"prompt": f"@finish length\nToo long {i}."} for i in range(5)]
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    proc = _run(tmp_path, dataset, remote_args, "--num_workers=1")
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "--max_tokens=None" not in proc.stderr and "the server's default output limit" in proc.stderr
    for record in _batch_lines(tmp_path):
        assert "--max_tokens too small" not in record["error"]
        assert "the server's default output limit, as no --max_tokens was given" in record["error"]


def test_an_http_500_to_tool_choice_required_says_which_values_the_server_takes(tmp_path, model_server, remote_args):
    def refuse_required(body, state):  # as llama.cpp's server does: an empty 500
        if body.get("tool_choice") == "required":
            return Reply(status=500, body=error_body(500, ""), headers={"Retry-After": "0"})
        return None

    model_server.policy = refuse_required
    dataset = write_jsonl(tmp_path / "d.jsonl", [{"prompt": TERMINAL + "Run it."}])
    proc = _run(tmp_path, dataset, remote_args, "--tool_choice=required")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    (failed,) = _batch_lines(tmp_path)
    assert failed["error"].startswith("HTTP 500")
    assert "tool_choice=required" in failed["error"] and "--tool_choice=auto or none" in failed["error"]
