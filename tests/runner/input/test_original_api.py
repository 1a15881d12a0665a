"""The original's Python API: BatchRunner(dataset_file=..., ...).run(resume=...), from a real script."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from tests.conftest import REPO, SECRET_KEY, read_jsonl, write_jsonl

TERMINAL_PROMPT = '@tool terminal {"command": "echo from-the-api"}\nRun echo.'


def _script(tmp_path, body: str) -> subprocess.CompletedProcess:
    script = tmp_path / "drive.py"
    # The guard is Python's rule for any script that starts processes with spawn or forkserver.
    code = "from batch_runner import BatchRunner\n\nif __name__ == '__main__':\n" + textwrap.indent(textwrap.dedent(body), "    ")
    script.write_text(code, encoding="utf-8")
    return subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "HOME": str(tmp_path)})


def test_original_keyword_constructor_and_run_resume(tmp_path, model_server):
    write_jsonl(tmp_path / "d.jsonl", [{"prompt": TERMINAL_PROMPT}, {"prompt": "Plain question?"}])
    proc = _script(tmp_path, f"""
        runner = BatchRunner(
            dataset_file="d.jsonl", batch_size=1, run_name="api_run", distribution="terminal_only",
            max_iterations=3, base_url={model_server.base_url!r}, api_key={SECRET_KEY!r}, model="test-model",
            num_workers=2, providers_allowed=["anthropic", "openai"], provider_sort="price",
            reasoning_config={{"enabled": True, "effort": "high"}}, max_tokens=321,
            prefill_messages=[{{"role": "user", "content": "PREFILL"}}], ephemeral_system_prompt="EPHEMERAL",
        )
        first = runner.run(resume=False)
        again = BatchRunner(dataset_file="d.jsonl", batch_size=1, run_name="api_run", distribution="terminal_only",
                            max_iterations=3, base_url={model_server.base_url!r}, api_key={SECRET_KEY!r},
                            model="test-model", providers_allowed=["anthropic", "openai"], provider_sort="price",
                            reasoning_config={{"enabled": True, "effort": "high"}}, max_tokens=321,
                            prefill_messages=[{{"role": "user", "content": "PREFILL"}}],
                            ephemeral_system_prompt="EPHEMERAL").run(resume=True)
        print("CODES", first, again)
    """)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "CODES 0 0" in proc.stdout
    assert "Resuming: 2 of 2 rows already committed" in proc.stdout
    assert proc.stdout.count("🧠 Reasoning effort: high") == 2  # once per runner built, not again at its resume
    rows = read_jsonl(tmp_path / "data" / "api_run" / "trajectories.jsonl")
    assert len(rows) == 2 and rows[0]["metadata"]["model"] == "test-model"
    chat = [r for r in model_server.requests if r.path.endswith("/chat/completions")]
    assert chat
    for request in chat:
        assert request.body["provider"] == {"only": ["anthropic", "openai"], "sort": "price"}
        assert request.body["reasoning"] == {"enabled": True, "effort": "high"}
        assert request.body["max_tokens"] == 321
        assert request.body["messages"][1] == {"role": "user", "content": "PREFILL"}
    config = json.loads((tmp_path / "data" / "api_run" / "config.json").read_text())["config"]
    assert config["max_turns"] == 3
    assert SECRET_KEY not in (tmp_path / "data" / "api_run" / "config.json").read_text()


def test_original_defaults_and_bad_keywords(tmp_path):
    proc = _script(tmp_path, """
        from runner.original_api import config_from_original
        config = config_from_original({"dataset_file": "d.jsonl", "batch_size": 2, "run_name": "r", "api_key": "k"})
        print("DEFAULTS", config.model, config.max_turns, config.num_workers, config.base_url, config.distribution)
        ours = BatchRunner(dataset_file="d.jsonl", batch_size=2, run_name="r", model="mock", output_dir="elsewhere", seed=3)
        print("OURS", ours.run_dir, ours.config.seed)
        try:
            BatchRunner(dataset_file="d.jsonl", batch_size=2, run_name="r", model="mock", max_turns_typo=3)
        except TypeError as err:
            print("TYPEERROR", err)
    """)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "DEFAULTS claude-opus-4-20250514 10 4 https://openrouter.ai/api/v1 default" in proc.stdout
    assert "OURS elsewhere/r 3" in proc.stdout
    assert "TYPEERROR BatchRunner() got an unexpected keyword argument 'max_turns_typo'; did you mean max_turns?" in proc.stdout


def test_our_flags_as_keywords_reach_the_request(tmp_path, model_server):
    """reasoning_effort= and prefill_messages_file= were printed, then dropped."""
    write_jsonl(tmp_path / "d.jsonl", [{"prompt": "Plain question?"}])
    (tmp_path / "prefill.json").write_text(json.dumps([{"role": "user", "content": "FROM-FILE"}]), encoding="utf-8")
    proc = _script(tmp_path, f"""
        code = BatchRunner(dataset_file="d.jsonl", batch_size=1, run_name="kw", distribution="minimal",
                           max_iterations=2, base_url={model_server.base_url!r}, api_key={SECRET_KEY!r},
                           model="test-model", reasoning_effort="high", prefill_messages_file="prefill.json").run()
        print("CODE", code)
        for both in ({{"max_iterations": 2, "max_turns": 7}}, {{"reasoning_config": {{"effort": "low"}}, "reasoning_disabled": True}},
                     {{"prefill_messages": [], "prefill_messages_file": "prefill.json"}}):
            try:
                BatchRunner(dataset_file="d.jsonl", batch_size=1, run_name="kw2", model="mock", **both)
            except Exception as err:
                print("REFUSED", type(err).__name__, err)
    """)
    assert "CODE 0" in proc.stdout, proc.stdout + proc.stderr
    chat = [r for r in model_server.requests if r.path.endswith("/chat/completions")]
    assert chat
    for request in chat:
        assert request.body["reasoning"]["effort"] == "high"
        assert {"role": "user", "content": "FROM-FILE"} in request.body["messages"]
    config = json.loads((tmp_path / "data" / "kw" / "config.json").read_text())["config"]
    assert config["max_turns"] == 2
    assert "REFUSED UsageError BatchRunner() got both max_iterations and max_turns" in proc.stdout
    assert "got both reasoning_config and reasoning_disabled" in proc.stdout
    assert "got both prefill_messages and prefill_messages_file" in proc.stdout


def test_reasoning_disabled_keyword_reaches_the_request(tmp_path, model_server):
    write_jsonl(tmp_path / "d.jsonl", [{"prompt": "Plain question?"}])
    proc = _script(tmp_path, f"""
        print("CODE", BatchRunner(dataset_file="d.jsonl", batch_size=1, run_name="rd", distribution="minimal",
                                  base_url={model_server.base_url!r}, api_key={SECRET_KEY!r}, model="test-model",
                                  reasoning_disabled=True).run())
    """)
    assert "CODE 0" in proc.stdout, proc.stdout + proc.stderr
    chat = [r for r in model_server.requests if r.path.endswith("/chat/completions")]
    assert chat and all(r.body["reasoning"]["effort"] == "none" for r in chat)


def test_a_script_without_the_main_guard_is_told_to_add_it(tmp_path):
    """The workers import the script again; without the guard they died unexplained."""
    write_jsonl(tmp_path / "d.jsonl", [{"prompt": "Plain question?"}])
    script = tmp_path / "unguarded.py"
    script.write_text('from batch_runner import BatchRunner\n'
                      'BatchRunner(dataset_file="d.jsonl", batch_size=1, run_name="ng", model="mock",\n'
                      '            distribution="minimal", num_workers=1).run()\n', encoding="utf-8")
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "HOME": str(tmp_path)})
    assert 'if __name__ == "__main__":' in proc.stdout + proc.stderr, proc.stdout + proc.stderr


def test_a_misspelt_keyword_is_named_with_the_closest_one_and_errors_name_keywords(tmp_path):
    """The Python API speaks keywords: a typo gets the CLI's suggestion, and a bad value's message
    names the keyword it was given as, not the command line's --flag."""
    write_jsonl(tmp_path / "d.jsonl", [{"prompt": "hi"}, "not an object"])
    proc = _script(tmp_path, """
        attempts = (
            dict(dataset_file="d.jsonl", batch_size=2, run_name="r", model="mock", max_iteration=3),
            dict(dataset_file="d.jsonl", batch_size=2, run_name="r", model="mock", num_worker=2),
            dict(dataset_file="d.jsonl", batch_size=0, run_name="r", model="mock"),
            dict(dataset_file="d.jsonl", batch_size=2, run_name="r", model="mock", max_iterations=0),
            dict(dataset_file="d.jsonl", batch_size=2, run_name="r", model="mock", tool_choice="sometimes"),
        )
        for keywords in attempts:
            try:
                BatchRunner(**keywords)
            except Exception as err:
                print("REFUSED", type(err).__name__, err)
        try:
            BatchRunner(dataset_file="d.jsonl", batch_size=2, run_name="r", model="mock", distribution="minimal").run()
        except Exception as err:
            print("RUN", type(err).__name__, err)
    """)
    out = proc.stdout
    assert "REFUSED TypeError BatchRunner() got an unexpected keyword argument 'max_iteration'; did you mean max_iterations?" in out, out + proc.stderr
    assert "REFUSED TypeError BatchRunner() got an unexpected keyword argument 'num_worker'; did you mean num_workers?" in out
    assert "REFUSED UsageError batch_size must be an integer >= 1 (got 0)" in out
    assert "REFUSED UsageError max_iterations must be an integer >= 1 (got 0)" in out
    assert "REFUSED UsageError tool_choice must be one of: auto, required, none (got 'sometimes')" in out
    assert "RUN UsageError d.jsonl: 1 invalid line(s) (listed above); fix them or pass skip_invalid=True to run the valid rows" in out
    assert "--" not in "".join(line for line in out.splitlines() if line.startswith(("REFUSED", "RUN")))


