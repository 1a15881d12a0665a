"""An interrupted compression (Ctrl-C, SIGKILL) finishes with --resume, without asking again for
a row already summarised, through the real command."""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, SECRET_KEY, read_jsonl, wait_for, write_jsonl
from tests.helpers.compress_fixtures import trajectory, write_tokenizer
from tests.helpers.model_server import ModelServer, Reply, chat_completion

ROWS = 8


def slow_summaries(body, state):
    return Reply(body=chat_completion(body, "The agent worked through its tools."), latency=0.7)


def start(work: Path, server: ModelServer, *extra: str, source: str = "runs.jsonl") -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("OPENROUTER_API_KEY", "OPENAI_API_KEY")}
    env["PYTHONPATH"] = str(REPO)
    args = [f"--input={source}", "--tokenizer=tok", "--target_max_tokens=500", "--summary_target_tokens=50",
            f"--base_url={server.base_url}", "--summary_model=s", f"--api_key={SECRET_KEY}",
            "--max_concurrent_requests=2", *extra]
    return subprocess.Popen([sys.executable, str(REPO / "trajectory_compressor.py"), *args], cwd=work, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def journal_rows(work: Path) -> list[dict]:
    """The rows decided (compressed or failed) in the journal; not what rows in flight spent so far."""
    path = work / "runs_compressed.jsonl.progress"
    if not path.exists():
        return []
    lines = path.read_bytes().split(b"\n")[1:]
    rows = []
    for line in lines:
        try:
            rows.append(json.loads(line))
        except ValueError:
            pass
    return [row for row in rows if row["status"] != "in_flight"]


def resume_to_the_end(work: Path, server: ModelServer) -> int:
    """--resume until the output is whole; every request the endpoint got by then must be counted
    once in the metrics JSON. Returns that count."""
    resumed = start(work, server, "--resume")
    _, err = resumed.communicate(timeout=120)
    assert resumed.returncode == 0, err
    total = server.count()
    metrics = json.loads((work / "runs_compressed.metrics.json").read_text())
    assert metrics["summariser"]["requests"] == total
    return total


@pytest.fixture
def work(tmp_path):
    write_tokenizer(tmp_path / "tok")
    write_jsonl(tmp_path / "runs.jsonl", [trajectory(10, 50, f"r{i}") for i in range(ROWS)])
    return tmp_path


@pytest.mark.parametrize("how", [signal.SIGINT, signal.SIGKILL])
def test_an_interrupted_compression_resumes_without_paying_twice(work, how):
    with ModelServer(policy=slow_summaries) as server:
        process = start(work, server)
        wait_for(lambda: len(journal_rows(work)) >= 2 or process.poll() is not None, 60)
        assert len(journal_rows(work)) >= 2, process.communicate(timeout=30)
        assert stat.S_IMODE((work / "runs_compressed.jsonl.progress").stat().st_mode) == 0o600
        process.send_signal(how)
        out, err = process.communicate(timeout=60)
        if how == signal.SIGINT:
            assert process.returncode == 130, err
            assert "--resume" in err
        assert not (work / "runs_compressed.jsonl").exists()  # only whole outputs are written
        done = {row["row"]["metadata"]["row_key"] for row in journal_rows(work) if row["status"] == "compressed"}
        first_requests = server.count()

        refused = start(work, server)  # without --resume: refused, nothing sent
        _, refusal = refused.communicate(timeout=60)
        assert refused.returncode == 1 and "--resume" in refusal and server.count() == first_requests

        resumed = start(work, server, "--resume")
        out, err = resumed.communicate(timeout=120)
        assert resumed.returncode == 0, err
        asked_again = [r for r in server.requests[first_requests:]]
    assert len(asked_again) == ROWS - len(done)
    for request in asked_again:  # none of them for a row already in the journal
        assert not any(f" {key} " in request.body["messages"][1]["content"] for key in done)
    output = read_jsonl(work / "runs_compressed.jsonl")
    assert [r["metadata"]["row_key"] for r in output] == [f"r{i}" for i in range(ROWS)]
    assert all(r["compression_metrics"]["status"] == "compressed" for r in output)
    metrics = json.loads((work / "runs_compressed.metrics.json").read_text())
    assert metrics["rows_resumed"] == len(done)
    for name in ("runs_compressed.jsonl", "runs_compressed.metrics.json"):  # private, as every file the runner writes
        assert stat.S_IMODE((work / name).stat().st_mode) == 0o600, name
    # Every request the endpoint got is counted once: the earlier invocation's, those of its rows
    # cut off in flight too (journaled before they were sent).
    assert metrics["summariser"]["requests"] == first_requests + len(asked_again)
    assert not (work / "runs_compressed.jsonl.progress").exists()


def test_a_torn_last_journal_line_is_dropped_and_that_row_done_again(work):
    with ModelServer(policy=slow_summaries) as server:
        process = start(work, server)
        wait_for(lambda: len(journal_rows(work)) >= 1, 60, step=0.02)
        process.kill()
        process.wait(timeout=30)
        journal = work / "runs_compressed.jsonl.progress"
        whole = journal.read_bytes()
        last = whole.rstrip(b"\n").split(b"\n")[-1]
        journal.write_bytes(whole + last[: len(last) // 2])  # killed in the middle of writing a row
        kept = {row["key"] for row in journal_rows(work)}
        before = server.count()
        resumed = start(work, server, "--resume")
        _, err = resumed.communicate(timeout=120)
        assert resumed.returncode == 0, err
        assert server.count() - before == ROWS - len(kept)
    assert [r["metadata"]["row_key"] for r in read_jsonl(work / "runs_compressed.jsonl")] == [f"r{i}" for i in range(ROWS)]


def test_a_directory_killed_after_its_first_file_resumes_without_paying_for_that_file_again(tmp_path):
    write_tokenizer(tmp_path / "tok")
    (tmp_path / "in").mkdir()
    write_jsonl(tmp_path / "in" / "a.jsonl", [trajectory(10, 50, f"a{i}") for i in range(3)])
    write_jsonl(tmp_path / "in" / "b.jsonl", [trajectory(10, 50, f"b{i}") for i in range(ROWS)])
    first_file = tmp_path / "in_compressed" / "a.jsonl"
    with ModelServer(policy=slow_summaries) as server:
        process = start(tmp_path, server, source="in")
        wait_for(lambda: first_file.exists() or process.poll() is not None, 60)
        assert first_file.exists(), process.communicate(timeout=30)
        process.kill()
        process.wait(timeout=30)
        first_requests = server.count()
        resumed = start(tmp_path, server, "--resume", source="in")
        _, err = resumed.communicate(timeout=120)
        assert resumed.returncode == 0, err
        asked_again = server.requests[first_requests:]
    for request in asked_again:  # the first file's rows were all summarised before the kill
        assert not any(f" a{i} " in request.body["messages"][1]["content"] for i in range(3))
    metrics = json.loads((tmp_path / "in_compressed" / "compression_metrics.json").read_text())
    assert metrics["files"][0]["rows_resumed"] == 3
    assert metrics["summariser"]["requests"] == first_requests + len(asked_again)  # both invocations' spend
    assert [r["metadata"]["row_key"] for r in read_jsonl(first_file)] == [f"a{i}" for i in range(3)]
    assert not list((tmp_path / "in_compressed").glob("*.progress"))


@pytest.mark.parametrize("again", [(), ("--resume",)])
def test_a_second_compression_of_the_same_output_is_refused_while_the_first_runs(work, again):
    def slower(body, state):  # the first one outlives the second's start-up, even under load
        return Reply(body=chat_completion(body, "The agent worked through its tools."), latency=3)

    with ModelServer(policy=slower) as server:
        process = start(work, server)
        wait_for(lambda: len(journal_rows(work)) >= 1 or process.poll() is not None, 60)
        assert len(journal_rows(work)) >= 1, process.communicate(timeout=30)
        asked = server.count()
        second = start(work, server, *again)
        _, refusal = second.communicate(timeout=60)
        assert process.poll() is None, "the first compression ended before the second was refused"
        assert second.returncode == 1, refusal
        assert "another compression is writing" in refusal and "--resume" not in refusal, refusal
        assert server.count() - asked <= 2  # only the first one's requests in flight (2 at a time)
        _, err = process.communicate(timeout=120)
        assert process.returncode == 0, err
        assert server.count() == ROWS  # each row asked for once
    assert [r["metadata"]["row_key"] for r in read_jsonl(work / "runs_compressed.jsonl")] == [f"r{i}" for i in range(ROWS)]


def test_rows_cut_off_in_flight_twice_are_paid_for_once_each_time(work):
    """SIGKILL with summaries in flight, --resume, SIGKILL again with the same rows in flight
    again, then --resume to the end: every request the endpoint got is counted, the cut-off
    ones of both kills included (the second attempt of a row must not replace the first's spend)."""
    with ModelServer(policy=slow_summaries) as server:
        for extra in ((), ("--resume",)):
            before = server.count()
            process = start(work, server, *extra)
            wait_for(lambda: server.count() >= before + 2 or process.poll() is not None, 60, step=0.02)
            process.kill()
            process.wait(timeout=30)
        resume_to_the_end(work, server)
    assert [r["metadata"]["row_key"] for r in read_jsonl(work / "runs_compressed.jsonl")] == [f"r{i}" for i in range(ROWS)]


def test_a_resume_after_a_whole_run_that_is_itself_cut_off_keeps_that_runs_rows_and_spend(work):
    """A whole run with one failed row, then a --resume interrupted while it retries that row, then
    --resume to the end: only that row is asked again, and every request is counted once (the
    interrupted resume's journal held the whole run's rows and spend, not only its own lines)."""
    phase = {"now": "fail"}

    def policy(body, state):
        if " r3 " in body["messages"][1]["content"]:
            if phase["now"] == "fail":
                return Reply(status=400, body={"error": {"message": "no"}})
            if phase["now"] == "hang":
                return Reply(hang=True)
        return Reply(body=chat_completion(body, "The agent worked through its tools."))

    with ModelServer(policy=policy) as server:
        first = start(work, server)
        _, err = first.communicate(timeout=120)
        assert first.returncode == 2, err  # a failed row
        whole_run = server.count()
        phase["now"] = "hang"
        second = start(work, server, "--resume")
        wait_for(lambda: server.count() > whole_run, 60, step=0.02)
        second.send_signal(signal.SIGINT)
        second.communicate(timeout=60)
        phase["now"] = "answer"
        resume_to_the_end(work, server)
        asked_again = server.requests[whole_run:]
    assert all(" r3 " in r.body["messages"][1]["content"] for r in asked_again) and len(asked_again) == 2
    assert [r["metadata"]["row_key"] for r in read_jsonl(work / "runs_compressed.jsonl")] == [f"r{i}" for i in range(ROWS)]


def _output_row(n: int, status: str = "compressed") -> bytes:
    metrics = {"status": status, "failure": "", "over_limit": False, "tokens_before": 10, "tokens_after": 5}
    return json.dumps({"x": n, "conversations": [], "compression_metrics": metrics}).encode()


def test_a_last_journal_line_without_its_newline_is_torn_and_nothing_is_glued_to_it(tmp_path):
    """A line is whole only with its newline: one written but for it is dropped (its row done
    again) and cut off the file, so the next line starts on a line of its own."""
    from runner.compress.journal import Entry, Journal

    output = tmp_path / "out.jsonl"
    journal = Journal.open(output, {"f": 1}, resume=False)
    journal.add(Entry("a", "compressed", {"requests": 1}, _output_row(1)))
    journal.add(Entry("b", "compressed", {"requests": 1}, _output_row(2)))
    journal.close()
    path = Journal.path_for(output)
    path.write_bytes(path.read_bytes().rstrip(b"\n"))  # the last write lost its newline
    again = Journal.open(output, {"f": 1}, resume=True)
    assert set(again.entries) == {"a"} and again.earlier_usage == [{"requests": 1}]
    again.add(Entry("c", "compressed", {"requests": 1}, _output_row(3)))
    again.close()
    reread = Journal.open(output, {"f": 1}, resume=True)
    assert set(reread.entries) == {"a", "c"}
    reread.close()


def test_a_journal_holding_only_rows_cut_off_in_flight_counts_their_spend_once(work):
    """Killed before any row finished: the journal holds only what the rows in flight spent. The
    resume counts it once (it is no whole run's output to carry over) and finishes."""
    with ModelServer(policy=slow_summaries) as server:
        process = start(work, server)
        wait_for(lambda: server.count() >= 2 or process.poll() is not None, 60, step=0.02)
        process.kill()
        process.wait(timeout=30)
        assert journal_rows(work) == []  # nothing decided yet
        resume_to_the_end(work, server)


def _killed_with_rows_journaled(work: Path, server: ModelServer, rows: int) -> Path:
    process = start(work, server)
    wait_for(lambda: len(journal_rows(work)) >= rows or process.poll() is not None, 60, step=0.02)
    process.kill()
    process.wait(timeout=30)
    assert len(journal_rows(work)) >= rows
    return work / "runs_compressed.jsonl.progress"


DAMAGED = {
    "not JSON": lambda line: b'{"key": "oops',
    "a row that is a number": lambda line: line.replace(b'"row":{', b'"row":5,"was":{', 1),
    "a row without its metrics": lambda line: line.replace(b'"compression_metrics"', b'"other"', 1),
    "a usage that is a list": lambda line: line.replace(b'"usage":{', b'"usage":[{', 1).replace(b'},"row"', b'}],"row"', 1),
    "an unknown status": lambda line: line.replace(b'"status":"compressed"', b'"status":"done"', 1),
    "metrics without their figures": lambda line: re.sub(rb'"compression_metrics":\{[^{}]*\}', b'"compression_metrics":{}', line),
    "a count that is text": lambda line: re.sub(rb'"requests":(\d+)', rb'"requests":"\1"', line, count=1),
    "a negative count": lambda line: re.sub(rb'"requests":(\d+)', rb'"requests":-\1', line, count=1),
    "a row without conversations": lambda line: line.replace(b'"conversations":', b'"talk":', 1),
}


@pytest.mark.parametrize("damage", sorted(DAMAGED))
def test_a_journal_damaged_before_its_last_line_is_refused_naming_the_line_and_kept_as_it_is(work, damage):
    """Only the last line can be torn by a kill; a damaged line before it was changed by someone
    (or by the disk). The resume stops before any request, names the file and the line, and keeps
    the journal byte for byte: the rows after that line are paid for too."""
    with ModelServer(policy=slow_summaries) as server:
        journal = _killed_with_rows_journaled(work, server, 3)
        lines = journal.read_bytes().split(b"\n")
        number, line = next((n, line) for n, line in enumerate(lines[1:-2], start=2) if b'"status":"compressed"' in line)
        lines[number - 1] = DAMAGED[damage](line)
        journal.write_bytes(b"\n".join(lines))
        kept = journal.read_bytes()
        before = server.count()
        resumed = start(work, server, "--resume")
        _, err = resumed.communicate(timeout=120)
        assert resumed.returncode == 1, err
        assert f"{journal.name} line {number}" in err and "delete" in err and "Traceback" not in err, err
        assert server.count() == before and journal.read_bytes() == kept


def test_the_refusal_without_resume_counts_the_rows_compressed_not_the_failed_or_the_cut_off(tmp_path):
    from runner.compress.journal import Entry, Journal, JournalError

    output = tmp_path / "out.jsonl"
    journal = Journal.open(output, {"f": 1}, resume=False)
    journal.add(Entry("a", "compressed", {"requests": 1}, _output_row(1)))
    journal.add(Entry("b", "failed", {"requests": 3}, _output_row(2, "failed")))
    journal.spending("c", {"requests": 1})
    journal.add(Entry("a2", "compressed", {"requests": 1}, _output_row(3)))
    journal.close()
    with pytest.raises(JournalError, match=r"\(2 rows compressed, 1 failed\)"):
        Journal.check(output, {"f": 1}, resume=False)


def test_a_journal_killed_while_its_header_was_written_holds_nothing_and_is_started_again(tmp_path):
    from runner.compress.journal import Entry, Journal

    output = tmp_path / "out.jsonl"
    path = Journal.path_for(output)
    path.write_bytes(b'{"fingerprint": {"f"')  # the very first write, cut: no row can have been journaled
    Journal.check(output, {"f": 1}, resume=False)  # nothing to refuse, nothing to resume
    journal = Journal.open(output, {"f": 1}, resume=False)
    journal.add(Entry("a", "compressed", {"requests": 1}, _output_row(1)))
    journal.close()
    again = Journal.open(output, {"f": 1}, resume=True)
    assert set(again.entries) == {"a"}
    again.close()
