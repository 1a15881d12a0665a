"""Unit tests of the run directory: commits, torn tails, the checkpoint cache."""

from __future__ import annotations

import json

import pytest

from runner.storage.records import RecordError
from runner.storage.store import RunStore, batch_files, iter_lines


def _record(key: str, index: int, outcome: str = "ok", cost: float | None = 0.5) -> dict:
    metadata = {"timestamp": "2026-01-01T10:00:00", "model": "m", "row_key": key, "run_id": "r1", "attempt": 1,
                "duration_seconds": 1.0, "seed": 1,
                "usage": {"requests": 2, "retries": 1, "prompt_tokens": 100, "cached_tokens": 40, "cost": cost or 0.0,
                          "unpriced_requests": 2 if cost is None else 0}}
    record = {"prompt_index": index}
    if outcome == "failed":
        record.update(failed=True, error="boom", error_class="provider", prompt="p", metadata=metadata)
        return record
    if outcome == "discarded":
        record.update(discarded="no_reasoning", prompt="p", metadata=metadata)
    else:
        record.update(conversations=[{"from": "human", "value": "p"}], metadata=metadata, completed=True, partial=False)
    record.update(api_calls=1, toolsets_used=[], tool_stats={}, tool_error_counts={}, reasoning_stats={})
    return record


def test_commit_rotates_files_and_assigns_batch_numbers(tmp_path):
    store = RunStore(tmp_path, "r", batch_size=2)
    store.load()
    store.commit([_record(f"k{i}", i) for i in range(5)])
    store.close()
    assert [p.name for p in batch_files(tmp_path)] == ["batch_0.jsonl", "batch_1.jsonl", "batch_2.jsonl"]
    nums = [json.loads(line)["metadata"]["batch_num"] for p in batch_files(tmp_path) for _, line in iter_lines(p)]
    assert nums == [0, 0, 1, 1, 2]
    checkpoint = json.loads((tmp_path / "checkpoint.json").read_text())
    assert checkpoint["completed_prompts"] == [0, 1, 2, 3, 4]
    assert checkpoint["batch_stats"]["1"]["processed"] == 2


def test_resume_writes_new_files_after_existing_and_never_rewrites(tmp_path):
    store = RunStore(tmp_path, "r", batch_size=10)
    store.load()
    store.commit([_record("a", 0), _record("b", 1, "failed")])
    store.close()
    before = (tmp_path / "batch_0.jsonl").read_bytes()
    again = RunStore(tmp_path, "r", batch_size=10)
    again.load()
    assert again.is_committed("a") and not again.is_committed("b") and again.failures("b") == 1
    again.commit([_record("b", 1)])
    again.close()
    assert (tmp_path / "batch_0.jsonl").read_bytes() == before
    assert (tmp_path / "batch_1.jsonl").exists()
    third = RunStore(tmp_path, "r", batch_size=10)
    third.load()
    assert third.is_committed("b") and third.failures("b") == 1


def test_duplicate_results_commit_once(tmp_path):
    store = RunStore(tmp_path, "r", batch_size=10)
    store.load()
    store.commit([_record("a", 0), _record("a", 0)])
    store.commit([_record("a", 0)])
    store.close()
    assert len((tmp_path / "batch_0.jsonl").read_text().splitlines()) == 1


def test_torn_tail_is_moved_aside_and_never_glued(tmp_path):
    store = RunStore(tmp_path, "r", batch_size=10)
    store.load()
    store.commit([_record("a", 0)])
    store.close()
    path = tmp_path / "batch_0.jsonl"
    with open(path, "ab") as handle:
        handle.write(b'{"prompt_index": 1, "metadata": {"row_key": "b"')  # killed mid-write
    again = RunStore(tmp_path, "r", batch_size=10)
    assert again.repair_torn_tails(log=lambda s: None) == 1
    again.load()
    assert not again.is_committed("b")
    again.commit([_record("b", 1)])
    again.close()
    for p in batch_files(tmp_path):
        for line in p.read_text().splitlines():
            json.loads(line)  # every line parses: nothing was glued
    assert (tmp_path / "batch_0.jsonl.torn").read_bytes().startswith(b'{"prompt_index": 1')


def test_checkpoint_cache_is_used_and_tail_after_it_is_read(tmp_path):
    store = RunStore(tmp_path, "r", batch_size=100)
    store.load()
    store.commit([_record("a", 0)])
    store.close()
    # A line committed after the last checkpoint save (crash before the coalesced write).
    with open(tmp_path / "batch_0.jsonl", "ab") as handle:
        handle.write(json.dumps(_record("b", 1)).encode() + b"\n")
    again = RunStore(tmp_path, "r", batch_size=100)
    again.load()
    assert again.is_committed("a") and again.is_committed("b")
    # A corrupt checkpoint is ignored: the batch files are the truth.
    (tmp_path / "checkpoint.json").write_text("{not json")
    third = RunStore(tmp_path, "r", batch_size=100)
    third.load(log=lambda s: None)
    assert third.is_committed("a") and third.is_committed("b")


def test_checkpoint_of_another_run_is_ignored(tmp_path):
    (tmp_path / "checkpoint.json").write_text(json.dumps({"run_name": "other", "rows": {"x": ["ok", 0, 0]}, "files": {}}))
    store = RunStore(tmp_path, "r", batch_size=10)
    store.load()
    assert not store.is_committed("x")


