"""trajectory_compressor.py through the real command, against the scripted model server and a
real Hugging Face fast tokenizer written to a temporary directory (nothing fetched)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from tests.conftest import REPO, SECRET_KEY, read_jsonl, run_cli, write_jsonl
from tests.helpers.compress_fixtures import trajectory, write_tokenizer
from tests.helpers.model_server import ModelServer, Reply, chat_completion, error_reply

TARGET = 500
SUMMARY = "The agent ran the tools and found the answer."


def compress(args: list[str], cwd: Path, **kwargs):
    return run_cli(args, cwd, script="trajectory_compressor.py", **kwargs)


def count_tokens(tokenizer_dir: Path, text: str) -> int:
    from tokenizers import Tokenizer

    return len(Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).encode(text, add_special_tokens=False).ids)


def summarised(text: str = SUMMARY, finish: str | None = None):
    def policy(body, state):
        return Reply(body=chat_completion(body, text, finish_reason=finish))

    return policy


@pytest.fixture
def work(tmp_path):
    write_tokenizer(tmp_path / "tok")
    rows = [trajectory(10, 50, "long0"), {"prompt": "a row without conversations", "n": 1},
            trajectory(1, 5, "short"), trajectory(10, 50, "long1"), trajectory(12, 40, "long2")]
    write_jsonl(tmp_path / "runs.jsonl", rows)
    return tmp_path


def flags(server: ModelServer, *extra: str) -> list[str]:
    return ["--input=runs.jsonl", "--tokenizer=tok", f"--target_max_tokens={TARGET}", "--summary_target_tokens=50",
            f"--base_url={server.base_url}", "--summary_model=summariser", f"--api_key={SECRET_KEY}", *extra]


def described(result) -> str:
    return f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"


def no_secret_anywhere(folder: Path, result) -> None:
    for path in folder.rglob("*"):
        if path.is_file():
            assert SECRET_KEY.encode() not in path.read_bytes(), path
    assert SECRET_KEY not in result.stdout + result.stderr


def test_long_rows_are_compressed_within_the_budget_and_every_row_is_kept_in_order(work):
    with ModelServer(policy=summarised()) as server:
        result = compress(flags(server), work)
        requests = [r.body for r in server.requests if r.path.endswith("/chat/completions")]
        keys = {r.headers.get("authorization") for r in server.requests}
    assert result.returncode == 0, described(result)
    assert keys == {f"Bearer {SECRET_KEY}"}  # the key given reaches the summariser, and nothing else
    source = read_jsonl(work / "runs.jsonl")
    output = read_jsonl(work / "runs_compressed.jsonl")
    assert len(output) == len(source)
    # the row without conversations is written byte for byte as it was read
    assert (work / "runs_compressed.jsonl").read_text().splitlines()[1] == (work / "runs.jsonl").read_text().splitlines()[1]
    assert [r.get("metadata", {}).get("row_key") for r in output] == [r.get("metadata", {}).get("row_key") for r in source]
    for before, after in zip(source, output):
        if "conversations" not in before:
            continue
        metrics = after["compression_metrics"]
        tokens = sum(count_tokens(work / "tok", t["value"]) for t in after["conversations"])
        assert metrics["tokens_after"] == tokens  # counted by the same tokenizer
        assert tokens <= TARGET and metrics["over_limit"] is False
        if metrics["status"] == "under_limit":
            assert after["conversations"] == before["conversations"]
            continue
        assert metrics["status"] == "compressed"
        turns = after["conversations"]
        summary = [t for t in turns if t["value"].startswith("[CONTEXT SUMMARY]: ")]
        assert len(summary) == 1 and summary[0]["from"] == "human" and SUMMARY in summary[0]["value"]
        system = before["conversations"][0]["value"]
        assert turns[0]["value"].startswith(system) and "[CONTEXT SUMMARY]" in turns[0]["value"]  # it says so
        assert turns[1:4] == before["conversations"][1:4]  # the first human, gpt and tool turns
        assert turns[-4:] == before["conversations"][-4:]
        for i, turn in enumerate(turns):  # every tool response right after its call
            if turn["from"] == "tool":
                assert turns[i - 1]["from"] in ("gpt", "tool") and "CONTEXT SUMMARY" not in turns[i - 1]["value"]
    assert len(requests) == 3
    assert all(r["temperature"] == 0.3 and r["max_tokens"] == 100 and r["model"] == "summariser" for r in requests)
    metrics = json.loads((work / "runs_compressed.metrics.json").read_text())
    assert metrics["rows"] == 5 and metrics["rows_compressed"] == 3 and metrics["rows_under_limit"] == 1
    assert metrics["rows_without_conversations"] == 1 and metrics["rows_failed"] == 0
    assert metrics["summariser"]["requests"] == 3 and metrics["summariser"]["cost"] == pytest.approx(0.0003)
    assert metrics["tokenizer"] == "tok" and metrics["tokens_estimated"] is False
    assert "compressed: 3" in result.stdout and "3 requests" in result.stdout
    assert "⏳ 3 of 3 rows finished" in result.stderr and "\r" not in result.stderr  # plain lines when redirected
    no_secret_anywhere(work, result)


def test_the_output_loads_in_hugging_face_datasets(work):
    datasets = pytest.importorskip("datasets")
    rows = [trajectory(10, 50, f"r{i}") for i in range(3)] + [trajectory(1, 5, "short")]
    write_jsonl(work / "runs.jsonl", rows)
    with ModelServer(policy=summarised()) as server:
        result = compress(flags(server), work)
    assert result.returncode == 0, described(result)
    loaded = datasets.load_dataset("json", data_files=str(work / "runs_compressed.jsonl"), split="train")
    assert len(loaded) == 4
    assert loaded.features["compression_metrics"]["over_limit"].dtype == "bool"


def test_a_summariser_that_fails_every_request_leaves_every_row_uncompressed_and_counted(work):
    with ModelServer(policy=lambda body, state: error_reply(500)) as server:
        result = compress(flags(server), work, timeout=120)
        failed_requests = server.count()
    assert result.returncode == 2, described(result)
    source = read_jsonl(work / "runs.jsonl")
    output = read_jsonl(work / "runs_compressed.jsonl")
    assert len(output) == len(source)
    for before, after in zip(source, output):
        if "conversations" in before:
            assert after["conversations"] == before["conversations"]  # never a placeholder
    failed = [r["compression_metrics"] for r in output if r.get("compression_metrics", {}).get("status") == "failed"]
    assert len(failed) == 3 and {m["failure"] for m in failed} == {"provider"}
    assert all("HTTP 500" in m["error"] for m in failed)
    metrics = json.loads((work / "runs_compressed.metrics.json").read_text())
    assert metrics["rows_failed"] == 3 and metrics["failures"] == {"provider": 3}
    assert metrics["summariser"]["requests"] == failed_requests == 3 * 4  # a request and 3 retries each
    assert "summary failed: 3 rows" in result.stdout
    assert "Compressed 0 of 5 rows into" in result.stdout and "Compressed 5 rows" not in result.stdout
    # --resume retries the failed rows (and only those) once the summariser works
    with ModelServer(policy=summarised()) as server:
        again = compress(flags(server, "--resume"), work)
        assert again.returncode == 0, described(again)
        assert server.count() == 3
    assert json.loads((work / "runs_compressed.metrics.json").read_text())["rows_compressed"] == 3
    assert "Compressed 3 of 5 rows into" in again.stdout


def test_a_cut_summary_and_a_timeout_are_failures_not_summaries(work):
    def cut_then_hang(body, state):
        if "result 8 " in body["messages"][1]["content"]:  # only long2's region (the longest) reaches it
            return Reply(hang=True)
        return Reply(body=chat_completion(body, "A summary that was cut off befo", finish_reason="length"))

    with ModelServer(policy=cut_then_hang) as server:
        result = compress(flags(server, "--per_trajectory_timeout=3"), work, timeout=120)
    assert result.returncode == 2, described(result)
    output = read_jsonl(work / "runs_compressed.jsonl")
    source = read_jsonl(work / "runs.jsonl")
    failures = {r["metadata"]["row_key"]: r["compression_metrics"]["failure"] for r in output
                if r.get("compression_metrics", {}).get("status") == "failed"}
    assert failures == {"long0": "truncated", "long1": "truncated", "long2": "timeout"}
    assert all(a["conversations"] == b["conversations"] for a, b in zip(output, source) if "conversations" in b)
    assert "truncated 2" in result.stdout and "timeout 1" in result.stdout


def test_a_row_still_over_the_budget_is_marked(work):
    long_summary = " ".join(["alpha"] * 400)
    with ModelServer(policy=summarised(long_summary)) as server:
        result = compress(flags(server), work)
    assert result.returncode == 0, described(result)
    output = read_jsonl(work / "runs_compressed.jsonl")
    over = [r["compression_metrics"] for r in output if r.get("compression_metrics", {}).get("over_limit")]
    assert len(over) == 3 and all(m["tokens_after"] > TARGET for m in over)
    assert json.loads((work / "runs_compressed.metrics.json").read_text())["rows_over_limit"] == 3
    assert "still over the limit: 3 rows" in result.stdout


def test_dry_run_counts_and_tells_without_a_request_or_a_file(work):
    with ModelServer(policy=summarised()) as server:
        result = compress(flags(server, "--dry_run"), work)
        assert server.requests == [] and server.probes == []
    assert result.returncode == 0, described(result)
    assert sorted(p.name for p in work.iterdir()) == ["runs.jsonl", "tok"]
    assert "would compress: 3 rows" in result.stdout
    assert re.search(r"line 1: [\d,]+ tokens > 500: turns 5-\d+ of 23 \([\d,]+ tokens\) would be summarised", result.stdout)


def test_the_estimate_mode_says_it_is_an_estimate(work):
    with ModelServer(policy=summarised()) as server:
        result = compress([*flags(server), "--tokenizer=estimate"], work)
    assert result.returncode == 0, described(result)
    metrics = json.loads((work / "runs_compressed.metrics.json").read_text())
    assert metrics["tokens_estimated"] is True and metrics["tokenizer"] == "estimate (characters / 4)"
    assert all(r["compression_metrics"]["tokens_estimated"] for r in read_jsonl(work / "runs_compressed.jsonl")
               if "compression_metrics" in r)
    assert "estimate" in result.stdout


@pytest.mark.parametrize("line, expected", [
    ("{not json", "runs.jsonl line 2: not valid JSON"),
    (json.dumps({"conversations": [{"from": "human"}]}), "runs.jsonl line 2: conversations.0.value: Field required"),
    (json.dumps({"conversations": [{"from": "human", "value": 3}]}), "runs.jsonl line 2: conversations.0.value"),
    (json.dumps([1, 2]), "runs.jsonl line 2: a row must be a JSON object"),
])
def test_bad_input_is_named_and_nothing_is_sent(work, line, expected):
    (work / "runs.jsonl").write_text(json.dumps(trajectory(10, 50, "a")) + "\n" + line + "\n")
    with ModelServer(policy=summarised()) as server:
        result = compress(flags(server), work)
        assert server.requests == []
    assert result.returncode == 1, described(result)
    assert expected in result.stderr and result.stderr.count("\n") == 1
    assert not (work / "runs_compressed.jsonl").exists()


@pytest.mark.parametrize("args, expected", [
    (["--target_max_tokens=0"], "--target_max_tokens: input should be greater than or equal to 1"),
    (["--taget_max_tokens=10"], "unknown flag --taget_max_tokens; did you mean --target_max_tokens?"),
    (["--tokenizer=missing_dir/"], "--tokenizer=missing_dir/: no tokenizer.json there"),
    (["--input=nowhere.jsonl"], "--input=nowhere.jsonl: no such file or directory"),
])
def test_bad_flags_are_named(work, args, expected):
    with ModelServer(policy=summarised()) as server:
        result = compress([*flags(server), *args], work)
        assert server.requests == []
    assert result.returncode == 1, described(result)
    assert expected in result.stderr


@pytest.mark.parametrize("args, expected", [
    (["--input=runs.jsonl", "--output=."], "--output=.: is a directory; the output of a file is a file"),
    (["--input=runs.jsonl", "--output=tok"], "--output=tok: is a directory; the output of a file is a file"),
    (["--input=folder", "--output=runs.jsonl"], "--output=runs.jsonl: is a file; the output of a directory is a directory"),
])
def test_an_output_of_the_wrong_kind_is_refused_before_any_request(work, args, expected):
    (work / "folder").mkdir()
    write_jsonl(work / "folder" / "a.jsonl", [trajectory(10, 50, "a0")])
    before = (work / "runs.jsonl").read_bytes()
    with ModelServer(policy=summarised()) as server:
        result = compress([*flags(server)[1:], *args], work)
        assert server.requests == []
    assert result.returncode == 1, described(result)
    assert expected in result.stderr and result.stderr.count("\n") == 1, described(result)
    assert (work / "runs.jsonl").read_bytes() == before
    assert not list(work.rglob("*.progress"))


def test_the_current_directory_as_input_is_compressed_into_its_sibling(work):
    (work / "folder").mkdir()
    write_jsonl(work / "folder" / "a.jsonl", [trajectory(10, 50, "a0"), {"prompt": "p"}])
    with ModelServer(policy=summarised()) as server:
        result = compress([*flags(server)[1:], "--input=.", "--tokenizer=../tok"], work / "folder")
    assert result.returncode == 0, described(result)
    rows = read_jsonl(work / "folder_compressed" / "a.jsonl")
    assert rows[0]["compression_metrics"]["status"] == "compressed" and rows[1] == {"prompt": "p"}


@pytest.mark.parametrize("args, expected", [
    (["--config=options.yaml"], "--config=options.yaml needs PyYAML: pip install -e '.[compress]'"),
    (["--tokenizer=tok"], "--tokenizer=tok needs the tokenizers package: pip install -e '.[compress]'"),
])
def test_without_the_compress_extra_the_missing_package_is_named(work, args, expected):
    """Installed without the `compress` extra (its packages hidden from this process)."""
    hidden = work / "hidden"
    for package in ("yaml", "tokenizers"):
        (hidden / package).mkdir(parents=True)
        (hidden / package / "__init__.py").write_text(f"raise ImportError('No module named {package}')\n")
    (work / "options.yaml").write_text("seed: 3\n")
    result = compress(["--input=runs.jsonl", "--dry_run", *args], work,
                      env={"PYTHONPATH": f"{hidden}{os.pathsep}{REPO}"})
    assert result.returncode == 1, described(result)
    assert expected in result.stderr and result.stderr.count("\n") == 1, described(result)


def test_a_boolean_flag_given_a_value_means_that_value(work):
    with ModelServer(policy=summarised()) as server:
        off = compress([*flags(server), "--dry_run=false"], work)  # fire alone makes any text true
        assert off.returncode == 0 and server.count() == 3, described(off)
        assert (work / "runs_compressed.jsonl").exists()
        on = compress([*flags(server), "--dry_run=yes", "--output=other.jsonl"], work)
        assert on.returncode == 0 and "Dry run" in on.stdout and server.count() == 3, described(on)
        bad = compress([*flags(server), "--resume=maybe"], work)
        assert bad.returncode == 1 and server.count() == 3, described(bad)
    assert "--resume is on or off, not 'maybe'" in bad.stderr
    assert not (work / "other.jsonl").exists()


def test_a_remote_summariser_without_a_key_is_refused(work):
    result = compress(["--input=runs.jsonl", "--tokenizer=tok", "--base_url=https://example.invalid/v1"], work)
    assert result.returncode == 1 and "no API key for https://example.invalid/v1" in result.stderr


def test_the_config_file_gives_the_options_and_a_flag_wins(work):
    (work / "options.yaml").write_text(f"target_max_tokens: 100000\nsummary_target_tokens: 60\ntokenizer: tok\n")
    with ModelServer(policy=summarised()) as server:
        result = compress([*flags(server), "--config=options.yaml"], work)  # flags give --target_max_tokens=500
        request = server.requests[-1].body
    assert result.returncode == 0, described(result)
    metrics = json.loads((work / "runs_compressed.metrics.json").read_text())
    assert metrics["options"]["target_max_tokens"] == TARGET  # the flag's
    assert request["max_tokens"] == 100  # --summary_target_tokens=50 given as a flag wins over the file's 60
    (work / "bad.yaml").write_text("target_max_token: 10\n")
    result = compress([*flags(server), "--config=bad.yaml"], work)
    assert result.returncode == 1 and "--config=bad.yaml: unknown key 'target_max_token'" in result.stderr


def test_a_directory_is_compressed_file_by_file_into_a_sibling_directory(work):
    folder = work / "runs"
    folder.mkdir()
    write_jsonl(folder / "a.jsonl", [trajectory(10, 50, "a0"), trajectory(1, 5, "a1")])
    write_jsonl(folder / "b.jsonl", [{"prompt": "b0"}, trajectory(10, 50, "b1")])
    with ModelServer(policy=summarised()) as server:
        result = compress([*flags(server)[1:], "--input=runs"], work)
    assert result.returncode == 0, described(result)
    out = work / "runs_compressed"
    assert [r["metadata"]["row_key"] for r in read_jsonl(out / "a.jsonl")] == ["a0", "a1"]
    assert read_jsonl(out / "b.jsonl")[0] == {"prompt": "b0"}
    metrics = json.loads((out / "compression_metrics.json").read_text())
    assert metrics["rows"] == 4 and metrics["rows_compressed"] == 2 and len(metrics["files"]) == 2


def test_a_folder_named_like_a_jsonl_file_inside_the_input_directory_is_not_an_input(work):
    folder = work / "runs"
    (folder / "old.jsonl").mkdir(parents=True)
    write_jsonl(folder / "a.jsonl", [trajectory(10, 50, "a0")])
    with ModelServer(policy=summarised()) as server:
        result = compress([*flags(server)[1:], "--input=runs"], work)
    assert result.returncode == 0, described(result)
    assert [p.name for p in (work / "runs_compressed").iterdir() if p.suffix == ".jsonl"] == ["a.jsonl"]


def test_sample_percent_keeps_a_seeded_share_in_order(work):
    write_jsonl(work / "runs.jsonl", [trajectory(1, 5, f"r{i}") for i in range(20)])
    with ModelServer(policy=summarised()) as server:
        first = compress([*flags(server), "--sample_percent=25", "--seed=7"], work)
        keys = [r["metadata"]["row_key"] for r in read_jsonl(work / "runs_compressed.jsonl")]
        second = compress([*flags(server), "--sample_percent=25", "--seed=7"], work)
    assert first.returncode == second.returncode == 0
    assert len(keys) == 5 and keys == sorted(keys, key=lambda k: int(k[1:]))
    assert keys == [r["metadata"]["row_key"] for r in read_jsonl(work / "runs_compressed.jsonl")]


def test_resume_after_a_whole_run_asks_again_only_for_the_rows_that_failed(work):
    def long2_fails(body, state):
        if "result 8 " in body["messages"][1]["content"]:  # only long2's region reaches it
            return error_reply(400, "the summariser refuses this one")
        return Reply(body=chat_completion(body, SUMMARY))

    with ModelServer(policy=long2_fails) as server:
        first = compress(flags(server), work)
        assert first.returncode == 2, described(first)
        spent = json.loads((work / "runs_compressed.metrics.json").read_text())["summariser"]["requests"]
        kept = {r["metadata"]["row_key"]: r for r in read_jsonl(work / "runs_compressed.jsonl") if "metadata" in r}
        server.policy = summarised()
        again = compress(flags(server, "--resume"), work)
        assert again.returncode == 0, described(again)
        assert server.count() == 3 + 1  # long0, long1, long2, then long2 again
        done = compress(flags(server, "--resume"), work)
        assert done.returncode == 0 and server.count() == 4  # nothing left to ask for
    output = read_jsonl(work / "runs_compressed.jsonl")
    assert [r["compression_metrics"]["status"] for r in output if "compression_metrics" in r] == ["compressed", "under_limit", "compressed", "compressed"]
    assert output[0] == kept["long0"] and output[3] == kept["long1"]  # as the first run wrote them
    metrics = json.loads((work / "runs_compressed.metrics.json").read_text())
    assert metrics["rows_resumed"] == 3 and metrics["summariser"]["requests"] == spent + 1


def test_resume_after_a_whole_run_finds_it_whatever_the_spelling_of_the_paths(work):
    (work / "sub").mkdir()
    with ModelServer(policy=summarised()) as server:
        first = compress(flags(server), work)
        assert first.returncode == 0, described(first)
        asked = server.count()
        absolute = compress([*flags(server, "--resume")[1:], f"--input={work / 'runs.jsonl'}"], work)
        assert absolute.returncode == 0, described(absolute)
        elsewhere = compress([*flags(server, "--resume")[1:], "--input=../runs.jsonl", "--tokenizer=../tok"], work / "sub")
        assert elsewhere.returncode == 0, described(elsewhere)
        assert server.count() == asked  # nothing asked for again
    metrics = json.loads((work / "runs_compressed.metrics.json").read_text())
    assert metrics["rows_resumed"] == 3 and metrics["summariser"]["requests"] == asked


def test_resume_finds_earlier_summaries_by_row_content_in_a_changed_input(work):
    rows = [trajectory(10, 50, f"c{i}") for i in range(3)]
    write_jsonl(work / "runs.jsonl", rows)
    with ModelServer(policy=summarised()) as server:
        assert compress(flags(server), work).returncode == 0
        assert server.count() == 3
        # the input grew and was reordered (a resumed run's trajectories.jsonl); a row appears twice
        changed = [trajectory(10, 50, "new"), rows[2], rows[0], rows[1], rows[0]]
        write_jsonl(work / "runs.jsonl", changed)
        result = compress(flags(server, "--resume"), work)
        assert result.returncode == 0, described(result)
        assert server.count() == 4  # only the new row
    output = read_jsonl(work / "runs_compressed.jsonl")
    assert [r["metadata"]["row_key"] for r in output] == ["new", "c2", "c0", "c1", "c0"]
    assert all(r["compression_metrics"]["status"] == "compressed" for r in output)
    assert json.loads((work / "runs_compressed.metrics.json").read_text())["rows_resumed"] == 4


def test_equal_rows_share_one_summary(work):
    write_jsonl(work / "runs.jsonl", [trajectory(10, 50, "same")] * 3)
    with ModelServer(policy=summarised()) as server:
        result = compress(flags(server), work)
        assert result.returncode == 0, described(result)
        assert server.count() == 1
    output = read_jsonl(work / "runs_compressed.jsonl")
    assert len(output) == 3 and output[0] == output[1] == output[2]
    assert output[0]["compression_metrics"]["status"] == "compressed"


def test_progress_is_a_bar_on_a_terminal(work):
    import os
    import pty
    import subprocess
    import sys

    from tests.conftest import REPO

    import fcntl
    import struct
    import termios

    primary, secondary = pty.openpty()
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a terminal 100 columns wide
    env = {k: v for k, v in os.environ.items() if k not in ("OPENROUTER_API_KEY", "OPENAI_API_KEY")}
    env["PYTHONPATH"] = str(REPO)
    with ModelServer(policy=summarised()) as server:
        process = subprocess.Popen([sys.executable, str(REPO / "trajectory_compressor.py"), *flags(server)], cwd=work,
                                   env=env, stdout=subprocess.DEVNULL, stderr=secondary)
        os.close(secondary)
        seen = b""
        while True:
            try:
                chunk = os.read(primary, 4096)
            except OSError:  # the terminal closed with the process
                break
            if not chunk:
                break
            seen += chunk
        assert process.wait(timeout=120) == 0
    os.close(primary)
    assert b"\r" in seen and b"row/s" in seen  # tqdm's bar, redrawn in place
