"""What a user sees on the console: words that fit the numbers, whole causes, no bar in a log."""

from __future__ import annotations

import pytest

from runner.console import PlainProgress, plural
from tests.conftest import run_cli, write_jsonl


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


def test_plain_progress_prints_a_line_every_interval():
    lines, now = [], [0.0]

    class Out:
        def write(self, text):
            lines.append(text)

        def flush(self):
            pass

    bar = PlainProgress(3, every=10, out=Out(), clock=lambda: now[0])
    bar.set_postfix({"ok": 1})
    now[0] = 1.0
    bar.update(1)  # too soon
    now[0] = 11.0
    bar.update(1)  # a line
    now[0] = 12.0
    bar.tick()  # too soon
    now[0] = 30.0
    bar.close()  # the last line
    text = "".join(lines)
    assert text.count("⏳") == 2 and "2 of 3 prompts finished (67%): ok 1; 11s elapsed" in text


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
