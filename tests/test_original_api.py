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
    assert "TYPEERROR BatchRunner() got unexpected keyword argument(s): max_turns_typo" in proc.stdout
