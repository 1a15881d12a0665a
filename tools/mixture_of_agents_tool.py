"""mixture_of_agents: several reference models answer, then an aggregator model writes the final answer."""

from __future__ import annotations

import asyncio

from tools.registry import ToolContext, ToolSpec

AGGREGATOR_INSTRUCTIONS = (
    "Several AI models have answered the question below independently. Their answers may be "
    "incomplete, contradict each other, or contain mistakes. Weigh them critically, keep what is "
    "correct and well supported, fix or drop what is not, and write one complete, accurate answer "
    "to the question in your own words. Do not mention the individual answers or the models."
)


async def _ask(ctx: ToolContext, model: str, messages: list[dict]) -> str:
    reply = await ctx.model.complete(messages, model=model, max_tokens=None)
    text = (reply.content or "").strip()
    if not text:
        raise ValueError("empty answer")
    return text


def _aggregation_prompt(user_prompt: str, answers: list[str]) -> str:
    numbered = "\n\n".join(f"### Answer {i}\n{answer}" for i, answer in enumerate(answers, 1))
    return f"{AGGREGATOR_INSTRUCTIONS}\n\n## Question\n{user_prompt}\n\n## Answers\n{numbered}"


async def mixture_of_agents(args: dict, ctx: ToolContext) -> dict:
    user_prompt = str(args.get("user_prompt") or "").strip()
    if not user_prompt:
        return {"error": "user_prompt must not be empty"}
    references = list(dict.fromkeys(ctx.settings.moa_reference_models))  # unique, in order
    aggregator = ctx.settings.moa_aggregator_model or ctx.settings.model
    if not references:
        return {"error": "no reference models configured (moa_reference_models)"}

    question = [{"role": "user", "content": user_prompt}]
    outcomes = await asyncio.gather(*(_ask(ctx, m, question) for m in references), return_exceptions=True)
    answers, used, failed = [], [], []
    for model, outcome in zip(references, outcomes):
        if isinstance(outcome, BaseException):
            failed.append({"model": model, "error": f"{type(outcome).__name__}: {outcome}"[:300]})
        else:
            answers.append(outcome)
            used.append(model)
    if not answers:
        return {"error": "every reference model failed", "failed_models": failed}

    try:
        final = await _ask(ctx, aggregator, [{"role": "user", "content": _aggregation_prompt(user_prompt, answers)}])
    except Exception as exc:
        return {"error": f"aggregator model {aggregator} failed: {exc}", "models_used": used, "failed_models": failed}
    return {"response": final, "models_used": used, "aggregator_model": aggregator, "failed_models": failed}


TOOLS = [
    ToolSpec(
        name="mixture_of_agents",
        toolset="moa",
        description=(
            "Get a carefully checked answer to a hard question: several strong models answer it "
            "independently and another model combines their answers into one. Slow and costly; use it "
            "for difficult reasoning, maths or analysis, not for simple lookups."
        ),
        parameters={
            "type": "object",
            "properties": {
                "user_prompt": {
                    "type": "string",
                    "description": "The complete, self-contained question or task to send to the models.",
                }
            },
            "required": ["user_prompt"],
        },
        handler=mixture_of_agents,
        needs_settings=("model",),
        needs_settings_reason="no model configured",
    )
]
