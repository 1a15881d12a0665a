"""The command line as a new user types it: typos stop the run, --help explains, names stay text."""

from __future__ import annotations

import inspect
import re
import subprocess
import sys

import pytest

import batch_runner
from runner.input.flags import FLAG_NAMES, FLAGS, NEW, ORIGINAL
from tests.conftest import REPO, read_jsonl, run_cli, write_jsonl


def _dataset(tmp_path):
    return write_jsonl(tmp_path / "d.jsonl", [{"prompt": "Explain rainbows briefly."}, {"prompt": "And clouds?"}])


@pytest.mark.parametrize(
    "typo, suggestion",
    [
        ("--num_worker=1", "--num_workers"),
        ("--max_sample=2", "--max_samples"),
        ("--verbos", "--verbose"),
        ("--max-sample", "--max_samples"),
        ("--num_worker 1", "--num_workers"),
        ("--noverbos", "--verbose"),
    ],
)
def test_unknown_flag_stops_before_anything_starts(tmp_path, typo, suggestion):
    data = _dataset(tmp_path)
    args = [f"--dataset_file={data}", "--batch_size=1", "--run_name=r", "--model=mock", *typo.split(" ")]
    proc = run_cli(args, tmp_path)
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    flag = typo.split("=")[0].split(" ")[0]
    assert f"unknown flag {flag}" in proc.stderr
    assert f"did you mean {suggestion}?" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "data").exists()  # nothing started, nothing written
    assert "Batch Runner Initialized" not in proc.stdout


def test_stray_arguments_and_short_flags_are_refused(tmp_path):
    data = _dataset(tmp_path)
    common = [f"--dataset_file={data}", "--batch_size=1", "--run_name=r", "--model=mock"]
    for extra, needle in ((["stray"], "unexpected argument 'stray'"), (["-w", "2"], "unknown flag -w"),
                          (["--run_name"], "--run_name needs a value")):
        proc = run_cli(common + extra, tmp_path)
        assert proc.returncode == 1, extra
        assert needle in proc.stderr
    assert not (tmp_path / "data").exists()


