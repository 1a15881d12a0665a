"""--rescore: the committed samples scored again from their lines (judge requests only), the
outputs rebuilt under the run lock, the batch files untouched; scorers that need the sample's
environment refused with nothing changed."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import SECRET_KEY, read_jsonl, run_cli, write_jsonl

ROWS = [
    {"prompt": "@answer The capital is Paris.\nCapital of France?", "target": "paris"},
    {"prompt": "@answer paris\n@grade I\nSay the capital.", "target": ["Paris", "Lyon"]},
    {"prompt": "@fail 400 1\nFails once.", "target": "x"},
]


def _snapshot(run: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(run.iterdir()) if p.is_file() and p.name != ".lock"}


def _first_run(tmp_path, remote_args):
    dataset = write_jsonl(tmp_path / "d.jsonl", ROWS)
    proc = run_cli([f"--dataset_file={dataset}", "--run_name=r", "--batch_size=5", "--distribution=terminal_only",
                    *remote_args, "--scorer=includes"], tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr  # one row failed
    return tmp_path / "data" / "r"


def _rescore(tmp_path, *flags, env=None):
    return run_cli(["--run_name=r", "--rescore", *flags], tmp_path, env=env)


def _scores(run: Path) -> dict[str, list[tuple[str, float, bool]]]:
    return {t["conversations"][1]["value"].splitlines()[-1]: [(e["scorer"], e["value"], e["passed"])
                                                           for e in t["metadata"]["scores"]]
            for t in read_jsonl(run / "trajectories.jsonl")}


def test_rescore_replaces_the_scores_without_an_agent_request(tmp_path, model_server, remote_args):
    run = _first_run(tmp_path, remote_args)
    batches = {name: data for name, data in _snapshot(run).items() if name.startswith("batch_")}
    agent_requests = model_server.count()
    proc = _rescore(tmp_path, "--scorer=exact,judge", "--judge_model=judge-model",
                    env={"OPENROUTER_API_KEY": SECRET_KEY})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Rescored 2 samples with exact, judge" in proc.stdout
    assert _scores(run) == {"Capital of France?": [("exact", 0.0, False), ("judge", 1.0, True)],
                            "Say the capital.": [("exact", 1.0, True), ("judge", 0.0, False)]}
    judged = model_server.requests[agent_requests:]
    assert len(judged) == 2 and all(r.body["model"] == "judge-model" for r in judged)
    assert all(r.headers["authorization"] == f"Bearer {SECRET_KEY}" for r in judged)
    assert {n: d for n, d in _snapshot(run).items() if n.startswith("batch_")} == batches  # never rewritten
    stats = json.loads((run / "statistics.json").read_text())
    assert stats["spend"]["rescoring"]["requests"] == 2 and stats["spend_by_model"]["judge-model"]["requests"] == 2
    assert stats["spend"]["all"]["requests"] == sum(stats["spend"][b]["requests"] for b in stats["spend"] if b != "all")
    assert "judge-model" in (run / "report.html").read_text()
    assert SECRET_KEY not in (run / "rescores.jsonl").read_text()

    # --report and a later rescore: the latest scores are the sample's.
    assert run_cli(["--run_name=r", "--report"], tmp_path).returncode == 0
    assert _scores(run)["Capital of France?"] == [("exact", 0.0, False), ("judge", 1.0, True)]
    assert _rescore(tmp_path, "--scorer=includes", "--pass_threshold=2").returncode == 0
    assert _scores(run) == {"Capital of France?": [("includes", 1.0, False)], "Say the capital.": [("includes", 1.0, False)]}
    assert len(model_server.requests) == agent_requests + 2

    # A resume runs the failed row with the run's scorers; the rescored samples keep theirs.
    dataset = tmp_path / "d.jsonl"
    proc = run_cli([f"--dataset_file={dataset}", "--run_name=r", "--batch_size=5", "--distribution=terminal_only",
                    *remote_args, "--scorer=includes", "--resume"], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    scores = _scores(run)
    assert scores["Fails once."] == [("includes", 0.0, False)] and scores["Capital of France?"] == [("includes", 1.0, False)]


def test_rescore_refuses_scorers_that_need_the_environment(tmp_path, model_server, remote_args):
    run = _first_run(tmp_path, remote_args)
    before = _snapshot(run)
    requests = model_server.count()
    (tmp_path / "env_scorer.py").write_text("def check(sample):\n    return sample.exec('true').exit_code == 0\n")
    for flags, message in [
        (["--scorer=includes,command", "--verify_command=true"], "--rescore cannot use --scorer=command"),
        (["--scorer=env_scorer.py:check"], "--rescore cannot use --scorer=env_scorer.py:check: it calls sample.exec"),
        ([], "--rescore needs --scorer"),
        (["--scorer=judge"], "--scorer=judge needs --judge_model"),
        (["--scorer=nosuch"], "unknown scorer 'nosuch'"),
    ]:
        proc = _rescore(tmp_path, *flags)
        assert proc.returncode == 1, (flags, proc.stdout + proc.stderr)
        assert message in proc.stderr, (flags, proc.stderr)
        assert len(proc.stderr.strip().splitlines()) == 1
    assert _snapshot(run) == before and model_server.count() == requests
    proc = run_cli(["--run_name=nothere", "--rescore", "--scorer=includes"], tmp_path)
    assert proc.returncode == 1 and "holds no run" in proc.stderr


def test_rescore_waits_for_no_live_run(tmp_path, model_server, remote_args):
    from runner.storage.lock import RunLock

    run = _first_run(tmp_path, remote_args)
    before = _snapshot(run)
    lock = RunLock(run)
    lock.acquire(lambda text: None)  # a live run holds the run directory
    try:
        proc = _rescore(tmp_path, "--scorer=exact")
    finally:
        lock.release()
    assert proc.returncode == 1 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert {n: d for n, d in _snapshot(run).items() if not n.startswith(".run")} == {
        n: d for n, d in before.items() if not n.startswith(".run")}
    assert not (run / "rescores.jsonl").exists()


def test_a_scorer_that_reaches_exec_through_a_helper_changes_nothing(tmp_path, model_server, remote_args):
    run = _first_run(tmp_path, remote_args)
    before = _snapshot(run)
    (tmp_path / "indirect.py").write_text("def _run(sample):\n    return sample.exec('true')\n"
                                          "def check(sample):\n    return _run(sample).exit_code == 0\n")
    proc = _rescore(tmp_path, "--scorer=includes,indirect.py:check")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "a scorer called sample.exec" in proc.stderr and "nothing was changed" in proc.stderr
    assert _snapshot(run) == before


def test_rescore_scores_every_sample_of_a_prompt_on_its_own(tmp_path, model_server, remote_args):
    rows = [{"prompt": "@answers right|wrong|right\nFirst.", "id": "a", "target": "right"},
            {"prompt": "@answers wrong|right|wrong\nSecond.", "id": "b", "target": "right"}]
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    proc = run_cli([f"--dataset_file={dataset}", "--run_name=r", "--batch_size=5", "--distribution=terminal_only",
                    *remote_args, "--samples_per_prompt=3", "--scorer=includes", "--num_workers=1"], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (tmp_path / "wrongness.py").write_text(
        "def wrongness(sample):\n"
        "    return 1.0 if 'wrong' in sample.final_answer else 0.0\n")
    proc = _rescore(tmp_path, "--scorer=wrongness.py:wrongness,includes")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    kept = read_jsonl(tmp_path / "data" / "r" / "trajectories.jsonl")
    assert len(kept) == 6
    for line in kept:
        answer = line["conversations"][-1]["value"]
        assert [(e["scorer"], e["value"]) for e in line["metadata"]["scores"]] == [
            ("wrongness.py:wrongness", float("wrong" in answer)), ("includes", float("right" in answer))], line
    stats = json.loads((tmp_path / "data" / "r" / "statistics.json").read_text())
    assert stats["scoring"]["samples"] == 6 and stats["scoring"]["passed"] == 3


def test_a_judge_that_refuses_the_key_changes_nothing(tmp_path, model_server, remote_args):
    """Every grade refused (a key revoked since): the samples keep the scores they had, instead of
    each getting a scorer error in place of its grade."""
    from tests.helpers.model_server import ModelServer, error_reply

    run = _first_run(tmp_path, remote_args)
    before = _snapshot(run)
    with ModelServer(policy=lambda body, state: error_reply(401, "invalid api key")) as judge_server:
        proc = _rescore(tmp_path, "--scorer=judge", "--judge_model=judge-x", f"--judge_base_url={judge_server.base_url}",
                        env={"OPENROUTER_API_KEY": SECRET_KEY})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "refused the request (auth)" in proc.stderr and "nothing was changed" in proc.stderr
    assert _snapshot(run) == before
