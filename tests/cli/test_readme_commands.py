"""The shell commands of README.md and docs/*.md, as a user runs them: the two set-up commands from a fresh
clone, every other command run here or by a test of its page, or named as not runnable here with the reason."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO


def _setup_commands() -> list[str]:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Two commands on a fresh machine", 1)[1].split("\n## ", 1)[0]
    return [block.strip() for block in re.findall(r"```bash\n(.*?)```", section, re.S)]


def test_ci_runs_the_readme_test_command_in_a_virtual_environment():
    demo, tests = _setup_commands()
    assert tests == "bash .ci/run"
    script = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    assert "python3 -m venv" in script and "python3-venv" in script
    code = [line for line in script.splitlines() if not line.lstrip().startswith("#")]
    installs = [line for line in code if "pip install" in line]
    assert installs and all(line.startswith(".venv/bin/python -m pip install") for line in installs)  # never the system pip
    assert script.rstrip().splitlines()[-1].startswith(".venv/bin/python -m pytest")
    assert demo.startswith("python3 -m venv .venv && .venv/bin/pip install -e . && .venv/bin/python batch_runner.py ")


@pytest.mark.slow
def test_demo_command_works_from_a_fresh_clone(tmp_path):
    if not shutil.which("git"):
        pytest.skip("git is not installed")
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True, timeout=120)
    demo, _ = _setup_commands()
    # The one change: the venv sees the packages this machine already has, so the test downloads
    # nothing but pip's build backend (the command as written would fetch every dependency).
    command = demo.replace("python3 -m venv .venv", "python3 -m venv --system-site-packages .venv", 1)
    assert command != demo
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "OPENROUTER_API_KEY")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # python3: this Python
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    proc = subprocess.run(["bash", "-c", command], cwd=clone, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = (clone / "data" / "demo" / "trajectories.jsonl").read_text(encoding="utf-8").splitlines()
    prompts = (clone / "data" / "example_prompts.jsonl").read_text(encoding="utf-8").splitlines()
    assert len(rows) == len([p for p in prompts if p.strip()])
    assert all(json.loads(row)["conversations"] for row in rows)
    assert (clone / "data" / "demo" / "report.html").exists()
    # the venv's own package, not one installed elsewhere on the machine
    where = subprocess.run([str(clone / ".venv" / "bin" / "python"), "-c", "import runner.storage.store as s; print(s.__file__)"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, check=True).stdout
    assert where.startswith(str(clone)), where


def test_the_compressor_page_commands_work(tmp_path):
    """docs/compressor.md's example, as written, with the scripted server standing in for the
    llama.cpp server its last command names."""
    from tests.helpers.model_server import ModelServer

    page = (REPO / "docs" / "compressor.md").read_text(encoding="utf-8")
    commands = re.findall(r"```bash\n(.*?)```", page, re.S)[0].strip().splitlines()
    assert [c.split()[1] for c in commands] == ["batch_runner.py", "trajectory_compressor.py", "trajectory_compressor.py"]
    (tmp_path / "data").mkdir()
    shutil.copy(REPO / "data" / "example_prompts.jsonl", tmp_path / "data")
    env = {k: v for k, v in os.environ.items() if k not in ("OPENROUTER_API_KEY", "OPENAI_API_KEY")}
    env["PYTHONPATH"] = str(REPO)
    with ModelServer() as server:
        for command in commands:
            command = command.replace("http://127.0.0.1:8080/v1", server.base_url)
            command = re.sub(r"^python (\S+)", lambda m: f"{sys.executable} {REPO / m.group(1)}", command)
            proc = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True,
                                  timeout=300)
            assert proc.returncode == 0, command + "\n" + proc.stdout[-3000:] + proc.stderr[-3000:]
            if "--dry_run" in command:
                assert "would compress" in proc.stdout and not (tmp_path / "data/demo/trajectories_compressed.jsonl").exists()
        assert server.count() > 0  # the example compresses something
    rows = (tmp_path / "data/demo/trajectories.jsonl").read_text().splitlines()
    assert len((tmp_path / "data/demo/trajectories_compressed.jsonl").read_text().splitlines()) == len(rows)
    assert json.loads((tmp_path / "data/demo/trajectories_compressed.metrics.json").read_text())["rows_compressed"] > 0


def _doc_commands(page: str) -> list[str]:
    text = (REPO / "docs" / page).read_text(encoding="utf-8")
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        commands += [line.strip() for line in block.replace("\\\n", " ").splitlines() if line.strip()]
    return commands


def _doc_python(page: str) -> str:
    return re.findall(r"```python\n(.*?)```", (REPO / "docs" / page).read_text(encoding="utf-8"), re.S)[0]


@pytest.mark.slow
def test_scoring_page_commands_work(tmp_path):
    """docs/samples-and-scoring.md: its scoring and rescoring commands, and its Python scorers."""
    import shlex

    from tests.conftest import read_jsonl, run_cli

    (tmp_path / "data").mkdir()
    shutil.copy(REPO / "data" / "example_scored.jsonl", tmp_path / "data")
    commands = [c for c in _doc_commands("samples-and-scoring.md") if "--run_name=scored" in c]
    assert len(commands) == 2
    for command in commands:
        argv = shlex.split(command)
        assert argv[:2] == ["python", "batch_runner.py"], command
        proc = run_cli(argv[2:], tmp_path)
        assert proc.returncode == 0, command + "\n" + proc.stdout + proc.stderr
    run = tmp_path / "data" / "scored"
    kept = {row["metadata"]["id"]: row["metadata"]["scores"] for row in read_jsonl(run / "trajectories.jsonl")}
    assert [e["scorer"] for e in kept["sum"]] == ["exact", "includes"]  # the rescore's
    assert kept["sum"][1]["passed"] and not kept["readme"][1]["passed"]
    assert (run / "rescores.jsonl").exists()

    (tmp_path / "my_scorers.py").write_text(_doc_python("samples-and-scoring.md"))
    proc = run_cli(["--dataset_file=data/example_scored.jsonl", "--batch_size=5", "--run_name=py", "--model=mock",
                    "--distribution=terminal_only", "--scorer=my_scorers.py:has_plan,my_scorers:short_answer"], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    kept = {row["metadata"]["id"]: row["metadata"]["scores"] for row in read_jsonl(tmp_path / "data" / "py" / "trajectories.jsonl")}
    assert kept["plan"][0]["value"] == 1.0 and kept["plan"][0]["explanation"] == "plan.md has 3 lines"
    assert kept["sum"][0]["value"] == 0.0 and all(scores[1]["value"] == 1.0 for scores in kept.values())


def test_python_api_page_example_runs(tmp_path):
    """docs/python-api.md's script, on the example prompts and the offline model: every row answers
    its own prompt, and the prefilled example exchange is sent but never saved."""
    from tests.conftest import read_jsonl

    script = _doc_python("python-api.md")
    offline = script.replace('dataset_file="prompts.jsonl"', 'dataset_file="data/example_prompts.jsonl"') \
                    .replace('model="anthropic/claude-sonnet-4.6"', 'model="mock"')
    assert offline.count('"mock"') == 1 and "example_prompts" in offline  # the two substitutions, nothing else
    (tmp_path / "data").mkdir()
    shutil.copy(REPO / "data" / "example_prompts.jsonl", tmp_path / "data")
    (tmp_path / "my_batch.py").write_text(offline + "    raise SystemExit(code)\n")
    env = {k: v for k, v in os.environ.items() if k not in ("OPENROUTER_API_KEY", "OPENAI_API_KEY", "TERMINAL_ENV")}
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.run([sys.executable, "my_batch.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    prompts = {row["id"]: row["prompt"] for row in read_jsonl(tmp_path / "data" / "example_prompts.jsonl")}
    rows = read_jsonl(tmp_path / "data" / "my_run" / "trajectories.jsonl")
    assert {row["metadata"]["id"] for row in rows} == set(prompts)
    for row in rows:
        turns = row["conversations"]
        assert turns[1] == {"from": "human", "value": prompts[row["metadata"]["id"]]}
        assert "/etc/hostname" not in json.dumps(turns)  # the prefill is neither saved nor taken as the prompt
    commands = {row["metadata"]["id"]: json.dumps(row["conversations"][2:]) for row in rows}
    assert "plan.md" in commands["ex-02"] and "i <= 100" in commands["ex-03"]  # each row's own tool calls


# --- every shell command of README.md and docs/*.md: run here, run by another test, or not runnable ---

DOC_PAGES = ["README.md", *sorted(f"docs/{p.name}" for p in (REPO / "docs").glob("*.md"))]

# Commands (or a page's Nth block, or a whole page: None) another test of this file runs as written.
RUN_BY_ANOTHER_TEST = {
    ("README.md", "python3 -m venv .venv && .venv/bin/pip install -e . && .venv/bin/python batch_runner.py "
                  "--dataset_file=data/example_prompts.jsonl --batch_size=5 --run_name=demo --model=mock"):
        "test_demo_command_works_from_a_fresh_clone",
    ("README.md", "bash .ci/run"): "CI runs it; test_ci_runs_the_readme_test_command_in_a_virtual_environment checks it",
    ("docs/compressor.md", 0): "test_the_compressor_page_commands_work",  # its first block only
    ("docs/samples-and-scoring.md", None): "test_scoring_page_commands_work",
}

# Commands that cannot run in a test on this machine, and why.
NOT_RUNNABLE = {
    "export OPENROUTER_API_KEY=...": "needs a real OpenRouter key (the command after it runs against the scripted server)",
    "python -m llama_cpp.server --model SmolLM2-135M-Instruct.Q4_1.gguf --model_alias smollm2 "
    "--chat_format chatml-function-calling --n_ctx 8192 --host 127.0.0.1 --port 8080":
        "needs the compiled llama.cpp server and the model file (bash .ci/install-real-model), and the run "
        "after it would take minutes on the real model; tests/agent/test_real_model.py starts the same server "
        "(tests/helpers/real_model.py) for a short run, and the run command here runs against the scripted server",
    "python bench/bench_throughput.py --preset b --repeat 3": "a benchmark (minutes of full load), run by hand",
    "python bench/bench_throughput.py --preset a --repeat 3": "a benchmark (minutes of full load), run by hand",
    "python bench/bench_throughput.py --preset c": "a benchmark (512 sessions), run by hand",
    "python bench/bench_throughput.py --preset zero": "a benchmark (full load), run by hand",
    "python bench/bench_throughput.py --preset b": "a benchmark, run by hand (its quick preset runs in "
                                                   "tests/cli/test_bench_smoke.py)",
    "python bench/bench_throughput.py --startup": "a benchmark, run by hand",
    "python bench/bench_profile.py --preset b": "a profile under py-spy (not a dependency), run by hand",
    "python bench/bench_million.py": "a benchmark (1,000,000 rows, about half an hour), run by hand (its quick "
                                     "preset runs in tests/cli/test_bench_smoke.py)",
    "python bench/bench_million.py --rows 100000": "a benchmark (minutes of full load), run by hand",
    "python bench/bench_throughput.py --preset quick --samples 4 --scorer includes": "a benchmark, run by hand",
    "python bench/bench_dataset.py": "a benchmark (1,000,000 rows), run by hand",
    "python bench/bench_resume.py": "a benchmark (100,000 rows), run by hand",
    "python bench/bench_report.py": "a benchmark (100,000 rows), run by hand",
    "python bench/bench_budget.py": "a benchmark (20,000 prompts), run by hand",
    "pip install '.[ray]'": "installs from the package index",
    "ray start --head --port=6379": "starts a Ray cluster across machines; tests/runner/execution/test_ray_executor.py "
                                    "runs a local two-node cluster instead",
    "ray start --address=<head-ip>:6379": "joins a Ray cluster on another machine",
    "ray status": "needs the cluster of the commands before it",
    "python batch_runner.py --dataset_file=prompts.jsonl --batch_size=100 --run_name=big --executor=ray "
    "--ray_address=auto --sessions_per_node=32": "needs the Ray cluster started with `ray start`",
}

LOCAL_ENDPOINT = re.compile(r"--base_url=http://(?:localhost|127\.0\.0\.1):\d+/v1")


def _doc_blocks() -> list[tuple[str, int, list[str]]]:
    """(page, block number, commands) of every ```bash block: continuation lines joined, spaces
    collapsed, comments left out."""
    blocks = []
    for page in DOC_PAGES:
        text = (REPO / page).read_text(encoding="utf-8")
        for number, block in enumerate(re.findall(r"```bash\n(.*?)```", text, re.S)):
            commands = []
            for line in block.replace("\\\n", " ").splitlines():
                line = " ".join(re.sub(r"\s#\s.*$", "", line).split())
                if line and not line.startswith("#"):
                    commands.append(line)
            blocks.append((page, number, commands))
    return blocks


def _run_by_another_test(page: str, block: int, command: str) -> bool:
    return any((page, key) in RUN_BY_ANOTHER_TEST for key in (None, block, command))


def _runs_here(page: str, block: int, command: str) -> bool:
    return not _run_by_another_test(page, block, command) and command not in NOT_RUNNABLE


def test_every_documented_command_is_run_or_named_as_not_runnable():
    found = [(page, block, command) for page, block, commands in _doc_blocks() for command in commands]
    for page, block, command in found:
        if _runs_here(page, block, command):
            assert command.startswith("python batch_runner.py "), (
                f"{page}: `{command}` is neither run by a test nor listed in NOT_RUNNABLE with the reason")
    # no stale entry: each names a command the pages still have
    for command in NOT_RUNNABLE:
        assert any(c == command for _, _, c in found), f"NOT_RUNNABLE names a command no page has: {command}"
    for page, key in RUN_BY_ANOTHER_TEST:
        assert any(p == page and key in (None, b, c) for p, b, c in found), (page, key)


def _runnable_blocks():
    for page, number, commands in _doc_blocks():
        here = [c for c in commands if _runs_here(page, number, c)]
        if here:
            yield pytest.param(page, here, id=f"{page}[{number}]")


@pytest.mark.parametrize("page, commands", list(_runnable_blocks()))
def test_documented_commands_run(tmp_path, page, commands):
    """Each block's commands in order, in a fresh folder holding the example prompts (also as
    prompts.jsonl), with the scripted server standing in for the model server they name (a local
    one, or OpenRouter when they name none)."""
    import shlex

    from tests.conftest import run_cli
    from tests.helpers.model_server import ModelServer

    (tmp_path / "data").mkdir()
    shutil.copy(REPO / "data" / "example_prompts.jsonl", tmp_path / "data")
    shutil.copy(REPO / "data" / "example_prompts.jsonl", tmp_path / "prompts.jsonl")
    with ModelServer() as server:
        for command in commands:
            argv = shlex.split(LOCAL_ENDPOINT.sub(f"--base_url={server.base_url}", command))[2:]
            remote = not any(a.startswith(("--model=mock", "--base_url=", "--report", "--list_distributions")) for a in argv)
            if remote:  # the default endpoint, OpenRouter
                argv.append(f"--base_url={server.base_url}")
            proc = run_cli(argv, tmp_path, env={"OPENROUTER_API_KEY": "sk-test-documented"})
            assert proc.returncode == 0, f"{page}: {command}\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
            run_name = next((a.split("=", 1)[1] for a in argv if a.startswith("--run_name=")), None)
            if "--list_distributions" in argv:
                assert "terminal_only" in proc.stdout
            elif run_name:
                assert (tmp_path / "data" / run_name / "report.html").exists() and (
                    tmp_path / "data" / run_name / "statistics.json").exists()
                if any(a.startswith("--base_url=") for a in argv):
                    assert server.count() > 0  # the scripted server answered, no other


@pytest.mark.slow
def test_the_rejection_sampling_example_keeps_the_passing_samples(tmp_path):
    """docs/samples-and-scoring.md's rejection-sampling command, then its --report --keep=best."""
    import shlex

    from tests.conftest import read_jsonl, run_cli

    (tmp_path / "data").mkdir()
    shutil.copy(REPO / "data" / "example_scored.jsonl", tmp_path / "data")
    [command] = [c for c in _doc_commands("samples-and-scoring.md") if "--run_name=rejection" in c]
    argv = shlex.split(command)
    assert argv[:2] == ["python", "batch_runner.py"], command
    proc = run_cli(argv[2:], tmp_path)
    assert proc.returncode == 0, command + "\n" + proc.stdout + proc.stderr
    run = tmp_path / "data" / "rejection"
    lines = [line for path in sorted(run.glob("batch_*.jsonl")) for line in read_jsonl(path)]
    assert len(lines) == 12
    kept = read_jsonl(run / "trajectories.jsonl")
    assert kept and all(t["metadata"]["scores"][0]["passed"] for t in kept)
    assert len(kept) == sum(line["metadata"]["scores"][0]["passed"] for line in lines)
    stats = json.loads((run / "statistics.json").read_text())
    assert stats["outcomes"]["unselected"] == 12 - len(kept)
    assert sorted(stats["scoring"]["pass_at_k"]) == ["1", "2", "3", "4"]
    assert run_cli(["--report", "--run_name=rejection", "--keep=best"], tmp_path).returncode == 0
    best = read_jsonl(run / "trajectories.jsonl")
    assert [t["prompt_index"] for t in best] == [0, 1, 2]
