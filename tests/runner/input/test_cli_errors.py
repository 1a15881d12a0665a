"""The CLI's validation: every error is one clear line and a non-zero exit, before any work."""

from __future__ import annotations

import time

from tests.conftest import REPO, run_cli, write_jsonl


def _mock_run(tmp_path, *extra):
    return ["--batch_size=2", "--model=mock", *extra]


def test_list_distributions_prints_catalogue_and_exits_zero(tmp_path):
    started = time.monotonic()
    proc = run_cli(["--list_distributions"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert out.startswith("📊 Available Toolset Distributions\n" + "=" * 70)
    names = [line.split(": ", 1)[1] for line in out.splitlines() if line.startswith("📊 Distribution: ")]
    assert names == sorted(names) and len(names) == 17
    assert "     • terminal        : 100% chance" in out
    assert "--run_name=my_run --distribution=<name>" in out
    assert not (tmp_path / "data").exists()
    assert time.monotonic() - started < 5  # (the 0.5 s start-up target is measured in bench/)


def test_missing_required_flags(tmp_path):
    for args, needle in (
        (["--batch_size=2", "--run_name=r"], "--dataset_file is required"),
        (["--dataset_file=x.jsonl", "--run_name=r"], "--batch_size is required"),
        (["--dataset_file=x.jsonl", "--batch_size=2"], "--run_name is required"),
        (["--dataset_file=x.jsonl", "--batch_size=0", "--run_name=r"], "--batch_size must be an integer >= 1"),
        (["--dataset_file=x.jsonl", "--batch_size=abc", "--run_name=r"], "--batch_size must be an integer >= 1"),
    ):
        proc = run_cli(args, tmp_path)
        assert proc.returncode == 1, (args, proc.stdout, proc.stderr)
        assert needle in proc.stderr
        assert "Traceback" not in proc.stderr


def test_run_name_cannot_leave_output_dir(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "hi"}])
    for name in ("../x", "a/b", "..", ".hidden"):
        proc = run_cli([f"--dataset_file={data}", f"--run_name={name}", *_mock_run(tmp_path)], tmp_path)
        assert proc.returncode == 1
        assert "is not allowed" in proc.stderr
    assert not (tmp_path / "x").exists() and not (tmp_path / "data").exists()


def test_a_run_name_too_long_for_a_folder_is_refused_at_start(tmp_path):
    """A name the file system cannot hold is a bad name like any other: one line, exit 1, nothing written."""
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "hi"}])
    proc = run_cli([f"--dataset_file={data}", f"--run_name={'a' * 300}", *_mock_run(tmp_path)], tmp_path)
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "--run_name" in lines[0] and "300 characters" in lines[0], proc.stderr
    assert "OSError" not in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "data").exists()
    longest = "b" * 128  # the longest name allowed runs
    proc = run_cli([f"--dataset_file={data}", f"--run_name={longest}", "--distribution=minimal",
                    *_mock_run(tmp_path)], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "data" / longest / "trajectories.jsonl").exists()


def test_numeric_run_name_works(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "Explain rainbows briefly."}])
    proc = run_cli([f"--dataset_file={data}", "--run_name=123", "--distribution=minimal", *_mock_run(tmp_path)], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "data" / "123" / "trajectories.jsonl").exists()


def test_bad_options_are_refused(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "hi"}])
    common = [f"--dataset_file={data}", "--run_name=r", *_mock_run(tmp_path)]
    for extra, needle in (
        (["--distribution=nope"], "unknown --distribution='nope'"),
        (["--reasoning_effort=extreme"], "--reasoning_effort must be one of: none, minimal, low, medium, high, xhigh, max, ultra"),
        (["--num_workers=0"], "--num_workers must be an integer >= 1"),
        (["--provider_sort=cheapest"], "--provider_sort must be one of: price, throughput, latency"),
        (["--prefill_messages_file=missing.json"], "cannot load --prefill_messages_file"),
        (["--terminal_env=vm"], "--terminal_env must be local, docker, singularity or modal"),
        (["--seed=99999999999999999999"], "--seed must be an integer >= 0 and < 9223372036854775808"),
        (["--seed=-1"], "--seed must be an integer >= 0 and < 9223372036854775808"),
    ):
        proc = run_cli(common + extra, tmp_path)
        assert proc.returncode == 1, extra
        assert needle in proc.stderr, (extra, proc.stderr)
        assert "Fatal error" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert not (tmp_path / "data").exists(), extra  # nothing written, no .lock left


