"""What a user sees on the console: words that fit the numbers, whole causes, no bar in a log."""

from __future__ import annotations

import json
import re

import pytest

from runner.console import PlainProgress, plural
from runner.output.finalize import print_summary
from tests.conftest import run_cli, write_jsonl
from tests.runner.output.test_report import _finalize, hand_run  # noqa: F401 (the hand-written run fixture)


def test_one_prompt_is_singular_and_redirected_output_has_no_bar(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "Explain tides."}])
    proc = run_cli([f"--dataset_file={data}", "--batch_size=1", "--run_name=r", "--model=mock",
                    "--distribution=minimal", "--verbose", "--log_prefix_chars=7"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout + proc.stderr
    assert "(1 prompt)" in out and "Workers: 1 concurrent session\n" in out
    assert "Running 1 prompt: 1 session on 1 process\n" in out
    assert "1 prompts" not in out and "1 sessions" not in out and "1 calls" not in out
    assert "\r" not in proc.stderr and "%|" not in proc.stderr  # no tqdm redraws when stderr is a pipe
    assert "⏳ 1 of 1 prompt finished (100%)" in proc.stderr
    assert "Prompt 0 ok: 'Explain...'" in out  # --log_prefix_chars cuts the prompt preview
    assert "BATCH PROCESSING COMPLETE" in out


def test_two_prompts_start_two_sessions(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "Explain tides."}, {"prompt": "And waves?"}])
    proc = run_cli([f"--dataset_file={data}", "--batch_size=1", "--run_name=r", "--model=mock",
                    "--distribution=minimal", "--num_workers=4", "--num_processes=2"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "Running 2 prompts: 2 sessions on 2 processes" in proc.stdout
    assert "Workers: 2 concurrent sessions" in proc.stdout


def test_failure_line_shows_the_whole_cause(tmp_path, model_server, remote_args):
    cause = "upstream said " + "x" * 150 + " END-OF-CAUSE"
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"@fail 400 9 body={cause}\nAlways fails."}])
    proc = run_cli([f"--dataset_file={data}", "--batch_size=1", "--run_name=r", *remote_args,
                    "--distribution=minimal", "--log_prefix_chars=20"], tmp_path)
    assert proc.returncode in (2, 3), proc.stdout + proc.stderr
    line = next(line for line in (proc.stdout + proc.stderr).splitlines() if "Prompt 0 failed" in line)
    assert "END-OF-CAUSE" in line, line


def test_plain_progress_prints_on_change_and_a_quiet_line_with_the_oldest_wait():
    lines, now = [], [0.0]

    class Out:
        def write(self, text):
            lines.append(text)

        def flush(self):
            pass

    bar = PlainProgress(3, every=10, out=Out(), clock=lambda: now[0], waiting=lambda: 42.0, quiet_every=60)
    bar.set_postfix({"ok": 1})
    now[0] = 1.0
    bar.update(1)  # too soon
    now[0] = 11.0
    bar.update(1)  # a line
    now[0] = 12.0
    bar.tick()  # too soon
    now[0] = 25.0
    bar.tick()  # due, but nothing changed: no line
    assert "".join(lines).count("⏳") == 1
    now[0] = 71.0
    bar.tick()  # a minute without change: one line says the run is alive
    now[0] = 90.0
    bar.close()  # nothing changed since: no repeat
    text = "".join(lines)
    assert text.count("⏳") == 2, text
    assert "2 of 3 prompts finished (67%): ok 1; 11s elapsed; oldest request in flight waiting 42s" in text


