"""What one model request cost, when the endpoint does not say.

The endpoint's own figure always wins (OpenRouter's `usage.cost`, LiteLLM's response-cost header):
it knows discounts, cache writes and provider routing that no flag can. Only a request without a
reported cost is priced from its tokens with the user's `--price_*_per_mtok` flags; with neither,
its cost is unknown (None), never 0.0, so an unpriced run cannot pass for a free one.
"""

from __future__ import annotations

from pydantic import BaseModel, Field


class Prices(BaseModel):
    """USD per million tokens, the way providers publish them."""

    input_per_mtok: float = Field(ge=0)
    output_per_mtok: float = Field(ge=0)
    # A cache hit is cheaper on most providers; without a cached price it is charged as a miss
    # (the safe side for a budget).
    cached_input_per_mtok: float | None = Field(default=None, ge=0)

    def cost_of(self, usage: dict) -> float:
        """The cost of one reply's usage. OpenAI-style `prompt_tokens` include the cached ones."""
        prompt = int(usage.get("prompt_tokens") or 0)
        cached = min(prompt, int(usage.get("cached_tokens") or 0))
        completion = int(usage.get("completion_tokens") or 0)  # reasoning tokens are part of these
        cached_price = self.input_per_mtok if self.cached_input_per_mtok is None else self.cached_input_per_mtok
        return ((prompt - cached) * self.input_per_mtok + cached * cached_price + completion * self.output_per_mtok) / 1e6


FREE = Prices(input_per_mtok=0.0, output_per_mtok=0.0)  # the built-in offline model (--model=mock)


def request_cost(usage: dict, prices: Prices | None) -> float | None:
    """The reported cost if there is one, else the priced tokens, else None (unknown)."""
    reported = usage.get("cost")  # already checked by model_client.charge: a number or None
    if reported is not None:
        return float(reported)
    return prices.cost_of(usage) if prices is not None else None
