"""The command scorer runs in the sample's own environment after the session; the judge scorer
grades through the run's model client, its requests counted in the sample's usage."""

from __future__ import annotations

import json

from tests.conftest import SECRET_KEY, read_jsonl, run_cli, write_jsonl
from tests.helpers.model_server import ModelServer

WRITE = '@tool terminal {"command": "echo built-by-agent > out.txt"}\n'


def _run(tmp_path, rows, remote_args, *flags, run_name="r", distribution="terminal_only"):
    dataset = write_jsonl(tmp_path / f"{run_name}.jsonl", rows)
    return run_cli([f"--dataset_file={dataset}", f"--run_name={run_name}", "--batch_size=5",
                    f"--distribution={distribution}", *remote_args, *flags], tmp_path)


def _scores(tmp_path, run_name="r") -> dict[str, list[dict]]:
    kept = read_jsonl(tmp_path / "data" / run_name / "trajectories.jsonl")
    return {t["conversations"][1]["value"].splitlines()[-1]: t["metadata"] for t in kept}


def test_verify_sees_the_files_the_agent_left_and_not_the_key(tmp_path, model_server, remote_args):
    rows = [
        {"prompt": WRITE + "Build it.", "verify": "cat out.txt && grep -q built-by-agent out.txt"},
        {"prompt": "Build nothing.", "verify": "echo looking; cat out.txt"},
        {"prompt": WRITE + "Keys?", "verify": f"env | grep -q {SECRET_KEY[-10:]} && exit 7; env | grep -c KEY; exit 0"},
    ]
    proc = _run(tmp_path, rows, remote_args, "--scorer=command")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    scores = {prompt: meta["scores"] for prompt, meta in _scores(tmp_path).items()}
    built = scores["Build it."][0]
    assert (built["value"], built["passed"]) == (1.0, True)
    assert built["explanation"] == "verify passed (exit 0): built-by-agent"
    nothing = scores["Build nothing."][0]
    assert (nothing["value"], nothing["passed"]) == (0.0, False)
    assert nothing["explanation"].startswith("verify failed (exit 1): looking") and "out.txt" in nothing["explanation"]
    assert scores["Keys?"][0]["passed"], scores["Keys?"]
    assert not list((tmp_path / "data" / "r").glob("*workdir*"))


def test_verify_command_for_every_row_gets_an_environment_and_a_time_limit(tmp_path, model_server, remote_args):
    rows = [{"prompt": "No tools here."}, {"prompt": "@answer slow\nSlow check.", "verify": "sleep 30"}]
    proc = _run(tmp_path, rows, remote_args, "--scorer=command", "--verify_command=pwd && test -w .",
                "--verify_timeout=1", distribution="creative")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    scores = {prompt: meta["scores"][0] for prompt, meta in _scores(tmp_path).items()}
    assert scores["No tools here."]["passed"], scores  # a fresh environment for a session without one
    slow = scores["Slow check."]  # the row's own verify wins over --verify_command
    assert (slow["value"], slow["passed"]) == (0.0, False)
    assert slow["explanation"].startswith("scorer error: timed out: the verify command took longer than 1s")


def test_judge_grades_with_prompt_target_rubric_and_answer(tmp_path, model_server, remote_args):
    rows = [
        {"prompt": "@answer Paris\nCapital of France?", "target": "Paris", "rubric": "City names only."},
        {"prompt": "@answer Somewhere\n@grade P\nPartly?"},
        {"prompt": "@answer wrong\n@grade I\nWrong?"},
        {"prompt": "@answer fine\n@grade_bad 1\nRetried?"},
        {"prompt": "@answer fine\n@grade_bad 5\nNever graded?"},
        {"prompt": "@answer fine\n@fail 429 1 retry_after=0.1\nThrottled?"},
    ]
    proc = _run(tmp_path, rows, remote_args, "--scorer=judge", "--judge_model=judge-model",
                "--judge_rubric=Be strict.")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    meta = _scores(tmp_path)
    grade = {prompt: (m["scores"][0]["value"], m["scores"][0]["passed"]) for prompt, m in meta.items()}
    assert grade == {"Capital of France?": (1.0, True), "Partly?": (0.5, False), "Wrong?": (0.0, False),
                     "Retried?": (1.0, True), "Never graded?": (0.0, False), "Throttled?": (1.0, True)}
    assert "GRADE: C" in meta["Capital of France?"]["scores"][0]["explanation"]
    assert meta["Never graded?"]["scores"][0]["explanation"].startswith(
        "scorer error: ValueError: the judge's reply has no GRADE line after 3 attempts")
    judged = [r.body for r in model_server.requests if r.body.get("model") == "judge-model"]
    assert len(judged) == 6 + 1 + 2 + 1  # one each; a retry of an ungraded reply; two more; a 429 retried
    paris = next(b["messages"][0]["content"] for b in judged if "Capital of France?" in b["messages"][0]["content"])
    for part in ("[Task]\n@answer Paris\nCapital of France?", "[Reference answer]\nParis",
                 "[Grading guidance]\nCity names only.", "[Answer to grade]\nParis"):
        assert part in paris, paris
    assert "Be strict." not in paris  # the row's rubric wins over --judge_rubric
    assert all("tools" not in b for b in judged)
    # The judge's requests are the sample's spend, under the judge's model.
    for prompt, m in meta.items():
        by_model = {e["model"]: e for e in m["usage"]["by_model"]}
        assert set(by_model) == {"test-model", "judge-model"}, prompt
        assert m["usage"]["requests"] == sum(e["requests"] for e in by_model.values())
        assert m["usage"]["cost"] == round(sum(e["cost"] for e in by_model.values()), 8)
    assert {p: {e["model"]: e["requests"] for e in m["usage"]["by_model"]}["judge-model"] for p, m in meta.items()} == {
        "Capital of France?": 1, "Partly?": 1, "Wrong?": 1, "Retried?": 2, "Never graded?": 3, "Throttled?": 2}
    assert meta["Throttled?"]["usage"]["retries"] == 2  # the agent's 429 and the judge's
    stats = json.loads((tmp_path / "data" / "r" / "statistics.json").read_text())
    assert stats["spend_by_model"]["judge-model"]["requests"] == 10