def test_redirected_progress_prints_on_change_and_shows_the_oldest_wait(tmp_path, model_server, remote_args):
    rows = [{"prompt": "Answer quickly."}, {"prompt": "@latency 23\nAnswer slowly."}]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    proc = run_cli([f"--dataset_file={data}", "--batch_size=1", "--run_name=r", *remote_args,
                    "--distribution=minimal", "--num_workers=2"], tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    progress = [line for line in proc.stderr.splitlines() if line.startswith("⏳")]
    assert len(progress) == len(set(line.split(";")[0] for line in progress)), progress  # no repeated counts
    waiting = [line for line in progress if "oldest request in flight waiting" in line]
    assert waiting and waiting[0].startswith("⏳ 1 of 2 prompts finished"), progress
    assert progress[-1].startswith("⏳ 2 of 2 prompts finished (100%)"), progress


@pytest.mark.parametrize("count, word", [(0, "0 prompts"), (1, "1 prompt"), (2, "2 prompts"), (1200, "1,200 prompts")])
def test_plural(count, word):
    assert plural(count, "prompt") == word
    assert plural(1, "process", "processes") == "1 process" and plural(3, "process", "processes") == "3 processes"


def test_the_headline_states_the_outcome_and_statistics_record_it(tmp_path, model_server, remote_args):
    """Failed rows are not COMPLETE: the headline, the exit code and statistics.json say one outcome."""
    import json

    rows = [{"prompt": "@fail 400 9\nAlways fails."}, {"prompt": "@fail 400 9\nFails too."}, {"prompt": "Fine?"}]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    proc = run_cli([f"--dataset_file={data}", "--batch_size=1", "--run_name=r", *remote_args,
                    "--distribution=minimal", "--num_workers=1"], tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "📊 FINISHED WITH 2 FAILED ROWS (retry with --resume)" in out
    assert "COMPLETE" not in out
    stats = json.loads((tmp_path / "data" / "r" / "statistics.json").read_text())
    assert stats["outcome"] == {"kind": "failed_rows", "exit_code": 2, "message": None}
    assert run_cli(["--report", "--run_name=r"], tmp_path).returncode == 0  # runs nothing: the outcome stands
    assert json.loads((tmp_path / "data" / "r" / "statistics.json").read_text())["outcome"] == stats["outcome"]

    clean = write_jsonl(tmp_path / "clean.jsonl", [{"prompt": "Explain tides."}])
    proc = run_cli([f"--dataset_file={clean}", "--batch_size=1", "--run_name=c", "--model=mock",
                    "--distribution=minimal"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "📊 BATCH PROCESSING COMPLETE" in proc.stdout
    assert "Failed" not in proc.stdout + proc.stderr  # no red "Failed: 0" on a clean run
    stats = json.loads((tmp_path / "data" / "c" / "statistics.json").read_text())
    assert stats["outcome"] == {"kind": "done", "exit_code": 0, "message": None}


def test_no_forecast_from_the_first_rows(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"Explain tides, case {i}."} for i in range(8)])
    proc = run_cli([f"--dataset_file={data}", "--batch_size=2", "--run_name=r", "--model=mock",
                    "--distribution=minimal", "--num_workers=1"], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    first = next(line for line in proc.stdout.splitlines() if line.startswith("💰"))
    assert "rows/min" not in first and "ETA" not in first and "in all" not in first, first
    assert "forecast after 5 rows" in first, first


def test_an_error_that_stops_the_run_at_start_comes_without_the_banner(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "Explain tides."}])
    args = [f"--dataset_file={data}", "--batch_size=1", "--run_name=r", "--distribution=minimal"]
    assert run_cli([*args, "--model=mock"], tmp_path).returncode == 0
    again = run_cli([*args, "--model=mock"], tmp_path)  # rows already there, no --resume
    unreachable = run_cli([*args, "--model=m", "--base_url=http://127.0.0.1:9/v1", "--api_key=k", "--run_name=u"], tmp_path)
    for proc, cause in ((again, "--resume"), (unreachable, "nothing was started")):
        assert proc.returncode == 1 and cause in proc.stderr, proc.stdout + proc.stderr
        assert "Initialized" not in proc.stdout, proc.stdout



def test_the_summary_writes_every_count_with_thousands_separators(hand_run):
    """One number format: the summary's counts read like the rest of the console (1,234, not 1234)."""
    stats = _finalize(hand_run)
    stats["rows_this_run"] = 1201
    stats["outcomes"].update(ok=1202, completed=1203, discarded=1204, failed=1205, not_run=1206)
    stats["failed_by_class"] = {"provider": 1205}
    stats["total_batches"] = 1207
    stats["tool_statistics"]["terminal"].update(count=1208, success=1209)
    lines: list[str] = []
    print_summary(stats, hand_run, out=lines.append)
    text = "\n".join(lines)
    for n in range(1201, 1210):
        assert f"{n:,}" in text, (n, text)
    unseparated = re.findall(r"(?<![\d,./-])\d{4,}(?![\d,])", text.replace(str(hand_run), ""))
    assert unseparated == [], text
