"""Start-up imports only what the command needs: --help, --list_distributions and a bad flag value
never load the model client, the executors or an environment backend."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO, read_jsonl, run_cli, write_jsonl

# Code a command that runs nothing must not load: the model client (and its HTTP stack), the
# executors and workers, the environment backends, the tools, the output writers, the store and its
# record models.
HEAVY = ("agent.model_client", "agent.loop", "httpx2", "runner.execution", "runner.output", "runner.storage.store",
         "runner.storage.records",
         "runner.scoring", "tools.environments.local", "tools.environments.docker", "tools.environments.base",
         "tools.terminal_tool", "tools.file_tools", "docker", "ray")


def _imported(args: list[str], cwd) -> tuple[subprocess.CompletedProcess, set[str]]:
    proc = subprocess.run([sys.executable, "-X", "importtime", str(REPO / "batch_runner.py"), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "HOME": str(cwd)})
    modules = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    return proc, modules


@pytest.mark.parametrize("kind", ["help", "list_distributions", "bad value"])
def test_a_command_that_runs_nothing_imports_no_model_executor_or_environment(tmp_path, kind):
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "hi"}])
    args = {"help": ["--help"], "list_distributions": ["--list_distributions"],
            "bad value": [f"--dataset_file={data}", "--batch_size=0", "--run_name=r", "--model=mock"]}[kind]
    proc, modules = _imported(args, tmp_path)
    assert proc.returncode == (1 if kind == "bad value" else 0), proc.stdout + proc.stderr[-2000:]
    assert "toolset_distributions" in modules  # (the measurement works)
    loaded = sorted(m for m in modules if any(m == h or m.startswith(h + ".") for h in HEAVY))
    assert loaded == [], loaded


def test_the_catalogue_alone_loads_no_flag_or_configuration_code(tmp_path):
    proc, modules = _imported(["--list_distributions"], tmp_path)
    assert proc.returncode == 0 and "Available Toolset Distributions" in proc.stdout
    assert not {m for m in modules if m.startswith(("pydantic", "runner", "fire"))}, sorted(modules)
    # With other flags it goes the usual way (their names checked), and says the same.
    proc_with_flags, modules = _imported(["--list_distributions", "--verbose"], tmp_path)
    assert proc_with_flags.returncode == 0 and proc_with_flags.stdout == proc.stdout
    assert "runner.input.flags" in modules


def test_the_worker_code_leaves_the_tools_http_client_to_the_tools_that_make_requests(tmp_path):
    """What the fork server preloads for every run (the worker code, the tool registry and every
    tool's module) imports no httpx: the web and image tools import it when they make a request
    (with its command-line extras installed it pulls in rich, about 60 ms at every start)."""
    code = ("import sys, runner.execution.worker, tools.registry; tools.registry.all_tools(); "
            "print(sorted(m for m in ('httpx', 'rich') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]"


def test_the_keys_leave_before_the_heavy_imports_so_they_are_imported_once(tmp_path):
    """A key on the command line makes the runner re-execute itself without it: before its imports,
    or the new interpreter would import the configuration models and the rest a second time."""
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "hi"}])
    proc = subprocess.run([sys.executable, "-X", "importtime", str(REPO / "batch_runner.py"), f"--dataset_file={data}",
                           "--batch_size=0", "--run_name=r", "--model=mock", "--api_key=sk-test-abcdefgh"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "HOME": str(tmp_path)})
    assert proc.returncode == 1 and "batch_size" in proc.stdout + proc.stderr  # the flag check ran, after the re-exec
    imports = [line.split("|")[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")]
    assert imports.count("runner.input.secrets") == 2  # both interpreters: the re-exec happened
    assert imports.count("runner.input.config") == 1, "the configuration was imported before the re-exec too"
    assert "sk-test-abcdefgh" not in proc.stdout + proc.stderr


def test_a_run_against_a_plain_http_endpoint_never_loads_the_model_sdk(tmp_path, model_server, remote_args):
    """Its requests all go the plain path (agent/plain_http.py), the first one too: neither the
    fork server nor a worker imports the OpenAI SDK or its HTTP stack (0.35 s of CPU a run, and a
    slower first request in every session). A scorer, which runs in the worker, says what it has."""
    (tmp_path / "loaded.py").write_text(
        "import sys\n"
        "from runner.scoring import Score\n"
        "def sdk(sample):\n"
        "    found = sorted(m for m in ('openai', 'httpx2', 'httpx', 'aiohttp') if m in sys.modules)\n"
        "    return Score(float(not found), ','.join(found) or 'none')\n"
    )
    dataset = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "hi"}, {"prompt": "again"}])
    proc = run_cli([f"--dataset_file={dataset}", "--run_name=r", "--batch_size=1", "--distribution=terminal_only",
                    "--scorer=loaded.py:sdk", *remote_args], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    scores = [t["metadata"]["scores"][0] for t in read_jsonl(tmp_path / "data" / "r" / "trajectories.jsonl")]
    assert [(s["value"], s["explanation"]) for s in scores] == [(1.0, "none")] * 2
    assert model_server.count() >= 2 and model_server.requests[0].headers["authorization"].startswith("Bearer ")
