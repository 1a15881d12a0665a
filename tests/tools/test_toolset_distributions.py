"""Tests for toolset_distributions: catalogue, sampling, seeding and the printed catalogue."""

from __future__ import annotations

import logging
import os
import random
import subprocess
import sys
import typing
from pathlib import Path

import pytest

import toolset_distributions as td
from toolset_distributions import (
    DISTRIBUTIONS,
    format_distribution_catalogue,
    get_distribution,
    list_distributions,
    print_distribution_info,
    rng_for_row,
    sample_toolsets_from_distribution,
    validate_distribution,
)

ROOT = Path(__file__).resolve().parents[2]

ALL_NAMES = [
    "default", "image_gen", "research", "science", "development", "safe", "balanced", "minimal",
    "terminal_only", "terminal_web", "creative", "reasoning", "browser_use", "browser_only",
    "browser_tasks", "terminal_tasks", "mixed_tasks",
]


class FixedRng:
    """A stand-in generator that always returns the same value."""

    def __init__(self, value: float):
        self.value = value

    def random(self) -> float:
        return self.value


def run_python(code: str, env: dict | None = None) -> str:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True, env=env
    ).stdout


def add_temporary(monkeypatch, name: str, toolsets: dict[str, int]) -> None:
    monkeypatch.setitem(DISTRIBUTIONS, name, {"description": "temporary test entry", "toolsets": toolsets})


@pytest.fixture(autouse=True)
def fresh_warning_state(monkeypatch):
    monkeypatch.setattr(td, "_warned_invalid", set())


# --- catalogue and helpers --------------------------------------------------------------------


def test_get_distribution_known_and_unknown():
    dist = get_distribution("default")
    assert dist is not None and "description" in dist and "toolsets" in dist
    assert get_distribution("nonexistent") is None


def test_all_seventeen_distributions_in_order():
    assert list(DISTRIBUTIONS) == ALL_NAMES


def test_return_annotation_uses_typing_any():
    # The builtin any() in an annotation is a classic slip; the values really are typing.Any.
    assert typing.get_type_hints(get_distribution)["return"] == (dict[str, typing.Any] | None)


def test_list_distributions_is_equal_but_distinct_copy():
    first, second = list_distributions(), list_distributions()
    assert first == DISTRIBUTIONS and second == DISTRIBUTIONS
    assert first is not DISTRIBUTIONS and first is not second
    assert len(first) == len(DISTRIBUTIONS) == 17
    first.pop("default")
    assert "default" in DISTRIBUTIONS


@pytest.mark.parametrize(
    "name,expected", [("default", True), ("research", True), ("nonexistent", False), ("", False)]
)
def test_validate_distribution(name, expected):
    assert validate_distribution(name) is expected


def test_structure_of_every_distribution():
    for name, dist in DISTRIBUTIONS.items():
        assert set(dist) == {"description", "toolsets"}, name
        assert isinstance(dist["toolsets"], dict) and dist["toolsets"], name
        assert len(dist["description"]) > 5, name
        for toolset, prob in dist["toolsets"].items():
            assert 0 < prob <= 100, (name, toolset)


@pytest.mark.parametrize(
    "name,toolsets",
    [
        (
            "science",
            {"web": 94, "terminal": 94, "file": 94, "vision": 65, "browser": 50, "image_gen": 15, "moa": 10},
        ),
        ("reasoning", {"moa": 90, "web": 30, "terminal": 20}),
        ("browser_tasks", {"browser": 97, "vision": 12, "terminal": 15}),
        (
            "mixed_tasks",
            {"browser": 92, "terminal": 92, "file": 92, "web": 35, "vision": 15, "image_gen": 15},
        ),
        ("image_gen", {"image_gen": 90, "vision": 90, "web": 55, "terminal": 45, "moa": 10}),
    ],
)
def test_exact_percentages_and_insertion_order(name, toolsets):
    assert list(DISTRIBUTIONS[name]["toolsets"].items()) == list(toolsets.items())


def test_exact_descriptions():
    assert DISTRIBUTIONS["safe"]["description"] == "All tools except terminal for safety"
    assert DISTRIBUTIONS["browser_tasks"]["description"] == (
        "Browser-focused distribution (browser toolset includes web_search for finding URLs "
        "since Google blocks direct browser searches)"
    )


def test_every_catalogue_toolset_is_known_to_the_registry():
    from tools.registry import validate_toolset

    for dist in DISTRIBUTIONS.values():
        assert all(validate_toolset(ts) for ts in dist["toolsets"])


# --- sampling ---------------------------------------------------------------------------------


def test_unknown_distribution_raises():
    with pytest.raises(ValueError, match="Unknown distribution: nope"):
        sample_toolsets_from_distribution("nope")


