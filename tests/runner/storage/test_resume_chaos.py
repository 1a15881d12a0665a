"""Exactly-once under crashes: SIGKILL at random moments, Ctrl-C, and the files afterwards.

The chaos test runs a few hundred prompts (duplicates, prompts that fail once with 500 or 400,
prompts without reasoning) against the local server with random latency, kills the runner with
SIGKILL several times, resumes each time, and checks that every dataset row is accounted for
exactly once, that no committed row was ever paid for again, and that the files agree.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter

from tests.conftest import REPO, read_jsonl, run_cli, write_jsonl

WORKERS = 8


def _dataset(rng: random.Random) -> tuple[list[dict], dict[str, int]]:
    rows, failures = [], {}
    for i in range(240):
        latency = f"@latency {rng.uniform(0.05, 0.2):.3f}\n"
        kind = i % 12
        if kind == 0:
            text = f"{latency}@fail 500 1\n@tool terminal {{\"command\": \"echo r{i}\"}}\nServer error once #{i}."
            failures[text] = 1
        elif kind == 1:
            text = f"{latency}@fail 400 1\nBad request once #{i}."
            failures[text] = 1
        elif kind == 2:
            text = f"{latency}@reasoning none\nNo reasoning #{i}."
        elif kind in (3, 4):
            text = f"@latency 0.05\nDuplicate prompt {i % 5}."  # the same text several times
        else:
            text = f"{latency}@tool terminal {{\"command\": \"echo r{i}\"}}\nNormal prompt #{i}."
        rows.append({"prompt": text})
    return rows, failures


def _start(dataset, server, cwd, resume: bool, stdout=subprocess.DEVNULL, extra=()) -> subprocess.Popen:
    args = [sys.executable, str(REPO / "batch_runner.py"), f"--dataset_file={dataset}", "--run_name=chaos",
            "--batch_size=16", f"--num_workers={WORKERS}", "--distribution=terminal_only", "--max_turns=4",
            f"--base_url={server.base_url}", "--model=m", "--api_key=x", "--seed=3", *extra]
    if resume:
        args.append("--resume")
    return subprocess.Popen(args, cwd=cwd, stdout=stdout, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, start_new_session=True)


def _wait_for_requests(server, count: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while server.count() < count and time.monotonic() < deadline:
        time.sleep(0.05)


def _first_requests(server) -> Counter:
    """How many times each prompt's opening request reached the server (no assistant turn yet)."""
    counts = Counter()
    for request in server.requests:
        messages = request.body.get("messages", [])
        if request.path.endswith("/chat/completions") and not any(m["role"] == "assistant" for m in messages):
            counts[next(m["content"] for m in messages if m["role"] == "user")] += 1
    return counts


def _check_accounting(out, rows) -> dict:
    trajectories = read_jsonl(out / "trajectories.jsonl")
    indices = [t["prompt_index"] for t in trajectories]
    assert len(indices) == len(set(indices)), "duplicate rows in trajectories.jsonl"
    for t in trajectories:
        assert t["conversations"][1]["value"] == rows[t["prompt_index"]]["prompt"]
    lines = [r for p in sorted(out.glob("batch_*.jsonl")) for r in read_jsonl(p)]
    # A row without reasoning is committed whole; the merge's no-reasoning filter discards it.
    done = [r for r in lines if not r.get("failed")]
    discarded_keys = [r["metadata"]["row_key"] for r in done if r["reasoning_stats"]["turns_with_reasoning"] == 0]
    ok_keys = [r["metadata"]["row_key"] for r in done if r["reasoning_stats"]["turns_with_reasoning"] > 0]
    assert len(ok_keys) == len(set(ok_keys)), "a row was committed twice"
    assert len(discarded_keys) == len(set(discarded_keys))
    assert not set(ok_keys) & set(discarded_keys)
    assert len(ok_keys) + len(discarded_keys) == len(rows)  # every row accounted for, exactly once
    stats = json.loads((out / "statistics.json").read_text())
    outcomes = stats["outcomes"]
    assert outcomes["ok"] == len(trajectories) == len(ok_keys)
    assert outcomes["discarded"] == len(discarded_keys) == stats["discarded_no_reasoning"]
    assert outcomes["failed"] == 0 and outcomes["not_run"] == 0
    assert stats["tool_statistics"]["terminal"]["count"] == sum(t["tool_stats"]["terminal"]["count"] for t in trajectories)
    return stats


