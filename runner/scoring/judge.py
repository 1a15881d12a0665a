"""The judge scorer: a model grades the final answer, given the task, the target and a rubric.

The judge replies with a line `GRADE: C` (correct, 1.0), `GRADE: P` (partly correct, 0.5) or
`GRADE: I` (incorrect, 0.0); the last such line counts. A reply without one is asked again, up to
GRADE_ATTEMPTS in all; then the scorer fails (its entry says why). The requests go through the
run's model client, so they are paced, retried, priced and counted like the agent's, in the
sample's usage under the judge's model.
"""

from __future__ import annotations

import re
from typing import Any

from runner.scoring.sample import Sample, Score

GRADES = {"C": 1.0, "P": 0.5, "I": 0.0}
GRADE_ATTEMPTS = 3
_GRADE = re.compile(r"GRADE\s*:\s*\**\s*([CPI])\b")

INSTRUCTIONS = (
    "You grade answers to tasks. Read the task, the reference answer and the grading guidance when "
    "they are given, and the answer to grade. Explain your judgement briefly, then end with one line "
    "that is exactly 'GRADE: C' if the answer is correct, 'GRADE: P' if it is partly correct, or "
    "'GRADE: I' if it is incorrect."
)


def judge_prompt(sample: Sample, rubric: str | None) -> str:
    parts = [INSTRUCTIONS, f"[Task]\n{sample.prompt}"]
    if sample.targets:
        parts.append("[Reference answer]\n" + "\n".join(sample.targets))
    if rubric:
        parts.append(f"[Grading guidance]\n{rubric}")
    parts.append(f"[Answer to grade]\n{sample.final_answer}")
    return "\n\n".join(parts)


def read_grade(text: str | None) -> str | None:
    grades = _GRADE.findall(text or "")
    return grades[-1] if grades else None


async def grade(sample: Sample, session: Any, rubric: str | None) -> Score:
    if session is None:
        raise RuntimeError("no judge model is configured (--judge_model)")
    messages = [{"role": "user", "content": judge_prompt(sample, rubric)}]
    reply_text = ""
    for _ in range(GRADE_ATTEMPTS):
        reply = await session.complete(messages)
        reply_text = (reply.content or "").strip()
        letter = read_grade(reply_text)
        if letter is not None:
            return Score(GRADES[letter], _tail(reply_text))
    raise ValueError(f"the judge's reply has no GRADE line after {GRADE_ATTEMPTS} attempts; "
                     f"its last reply: {_tail(reply_text) or '(empty)'}")


def _tail(text: str, limit: int = 1000) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else "..." + text[-limit:]
