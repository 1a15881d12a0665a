"""The choice of turns to summarise: protected turns stay, a tool call stays with its responses."""

from __future__ import annotations

import random

from runner.compress.plan import choose_region, compressed_turns, head_end


def conversation(rng: random.Random) -> list[str]:
    roles = ["system", "human"]
    for _ in range(rng.randint(0, 12)):
        kind = rng.random()
        if kind < 0.6:
            roles += ["gpt"] + ["tool"] * rng.randint(1, 3)  # a call (or parallel calls) and the responses
        elif kind < 0.8:
            roles.append("gpt")
        else:
            roles.append("human")
    return roles + ["gpt"]


def test_a_region_never_separates_a_call_from_its_responses_nor_touches_protected_turns():
    rng = random.Random(5)
    for _ in range(3000):
        roles = conversation(rng)
        counts = [rng.randint(1, 200) for _ in roles]
        protect = rng.randint(0, 5)
        target = rng.randint(1, sum(counts))
        region = choose_region(roles, counts, target, rng.randint(1, 50), protect)
        if region is None:
            continue
        assert head_end(roles) <= region.start < region.end <= len(roles) - protect
        assert roles[region.start] != "tool"  # its call would stay outside
        assert region.end == len(roles) or roles[region.end] != "tool"  # its call would be summarised away
        assert region.tokens == sum(counts[region.start:region.end])


def test_the_region_takes_just_enough_turns():
    roles = ["system", "human", "gpt", "tool"] + ["human", "gpt"] * 5 + ["human", "gpt"]
    counts = [10] * len(roles)
    region = choose_region(roles, counts, target=len(roles) * 10 - 25, summary_tokens=5, protect_last=2)
    assert (region.start, region.end) == (4, 7)  # 30 tokens cover the 25 over plus the 5 of the summary


def test_a_call_whose_responses_reach_the_tail_stays_out_with_them():
    roles = ["system", "human", "gpt", "tool", "human", "gpt", "tool", "tool", "gpt"]
    region = choose_region(roles, [10] * 9, target=30, summary_tokens=1, protect_last=2)
    assert (region.start, region.end) == (4, 5)  # turn 5 calls, 6 and 7 answer; 7 is protected


def test_nothing_to_summarise_when_every_turn_is_protected():
    roles = ["system", "human", "gpt", "tool", "gpt"]
    assert choose_region(roles, [100] * 5, target=10, summary_tokens=1, protect_last=4) is None


def test_the_compressed_conversation_keeps_the_head_and_the_tail():
    turns = [{"from": r, "value": str(i)} for i, r in enumerate(["system", "human", "gpt", "tool", "gpt", "human", "gpt"])]
    region = choose_region([t["from"] for t in turns], [10] * 7, target=40, summary_tokens=1, protect_last=1)
    result = compressed_turns(turns, region, " the summary ")
    assert result[region.start] == {"from": "human", "value": "[CONTEXT SUMMARY]: the summary"}
    assert result[1:region.start] == turns[1:region.start] and result[region.start + 1:] == turns[region.end:]
    assert result[0]["value"].startswith("0") and turns[0]["value"] == "0"  # the input is not changed