def test_prefill_file_must_be_an_array(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "hi"}])
    (tmp_path / "p.json").write_text('{"role": "user"}')
    proc = run_cli([f"--dataset_file={data}", "--run_name=r", "--prefill_messages_file=p.json", *_mock_run(tmp_path)], tmp_path)
    assert proc.returncode == 1
    assert "must contain a JSON array of messages" in proc.stderr


def test_remote_model_without_key_stops_before_work(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "hi"}])
    proc = run_cli([f"--dataset_file={data}", "--run_name=r", "--batch_size=1"], tmp_path)
    assert proc.returncode == 1
    assert "--api_key" in proc.stderr and "--model=mock" in proc.stderr
    assert not (tmp_path / "data").exists()


def test_missing_and_empty_dataset(tmp_path):
    proc = run_cli(["--dataset_file=nope.jsonl", "--run_name=r", *_mock_run(tmp_path)], tmp_path)
    assert proc.returncode == 1 and "Dataset file not found: nope.jsonl" in proc.stderr
    (tmp_path / "empty.jsonl").write_text("\n\n")
    proc = run_cli(["--dataset_file=empty.jsonl", "--run_name=r", *_mock_run(tmp_path)], tmp_path)
    assert proc.returncode == 1 and "empty" in proc.stderr


