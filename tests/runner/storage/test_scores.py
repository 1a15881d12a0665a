"""Selection (--keep), pass@k and the score figures, on hand-made committed lines."""

from __future__ import annotations

import itertools
import json

import pytest

from runner.input.samples import sample_key
from runner.storage.runview import RunView, Selection, read_run
from runner.storage.scores import pass_at_k


@pytest.mark.parametrize("n, c", [(1, 0), (1, 1), (4, 2), (5, 1), (6, 6), (7, 3)])
def test_pass_at_k_is_the_chance_that_k_of_the_n_samples_include_a_passing_one(n, c):
    outcomes = [True] * c + [False] * (n - c)
    for k in range(1, n + 1):
        draws = list(itertools.combinations(outcomes, k))
        assert pass_at_k(n, c, k) == pytest.approx(sum(any(d) for d in draws) / len(draws))


def _line(row: str, sample: int, value: float | None, index: int, reasoning: int = 1) -> dict:
    metadata = {"row_key": sample_key(row, sample), "sample": sample, "samples": 3, "run_id": "r", "attempt": 1,
                "timestamp": "2026-12-01T10:00:00", "duration_seconds": 1.0,
                "usage": {"requests": 2, "prompt_tokens": 10, "completion_tokens": 5}}
    if value is not None:
        metadata["scores"] = [{"scorer": "includes", "value": value, "passed": value >= 1.0, "explanation": ""},
                              {"scorer": "judge", "value": 0.5, "passed": False,
                               "explanation": "scorer error: timeout" if sample == 2 else "GRADE: P"}]
    return {"prompt_index": index, "conversations": [{"from": "human", "value": row}], "metadata": metadata,
            "completed": True, "partial": False, "api_calls": 2, "toolsets_used": [], "tool_stats": {},
            "tool_error_counts": {}, "reasoning_stats": {"total_assistant_turns": 1, "turns_with_reasoning": reasoning,
                                                         "turns_without_reasoning": 1 - reasoning}}


def _view(tmp_path, lines, selection: Selection) -> RunView:
    path = tmp_path / "batch_0.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    dataset = {sample_key(row, s): i for i, row in enumerate(("a-0", "b-0")) for s in range(3)}
    return read_run([path], RunView(dataset, selection=selection, log=lambda _: None))


# row a: samples 0 and 2 pass (2 committed before 0); row b: none passes, sample 1 the highest
LINES = [_line("a-0", 2, 1.0, 0), _line("a-0", 1, 0.0, 0), _line("a-0", 0, 1.0, 0),
         _line("b-0", 0, 0.0, 1), _line("b-0", 1, 0.5, 1), _line("b-0", 2, 0.0, 1)]


def _kept(view) -> list[tuple[int, int]]:
    return sorted((e.prompt_index, e.sample) for e in view.rows.values() if e.rank == 2 and e.selected)


def test_keep_passing_best_and_all(tmp_path):
    view = _view(tmp_path, LINES, Selection(keep="passing"))
    assert _kept(view) == [(0, 0), (0, 2)]
    assert view.counts()["outcomes"]["unselected"] == 4 and view.kept.ok == 2
    assert view.spend["unselected"].attempts == 4 and view.spend["kept"].attempts == 2
    best = _view(tmp_path, LINES, Selection(keep="best"))
    assert _kept(best) == [(0, 0), (1, 1)]  # ties: the lowest sample index
    everything = _view(tmp_path, LINES, Selection())
    assert len(_kept(everything)) == 6 and "unselected" not in everything.counts()["outcomes"]
    assert "unselected" not in everything.spend


def test_score_figures(tmp_path):
    scoring = _view(tmp_path, LINES, Selection(keep="best")).scores.as_dict(3)
    assert scoring["scorers"] == ["includes", "judge"] and scoring["samples"] == 6 and scoring["passed"] == 2
    assert scoring["mean"] == pytest.approx(2.5 / 6, abs=1e-6)
    assert scoring["errors"] == 2  # the judge's sample-2 entries
    assert scoring["by_scorer"] == {"includes": round(2.5 / 6, 6), "judge": 0.5}
    assert scoring["pass_at_k"] == {"1": round((2 / 3) / 2, 6), "2": 0.5, "3": 0.5}


def test_the_no_reasoning_filter_is_the_views(tmp_path):
    lines = [_line("a-0", 0, None, 0, reasoning=0), _line("b-0", 0, None, 1)]
    kept = _view(tmp_path, lines, Selection(discard_no_reasoning=False))
    assert _kept(kept) == [(0, 0), (1, 0)]
    filtered = _view(tmp_path, lines, Selection(discard_no_reasoning=True))
    assert _kept(filtered) == [(1, 0)] and filtered.counts()["outcomes"]["discarded"] == 1
    assert filtered.spend["discarded"].attempts == 1


def test_stop_after_passing_spares_the_rest_of_a_row_that_passed(tmp_path):
    lines = [_line("a-0", 0, 1.0, 0), _line("b-0", 0, 0.0, 1)]
    outcomes = _view(tmp_path, lines, Selection(stop_after_passing=1)).counts()["outcomes"]
    assert (outcomes["spared"], outcomes["not_run"]) == (2, 2)  # a's samples 1 and 2; b's still to run