def test_default_includes_every_toolset_in_order():
    assert sample_toolsets_from_distribution("default") == list(DISTRIBUTIONS["default"]["toolsets"])
    # Even the largest value random() can return stays below 100.
    everything = list(DISTRIBUTIONS["default"]["toolsets"])
    assert sample_toolsets_from_distribution("default", FixedRng(0.9999999)) == everything


def test_minimal_includes_web():
    assert "web" in sample_toolsets_from_distribution("minimal")


def test_balanced_returns_list_of_str():
    result = sample_toolsets_from_distribution("balanced")
    assert isinstance(result, list) and all(isinstance(ts, str) for ts in result)


def test_reasoning_never_empty():
    for _ in range(20):
        assert len(sample_toolsets_from_distribution("reasoning")) >= 1


@pytest.mark.parametrize(
    "name,fallback",
    [
        ("reasoning", "moa"),
        ("browser_tasks", "browser"),
        ("terminal_tasks", "terminal"),
        ("mixed_tasks", "browser"),
    ],
)
def test_fallback_picks_highest_percentage_first_on_ties(name, fallback):
    assert sample_toolsets_from_distribution(name, FixedRng(0.99)) == [fallback]


def test_low_draw_selects_everything_in_insertion_order():
    everything = list(DISTRIBUTIONS["science"]["toolsets"])
    assert sample_toolsets_from_distribution("science", FixedRng(0.0)) == everything


def test_threshold_is_strict_less_than():
    # 0.3 * 100 == 30 is not < 30, so web (30) is out; terminal (20) too; moa (90) is in.
    assert sample_toolsets_from_distribution("reasoning", FixedRng(0.3)) == ["moa"]
    assert sample_toolsets_from_distribution("reasoning", FixedRng(0.2999)) == ["moa", "web"]


def test_uses_module_random_when_no_rng():
    random.seed(1234)
    first = [sample_toolsets_from_distribution("balanced") for _ in range(50)]
    random.seed(1234)
    second = [sample_toolsets_from_distribution("balanced") for _ in range(50)]
    assert first == second


def test_invalid_toolset_skipped_and_warned_once_per_process(monkeypatch, caplog):
    add_temporary(monkeypatch, "tmp", {"bogus": 100, "web": 50})
    with caplog.at_level(logging.WARNING, logger="toolset_distributions"):
        results = [sample_toolsets_from_distribution("tmp", FixedRng(0.99)) for _ in range(5)]
    # bogus is skipped even at 100%, and the fallback only considers valid toolsets.
    assert results == [["web"]] * 5
    warnings = [r for r in caplog.records if "bogus" in r.getMessage()]
    assert len(warnings) == 1
    assert "tmp" in warnings[0].getMessage()


def test_only_invalid_toolsets_gives_empty(monkeypatch):
    add_temporary(monkeypatch, "tmp", {"bogus": 100})
    assert sample_toolsets_from_distribution("tmp", FixedRng(0.0)) == []


def test_invalid_toolset_does_not_consume_a_draw(monkeypatch):
    # Skipped toolsets take no trial, so the valid ones see the same draws as without them.
    add_temporary(monkeypatch, "tmp", {"web": 50, "bogus": 50, "file": 50})
    add_temporary(monkeypatch, "tmp2", {"web": 50, "file": 50})
    for key in range(50):
        a = sample_toolsets_from_distribution("tmp", rng_for_row(3, str(key)))
        b = sample_toolsets_from_distribution("tmp2", rng_for_row(3, str(key)))
        assert a == b


# --- seeding ----------------------------------------------------------------------------------


def test_rng_for_row_is_reproducible():
    keys = [str(i) for i in range(20)]
    a = [sample_toolsets_from_distribution("balanced", rng_for_row(7, k)) for k in keys]
    b = [sample_toolsets_from_distribution("balanced", rng_for_row(7, k)) for k in keys]
    assert a == b
    assert rng_for_row(7, "k").random() == rng_for_row(7, "k").random()
    seq1, seq2 = rng_for_row(7, "k"), rng_for_row(7, "k")
    assert [seq1.random() for _ in range(10)] == [seq2.random() for _ in range(10)]


def test_rng_for_row_is_stable_across_processes():
    # str hashing is randomised per process; the derived stream must not be.
    code = "from toolset_distributions import rng_for_row; print(repr(rng_for_row(7, 'k').random()))"
    out = {
        run_python(code, env={**os.environ, "PYTHONHASHSEED": str(h)})
        for h in (1, 2)
    }
    assert out == {repr(rng_for_row(7, "k").random()) + "\n"}


def test_rng_for_row_differs_by_key_and_seed():
    keys = [f"row-{i}" for i in range(200)]
    samples = {tuple(sample_toolsets_from_distribution("balanced", rng_for_row(7, k))) for k in keys}
    # balanced has 2**7 outcomes; 200 keys giving one result would mean the key is ignored.
    assert len(samples) > 30
    assert len({rng_for_row(7, k).random() for k in keys}) == len(keys)
    assert rng_for_row(7, "k").random() != rng_for_row(8, "k").random()
    # Seed and key are kept apart: (1, "2x") and (12, "x") must not collide.
    assert rng_for_row(1, "2x").random() != rng_for_row(12, "x").random()