def test_invalid_lines_are_all_named_and_nothing_runs(tmp_path):
    path = tmp_path / "bad.jsonl"
    with open(path, "wb") as handle:
        handle.write(b'{"prompt": "fine"}\n')  # 1
        handle.write(b'{"prompt": \n')  # 2 invalid JSON
        handle.write(b'["prompt"]\n')  # 3 not an object
        handle.write(b'{"text": "x"}\n')  # 4 missing prompt
        handle.write(b'{"prompt": "   "}\n')  # 5 empty prompt
        handle.write(b'{"prompt": 42}\n')  # 6 non-string prompt
        handle.write(b'{"prompt": "ok", "image": 5}\n')  # 7 wrong image type
        handle.write(b'{"prompt": "ok", "cwd": ["a"]}\n')  # 8 wrong cwd type
        handle.write(b'{"prompt": "caf\xe9"}\n')  # 9 invalid UTF-8
        handle.write(b'\n')  # 10 blank: ignored
        handle.write(b'{"prompt": "also fine", "id": 7}\n')  # 11
        handle.write(b'{"prompt": null}\n')  # 12 null prompt
        handle.write(b'{"prompt": "ok", "id": true}\n')  # 13 an id that is neither text nor an integer
        handle.write(b'{"prompt": "ok", "id": 1.5}\n')  # 14
    proc = run_cli(["--dataset_file=bad.jsonl", "--run_name=r", *_mock_run(tmp_path)], tmp_path)
    assert proc.returncode == 1
    err = proc.stderr
    expected = {
        2: "invalid JSON",
        3: "not a JSON object (got an array)",
        4: "missing 'prompt' field",
        5: "'prompt' must not be empty",
        6: "'prompt' must be a string, got a number",
        7: "'image' must be a string",
        8: "'cwd' must be a string",
        9: "invalid UTF-8",
        12: "'prompt' must be a string, got null",
        13: "'id' must be a string or an integer, got a boolean",
        14: "'id' must be a string or an integer, got a number",
    }
    for line_no, reason in expected.items():
        matching = [line for line in err.splitlines() if line.strip().startswith(f"bad.jsonl:{line_no}:")]
        assert matching and reason in matching[0], (line_no, err)
    assert "bad.jsonl:1:" not in err and "bad.jsonl:10:" not in err and "bad.jsonl:11:" not in err
    assert "11 invalid line(s)" in err and "--skip_invalid" in err
    assert not (tmp_path / "data" / "r").exists() or not list((tmp_path / "data" / "r").glob("batch_*"))

    proc = run_cli(["--dataset_file=bad.jsonl", "--run_name=r", "--skip_invalid", "--distribution=minimal",
                    *_mock_run(tmp_path)], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "Skipping 11 invalid line(s)" in proc.stdout
    rows = (tmp_path / "data" / "r" / "trajectories.jsonl").read_text().splitlines()
    assert len(rows) == 2


def test_rerun_without_resume_is_refused(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "Explain tides."}])
    args = [f"--dataset_file={data}", "--run_name=r", "--distribution=minimal", *_mock_run(tmp_path)]
    assert run_cli(args, tmp_path).returncode == 0
    before = (tmp_path / "data" / "r" / "batch_0.jsonl").read_bytes()
    proc = run_cli(args, tmp_path)
    assert proc.returncode == 1
    assert "--resume" in proc.stderr and "--overwrite" in proc.stderr
    assert (tmp_path / "data" / "r" / "batch_0.jsonl").read_bytes() == before
    proc = run_cli(args + ["--overwrite"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert len((tmp_path / "data" / "r" / "trajectories.jsonl").read_text().splitlines()) == 1


def test_repo_has_example_dataset():
    lines = (REPO / "data" / "example_prompts.jsonl").read_text().splitlines()
    assert len(lines) >= 10


def test_byte_order_mark_at_the_start_is_accepted(tmp_path):
    (tmp_path / "bom.jsonl").write_bytes(b'\xef\xbb\xbf{"prompt": "Explain tides."}\r\n{"prompt": "And waves?"}\r\n')
    proc = run_cli(["--dataset_file=bom.jsonl", "--run_name=r", "--distribution=minimal", *_mock_run(tmp_path)], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert len((tmp_path / "data" / "r" / "trajectories.jsonl").read_text().splitlines()) == 2


def test_docker_row_without_image_is_refused_before_anything_runs(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "image": "busybox:1"}, {"prompt": "b"}])
    proc = run_cli([f"--dataset_file={data}", "--run_name=r", "--terminal_env=docker", *_mock_run(tmp_path)], tmp_path)
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    assert "d.jsonl:2: no 'image' (or 'docker_image') field" in proc.stderr
    assert "d.jsonl:1:" not in proc.stderr
    assert "Checking" not in proc.stdout  # no image was looked at, let alone pulled
    assert not (tmp_path / "data" / "r").exists() or not list((tmp_path / "data" / "r").glob("batch_*"))


def test_duplicate_ids_are_refused_naming_the_lines_unless_allowed(tmp_path, model_server, remote_args):
    rows = [{"prompt": "First.", "id": "a"}, {"prompt": "Second.", "id": 7}, {"prompt": "Third.", "id": "a"},
            {"prompt": "Fourth."}, {"prompt": "Fifth."}, {"prompt": "Sixth.", "id": "7"}]
    write_jsonl(tmp_path / "d.jsonl", rows)
    args = ["--dataset_file=d.jsonl", "--run_name=r", "--batch_size=2", "--distribution=minimal", *remote_args]
    proc = run_cli(args, tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    err = proc.stderr
    # Each repeated id is named with its line and the line that has it first (7 and "7" are one id: "7").
    assert "d.jsonl:3: duplicate id 'a' (first on line 1)" in err, err
    assert "d.jsonl:6: duplicate id '7' (first on line 2)" in err, err
    assert "2 duplicate id(s)" in err and "--allow_duplicate_ids" in err, err
    assert "d.jsonl:4:" not in err and "d.jsonl:5:" not in err  # rows without an id are never duplicates
    assert model_server.count() == 0 and not list((tmp_path / "data").glob("r/batch_*"))

    proc = run_cli(args + ["--allow_duplicate_ids"], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    kept = (tmp_path / "data" / "r" / "trajectories.jsonl").read_text().splitlines()
    assert len(kept) == 6