def test_a_run_config_without_seed_resumes_with_the_seed_the_run_drew(tmp_path):
    """BatchRunner(config, resume=True): a RunConfig built without a seed draws a new one, but the
    resumed run samples with the seed it drew first (as the CLI's --resume does), and says nothing
    of a changed configuration."""
    write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"question {i}?"} for i in range(4)])
    proc = _script(tmp_path, """
        import json
        from runner.configure import build_config
        flags = dict(dataset_file="d.jsonl", batch_size=2, run_name="cfg", model="mock", num_workers=1)
        first = BatchRunner(build_config(**flags, max_samples=2)).run()
        drawn = json.load(open("data/cfg/config.json"))["config"]["seed"]
        config = build_config(**flags)
        again = BatchRunner(config, resume=True).run()
        print("CODES", first, again, config.seed != drawn)
        print("SEEDS", drawn, json.load(open("data/cfg/config.json"))["config"]["seed"])
    """)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "CODES 0 0 True" in proc.stdout, proc.stdout + proc.stderr
    drawn, recorded = proc.stdout.split("SEEDS ")[1].split()[:2]
    assert drawn == recorded
    rows = read_jsonl(tmp_path / "data" / "cfg" / "trajectories.jsonl")
    assert len(rows) == 4 and {row["metadata"]["seed"] for row in rows} == {int(drawn)}
    assert "configuration" not in proc.stdout + proc.stderr