def test_sample_independent_of_processing_order():
    keys = [str(i) for i in range(100)]
    forward = {k: sample_toolsets_from_distribution("science", rng_for_row(42, k)) for k in keys}
    backward = {k: sample_toolsets_from_distribution("science", rng_for_row(42, k)) for k in reversed(keys)}
    assert forward == backward


@pytest.mark.parametrize("name", ["balanced", "science"])
def test_sampling_frequencies_match_percentages(name):
    rng = random.Random(20240601)
    draws = 20000
    counts = dict.fromkeys(DISTRIBUTIONS[name]["toolsets"], 0)
    for _ in range(draws):
        for ts in sample_toolsets_from_distribution(name, rng):
            counts[ts] += 1
    for ts, pct in DISTRIBUTIONS[name]["toolsets"].items():
        # 1.5 points is > 4 standard deviations at n=20000; the fallback adds < 0.1 point here.
        assert abs(100 * counts[ts] / draws - pct) < 1.5, (ts, counts[ts])


# --- printed catalogue ------------------------------------------------------------------------


def test_catalogue_header_and_sorted_names():
    lines = format_distribution_catalogue().split("\n")
    assert lines[0] == "📊 Available Toolset Distributions"
    assert lines[1] == "=" * 70
    prefix = "📊 Distribution: "
    names = [line.removeprefix(prefix) for line in lines if line.startswith(prefix)]
    assert names == sorted(ALL_NAMES)
    assert names[:3] == ["balanced", "browser_only", "browser_tasks"]
    # Each block starts with a blank line.
    for i, line in enumerate(lines):
        if line.startswith("📊 Distribution: "):
            assert lines[i - 1] == ""


def test_catalogue_block_for_browser_tasks():
    text = format_distribution_catalogue()
    block = (
        "\n📊 Distribution: browser_tasks\n"
        f"   Description: {DISTRIBUTIONS['browser_tasks']['description']}\n"
        "   Toolsets:\n"
        "     • browser         :  97% chance\n"
        "     • terminal        :  15% chance\n"
        "     • vision          :  12% chance\n"
    )
    assert block in text


def test_catalogue_ties_keep_insertion_order():
    text = format_distribution_catalogue()
    assert (
        "     • web             :  94% chance\n"
        "     • terminal        :  94% chance\n"
        "     • file            :  94% chance\n"
        "     • vision          :  65% chance\n"
    ) in text
    assert "     • web             : 100% chance" in text


def test_catalogue_usage_footer():
    lines = format_distribution_catalogue().split("\n")
    assert lines[-4:] == [
        "",
        "💡 Usage:",
        "  python batch_runner.py --dataset_file=data.jsonl --batch_size=10 \\",
        "                         --run_name=my_run --distribution=<name>",
    ]


def test_print_distribution_info(capsys):
    print_distribution_info("reasoning")
    out = capsys.readouterr().out
    assert out == (
        "\n📊 Distribution: reasoning\n"
        "   Description: Heavy mixture of agents usage with minimal other tools\n"
        "   Toolsets:\n"
        "     • moa             :  90% chance\n"
        "     • web             :  30% chance\n"
        "     • terminal        :  20% chance\n"
    )
    print_distribution_info("nope")
    assert capsys.readouterr().out == "❌ Unknown distribution: nope\n"


def test_import_is_light():
    # `--list_distributions` must be fast: importing the module must not pull tool implementations
    # or heavy third-party packages.
    code = (
        "import sys, toolset_distributions\n"
        "heavy = {'pydantic', 'openai', 'httpx', 'docker', 'fire', 'tqdm'}\n"
        "tools = {'tools.terminal_tool', 'tools.web_tools', 'tools.browser_tools'}\n"
        "print([m for m in sys.modules if m.split('.')[0] in heavy or m in tools])\n"
    )
    assert run_python(code).strip() == "[]"


def test_fallback_toolset_is_the_highest_that_can_offer_a_tool_ties_in_order():
    from runner.execution.worker import fallback_toolset
    from tools.registry import all_tool_names, toolsets

    catalogue = toolsets()
    none_of = lambda *names: {tool: "test" for ts in names for tool in catalogue.get(ts, ())}  # noqa: E731
    assert fallback_toolset("image_gen", {}) == "image_gen"  # image_gen and vision tie at 90: the first
    assert fallback_toolset("image_gen", none_of("image_gen")) == "vision"
    assert fallback_toolset("image_gen", none_of("image_gen", "vision")) == "web"
    assert fallback_toolset("image_gen", {name: "test" for name in all_tool_names()}) is None