def test_sigkill_chaos_then_resume_is_exactly_once(tmp_path, model_server):
    rng = random.Random(20261129)
    rows, failures = _dataset(rng)
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    kills = 0
    for attempt in range(4):
        proc = _start(dataset, model_server, tmp_path, resume=attempt > 0)
        time.sleep(rng.uniform(1.6, 3.2))
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the runner and its workers, mid-write or not
            kills += 1
        proc.wait(30)
    assert kills >= 2, "the runs finished too fast to be interrupted; the test proves nothing"
    for _ in range(3):  # finish: failed-once rows need one more resume
        proc = _start(dataset, model_server, tmp_path, resume=True)
        _, err = proc.communicate(timeout=240)
        if proc.returncode == 0:
            break
        assert proc.returncode == 2, err
    assert proc.returncode == 0, err
    out = tmp_path / "data" / "chaos"
    _check_accounting(out, rows)

    # Paid-for work is never repeated: beyond the scripted failures, the only extra opening
    # requests come from prompts that were in flight when a kill struck (at most WORKERS each).
    multiplicity = Counter(r["prompt"] for r in rows)
    seen = _first_requests(model_server)
    expected = {text: n + failures.get(text, 0) for text, n in multiplicity.items()}
    assert all(seen[text] >= expected[text] for text in expected)
    extra = sum(seen[text] - expected[text] for text in expected)
    assert extra <= kills * WORKERS, (extra, kills)

    # A resume that finds everything done pays nothing and rebuilds the merged files.
    (out / "trajectories.jsonl").unlink()
    (out / "statistics.json").unlink()
    before = model_server.count()
    proc = run_cli([f"--dataset_file={dataset}", "--run_name=chaos", "--batch_size=16", "--distribution=terminal_only",
                    "--max_turns=4", f"--base_url={model_server.base_url}", "--model=m", "--api_key=x", "--seed=3",
                    "--resume"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert model_server.count() == before
    _check_accounting(out, rows)


def test_ctrl_c_stops_gracefully_then_resume_finishes(tmp_path, model_server):
    rows = [{"prompt": f"@latency 0.3\n@tool terminal {{\"command\": \"echo {i}\"}}\nSlow prompt {i}."} for i in range(60)]
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    proc = _start(dataset, model_server, tmp_path, resume=False, stdout=subprocess.PIPE)
    _wait_for_requests(model_server, 16)  # mid-run, however long a loaded machine takes to start it
    os.kill(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Stopping: no new prompts" in out + err and "--resume" in err
    assert "BATCH PROCESSING INTERRUPTED" in out and "BATCH PROCESSING COMPLETE" not in out
    out = tmp_path / "data" / "chaos"
    stats = json.loads((out / "statistics.json").read_text())  # merged and written despite the stop
    done = stats["outcomes"]["ok"]
    assert 0 < done < 60 and stats["outcomes"]["not_run"] == 60 - done
    assert len(read_jsonl(out / "trajectories.jsonl")) == done
    assert json.loads((out / ".lock").read_text())["held"] is False  # released (the file itself stays)
    proc = _start(dataset, model_server, tmp_path, resume=True)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    _check_accounting(out, rows)
    seen = _first_requests(model_server)
    assert all(seen[r["prompt"]] == 1 for r in rows)  # the graceful stop wasted no request


def test_resume_refuses_changed_configuration(tmp_path, model_server, remote_args):
    dataset = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "One."}, {"prompt": "Two."}])
    base = [f"--dataset_file={dataset}", "--run_name=r", "--batch_size=2", "--distribution=terminal_only", *remote_args]
    assert run_cli(base + ["--max_samples=1"], tmp_path).returncode == 0
    proc = run_cli(base + ["--resume", "--max_turns=3"], tmp_path)
    assert proc.returncode == 1
    assert "max_turns" in proc.stderr and "--allow_config_change" in proc.stderr
    proc = run_cli(base + ["--resume", "--max_turns=3", "--allow_config_change"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert len(read_jsonl(tmp_path / "data" / "r" / "trajectories.jsonl")) == 2


def test_edited_dataset_resumes_only_new_and_changed_rows(tmp_path, model_server, remote_args):
    first = [{"prompt": "Alpha."}, {"prompt": "Beta."}, {"prompt": "Gamma."}]
    dataset = write_jsonl(tmp_path / "d.jsonl", first)
    base = [f"--dataset_file={dataset}", "--run_name=r", "--batch_size=2", "--distribution=terminal_only", *remote_args]
    assert run_cli(base, tmp_path).returncode == 0
    before = _first_requests(model_server)
    # Reordered, one row inserted, one row changed.
    write_jsonl(dataset, [{"prompt": "Zed (new)."}, {"prompt": "Gamma."}, {"prompt": "Alpha."}, {"prompt": "Beta, edited."}])
    proc = run_cli(base + ["--resume"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    after = _first_requests(model_server)
    assert {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)} == {
        "Zed (new).": 1, "Beta, edited.": 1}
    out = tmp_path / "data" / "r"
    kept = read_jsonl(out / "trajectories.jsonl")
    assert [(t["prompt_index"], t["conversations"][1]["value"]) for t in kept] == [
        (0, "Zed (new)."), (1, "Gamma."), (2, "Alpha."), (3, "Beta, edited.")]
    assert sorted(p.name for p in out.glob("batch_*.jsonl")) == ["batch_0.jsonl", "batch_1.jsonl", "batch_2.jsonl"]
    stats = json.loads((out / "statistics.json").read_text())
    assert stats["stale_rows"] == 1  # the old "Beta." row is kept on disk but not in the dataset


def test_second_ctrl_c_quits_at_once_and_loses_nothing(tmp_path, model_server):
    rows = [{"prompt": f"@latency 1.5\n@tool terminal {{\"command\": \"echo {i}\"}}\nVery slow prompt {i}."}
            for i in range(40)]
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    proc = _start(dataset, model_server, tmp_path, resume=False, stdout=subprocess.PIPE)
    _wait_for_requests(model_server, 16)
    os.kill(proc.pid, signal.SIGINT)
    time.sleep(0.5)
    stopped = time.monotonic()
    os.kill(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert time.monotonic() - stopped < 5  # not the 30 s grace period
    assert proc.returncode == 130, err
    assert "Quit at once" in err
    proc = _start(dataset, model_server, tmp_path, resume=True)
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err
    _check_accounting(tmp_path / "data" / "chaos", rows)


def test_sigkill_of_a_sampled_scored_run_then_resume_finds_each_sample_once(tmp_path, model_server):
    rng = random.Random(20261201)
    samples = 3
    rows = [{"prompt": f"@latency {rng.uniform(0.05, 0.2):.3f}\n@answers right|wrong\n"
                       f"@tool terminal {{\"command\": \"echo s{i}\"}}\nSampled prompt #{i}.", "target": "right"}
            for i in range(60)]
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    flags = [f"--samples_per_prompt={samples}", "--scorer=includes"]
    kills = 0
    for attempt in range(3):
        proc = _start(dataset, model_server, tmp_path, resume=attempt > 0, extra=flags)
        time.sleep(rng.uniform(1.6, 3.2))
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            kills += 1
        proc.wait(30)
    assert kills >= 2, "the runs finished too fast to be interrupted; the test proves nothing"
    proc = _start(dataset, model_server, tmp_path, resume=True, extra=flags)
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err
    out = tmp_path / "data" / "chaos"
    lines = [r for p in sorted(out.glob("batch_*.jsonl")) for r in read_jsonl(p)]
    done = Counter((r["prompt_index"], r["metadata"]["sample"]) for r in lines if not r.get("failed"))
    assert done == Counter({(i, s): 1 for i in range(len(rows)) for s in range(samples)})  # each exactly once
    assert all(len(r["metadata"]["scores"]) == 1 for r in lines if not r.get("failed"))
    kept = read_jsonl(out / "trajectories.jsonl")
    assert [(t["prompt_index"], t["metadata"]["sample"]) for t in kept] == sorted(done)
    scoring = json.loads((out / "statistics.json").read_text())["scoring"]
    assert scoring["samples"] == len(rows) * samples
    assert scoring["passed"] == sum(r["metadata"]["scores"][0]["passed"] for r in lines if not r.get("failed"))
    # no committed sample was paid for again: extra openings only from samples in flight at a kill
    seen = _first_requests(model_server)
    extra = sum(seen[r["prompt"]] - samples for r in rows)
    assert 0 <= extra <= kills * WORKERS, (extra, kills)
