"""Claims of README.md and docs/*.md that could drift from the behaviour, checked against it."""

from __future__ import annotations

import json
import re
import shutil

from tests.conftest import REPO, read_jsonl, run_cli, write_jsonl

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    return {_anchor(h) for h in re.findall(r"(?m)^#+ (.+)$", text)}


def test_every_link_between_the_pages_reaches_a_file_of_the_repository_and_its_heading():
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # a web address
            path, _, anchor = target.partition("#")
            where = (page.parent / path).resolve() if path else page
            assert where.is_relative_to(REPO) and where.exists(), f"{page.name}: {target} is not a file of the repository"
            if anchor:
                assert anchor in _anchors(where), f"{page.name}: {target}: no such heading"
        assert "shared/reference" not in page.read_text(encoding="utf-8"), page.name


def test_loop_notes_are_metadata_not_turns_as_the_differences_page_says(tmp_path):
    (tmp_path / "d.jsonl").write_text(json.dumps({"prompt": "Run the echo command in the shell, then count lines"}) + "\n")
    proc = run_cli(["--dataset_file=d.jsonl", "--batch_size=5", "--run_name=r", "--model=mock",
                    "--distribution=terminal_only", "--max_turns=1"], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    row = read_jsonl(tmp_path / "data" / "r" / "trajectories.jsonl")[0]
    assert row["metadata"]["stop_reason"] == "turn_limit"
    assert row["metadata"]["loop_notes"].startswith("after turn ")  # the turn-limit summary request
    roles = [turn["from"] for turn in row["conversations"]]
    assert roles[:2] == ["system", "human"] and set(roles[2:]) <= {"gpt", "tool"}
    differences = (REPO / "docs" / "differences.md").read_text(encoding="utf-8")
    row_text = next(line for line in differences.splitlines() if "loop notes" in line)
    assert "`metadata.loop_notes`" in row_text and "`system` turns" not in row_text.split("|")[2]


def test_an_unknown_cost_is_recorded_as_the_cost_page_says(tmp_path, model_server):
    dataset = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "@cost none\nUnpriced."}])
    proc = run_cli([f"--dataset_file={dataset}", "--run_name=r", "--batch_size=4", f"--base_url={model_server.base_url}",
                    "--model=test-model", "--api_key=x", "--distribution=terminal_only"], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    usage = read_jsonl(tmp_path / "data" / "r" / "trajectories.jsonl")[0]["metadata"]["usage"]
    assert usage["cost"] == 0.0 and usage["unpriced_requests"] == usage["requests"] > 0
    assert json.loads((tmp_path / "data" / "r" / "statistics.json").read_text())["cost"] is None
    assert "cost unknown" in proc.stdout
    page = (REPO / "docs" / "cost-and-budget.md").read_text(encoding="utf-8")
    claim = page.split("**unknown**", 1)[1].split("The\nbuilt-in", 1)[0]
    assert "`0.0` when none is" in claim and "`metadata.usage.unpriced_requests`" in claim
    assert "`cost: null`" in claim and '"cost unknown"' in claim
    outputs = (REPO / "docs" / "outputs.md").read_text(encoding="utf-8")
    assert "`usage.cost` is always a number" in outputs and "`metadata.usage.cost` is `null`" not in page + outputs


def test_the_exit_codes_named_are_the_runners():
    import batch_runner

    codes = {value for name, value in vars(batch_runner).items() if name.startswith("EXIT_") and isinstance(value, int)}
    readme = (REPO / "README.md").read_text(encoding="utf-8").split("Exit codes:", 1)[1].split("\n\n", 1)[0]
    page = (REPO / "docs" / "guarantees.md").read_text(encoding="utf-8").split("## Exit codes", 1)[1].split("\n## ", 1)[0]
    for text in (readme, page):
        assert {int(code) for code in re.findall(r"`(\d+)`\s", text)} == codes, text


def test_the_ok_row_example_of_the_outputs_page_has_the_fields_of_a_real_row(tmp_path):
    """Every field the example shows is in a real row, where the example puts it (new fields may be
    missing from the example; a renamed or removed one may not stay in it)."""
    page = (REPO / "docs" / "outputs.md").read_text(encoding="utf-8")
    example = json.loads(re.findall(r"```json\n(.*?)```", page, re.S)[0])
    proc = run_cli(["--dataset_file=data/example_prompts.jsonl", "--batch_size=20", "--run_name=r", "--model=mock",
                    "--distribution=terminal_only", "--max_samples=1"], _with_prompts(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    row = read_jsonl(tmp_path / "data" / "r" / "trajectories.jsonl")[0]
    assert list(example) == [key for key in row if key in example]  # same order, none missing
    meta, usage = row["metadata"], row["metadata"]["usage"]
    assert set(example["metadata"]) <= set(meta)
    assert set(example["metadata"]["usage"]) <= set(usage)
    assert set(example["metadata"]["usage"]["by_model"][0]) <= set(usage["by_model"][0])
    assert set(example["reasoning_stats"]) == set(row["reasoning_stats"])
    assert example["metadata"]["schema_version"] == meta["schema_version"]
    assert [turn["from"] for turn in row["conversations"][:2]] == [t["from"] for t in example["conversations"][:2]]


def _with_prompts(tmp_path):
    (tmp_path / "data").mkdir()
    shutil.copy(REPO / "data" / "example_prompts.jsonl", tmp_path / "data")
    return tmp_path


def test_the_python_api_page_names_the_original_keywords_and_their_defaults():
    from runner import original_api

    page = (REPO / "docs" / "python-api.md").read_text(encoding="utf-8")
    listed = " ".join(page.split("The keywords are the original's:", 1)[1].split("Every other flag", 1)[0].split())
    for name, default in original_api.ORIGINAL_DEFAULTS.items():
        if name == "openrouter_min_coding_score":  # named as unsupported, after the list
            assert f"`{name}` is not supported" in page
            continue
        assert f"`{name}`" in listed, name
        if isinstance(default, (int, str)) and not isinstance(default, bool) and default != "":
            assert f"`{name}` (`{default}`" in listed or f"`{name}` ({default})" in listed, (name, default)


def test_the_readme_links_every_docs_page():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    for page in sorted((REPO / "docs").glob("*.md")):
        assert f"](docs/{page.name})" in readme, f"docs/{page.name} is not listed in the README (Where to read more)"


def test_an_unknown_python_api_keyword_is_the_type_error_the_page_describes():
    import pytest

    from batch_runner import BatchRunner

    page = (REPO / "docs" / "python-api.md").read_text(encoding="utf-8")
    assert 'raises `TypeError`, naming the closest keyword: "did you mean num_workers?"' in " ".join(page.split())
    with pytest.raises(TypeError, match="did you mean num_workers"):
        BatchRunner(dataset_file="d.jsonl", batch_size=1, run_name="r", num_worker=2)


def test_a_resume_given_only_the_run_name_continues_with_the_recorded_configuration(tmp_path):
    _with_prompts(tmp_path)
    first = run_cli(["--dataset_file=data/example_prompts.jsonl", "--batch_size=5", "--run_name=r", "--model=mock",
                     "--distribution=terminal_only", "--max_samples=2"], tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    again = run_cli(["--run_name=r", "--resume"], tmp_path)  # no model, dataset or key given
    assert again.returncode == 0, again.stdout + again.stderr
    rows = read_jsonl(tmp_path / "data" / "r" / "trajectories.jsonl")
    assert len(rows) == 12 and {row["metadata"]["model"] for row in rows} == {"mock"}  # --max_samples is not kept
    page = " ".join((REPO / "docs" / "guarantees.md").read_text(encoding="utf-8").split())
    assert "`--run_name=NAME --resume` alone continues the run as it was started" in page