def test_every_file_the_runner_creates_is_private_and_existing_modes_are_kept(tmp_path):
    """Through the CLI: batch files, merged outputs and the report are 0600; a mode the user set stays."""
    import stat

    from tests.conftest import run_cli, write_jsonl

    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "Explain tides."}, {"prompt": "And waves?"}])
    args = [f"--dataset_file={data}", "--batch_size=1", "--run_name=r", "--model=mock", "--distribution=minimal"]
    proc = run_cli(args, tmp_path)
    assert proc.returncode == 0, proc.stderr
    run_dir = tmp_path / "data" / "r"
    files = {p.name: stat.S_IMODE(p.stat().st_mode) for p in run_dir.iterdir() if p.is_file()}
    for name in ("batch_0.jsonl", "batch_1.jsonl", "trajectories.jsonl", "statistics.json", "checkpoint.json",
                 "config.json", "report.html"):
        assert files.pop(name) == 0o600, name
    assert all(mode == 0o600 for mode in files.values()), files

    for name in ("batch_0.jsonl", "trajectories.jsonl", "report.html", "statistics.json"):
        (run_dir / name).chmod(0o640)
    proc = run_cli(args + ["--resume"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    for name in ("batch_0.jsonl", "trajectories.jsonl", "report.html", "statistics.json"):
        assert stat.S_IMODE((run_dir / name).stat().st_mode) == 0o640, name


def test_a_record_that_does_not_fit_its_schema_is_never_written(tmp_path):
    store = RunStore(tmp_path, "r", batch_size=10)
    store.load()
    bad = _record("a", 0)
    bad["metadata"]["id"] = 17  # ids are strings in every row
    with pytest.raises(RecordError, match="metadata.id"):
        store.commit([bad])
    store.close()
    assert not (tmp_path / "batch_0.jsonl").exists() or (tmp_path / "batch_0.jsonl").read_bytes() == b""


def test_spend_is_kept_as_rows_commit_and_survives_a_resume(tmp_path):
    store = RunStore(tmp_path, "r", batch_size=10)
    store.load()
    store.commit([_record("a", 0), _record("b", 1, "failed"), _record("c", 2, "discarded")])
    assert store.spent().as_dict()["requests"] == 6 and store.spent().as_dict()["cost"] == 1.5
    store.close()
    lines = [json.loads(line) for p in batch_files(tmp_path) for _, line in iter_lines(p)]
    assert [line["metadata"]["schema_version"] for line in lines] == [3, 3, 3]
    for cached in (True, False):  # from checkpoint.json, and from the batch files alone
        if not cached:
            (tmp_path / "checkpoint.json").unlink()
        again = RunStore(tmp_path, "r", batch_size=10)
        again.load()
        spent = again.spent().as_dict()
        assert spent["attempts"] == 3 and spent["requests"] == 6 and spent["retries"] == 3
        assert spent["cost"] == 1.5 and spent["cache_hit_ratio"] == 0.4
        again.commit([_record("b", 1, cost=None)])  # an endpoint that reports no cost
        assert again.spent().as_dict()["cost"] is None  # unknown, never 0
        again.close()
        assert again.spent().as_dict()["attempts"] == 4
        (tmp_path / "batch_1.jsonl").unlink()  # back to three lines for the next round
        (tmp_path / "checkpoint.json").unlink(missing_ok=True)
        store = RunStore(tmp_path, "r", batch_size=10)
        store.load()
        store.close()


def test_a_failed_commit_never_reaches_checkpoint_json(tmp_path):
    """Disk full mid-group: the rows of the failed group are not committed, and no checkpoint
    written after it (at close) may say they are, or a resume would never run them."""
    import errno

    from runner.storage.store import StorageError

    store = RunStore(tmp_path, "r", batch_size=10)
    store.load()
    store.commit([_record("a", 0)])
    store.save_checkpoint(force=True)
    real_write, calls = store._write_all, []

    def full_disk(data: bytes) -> None:
        calls.append(data)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write(data)

    store._write_all = full_disk
    with pytest.raises(StorageError):
        store.commit([_record("b", 1), _record("c", 2)])
    store.close()
    again = RunStore(tmp_path, "r", batch_size=10)
    again.load()
    assert again.is_committed("a") and not again.is_committed("b") and not again.is_committed("c")
    assert again.spent().attempts == 1


def test_a_slow_checkpoint_write_spaces_out_the_next_one(tmp_path, monkeypatch):
    """checkpoint.json names every row, so it takes longer to write as rows are done: after a
    write that took 1 s the next waits 20 s (not the 2 s floor), so a million-row run does not
    spend its parent's time rewriting the cache. A commit in between is committed all the same."""
    import runner.storage.store as store_module

    clock = [1000.0]
    monkeypatch.setattr(store_module.time, "monotonic", lambda: clock[0])
    writes = []
    real_write = store_module.write_checkpoint

    def slow_write(path, checkpoint):
        clock[0] += 1.0  # the write takes a second
        writes.append(sorted(checkpoint["rows"]))
        real_write(path, checkpoint)

    monkeypatch.setattr(store_module, "write_checkpoint", slow_write)
    store = RunStore(tmp_path, "r", batch_size=10)
    store.load()
    store.commit([_record("a", 0)])
    clock[0] += 3.0  # past the 2 s floor, within 20 x the last write
    store.commit([_record("b", 1)])
    assert writes == [["a"]]
    clock[0] += 18.0
    store.commit([_record("c", 2)])
    assert writes == [["a"], ["a", "b", "c"]]
    store.close()  # the last write is forced
    assert json.loads((tmp_path / "checkpoint.json").read_text())["completed_prompts"] == [0, 1, 2]