def test_judge_on_its_own_endpoint(tmp_path, model_server, remote_args):
    with ModelServer() as judge_server:
        rows = [{"prompt": "@answer ok\nQ?"}]
        proc = _run(tmp_path, rows, remote_args, "--scorer=judge", "--judge_model=judge-x",
                    f"--judge_base_url={judge_server.base_url}")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert judge_server.count() == 1 and all(r.body["model"] == "test-model" for r in model_server.requests)
        assert judge_server.requests[0].headers["authorization"] == f"Bearer {SECRET_KEY}"
    assert _scores(tmp_path)["Q?"]["scores"][0]["value"] == 1.0


def test_judge_of_the_offline_model_needs_an_endpoint(tmp_path):
    dataset = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "Q"}])
    proc = run_cli([f"--dataset_file={dataset}", "--run_name=r", "--batch_size=1", "--model=mock", "--scorer=judge",
                    "--judge_model=judge-x"], tmp_path)
    assert proc.returncode == 1 and "--scorer=judge needs --judge_base_url" in proc.stderr


def test_python_scorer_runs_commands_in_the_sample_environment(tmp_path, model_server, remote_args):
    (tmp_path / "env_scorers.py").write_text(
        "from runner.scoring import Score\n"
        "def built(sample):\n"
        "    result = sample.exec('cat out.txt')\n"
        "    return Score(float(result.exit_code == 0), result.output.strip())\n"
        "async def built_async(sample):\n"
        "    result = await sample.exec('test -f out.txt')\n"
        "    return result.exit_code == 0\n"
    )
    rows = [{"prompt": WRITE + "Build it."}, {"prompt": "Build nothing."}]
    proc = _run(tmp_path, rows, remote_args, "--scorer=env_scorers.py:built,env_scorers:built_async")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    scores = {prompt: [(e["value"], e["explanation"]) for e in m["scores"]] for prompt, m in _scores(tmp_path).items()}
    assert scores["Build it."] == [(1.0, "built-by-agent"), (1.0, "")]
    assert [value for value, _ in scores["Build nothing."]] == [0.0, 0.0]


def test_an_unreachable_judge_endpoint_is_refused_at_start(tmp_path, model_server, remote_args):
    proc = _run(tmp_path, [{"prompt": "Q?"}], remote_args, "--scorer=judge", "--judge_model=judge-x",
                "--judge_base_url=http://127.0.0.1:9/v1")
    assert proc.returncode == 1 and "127.0.0.1:9" in proc.stderr and "nothing was started" in proc.stderr
    assert model_server.count() == 0


def _judge_without_a_cost(body, state):
    from tests.helpers.model_server import Reply, chat_completion

    completion = chat_completion(body, "Read.\nGRADE: C")
    del completion["usage"]["cost"]
    return Reply(body=completion)


def test_a_judge_of_its_own_that_reports_no_cost_stops_a_budget_without_prices(tmp_path, model_server, remote_args):
    # --max_cost without prices stops at the first reply without a cost, the judge's as the agent's.
    with ModelServer(policy=_judge_without_a_cost) as judge_server:
        rows = [{"prompt": f"@answer ok\nQ{i}?"} for i in range(4)]
        proc = _run(tmp_path, rows, remote_args, "--scorer=judge", "--judge_model=judge-x",
                    f"--judge_base_url={judge_server.base_url}", "--max_cost=1", "--num_workers=1")
        assert proc.returncode == 4, proc.stdout + proc.stderr
        assert judge_server.count() == 1


def _judge_refusing_the_key(body, state):
    from tests.helpers.model_server import error_reply

    return error_reply(401, f"invalid api key {SECRET_KEY}")  # as some providers do, the key echoed


def test_a_judge_that_refuses_the_key_mid_run_stops_the_run_and_keeps_the_samples_made(tmp_path, model_server,
                                                                                     remote_args):
    """The probe at start passed (its models route is open); then every grade is refused. Without
    a stop, every row would pay for its agent and get no grade: the run stops as on the agent's own
    401, and the samples made meanwhile keep their trajectories for --rescore."""
    with ModelServer(policy=_judge_refusing_the_key) as judge_server:
        rows = [{"prompt": f"@answer ok\nQ{i}?"} for i in range(12)]
        proc = _run(tmp_path, rows, remote_args, "--scorer=judge", "--judge_model=judge-x",
                    f"--judge_base_url={judge_server.base_url}", "--num_workers=1")
        assert proc.returncode == 3, proc.stdout + proc.stderr
        assert "judge" in proc.stderr and "(auth)" in proc.stderr and "--rescore" in proc.stderr, proc.stderr
        assert SECRET_KEY not in proc.stdout + proc.stderr
        assert 1 <= judge_server.count() <= 3
    kept = read_jsonl(tmp_path / "data" / "r" / "trajectories.jsonl")
    assert 1 <= len(kept) <= 3
    assert all(t["metadata"]["scores"][0]["explanation"].startswith("scorer error: ") for t in kept)
    stats = json.loads((tmp_path / "data" / "r" / "statistics.json").read_text())
    assert stats["outcomes"]["not_run"] >= len(rows) - 3
    assert not [p for p in (tmp_path / "data").rglob("*") if p.is_file() and SECRET_KEY.encode() in p.read_bytes()]