def test_every_fire_spelling_of_a_real_flag_is_accepted(tmp_path):
    data = _dataset(tmp_path)
    proc = run_cli(
        [f"--dataset-file={data}", "--batch_size", "1", "--run_name=spelled", "--model", "mock", "--noverbose",
         "--keep-no-reasoning", "--distribution=minimal", "--num_workers=2"],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert len(read_jsonl(tmp_path / "data" / "spelled" / "trajectories.jsonl")) == 2


@pytest.mark.parametrize("extra, flag", [
    (["--overwrite=no"], "--overwrite"), (["--overwrite=maybe"], "--overwrite"),
    (["--resume=nope"], "--resume"), (["--verbose=maybe"], "--verbose"), (["--verbose", "2"], "--verbose"),
])
def test_a_boolean_flag_refuses_a_value_that_is_not_on_or_off(tmp_path, extra, flag):
    """fire made any text true, so --overwrite=no deleted the run's outputs."""
    data = _dataset(tmp_path)
    common = [f"--dataset_file={data}", "--batch_size=2", "--run_name=r", "--model=mock", "--distribution=minimal"]
    assert run_cli(common, tmp_path).returncode == 0
    trajectories = tmp_path / "data" / "r" / "trajectories.jsonl"
    before = trajectories.read_bytes()
    proc = run_cli(common + extra, tmp_path)
    if extra == ["--overwrite=no"]:  # a word that means off: the run exists, so it is refused as without --overwrite
        assert "removed the earlier outputs" not in proc.stdout + proc.stderr
        assert proc.returncode == 1, proc.stderr
    else:
        assert proc.returncode == 1, proc.stderr
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and flag in lines[0] and "Traceback" not in proc.stderr, proc.stderr
    assert trajectories.read_bytes() == before


def test_boolean_flag_words_mean_what_they_say(tmp_path):
    data = _dataset(tmp_path)
    common = [f"--dataset_file={data}", "--batch_size=2", "--run_name=w", "--model=mock", "--distribution=minimal"]
    assert run_cli(common + ["--verbose=OFF", "--resume=false"], tmp_path).returncode == 0
    for off in (["--resume=no", "--overwrite=0"], ["--resume", "Off"], ["--noresume", "--overwrite=FALSE"]):
        proc = run_cli(common + off, tmp_path)
        assert proc.returncode == 1 and "removed the earlier outputs" not in proc.stdout, (off, proc.stdout, proc.stderr)
    proc = run_cli(common + ["--resume=Yes"], tmp_path)
    assert proc.returncode == 0 and "removed the earlier outputs" not in proc.stdout, proc.stderr
    proc = run_cli(common + ["--overwrite=ON"], tmp_path)
    assert proc.returncode == 0 and "removed the earlier outputs" in proc.stdout + proc.stderr, proc.stderr


def test_a_double_dash_and_what_follows_it_are_refused(tmp_path):
    """After '--' fire took the flags as its own, and the run ignored them."""
    data = _dataset(tmp_path)
    proc = run_cli([f"--dataset_file={data}", "--batch_size=1", "--run_name=dd", "--model=mock", "--",
                    "--max_samples=1", "--num_workers=1"], tmp_path)
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "'--'" in lines[0], proc.stderr
    assert not (tmp_path / "data").exists()


@pytest.mark.parametrize("name", ["1e3", "0x10", "1_000", "007", "True", "None"])
def test_run_names_are_text_as_typed(tmp_path, name):
    data = _dataset(tmp_path)
    proc = run_cli([f"--dataset_file={data}", "--batch_size=2", f"--run_name={name}", "--model=mock",
                    "--distribution=minimal"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert [p.name for p in (tmp_path / "data").iterdir()] == [name]
    assert read_jsonl(tmp_path / "data" / name / "trajectories.jsonl")


def test_help_has_one_described_line_per_flag_with_full_defaults(tmp_path):
    proc = run_cli(["--help"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for name in FLAG_NAMES:
        lines = [line for line in out.splitlines() if line.startswith(f"  --{name} ")]
        assert len(lines) == 1, name
        assert len(lines[0].split(None, 1)) == 2 and len(lines[0].split(None, 1)[1]) > 10, lines[0]
    model_line = next(line for line in out.splitlines() if line.startswith("  --model "))
    assert "[default: anthropic/claude-sonnet-4.6]" in model_line
    moa_line = next(line for line in out.splitlines() if line.startswith("  --moa_reference_models "))
    assert "[default: anthropic/claude-sonnet-4.6,google/gemini-2.5-pro,openai/gpt-5,deepseek/deepseek-r1]" in moa_line
    assert "sonn..." not in out and "-w," not in out and "-w " not in out
    assert out.index(f"{ORIGINAL}:") < out.index("  --dataset_file ") < out.index(f"{NEW}:") < out.index("  --seed ")
    assert not (tmp_path / "data").exists()


def test_main_takes_the_declared_flags_and_docs_list_them_as_declared():
    """One declaration per flag: main()'s parameters and docs/flags.md are derived from it."""
    from runner.input.flags import flags_reference

    assert FLAG_NAMES == list(inspect.signature(batch_runner.main).parameters)
    assert (REPO / "docs" / "flags.md").read_text(encoding="utf-8") == flags_reference(), (
        "docs/flags.md is out of date: python -m runner.input.flags > docs/flags.md")
    proc = subprocess.run([sys.executable, "-m", "runner.input.flags"], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0 and proc.stdout == flags_reference(), proc.stderr
    rows = [line for line in flags_reference().splitlines() if line.startswith("| `--")]
    assert [row.split("`")[1] for row in rows] == [f"--{flag.name}" for flag in FLAGS]
    assert "(docs/flags.md)" in (REPO / "README.md").read_text(encoding="utf-8")


def test_each_default_is_defined_once_on_its_config_field():
    """main() leaves every option None (not given): the config models hold the defaults, which
    --help shows."""
    from runner.input.config import RunConfig

    for name, param in inspect.signature(batch_runner.main).parameters.items():
        assert param.default is None, name
    shown = {flag.name: flag.default for flag in FLAGS}
    assert shown["command_timeout"] == "180" and shown["request_timeout"] == "600"
    assert shown["max_turns"] == str(RunConfig.model_fields["max_turns"].default)
    assert shown["dataset_file"] == "required" and shown["resume"] == "off"
    config = batch_runner.build_config(dataset_file="d.jsonl", batch_size=1, run_name="r", model="mock")
    drawn = {"tools", "seed"}  # without --seed, each configuration draws its own
    assert config.model_dump(exclude=drawn) == RunConfig(dataset_file="d.jsonl", batch_size=1, run_name="r",
                                                         model="mock").model_dump(exclude=drawn)


@pytest.mark.parametrize("flag, line", [("--reasoning_disabled", "🧠 Reasoning: DISABLED (effort=none)"),
                                        ("--reasoning_effort=high", "🧠 Reasoning effort: high")])
def test_the_reasoning_line_comes_first_as_the_original_prints_it(tmp_path, flag, line):
    """The reasoning setting is reported once the flags are read, on its own line, before the header."""
    data = _dataset(tmp_path)
    proc = run_cli([f"--dataset_file={data}", "--batch_size=1", "--run_name=r", "--model=mock", flag], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines.count(line) == 1 and not any(other.strip() == line and other != line for other in lines)
    assert lines.index(line) < lines.index("📊 Batch Runner Initialized")
