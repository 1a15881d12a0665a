"""Which turns of a conversation to summarise, and the conversation that replaces them.

Protected: the first system, human, gpt and tool turns (the head, up to the last of them) and
the last `protect_last_n_turns` turns. From the first turn after the head (past the responses
to a call made in the head), turns are taken until
what they hold covers the excess plus the summary that replaces them. The region is then moved so
that it never separates a tool call (a gpt turn) from its responses (the tool turns right after
it): it never starts on a tool turn, and it never ends between a call and its responses.
"""

from __future__ import annotations

from dataclasses import dataclass

SUMMARY_PREFIX = "[CONTEXT SUMMARY]: "
SYSTEM_NOTICE = ("\n\nNote: part of the earlier conversation was replaced by a summary, the turn that starts "
                 "with [CONTEXT SUMMARY].")
HEAD_ROLES = ("system", "human", "gpt", "tool")


@dataclass(frozen=True)
class Region:
    start: int  # first summarised turn
    end: int  # one past the last summarised turn
    tokens: int  # what the summarised turns hold


def head_end(roles: list[str]) -> int:
    """One past the last protected head turn (the first of each role in HEAD_ROLES)."""
    firsts = [roles.index(role) for role in HEAD_ROLES if role in roles]
    return max(firsts) + 1 if firsts else 0


def choose_region(roles: list[str], counts: list[int], target: int, summary_tokens: int,
                  protect_last: int) -> Region | None:
    """The turns to summarise, or None when no turn can be (all protected, or a tool call and its
    responses span the whole middle)."""
    total = sum(counts)
    lower = head_end(roles)
    upper = max(lower, len(roles) - protect_last)  # the tail starts here
    needed = total - target + summary_tokens
    start = lower
    while start < upper and roles[start] == "tool":  # its call is in the head: keep them together
        start += 1
    end, taken = start, 0
    while end < upper and taken < needed:
        taken += counts[end]
        end += 1
    end = _keep_calls_whole(roles, start, end, upper)
    if end <= start:
        return None
    return Region(start, end, sum(counts[start:end]))


def _keep_calls_whole(roles: list[str], start: int, end: int, upper: int) -> int:
    """`end` moved so that the responses after the region's last call are in it too, or, when they
    reach into the protected tail, so that the call stays out of it with them."""
    if end >= len(roles) or roles[end] != "tool":
        return end
    extended = end
    while extended < upper and roles[extended] == "tool":
        extended += 1
    if extended >= len(roles) or roles[extended] != "tool":
        return extended
    while end > start and roles[end] == "tool":  # back to the call, which stays out with them
        end -= 1
    return end


def compressed_turns(turns: list[dict], region: Region, summary: str) -> list[dict]:
    """The conversation with the region replaced by one human turn holding the summary, and a
    notice appended to the system turn (a copy: the input's turns are not changed)."""
    summary_turn = {"from": "human", "value": SUMMARY_PREFIX + summary.strip()}
    result = [dict(turn) for turn in turns[:region.start]] + [summary_turn] + [dict(t) for t in turns[region.end:]]
    for turn in result:
        if turn["from"] == "system":
            turn["value"] = turn["value"] + SYSTEM_NOTICE
            break
    return result
