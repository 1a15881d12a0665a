"""Samples per prompt through the real CLI: each (row, sample) its own unit of work."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import pytest

from tests.conftest import REPO, read_jsonl, run_cli, write_jsonl


def _run(tmp_path, dataset, remote_args, *extra, run_name="r", timeout=300):
    args = [f"--dataset_file={dataset}", f"--run_name={run_name}", "--batch_size=4", "--distribution=terminal_only",
            *remote_args, *extra]
    return run_cli(args, tmp_path, timeout=timeout)


def _batch_lines(tmp_path, run_name="r") -> list[dict]:
    return [line for path in sorted((tmp_path / "data" / run_name).glob("batch_*.jsonl")) for line in read_jsonl(path)]


def _openings(server) -> Counter:
    """Conversations the server saw opened, by prompt (requests with no assistant turn yet)."""
    counts = Counter()
    for request in server.requests:
        messages = request.body.get("messages", [])
        if not any(m["role"] == "assistant" for m in messages):
            counts[next(m["content"] for m in messages if m["role"] == "user")] += 1
    return counts


TOOL = '@tool terminal {"command": "pwd; ls; touch left-by-the-agent"}\n'


def test_each_sample_is_its_own_unit_with_its_own_key_seed_and_environment(tmp_path, model_server, remote_args):
    rows = [{"prompt": TOOL + "First.", "id": "a"}, {"prompt": TOOL + "Second.", "id": "b"}]
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    proc = _run(tmp_path, dataset, remote_args, "--samples_per_prompt=3", "--seed=7")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    kept = read_jsonl(tmp_path / "data" / "r" / "trajectories.jsonl")
    # by row, then sample; each (row, sample) once
    assert [(t["prompt_index"], t["metadata"]["sample"]) for t in kept] == [(i, s) for i in range(2) for s in range(3)]
    assert {t["metadata"]["samples"] for t in kept} == {3}
    assert len({t["metadata"]["row_key"] for t in kept}) == 6 and len({t["metadata"]["sample_seed"] for t in kept}) == 6
    assert all(t["metadata"]["id"] == rows[t["prompt_index"]]["id"] for t in kept)
    assert _openings(model_server) == Counter({rows[0]["prompt"]: 3, rows[1]["prompt"]: 3})
    # a fresh environment per sample: no sample sees the file another one left behind
    outputs = [t["conversations"][3]["value"] for t in kept]
    assert all("left-by-the-agent" not in out.split('"output": "')[1].split("touch")[0] for out in outputs)
    assert len({out.split('"output": "')[1].split("\\n")[0] for out in outputs}) == 6  # six working directories
    stats = json.loads((tmp_path / "data" / "r" / "statistics.json").read_text())
    assert stats["total_prompts"] == 2 and stats["outcomes"]["ok"] == 6 and stats["samples_per_prompt"] == 3

    # The same seed gives each sample the same seed again; N = 1 is sample 0 of N = 3.
    proc = _run(tmp_path, dataset, remote_args, "--seed=7", run_name="one")
    assert proc.returncode == 0, proc.stderr
    one = read_jsonl(tmp_path / "data" / "one" / "trajectories.jsonl")
    assert [(t["metadata"]["sample"], t["metadata"]["samples"]) for t in one] == [(0, 1), (0, 1)]
    assert [t["metadata"]["sample_seed"] for t in one] == [t["metadata"]["sample_seed"] for t in kept
                                                           if t["metadata"]["sample"] == 0]
    assert [t["metadata"]["row_key"] for t in one] == [t["metadata"]["row_key"] for t in kept if t["metadata"]["sample"] == 0]
    assert "samples_per_prompt" not in json.loads((tmp_path / "data" / "one" / "statistics.json").read_text())


def test_raising_samples_on_resume_runs_only_the_new_ones_and_lowering_is_refused(tmp_path, model_server, remote_args):
    rows = [{"prompt": "Alpha."}, {"prompt": "Beta."}]
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    assert _run(tmp_path, dataset, remote_args).returncode == 0
    assert _openings(model_server) == Counter({"Alpha.": 1, "Beta.": 1})
    proc = _run(tmp_path, dataset, remote_args, "--resume", "--samples_per_prompt=3")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 of 6 samples already committed; 4 to run" in proc.stdout
    assert _openings(model_server) == Counter({"Alpha.": 3, "Beta.": 3})  # samples 1 and 2 only
    lines = _batch_lines(tmp_path)
    assert sorted((line["prompt_index"], line["metadata"]["sample"]) for line in lines) == [
        (i, s) for i in range(2) for s in range(3)]
    assert len(read_jsonl(tmp_path / "data" / "r" / "trajectories.jsonl")) == 6

    before = model_server.count()
    proc = _run(tmp_path, dataset, remote_args, "--resume", "--samples_per_prompt=2")
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1].startswith("❌ Error: --samples_per_prompt=2 is lower than the 3")
    assert "already paid for" in proc.stderr
    assert model_server.count() == before
    assert len(read_jsonl(tmp_path / "data" / "r" / "trajectories.jsonl")) == 6  # nothing lost


@pytest.mark.parametrize("flags, message", [
    (["--samples_per_prompt=0"], "--samples_per_prompt must be an integer >= 1 (got 0)"),
    (["--samples_per_prompt=-2"], "--samples_per_prompt must be an integer >= 1 (got -2)"),
    (["--keep=passing"], "--keep=passing selects samples by their score: it needs --scorer"),
    (["--keep=best", "--samples_per_prompt=4"], "--keep=best selects samples by their score: it needs --scorer"),
    (["--keep=most"], "--keep must be one of: all, passing, best (got 'most')"),
    (["--stop_after_passing=1"], "--stop_after_passing counts the samples that passed: it needs --scorer"),
])
def test_bad_sample_flags_are_refused_before_any_model_call(tmp_path, model_server, remote_args, flags, message):
    dataset = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "Hello."}])
    proc = _run(tmp_path, dataset, remote_args, *flags)
    assert proc.returncode == 1
    assert proc.stderr.strip() == f"❌ Error: {message}"
    assert model_server.count() == 0 and not (tmp_path / "data" / "r").exists()


def test_python_api_takes_samples_per_prompt(tmp_path):
    write_jsonl(tmp_path / "d.jsonl", [{"prompt": "Hello there."}])
    script = tmp_path / "s.py"
    script.write_text(
        "from batch_runner import BatchRunner\n"
        "if __name__ == '__main__':\n"
        "    runner = BatchRunner(dataset_file='d.jsonl', batch_size=2, run_name='api', model='mock',\n"
        "                         samples_per_prompt=2, distribution='terminal_only')\n"
        "    raise SystemExit(runner.run())\n")
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=180,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    kept = read_jsonl(tmp_path / "data" / "api" / "trajectories.jsonl")
    assert [(t["metadata"]["sample"], t["metadata"]["samples"]) for t in kept] == [(0, 2), (1, 2)]


def test_a_model_without_reasoning_is_said_early_and_kept_later_with_no_new_request(tmp_path, model_server,
                                                                                    remote_args):
    rows = [{"prompt": f"@reasoning none\n{TOOL}Row {i}."} for i in range(6)]
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    proc = _run(tmp_path, dataset, remote_args, "--num_workers=2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    warning = next(line for line in out.splitlines() if "were all discarded for no reasoning" in line)
    assert "--keep_no_reasoning" in warning
    assert out.index(warning) < out.index("BATCH PROCESSING")  # said during the run, not only at its end
    assert "0 of 6 kept: all discarded for no reasoning (pass --keep_no_reasoning" in out
    # the summary's counts include what the discarded rows did
    assert "No tool calls were made during this run" not in out and "No assistant turns recorded" not in out
    assert "the 6 discarded rows made these" in out and "Total assistant turns:    12" in out
    run = tmp_path / "data" / "r"
    assert read_jsonl(run / "trajectories.jsonl") == []
    stats = json.loads((run / "statistics.json").read_text())
    assert stats["discarded_statistics"]["tool_statistics"]["terminal"]["count"] == 6
    assert stats["spend"]["discarded"]["requests"] == 12
    live = json.loads((run / "status.json").read_text())["rows"]  # the live counts apply the filter too
    assert (live["kept"], live["discarded"]) == (0, 6)

    before = model_server.count()
    proc = run_cli(["--report", "--run_name=r", "--keep_no_reasoning"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert model_server.count() == before
    kept = read_jsonl(run / "trajectories.jsonl")
    assert [t["prompt_index"] for t in kept] == list(range(6))
    assert all(t["conversations"][1]["value"] == rows[t["prompt_index"]]["prompt"] for t in kept)
    assert json.loads((run / "statistics.json").read_text())["outcomes"]["ok"] == 6


def _stats(tmp_path, run_name="r") -> dict:
    return json.loads((tmp_path / "data" / run_name / "statistics.json").read_text())


def _kept(tmp_path, run_name="r") -> list[dict]:
    return read_jsonl(tmp_path / "data" / run_name / "trajectories.jsonl")


def _passed(line: dict) -> bool:
    return line["metadata"]["scores"][0]["passed"]


def test_keep_selects_samples_when_the_outputs_are_built_and_statistics_score_them(tmp_path, model_server,
                                                                                    remote_args):
    rows = [{"prompt": "@answers right|wrong|wrong|right\nQuestion one.", "target": "right"},
            {"prompt": "@answers wrong\nQuestion two.", "target": "right"}]
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    proc = _run(tmp_path, dataset, remote_args, "--samples_per_prompt=4", "--scorer=includes", "--keep=passing")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = _batch_lines(tmp_path)
    assert len(lines) == 8 and sum(map(_passed, lines)) == 2
    passing = sorted((line["prompt_index"], line["metadata"]["sample"]) for line in lines if _passed(line))
    kept = _kept(tmp_path)
    assert [(t["prompt_index"], t["metadata"]["sample"]) for t in kept] == passing  # rejection sampling
    stats = _stats(tmp_path)
    assert stats["outcomes"]["ok"] == 2 and stats["outcomes"]["unselected"] == 6
    assert stats["spend"]["unselected"]["requests"] == 6 and stats["spend"]["kept"]["requests"] == 2
    assert "Not selected (--keep): 6" in proc.stdout
    scoring = stats["scoring"]
    assert scoring["scorers"] == ["includes"] and scoring["samples"] == 8 and scoring["passed"] == 2
    assert scoring["mean"] == 0.25 and scoring["errors"] == 0 and scoring["by_scorer"] == {"includes": 0.25}
    # pass@k over the rows: row one has 2 of 4, row two 0 of 4
    assert scoring["pass_at_k"] == {"1": 0.25, "2": round((1 - 1 / 6) / 2, 6), "3": 0.5, "4": 0.5}

    # Another selection is a rebuild of the outputs, not a new request.
    before = model_server.count()
    assert run_cli(["--report", "--run_name=r", "--keep=best"], tmp_path).returncode == 0
    best = _kept(tmp_path)
    assert [(t["prompt_index"], t["metadata"]["sample"]) for t in best] == [passing[0], (1, 0)]
    assert _stats(tmp_path)["outcomes"]["unselected"] == 6
    assert run_cli(["--report", "--run_name=r", "--keep=all"], tmp_path).returncode == 0
    assert len(_kept(tmp_path)) == 8 and "unselected" not in _stats(tmp_path)["outcomes"]
    assert model_server.count() == before


def test_stop_after_passing_starts_no_more_samples_of_a_row_that_passed(tmp_path, model_server, remote_args):
    rows = [{"prompt": "@answers right\nEasy.", "target": "right"},
            {"prompt": "@answers wrong|wrong|right\nHard.", "target": "right"},
            {"prompt": "@answers wrong\nImpossible.", "target": "right"}]
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    flags = ["--samples_per_prompt=5", "--scorer=includes", "--stop_after_passing=1", "--num_workers=1"]
    proc = _run(tmp_path, dataset, remote_args, *flags)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # one session at a time: each row stops at its first passing sample
    assert _openings(model_server) == Counter({rows[0]["prompt"]: 1, rows[1]["prompt"]: 3, rows[2]["prompt"]: 5})
    stats = _stats(tmp_path)
    assert stats["outcomes"]["spared"] == 4 + 2 and stats["outcomes"]["not_run"] == 0
    assert stats["outcomes"]["ok"] == 9 and stats["scoring"]["passed"] == 2
    assert "Not run (--stop_after_passing, their row passed enough): 6" in proc.stdout
    # It holds across resume: nothing more is started, even with more samples.
    before = model_server.count()
    proc = _run(tmp_path, dataset, remote_args, *flags[:-1], "--resume")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = _run(tmp_path, dataset, remote_args, "--samples_per_prompt=6", *flags[1:], "--resume")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert model_server.count() == before + 1  # only the impossible row's new sample 5
    assert _stats(tmp_path)["outcomes"]["spared"] == 5 + 3


def test_a_plain_resume_keeps_the_runs_early_stop_and_selection(tmp_path, model_server, remote_args):
    # A run stopped part way is resumed with --resume alone: its --stop_after_passing still spares
    # what it spared (those samples are not paid for), and its --keep still selects.
    rows = [{"prompt": "@answers right\nEasy.", "target": "right"},
            {"prompt": "@answers wrong\nImpossible.", "target": "right"}]
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    flags = ["--samples_per_prompt=3", "--scorer=includes", "--stop_after_passing=1", "--keep=passing",
             "--num_workers=1"]
    proc = _run(tmp_path, dataset, remote_args, *flags)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    before = model_server.count()
    run = ["--run_name=r", "--resume", *remote_args]
    proc = run_cli(run, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert model_server.count() == before  # the easy row's spared samples stay unpaid
    assert _stats(tmp_path)["outcomes"]["spared"] == 2
    kept = read_jsonl(tmp_path / "data" / "r" / "trajectories.jsonl")
    assert [line["metadata"]["scores"][0]["passed"] for line in kept] == [True]
    # Given again with another value, the flags are this invocation's.
    proc = run_cli([*run, "--keep=all", "--stop_after_passing=3"], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert model_server.count() == before + 2  # the easy row's samples 1 and 2
    assert len(read_jsonl(tmp_path / "data" / "r" / "trajectories.jsonl")) == 6
