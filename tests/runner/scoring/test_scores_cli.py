"""Scorers through the real CLI: metadata.scores on every scored line, the pass threshold, a
scorer's failure kept on its entry, and bad scoring input refused before any model call."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import read_jsonl, run_cli, write_jsonl

ENTRY_TYPES = {"scorer": str, "value": float, "passed": bool, "explanation": str}


def _run(tmp_path, rows, remote_args, *flags, run_name="r"):
    dataset = write_jsonl(tmp_path / f"{run_name}.jsonl", rows)
    return run_cli([f"--dataset_file={dataset}", f"--run_name={run_name}", "--batch_size=5",
                    "--distribution=terminal_only", *remote_args, *flags], tmp_path)


def _kept(tmp_path, run_name="r") -> list[dict]:
    return read_jsonl(tmp_path / "data" / run_name / "trajectories.jsonl")


def _assert_entry_types(scores: list[dict]) -> None:
    for entry in scores:
        assert {k: type(v) for k, v in entry.items()} == ENTRY_TYPES, entry


def test_includes_and_exact_score_every_sample(tmp_path, model_server, remote_args):
    rows = [
        {"prompt": "@answer The capital is PARIS,  of course.\nCapital of France?", "target": "capital is   paris"},
        {"prompt": "@answer lyon\nWhich city?", "target": ["Marseille", " LYON "]},
        {"prompt": "@answer No idea.\nSomething else?", "target": "yes"},
    ]
    proc = _run(tmp_path, rows, remote_args, "--scorer=includes,exact")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    by_prompt = {t["conversations"][1]["value"].splitlines()[-1]: t["metadata"]["scores"] for t in _kept(tmp_path)}
    for scores in by_prompt.values():
        _assert_entry_types(scores)
        assert [e["scorer"] for e in scores] == ["includes", "exact"]
    assert [(e["value"], e["passed"]) for e in by_prompt["Capital of France?"]] == [(1.0, True), (0.0, False)]
    assert [(e["value"], e["passed"]) for e in by_prompt["Which city?"]] == [(1.0, True), (1.0, True)]
    assert [(e["value"], e["passed"]) for e in by_prompt["Something else?"]] == [(0.0, False), (0.0, False)]
    assert "capital is   paris" in by_prompt["Capital of France?"][0]["explanation"]
    batch = read_jsonl(tmp_path / "data" / "r" / "batch_0.jsonl")
    assert all("scores" in line["metadata"] for line in batch)  # the committed lines carry them


def test_pass_threshold_applies_to_every_entry(tmp_path, model_server, remote_args):
    rows = [{"prompt": "@answer nothing\nQ?", "target": "something"}]
    assert _run(tmp_path, rows, remote_args, "--scorer=exact,includes", "--pass_threshold=0").returncode == 0
    scores = _kept(tmp_path)[0]["metadata"]["scores"]
    assert [(e["value"], e["passed"]) for e in scores] == [(0.0, True), (0.0, True)]
    proc = _run(tmp_path, rows, remote_args, "--scorer=exact", "--pass_threshold=-0.5x", run_name="bad")
    assert proc.returncode == 1 and "--pass_threshold" in proc.stderr


def test_a_run_without_scorers_writes_no_scores(tmp_path, model_server, remote_args):
    rows = [{"prompt": "@answer yes\nQ?", "target": "yes", "verify": "true", "rubric": "be nice"}]
    assert _run(tmp_path, rows, remote_args).returncode == 0
    kept = _kept(tmp_path)
    assert len(kept) == 1 and "scores" not in kept[0]["metadata"]
    config = json.loads((tmp_path / "data" / "r" / "config.json").read_text())
    assert "scorer" not in config["fingerprint_fields"]


def test_python_scorer_sync_and_async_and_failing(tmp_path, model_server, remote_args):
    (tmp_path / "my_scorers.py").write_text(
        "from runner.scoring import Score\n"
        "def length(sample):\n"
        "    assert sample.row['extra'] == 'carried' and sample.target == 'abc'\n"
        "    assert [t['from'] for t in sample.conversation][:2] == ['system', 'human']\n"
        "    return Score(len(sample.final_answer) / 10, f\"{sample.metadata['row_key']} {sample.final_answer}\")\n"
        "async def boolean(sample):\n"
        "    return sample.final_answer == 'abcdefghij'\n"
        "def broken(sample):\n"
        "    raise RuntimeError('the scorer is broken')\n"
        "def not_a_score(sample):\n"
        "    return 'high'\n"
    )
    rows = [{"prompt": "@answer abcdefghij\nTen letters.", "target": "abc", "extra": "carried"}]
    proc = _run(tmp_path, rows, remote_args, "--scorer=my_scorers:length,my_scorers.py:boolean,"
                "my_scorers:broken,my_scorers:not_a_score")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    kept = _kept(tmp_path)
    assert len(kept) == 1 and kept[0]["completed"]  # the failing scorers did not fail the sample
    scores = kept[0]["metadata"]["scores"]
    _assert_entry_types(scores)
    assert [(e["scorer"], e["value"], e["passed"]) for e in scores] == [
        ("my_scorers:length", 1.0, True), ("my_scorers.py:boolean", 1.0, True),
        ("my_scorers:broken", 0.0, False), ("my_scorers:not_a_score", 0.0, False)]
    assert scores[0]["explanation"] == f"{kept[0]['metadata']['row_key']} abcdefghij"
    assert scores[2]["explanation"] == "scorer error: RuntimeError: the scorer is broken"
    assert scores[3]["explanation"].startswith("scorer error: ValueError: the scorer returned 'high'")


@pytest.mark.parametrize("flags, rows, message", [
    (["--scorer=includes,nosuch"], [{"prompt": "Q", "target": "x"}], "unknown scorer 'nosuch'"),
    (["--scorer=missing_module_xyz:fn"], [{"prompt": "Q"}], "cannot import missing_module_xyz"),
    (["--scorer=nofile.py:fn"], [{"prompt": "Q"}], "no such file nofile.py"),
    (["--scorer=judge"], [{"prompt": "Q"}], "--scorer=judge needs --judge_model"),
    (["--scorer=command"], [{"prompt": "Q"}, {"prompt": "R"}], "no 'verify' field"),
    (["--scorer=includes"], [{"prompt": "Q", "target": "x"}, {"prompt": "R"}], "no 'target' field"),
    (["--scorer=includes"], [{"prompt": "Q", "target": 3}], "'target' must be a string or a list of strings"),
    (["--scorer=includes"], [{"prompt": "Q", "target": []}], "'target' must be a non-empty string"),
    (["--scorer=,"], [{"prompt": "Q"}], "--scorer is empty"),
    # an option of a scorer the run does not use would be ignored: the check the user asked for never runs
    (["--scorer=includes", "--verify_command=pytest -q"], [{"prompt": "Q", "target": "x"}],
     "--verify_command is an option of --scorer=command, which is not given"),
    (["--judge_model=judge-x"], [{"prompt": "Q"}], "--judge_model is an option of --scorer=judge, which is not given"),
    (["--scorer=includes", "--judge_rubric=be strict"], [{"prompt": "Q", "target": "x"}],
     "--judge_rubric is an option of --scorer=judge"),
])
def test_bad_scoring_input_is_one_line_before_any_model_call(tmp_path, model_server, remote_args, flags, rows,
                                                             message):
    proc = _run(tmp_path, rows, remote_args, *flags)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert message in proc.stderr, proc.stderr
    assert model_server.count() == 0
    assert not list((tmp_path / "data").glob("*/batch_*.jsonl"))


def test_a_module_scorer_that_raises_on_import_is_refused(tmp_path, model_server, remote_args):
    (tmp_path / "bad_scorer.py").write_text("raise ImportError('needs numpy 9')\n")
    proc = _run(tmp_path, [{"prompt": "Q"}], remote_args, "--scorer=bad_scorer:fn")
    assert proc.returncode == 1 and "cannot import bad_scorer: ImportError: needs numpy 9" in proc.stderr
    (tmp_path / "good.py").write_text("x = 1\n")
    proc = _run(tmp_path, [{"prompt": "Q"}], remote_args, "--scorer=good.py:fn")
    assert proc.returncode == 1 and "has no function 'fn'" in proc.stderr
    assert model_server.count() == 0


def test_two_scored_runs_load_together_in_datasets(tmp_path, model_server, remote_args):
    datasets = pytest.importorskip("datasets")
    (tmp_path / "s.py").write_text("def boom(sample):\n    raise ValueError('no')\n")
    a = [{"prompt": "@answer yes\nA?", "target": "yes"}, {"prompt": "@answer no\nB?", "target": ["yes", "y"]}]
    b = [{"prompt": "@answer 3\nC?", "target": "3", "id": 4}]
    assert _run(tmp_path, a, remote_args, "--scorer=includes", run_name="a").returncode == 0
    assert _run(tmp_path, b, remote_args, "--scorer=s.py:boom,exact", "--pass_threshold=0.5",
                run_name="b").returncode == 0
    files = [str(tmp_path / "data" / name / "trajectories.jsonl") for name in ("a", "b")]
    for order in (files, files[::-1]):
        loaded = datasets.load_dataset("json", data_files=order, split="train", cache_dir=str(tmp_path / "hf"))
        assert loaded.num_rows == 3
        entry = loaded.features["metadata"]["scores"].feature
        assert {k: v.dtype for k, v in entry.items()} == {"scorer": "string", "value": "float64", "passed": "bool",
                                                          "explanation": "string"}


def test_resume_with_other_scorers_is_a_configuration_change(tmp_path, model_server, remote_args):
    rows = [{"prompt": "@answer yes\nQ?", "target": "yes"}, {"prompt": "@fail 400 1\nR?", "target": "no"}]
    assert _run(tmp_path, rows, remote_args, "--scorer=includes").returncode == 2
    proc = _run(tmp_path, rows, remote_args, "--scorer=exact", "--resume")
    assert proc.returncode == 1 and """(scorer: ["includes"] -> ["exact"]; changed since""" in proc.stderr, proc.stderr
    proc = _run(tmp_path, rows, remote_args, "--scorer=exact", "--resume", "--allow_config_change")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    scorers = {t["conversations"][1]["value"].splitlines()[-1]: t["metadata"]["scores"][0]["scorer"] for t in _kept(tmp_path)}
    assert scorers == {"Q?": "includes", "R?": "exact"}


def test_a_scorer_that_runs_out_of_time_keeps_the_sample(tmp_path, model_server, remote_args):
    (tmp_path / "slow.py").write_text("import asyncio\nasync def slow(sample):\n    await asyncio.sleep(60)\n")
    rows = [{"prompt": "@answer yes\nQ?", "target": "yes"}]
    proc = _run(tmp_path, rows, remote_args, "--scorer=slow.py:slow,includes", "--verify_timeout=1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    kept = _kept(tmp_path)
    assert len(kept) == 1 and kept[0]["conversations"][-1]["from"] == "gpt"
    slow, includes = kept[0]["metadata"]["scores"]
    assert (slow["value"], slow["passed"]) == (0.0, False)
    assert slow["explanation"] == "scorer error: timed out: the scorer took longer than 6s"
    assert includes["passed"]
    assert kept[0]["metadata"]["duration_seconds"] < 30


def test_sync_scorers_that_never_return_do_not_stall_the_run(tmp_path, model_server, remote_args):
    # More hung scorers than a worker has threads for its sessions' commands and clean-ups.
    (tmp_path / "stuck.py").write_text("import time\ndef stuck(sample):\n    time.sleep(3600)\n")
    rows = [{"prompt": f"@tool terminal {{\"command\": \"echo {i}\"}}\n@answer done {i}\nQ{i}", "target": f"done {i}"}
            for i in range(12)]
    proc = _run(tmp_path, rows, remote_args, "--scorer=includes,stuck.py:stuck", "--verify_timeout=1",
                "--num_workers=2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    kept = _kept(tmp_path)
    assert len(kept) == 12
    for line in kept:
        includes, stuck = line["metadata"]["scores"]
        assert includes["passed"] and not stuck["passed"]
        assert stuck["explanation"].startswith("scorer error: timed out")


@pytest.mark.parametrize("raised", ["SystemExit(3)", "KeyboardInterrupt()"])
def test_a_scorer_that_raises_an_exit_keeps_the_sample(tmp_path, model_server, remote_args, raised):
    (tmp_path / "quits.py").write_text(f"def quits(sample):\n    raise {raised}\n"
                                       f"async def aquits(sample):\n    raise {raised}\n")
    rows = [{"prompt": f"@answer yes {i}\nQ{i}?", "target": "yes"} for i in range(3)]
    proc = _run(tmp_path, rows, remote_args, "--scorer=includes,quits.py:quits,quits.py:aquits")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    kept = _kept(tmp_path)
    assert len(kept) == 3
    for line in kept:
        includes, quits, aquits = line["metadata"]["scores"]
        _assert_entry_types([includes, quits, aquits])
        assert includes["passed"]
        name = raised.split("(")[0]
        for entry in (quits, aquits):
            assert (entry["value"], entry["passed"]) == (0.0, False)
            assert entry["explanation"].startswith(f"scorer error: {name}"), entry
