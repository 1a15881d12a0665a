"""One record, one reader: statistics.json, report.html and trajectories.jsonl agree after dataset
edits and resumes, spend covers every attempt, and the output of any two runs loads together."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, SECRET_KEY, read_jsonl, run_cli, write_jsonl

TERMINAL = '@tool terminal {"command": "echo hi"}\n'


def _run(tmp_path, dataset, remote_args, *extra, run_name="r"):
    args = [f"--dataset_file={dataset}", f"--run_name={run_name}", "--batch_size=3", *remote_args, *extra]
    return run_cli(args, tmp_path)


def _lines(run: Path) -> list[dict]:
    return [r for p in sorted(run.glob("batch_*.jsonl")) for r in read_jsonl(p)]


def _embedded(run: Path, element_id: str):
    html = (run / "report.html").read_text(encoding="utf-8")
    match = re.search(rf'<script type="application/json" id="{element_id}">(.*?)</script>', html, re.S)
    assert match, element_id
    return json.loads(match.group(1))


def _assert_report_matches_statistics(run: Path) -> dict:
    stats = json.loads((run / "statistics.json").read_text())
    summary = _embedded(run, "summary-data")
    for key in ("outcomes", "failed_by_class", "retried_rows", "reasoning_statistics", "tokens", "cost", "spend",
                "retries", "requests", "api_calls", "total_prompts", "discarded_no_reasoning"):
        assert summary[key] == stats[key], key
    assert {k: v["count"] for k, v in summary["tool_statistics"].items()} == {
        k: v["count"] for k, v in stats["tool_statistics"].items()}
    assert summary["duration"]["active_seconds"] == stats["duration_seconds"]
    assert len(_embedded(run, "rows-data")["rows"]) == stats["total_prompts"] - stats["outcomes"]["not_run"]
    return stats


def _assert_spend_is_every_line(run: Path, stats: dict) -> None:
    lines = _lines(run)
    usage = [line["metadata"]["usage"] for line in lines]
    every = stats["spend"]["all"]
    assert every["attempts"] == len(lines)
    for key in ("requests", "retries", "prompt_tokens", "completion_tokens", "cached_tokens", "total_tokens"):
        assert every[key] == sum(u[key] for u in usage) == stats.get(key, stats["tokens"].get(key)), key
    assert every["cost"] == pytest.approx(sum(u["cost"] for u in usage)) and stats["cost"] == every["cost"]
    buckets = [stats["spend"][b] for b in ("kept", "discarded", "failed", "other")]
    assert sum(b["attempts"] for b in buckets) == len(lines)
    assert sum(b["requests"] for b in buckets) == every["requests"]
    assert stats["cache_hit_ratio"] == round(every["cached_tokens"] / every["prompt_tokens"], 4)


def test_dataset_edit_then_resume_report_statistics_and_rows_agree(tmp_path, model_server, remote_args):
    same = TERMINAL + "The same question."
    rows = [
        {"prompt": TERMINAL + "First.", "id": "first"},
        {"prompt": same, "id": "twin-a"},
        {"prompt": same, "id": "twin-b"},
        {"prompt": "@reasoning none\nNo reasoning.", "id": "plain"},
        {"prompt": "@fail 400 1\nFails once.", "id": "flaky"},
        {"prompt": TERMINAL + "Leaves the dataset.", "id": "gone"},
        {"prompt": "@fail 500 1\nRetried inside the attempt.", "id": "retry"},
    ]
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    proc = _run(tmp_path, dataset, remote_args, "--distribution=terminal_only")
    assert proc.returncode == 2, proc.stdout + proc.stderr  # the 400 row failed
    run = tmp_path / "data" / "r"
    first = _assert_report_matches_statistics(run)
    assert first["outcomes"]["failed"] == 1 and first["outcomes"]["discarded"] == 1
    assert first["spend"]["failed"]["attempts"] == 1 and first["spend"]["discarded"]["attempts"] == 1
    assert first["retries"] == 1  # the 500 retried inside its attempt, on a kept row

    # Edit: a row leaves, the twins swap ids, an id changes alone, the order changes, a row is added.
    edited = [
        {"prompt": TERMINAL + "Added later.", "id": "new"},
        {"prompt": "@fail 400 1\nFails once.", "id": "flaky"},
        {"prompt": same, "id": "twin-b"},
        {"prompt": same, "id": "twin-a"},
        {"prompt": TERMINAL + "First.", "id": "first-renamed"},
        {"prompt": "@reasoning none\nNo reasoning.", "id": "plain"},
        {"prompt": "@fail 500 1\nRetried inside the attempt.", "id": "retry"},
    ]
    write_jsonl(dataset, edited)
    proc = _run(tmp_path, dataset, remote_args, "--distribution=terminal_only", "--resume")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    stats = _assert_report_matches_statistics(run)
    assert stats["outcomes"] == {"ok": 6, "completed": 6, "partial": 0, "turn_limit": 0, "discarded": 1, "failed": 0,
                                 "not_run": 0, "filtered": 0}
    assert stats["total_prompts"] == 7 and stats["stale_rows"] == 1 and stats["retried_rows"] == 1
    _assert_spend_is_every_line(run, stats)
    assert stats["spend"]["other"]["attempts"] == 1  # the row that left the dataset was paid for all the same

    # Ids and positions come from the dataset as it is now; everything else from the committed line.
    kept = read_jsonl(run / "trajectories.jsonl")
    by_index = {t["prompt_index"]: t for t in kept}
    assert sorted(by_index) == [0, 1, 2, 3, 4, 6]
    for index, t in by_index.items():
        assert t["conversations"][1]["value"] == edited[index]["prompt"]
        assert t["metadata"]["id"] == edited[index]["id"], index
    lines = {(r["metadata"]["row_key"], r["metadata"]["attempt"]): r for r in _lines(run)}
    twin_first = by_index[2]["metadata"]
    assert lines[(twin_first["row_key"], 1)]["metadata"]["id"] == "twin-a"  # as committed; merged with the new id
    config = json.loads((run / "config.json").read_text())
    assert len(config["invocations"]) == 2 and all(i["ended_at"] for i in config["invocations"])


def test_duration_sums_every_invocation(tmp_path, model_server, remote_args):
    dataset = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "@latency 0.6\nSlow one."}, {"prompt": "@fail 400 1\nOnce."}])
    assert _run(tmp_path, dataset, remote_args, "--distribution=terminal_only").returncode == 2
    run = tmp_path / "data" / "r"
    first = json.loads((run / "statistics.json").read_text())
    assert _run(tmp_path, dataset, remote_args, "--distribution=terminal_only", "--resume").returncode == 0
    stats = json.loads((run / "statistics.json").read_text())
    invocations = json.loads((run / "config.json").read_text())["invocations"]
    assert stats["run_time"]["invocations"] == 2 and stats["run_time"]["first_started_at"] == invocations[0]["started_at"][:19]
    assert stats["duration_seconds"] >= first["duration_seconds"] + 0.1  # the second invocation is added, not alone
    assert stats["duration_seconds"] >= 0.6


def test_rows_appended_during_the_run_are_merged(tmp_path, model_server, remote_args):
    rows = [{"prompt": f"@latency 0.4\nSlow row {i}."} for i in range(4)]
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    args = [sys.executable, str(REPO / "batch_runner.py"), f"--dataset_file={dataset}", "--run_name=r", "--batch_size=2",
            "--num_workers=1", "--distribution=terminal_only", *remote_args]
    proc = subprocess.Popen(args, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    run = tmp_path / "data" / "r"
    deadline = time.monotonic() + 60
    while not (run / "batch_0.jsonl").exists() or not (run / "batch_0.jsonl").read_text():
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    with open(dataset, "a", encoding="utf-8") as handle:  # the user adds rows while the run goes on
        handle.write(json.dumps({"prompt": "Appended row.", "id": "late"}) + "\n")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    kept = read_jsonl(run / "trajectories.jsonl")
    stats = json.loads((run / "statistics.json").read_text())
    assert len(kept) == 5 and kept[4]["metadata"]["id"] == "late" and kept[4]["prompt_index"] == 4
    assert stats["total_prompts"] == 5 and stats["stale_rows"] == 0 and stats["outcomes"]["ok"] == 5


def _two_runs(tmp_path, remote_args, b_rows, *b_flags) -> list[str]:
    with_ids = [
        {"prompt": TERMINAL + "Run it.", "id": 7},
        {"prompt": "@reasoning none\nNo reasoning here.", "id": "text-id"},
        {"prompt": "@fail 400 1\nFails.", "id": "f"},
        {"prompt": "@unknown_tool 5\nAlways unknown.", "id": "p"},
    ]
    a = write_jsonl(tmp_path / "a.jsonl", with_ids)
    b = write_jsonl(tmp_path / "b.jsonl", b_rows)
    assert _run(tmp_path, a, remote_args, "--distribution=terminal_only", "--seed=11", run_name="a").returncode == 2
    proc = _run(tmp_path, b, remote_args, *b_flags, run_name="b")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return [str(tmp_path / "data" / name / "trajectories.jsonl") for name in ("a", "b")]


def _load_both_orders(tmp_path, files):
    datasets = pytest.importorskip("datasets")
    for order in (files, files[::-1]):
        loaded = datasets.load_dataset("json", data_files=order, split="train", cache_dir=str(tmp_path / "hf"))
        assert loaded.num_rows == sum(len(read_jsonl(f)) for f in files)
        assert loaded.features["metadata"]["id"].dtype == "string"
        assert loaded.features["metadata"]["seed"].dtype == "int64"


def test_two_dissimilar_runs_load_together_in_either_order(tmp_path, model_server, remote_args):
    pytest.importorskip("datasets")
    plain = [  # no ids, no seed, another distribution and turn limit, rows without reasoning kept, no cost reported
        {"prompt": '@cost none\n@tool write_file {"path": "a.txt", "content": "x"}\n@tool read_file {"path": "a.txt"}\nFiles.'},
        {"prompt": "@cost none\n@reasoning none\nKept without reasoning."},
        {"prompt": "@cost none\nJust answer."},
    ]
    files = _two_runs(tmp_path, remote_args, plain, "--distribution=development", "--max_turns=5",
                      "--keep_no_reasoning")
    seeds = set()
    for name in ("a", "b"):
        config = json.loads((tmp_path / "data" / name / "config.json").read_text())["config"]
        assert isinstance(config["seed"], int) and config["seed_drawn"] == (name == "b")
        for row in read_jsonl(tmp_path / "data" / name / "trajectories.jsonl"):
            assert row["metadata"]["seed"] == config["seed"] and isinstance(row["metadata"]["id"], str)
            seeds.add(row["metadata"]["seed"])
            roles = [turn["from"] for turn in row["conversations"]]
            assert roles[:2] == ["system", "human"] and set(roles[2:]) <= {"gpt", "tool"}, roles
    assert len(seeds) == 2
    _load_both_orders(tmp_path, files)


def test_a_run_without_any_loop_note_and_one_with_them_load_together(tmp_path, model_server, remote_args):
    pytest.importorskip("datasets")
    files = _two_runs(tmp_path, remote_args, [{"prompt": TERMINAL * 3 + "Out of turns."}], "--max_turns=2")
    (limited,) = read_jsonl(files[1])
    assert limited["metadata"]["loop_notes"]  # b has a note; no row of a has one
    assert [turn["from"] for turn in limited["conversations"]].count("system") == 1  # the note is not a turn
    _load_both_orders(tmp_path, files)


def test_an_unseeded_run_draws_its_seed_once_and_resumes_with_it(tmp_path, model_server, remote_args):
    rows = [{"prompt": f"Question {i}."} for i in range(3)] + [{"prompt": "@fail 400 1\nOnce."}]
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    assert _run(tmp_path, dataset, remote_args, "--distribution=balanced").returncode == 2
    run = tmp_path / "data" / "r"
    seed = json.loads((run / "config.json").read_text())["config"]["seed"]
    proc = _run(tmp_path, dataset, remote_args, "--distribution=balanced", "--resume")  # no config-change refusal
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads((run / "config.json").read_text())["config"]["seed"] == seed
    assert {line["metadata"]["seed"] for line in _lines(run)} == {seed}
    assert SECRET_KEY not in (run / "config.json").read_text()


def test_toolsets_used_are_the_offered_ones_and_the_sample_is_kept(tmp_path, model_server, remote_args):
    # "image_gen" samples image_gen 90% of the time, but no image backend is configured here, so
    # its one tool is never offered; a toolset counts as offered when one of its tools is.
    rows = [{"prompt": f"Question {i}."} for i in range(12)]
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    proc = _run(tmp_path, dataset, remote_args, "--distribution=image_gen", "--seed=3")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    kept = read_jsonl(tmp_path / "data" / "r" / "trajectories.jsonl")
    from tools.registry import all_tools

    for row in kept:
        meta = row["metadata"]
        offered_sets = {all_tools()[name].toolset for name in meta["tools_offered"]}
        assert set(row["toolsets_used"]) == offered_sets
        if offered_sets & set(meta["toolsets_sampled"]):
            assert set(row["toolsets_used"]) <= set(meta["toolsets_sampled"])
        else:  # the draw offered nothing: the distribution's highest toolset that can (vision) instead
            assert row["toolsets_used"] == ["vision"], meta
    assert any("image_gen" in row["metadata"]["toolsets_sampled"] for row in kept)
    assert not any("image_gen" in row["toolsets_used"] for row in kept)  # no image backend configured here
    summary = _embedded(tmp_path / "data" / "r", "summary-data")
    assert summary["toolsets"]["image_gen"]["rows"] == 0 and summary["toolsets"]["image_gen"]["sampled_rows"] > 0


def test_a_run_whose_draws_offer_no_tool_falls_back_and_loads_with_another_run(tmp_path, model_server, remote_args):
    """With seed 2008 both rows of the image_gen distribution draw only image_gen, which has no
    backend here: each row falls back to the distribution's highest toolset that can offer a tool
    (image_gen's tie partner vision, else web), keeps its draw in metadata.toolsets_sampled, and
    the run loads together with another one in either order (no all-empty list column)."""
    pytest.importorskip("datasets")
    files = _two_runs(tmp_path, remote_args, [{"prompt": "img 1"}, {"prompt": "img 2"}],
                      "--distribution=image_gen", "--seed=2008")
    rows = read_jsonl(tmp_path / "data" / "b" / "trajectories.jsonl")
    assert len(rows) == 2
    for row in rows:
        assert row["metadata"]["toolsets_sampled"] == ["image_gen"], row["metadata"]
        assert row["toolsets_used"] and row["metadata"]["tools_offered"], row
        assert row["toolsets_used"][0] in ("vision", "web")
    _load_both_orders(tmp_path, files)