def test_each_run_of_one_runner_is_its_own_invocation(tmp_path):
    """run() then run(resume=True) on the same object: two invocations, each with its own run id
    and start, so the run's duration is the time actually spent running."""
    write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"question {i}?"} for i in range(4)])
    proc = _script(tmp_path, """
        import json, time
        from runner.configure import build_config
        for name, runner in (("cfg", BatchRunner(build_config(dataset_file="d.jsonl", batch_size=2, run_name="cfg",
                                                              model="mock", num_workers=1, max_samples=2))),
                             ("kw", BatchRunner(dataset_file="d.jsonl", batch_size=2, run_name="kw", model="mock",
                                                num_workers=1, max_samples=2))):
            first = runner.run()
            time.sleep(3)
            again = runner.run(resume=True)
            print("CODES", name, first, again)
    """)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "CODES cfg 0 0" in proc.stdout and "CODES kw 0 0" in proc.stdout
    for name in ("cfg", "kw"):
        first, again = json.loads((tmp_path / "data" / name / "config.json").read_text())["invocations"]
        assert first["run_id"] != again["run_id"]
        assert first["ended_at"] <= again["started_at"]
        run_time = json.loads((tmp_path / "data" / name / "statistics.json").read_text())["run_time"]
        assert run_time["invocations"] == 2
        # the 3 s between the two calls are not running time
        assert run_time["running_seconds"] < (_seconds(again["ended_at"]) - _seconds(first["started_at"])) - 2.5


def _seconds(timestamp: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(timestamp).timestamp()
