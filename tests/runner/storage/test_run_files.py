"""The run directory through the real CLI: --overwrite removes only the runner's own files, and a
full disk stops the run with a clear message (exit 5) that a resume recovers from."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import uuid

import pytest

from tests.conftest import read_jsonl, run_cli, write_jsonl


def _args(dataset, server, *extra, output_dir="data"):
    return [f"--dataset_file={dataset}", "--run_name=r", "--batch_size=5", "--distribution=terminal_only",
            f"--base_url={server.base_url}", "--model=m", "--api_key=x", f"--output_dir={output_dir}", *extra]


def test_overwrite_keeps_the_users_files_in_the_run_folder(model_server, tmp_path):
    run_dir = tmp_path / "data" / "r"
    run_dir.mkdir(parents=True)
    dataset = write_jsonl(run_dir / "prompts.jsonl", [{"prompt": f"Row {i}."} for i in range(6)])
    (run_dir / "notes.json").write_text('{"mine": true}\n')
    (run_dir / "summary.html").write_text("<p>my notes</p>\n")
    proc = run_cli(_args(dataset, model_server), tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (run_dir / "batch_1.jsonl").exists()
    (run_dir / ".trajectories_left0ver.tmp").write_text("a merge killed mid-write\n")
    (run_dir / "batch_7.jsonl.torn").write_text("{\"torn\n")

    proc = run_cli(_args(dataset, model_server, "--overwrite"), tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "--overwrite: removed" in proc.stdout
    assert len(read_jsonl(dataset)) == 6  # the dataset kept in the folder is still there
    assert json.loads((run_dir / "notes.json").read_text()) == {"mine": True}
    assert (run_dir / "summary.html").read_text() == "<p>my notes</p>\n"
    assert not (run_dir / ".trajectories_left0ver.tmp").exists() and not (run_dir / "batch_7.jsonl.torn").exists()
    assert len(read_jsonl(run_dir / "trajectories.jsonl")) == 6
    assert sorted(p.name for p in run_dir.glob("batch_*")) == ["batch_0.jsonl", "batch_1.jsonl"]


@pytest.mark.parametrize("name", ["trajectories.jsonl", "status_history.jsonl", "statistics.json", "checkpoint.json",
                                  "config.json", "report.html", "status.json", "batch_0.jsonl", "batch_3.jsonl", ".lock"])
def test_a_dataset_under_a_runner_file_name_in_the_run_folder_is_refused(model_server, tmp_path, name):
    run_dir = tmp_path / "data" / "r"
    run_dir.mkdir(parents=True)
    rows = [{"prompt": f"Row {i}."} for i in range(3)]
    dataset = write_jsonl(run_dir / name, rows)
    before = dataset.read_bytes()
    proc = run_cli(_args(dataset, model_server), tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "the dataset is one of the files the runner writes" in proc.stderr and name in proc.stderr
    assert dataset.read_bytes() == before  # untouched
    assert sorted(p.name for p in run_dir.iterdir()) == [name]  # nothing else written
    assert not model_server.requests_for("Row 0.")


def test_a_dataset_reached_through_a_symlink_into_the_run_folder_is_refused(model_server, tmp_path):
    run_dir = tmp_path / "data" / "r"
    run_dir.mkdir(parents=True)
    target = write_jsonl(run_dir / "trajectories.jsonl", [{"prompt": "Row 0."}])
    link = tmp_path / "prompts.jsonl"
    link.symlink_to(target)
    proc = run_cli(_args(link, model_server), tmp_path)
    assert proc.returncode == 1 and "the dataset is one of the files the runner writes" in proc.stderr
    assert len(read_jsonl(target)) == 1


@pytest.fixture
def small_disk(tmp_path):
    """A real file system of its own (tmpfs) that a run can fill: ENOSPC from the kernel."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=96k", f"abr-test-{uuid.uuid4().hex[:6]}", str(mount_point)],
                   check=True)
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def test_full_disk_stops_with_the_path_and_a_resume_completes(model_server, tmp_path, small_disk):
    filler = "x" * 2000  # each row several kilobytes, so 60 rows cannot fit in 96 KiB
    dataset = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"Row {i}. {filler}"} for i in range(60)])
    proc = run_cli(_args(dataset, model_server, output_dir=small_disk), tmp_path)
    console = proc.stdout + proc.stderr
    assert proc.returncode == 5, console
    assert "No space left on device" in console and str(small_disk / "r") in console
    assert "committed rows are safe" in console and "--resume" in console
    assert "Fatal error" not in console and "Traceback" not in console
    committed = sum(len(read_jsonl(p)) for p in (small_disk / "r").glob("batch_*.jsonl"))
    assert 0 < committed < 60

    subprocess.run(["mount", "-o", "remount,size=16m", str(small_disk)], check=True)  # space freed
    proc = run_cli(_args(dataset, model_server, "--resume", output_dir=small_disk), tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = read_jsonl(small_disk / "r" / "trajectories.jsonl")
    assert sorted(r["prompt_index"] for r in rows) == list(range(60))
