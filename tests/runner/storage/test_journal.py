"""The spend journal of a worker process: small on disk, read once, recorded once."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

from runner.storage import journal as journal_module
from runner.storage.journal import SpendJournal, journals, read_journals, record_journaled_spend
from runner.storage.store import RunStore, batch_files
from tests.conftest import read_jsonl


def _task(key: str, attempt: int = 1) -> SimpleNamespace:
    return SimpleNamespace(key=key, index=int(key[-1]), id="", attempt=attempt, seed=7, sample=0, samples=1,
                           sample_seed=0, prompt=f"prompt of {key}")


def _usage(requests: int, cost: float = 0.0, unpriced: int = 0) -> dict:
    return {"requests": requests, "cost": cost, "unpriced_requests": unpriced, "by_model": [], "pending": 0}


def test_a_new_generation_keeps_the_running_attempts_and_the_one_before_last_is_deleted(tmp_path, monkeypatch):
    monkeypatch.setattr(journal_module, "JOURNAL_ROTATE_BYTES", 200)
    monkeypatch.setattr(journal_module, "JOURNAL_ROTATE_AGE", 0.0)
    writer = SpendJournal(tmp_path, "run1", "m")
    writer.note(_task("k0"), _usage(1))
    writer.note(_task("k1"), _usage(1))
    writer.finished("k1")
    for n in range(2, 30):
        writer.note(_task("k0"), _usage(n))
    assert writer.generation >= 3 and len(journals(tmp_path)) == 2  # never more than two files
    attempts = read_journals(journals(tmp_path))
    assert attempts[("run1", "k0", 1)].usage["requests"] == 29  # the running attempt survives every rotation
    assert ("run1", "k1", 1) not in attempts  # finished generations ago: its result was committed long since


def test_journaled_spend_is_recorded_once_even_if_the_journal_survives(tmp_path):
    writer = SpendJournal(tmp_path, "run1", "m")
    writer.note(_task("k0"), _usage(2, cost=0.02))
    writer.note(_task("k1"), _usage(1, unpriced=1))
    writer.note(_task("k2"), _usage(0))  # a request counted, then never sent: nothing to record
    writer.note(_task("k3", attempt=2), _usage(3, cost=0.03))
    for _, fd in writer.files:  # the worker exits
        journal_module.os.close(fd)
    (copy,) = [shutil.copy(p, tmp_path / "saved") for p in journals(tmp_path)]
    store = RunStore(tmp_path, "r", batch_size=10)
    store.load(print)
    # k3's attempt 2 was committed by the parent before it died: covered
    store.commit([_failed("k3", attempt=2, run_id="run1", requests=3)])
    assert record_journaled_spend(tmp_path, store, log=print) == 2
    assert journals(tmp_path) == []
    shutil.copy(copy, tmp_path / ".spend_run1_1_0.journal")  # as if a kill came before the journal was deleted
    assert record_journaled_spend(tmp_path, store, log=print) == 0
    lines = [line for path in batch_files(tmp_path) for line in read_jsonl(path)]
    recovered = {line["metadata"]["row_key"]: line for line in lines if "journal" in line["error"]}
    assert set(recovered) == {"k0", "k1"}
    assert recovered["k0"]["metadata"]["usage"]["requests"] == 2 and recovered["k0"]["error_class"] == "interrupted"
    assert recovered["k1"]["metadata"]["usage"]["unpriced_requests"] == 1
    assert recovered["k0"]["metadata"]["run_id"] == "run1" and recovered["k0"]["prompt"] == "prompt of k0"


def _failed(key: str, *, attempt: int, run_id: str, requests: int) -> dict:
    from runner.storage.records import FailedRecord, Metadata, UsageRecord, as_dict

    metadata = Metadata(timestamp="2026-01-01T00:00:00+00:00", model="m", row_key=key, run_id=run_id, attempt=attempt,
                        duration_seconds=0.0, seed=7, usage=UsageRecord(requests=requests))
    return as_dict(FailedRecord(prompt_index=3, failed=True, error="worker process died", error_class="agent",
                                prompt="", metadata=metadata))


def test_a_journal_of_a_live_worker_is_left_for_later(tmp_path, monkeypatch):
    monkeypatch.setattr(journal_module, "WAIT_FOR_WRITERS", 0.2)
    writer = SpendJournal(tmp_path, "run1", "m")  # its lock is held: "alive"
    writer.note(_task("k0"), _usage(1))
    store = RunStore(tmp_path, "r", batch_size=10)
    store.load(print)
    said = []
    assert record_journaled_spend(tmp_path, store, log=said.append) == 0
    assert len(journals(tmp_path)) == 1 and "still alive" in said[0]
    assert record_journaled_spend(tmp_path, store, skip_run_id="run1", log=said.append) == 0  # its own run's: not read
    assert Path(journals(tmp_path)[0]).exists()


def test_the_journals_of_the_invocation_now_ending_are_checked_against_what_it_committed(tmp_path):
    writer = SpendJournal(tmp_path, "run1", "m")
    writer.note(_task("k0"), _usage(2))  # committed by the parent (its worker died)
    writer.note(_task("k1"), _usage(1))  # given up in flight before the parent heard of its request
    for _, fd in writer.files:
        journal_module.os.close(fd)
    store = RunStore(tmp_path, "r", batch_size=10)
    store.load(print)
    store.commit([_failed("k0", attempt=1, run_id="run1", requests=2)])
    assert record_journaled_spend(tmp_path, store, own_run_id="run1", log=print) == 1
    lines = [line for path in batch_files(tmp_path) for line in read_jsonl(path)]
    assert sorted(line["metadata"]["row_key"] for line in lines) == ["k0", "k1"] and journals(tmp_path) == []


def _closed_journal(tmp_path: Path, run_id: str = "run1") -> SpendJournal:
    writer = SpendJournal(tmp_path, run_id, "m")
    writer.note(_task("k0"), _usage(2))
    for _, fd in writer.files:  # the worker exits
        journal_module.os.close(fd)
    return writer


def _loaded_store(tmp_path: Path) -> RunStore:
    store = RunStore(tmp_path, "r", batch_size=10)
    store.load(print)
    return store


def _recorded_keys(tmp_path: Path) -> list[str]:
    return sorted(line["metadata"]["row_key"] for path in batch_files(tmp_path) for line in read_jsonl(path))


def test_lines_that_are_not_well_formed_are_skipped_with_one_warning_naming_the_file_and_line(tmp_path):
    writer = _closed_journal(tmp_path)
    path = writer.files[0][0]
    bad = [b"5", b"[1, 2]", b"not json", b'{"start": {"key": "k5", "id": ""}}',  # no index nor attempt
           b'{"start": {"key": "k6", "index": 6, "attempt": 1, "seed": "x"}}', b'{"k": "k0", "a": 1}',
           b'{"k": ["k0"], "a": 1, "t": 1.0, "u": {"requests": 9}}', b'{"k": "k5", "a": 1, "t": 1.0, "u": 7}',
           b'{"other": 1}']
    with open(path, "ab") as handle:
        handle.write(b"\n".join(bad) + b"\n")
    said = []
    assert record_journaled_spend(tmp_path, _loaded_store(tmp_path), log=said.append) == 1
    assert _recorded_keys(tmp_path) == ["k0"]  # the well-formed attempt is still recorded, with its usage
    warnings = [line for line in said if "line" in line and path.name in line]
    assert len(warnings) == 1 and "line 4" in warnings[0], said  # the header, start and usage lines come first
    assert journals(tmp_path) == []  # retired like any other: it never blocks a later invocation


def test_what_is_not_a_regular_file_is_skipped_never_read(tmp_path):
    import os

    (tmp_path / ".spend_zz_1_0.journal").mkdir()
    os.mkfifo(tmp_path / ".spend_zz_2_0.journal")  # a plain open() of a FIFO blocks until a writer comes
    (tmp_path / ".spend_zz_3_0.journal").symlink_to(tmp_path / "elsewhere")
    _closed_journal(tmp_path)
    said = []
    assert record_journaled_spend(tmp_path, _loaded_store(tmp_path), log=said.append) == 1
    assert _recorded_keys(tmp_path) == ["k0"]
    assert (tmp_path / ".spend_zz_1_0.journal").is_dir() and (tmp_path / ".spend_zz_2_0.journal").exists()


def test_an_attempt_of_a_row_not_in_the_dataset_is_not_recorded(tmp_path):
    writer = _closed_journal(tmp_path)
    said = []
    store = _loaded_store(tmp_path)
    assert record_journaled_spend(tmp_path, store, units={"k1": 1}, log=said.append) == 0
    assert _recorded_keys(tmp_path) == [] and journals(tmp_path) == []
    assert any("k0" in line and "not in the dataset" in line and writer.files[0][0].name in line for line in said), said


def test_numbers_no_record_can_hold_are_skipped_and_nothing_unreadable_is_committed(tmp_path):
    writer = _closed_journal(tmp_path)
    path = writer.files[0][0]
    start = '{"start": {"key": "k%d", "index": %d, "attempt": 1, "t": %s}}'
    usage = '{"k": "k%d", "a": 1, "t": 1.0, "u": %s}'
    bad = [(1, "1.0", '{"requests": 1, "prompt_tokens": 1e300}'),
           (2, "1.0", '{"requests": 18446744073709551615}'),
           (3, "1.0", '{"requests": 1, "by_model": [{"model": "m", "prompt_tokens": 1e300}]}'),
           (4, "-1e300", '{"requests": 1}'),
           (5, "1.0", '{"requests": 1, "cost": -5}')]
    with open(path, "ab") as handle:
        for n, t, u in bad:
            handle.write((start % (n, n, t) + "\n" + usage % (n, u) + "\n").encode())
    said = []
    store = _loaded_store(tmp_path)
    assert record_journaled_spend(tmp_path, store, log=said.append) == 1
    assert _recorded_keys(tmp_path) == ["k0"]
    assert any(path.name in line and "skipped" in line for line in said), said
    reread = RunStore(tmp_path, "r", batch_size=10)
    reread.load(print)  # what was committed reads back
    assert reread.view.entry("k0") is not None
