"""--compress_to_tokens: the runner compresses its trajectories at the end of a run, through the
real CLI against the scripted server (which is also the summariser: the run's endpoint)."""

from __future__ import annotations

import json
import stat

from tests.conftest import SECRET_KEY, read_jsonl, run_cli, write_jsonl

PROMPT = ("@tool terminal {\"command\": \"echo first-%d\"}\n@tool terminal {\"command\": \"seq 1 60\"}\n"
          "@tool terminal {\"command\": \"seq 100 160\"}\n@tool terminal {\"command\": \"echo last\"}\nRun them all.")


def run(tmp_path, remote_args, *extra):
    args = ["--dataset_file=d.jsonl", "--run_name=r", "--batch_size=2", "--distribution=terminal_only", *remote_args,
            "--compress_to_tokens=300", "--summary_target_tokens=30", "--protect_last_n_turns=2", *extra]
    return run_cli(args, tmp_path)


def summary_requests(server) -> list:
    return [r for r in server.requests if r.path.endswith("/chat/completions") and not r.body.get("tools")]


def test_a_run_writes_its_compressed_trajectories_beside_the_uncompressed_ones(tmp_path, model_server, remote_args):
    write_jsonl(tmp_path / "d.jsonl", [{"prompt": PROMPT % i} for i in range(3)])
    result = run(tmp_path, remote_args)
    assert result.returncode == 0, result.stdout + result.stderr
    run_dir = tmp_path / "data" / "r"
    trajectories = read_jsonl(run_dir / "trajectories.jsonl")
    compressed = read_jsonl(run_dir / "trajectories_compressed.jsonl")
    assert all("compression_metrics" not in row for row in trajectories)  # left as they are
    assert [r["metadata"]["row_key"] for r in compressed] == [r["metadata"]["row_key"] for r in trajectories]
    statuses = [r["compression_metrics"]["status"] for r in compressed]
    assert statuses.count("compressed") == 3, statuses
    for before, after in zip(trajectories, compressed):
        assert after["conversations"][-2:] == before["conversations"][-2:]
        assert any(t["value"].startswith("[CONTEXT SUMMARY]: ") for t in after["conversations"])
        assert {k: v for k, v in after.items() if k not in ("conversations", "compression_metrics")} == \
               {k: v for k, v in before.items() if k != "conversations"}
    metrics = json.loads((run_dir / "trajectories_compressed.metrics.json").read_text())
    for name in ("trajectories_compressed.jsonl", "trajectories_compressed.metrics.json"):
        assert stat.S_IMODE((run_dir / name).stat().st_mode) == 0o600, name  # private, as every file of a run
    asked = summary_requests(model_server)
    assert metrics["summariser"]["requests"] == len(asked) == 3
    assert all(r.body["model"] == "test-model" and r.headers["authorization"] == f"Bearer {SECRET_KEY}" for r in asked)
    assert "Compressed 3 of 3 rows" in result.stdout
    for path in run_dir.rglob("*"):
        if path.is_file():
            assert SECRET_KEY.encode() not in path.read_bytes(), path

    # resumed with more rows: only the new row's summary is asked for
    write_jsonl(tmp_path / "d.jsonl", [{"prompt": PROMPT % i} for i in range(4)])
    again = run(tmp_path, remote_args, "--resume")
    assert again.returncode == 0, again.stdout + again.stderr
    assert len(summary_requests(model_server)) == 4
    assert len(read_jsonl(run_dir / "trajectories_compressed.jsonl")) == 4


def test_a_bad_compression_option_stops_the_run_before_any_request(tmp_path, model_server, remote_args):
    write_jsonl(tmp_path / "d.jsonl", [{"prompt": PROMPT % 0}])
    result = run(tmp_path, remote_args, "--tokenizer=no_such_dir/")
    assert result.returncode == 1 and "--tokenizer=no_such_dir/: no tokenizer.json there" in result.stderr
    assert model_server.requests == []


def test_the_offline_model_summarises_an_offline_run(tmp_path):
    import shutil

    from tests.conftest import REPO

    shutil.copy(REPO / "data" / "example_prompts.jsonl", tmp_path / "d.jsonl")
    result = run_cli(["--dataset_file=d.jsonl", "--run_name=m", "--batch_size=5", "--model=mock",
                      "--compress_to_tokens=2000", "--summary_target_tokens=100"], tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    run_dir = tmp_path / "data" / "m"
    compressed = read_jsonl(run_dir / "trajectories_compressed.jsonl")
    assert len(compressed) == len(read_jsonl(run_dir / "trajectories.jsonl"))
    assert "compressed" in [r["compression_metrics"]["status"] for r in compressed]
    metrics = json.loads((run_dir / "trajectories_compressed.metrics.json").read_text())
    assert metrics["summariser"]["cost_known"] is True  # the offline model is free, not unpriced


def test_a_resume_given_only_the_run_name_compresses_as_the_run_did(tmp_path, model_server, remote_args):
    """The compression options are part of the recorded configuration: a resume without them keeps
    trajectories_compressed.jsonl in step with trajectories.jsonl instead of leaving it stale."""
    write_jsonl(tmp_path / "d.jsonl", [{"prompt": PROMPT % i} for i in range(3)])
    first = run(tmp_path, remote_args, "--max_samples=2")
    assert first.returncode == 0, first.stdout + first.stderr
    again = run_cli(["--run_name=r", "--resume"], tmp_path, env={"OPENAI_API_KEY": SECRET_KEY})
    assert again.returncode == 0, again.stdout + again.stderr
    run_dir = tmp_path / "data" / "r"
    compressed = read_jsonl(run_dir / "trajectories_compressed.jsonl")
    assert [r["metadata"]["row_key"] for r in compressed] == \
           [r["metadata"]["row_key"] for r in read_jsonl(run_dir / "trajectories.jsonl")]
    assert len(compressed) == 3
    assert len(summary_requests(model_server)) == 3  # the two rows summarised before are not asked for again
    assert all(r["compression_metrics"]["target_max_tokens"] == 300 for r in compressed)
    config = json.loads((run_dir / "config.json").read_text())["config"]
    assert (config["compress_to_tokens"], config["summary_target_tokens"]) == (300, 30)


def test_a_run_stopped_at_its_cost_budget_spends_nothing_more_on_summaries(tmp_path, model_server, remote_args):
    write_jsonl(tmp_path / "d.jsonl", [{"prompt": PROMPT % i} for i in range(8)])
    stopped = run(tmp_path, remote_args, "--max_cost=0.0008", "--num_workers=1")
    assert stopped.returncode == 4, stopped.stdout + stopped.stderr
    assert summary_requests(model_server) == []
    run_dir = tmp_path / "data" / "r"
    assert not (run_dir / "trajectories_compressed.jsonl").exists()
    assert "Not compressed: the run stopped at its cost budget" in stopped.stdout, stopped.stdout
    finished = run(tmp_path, remote_args, "--resume", "--max_cost=1")
    assert finished.returncode == 0, finished.stdout + finished.stderr
    assert len(read_jsonl(run_dir / "trajectories_compressed.jsonl")) == len(read_jsonl(run_dir / "trajectories.jsonl"))
