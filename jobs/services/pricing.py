"""Prices: what a model's tokens cost a batch (the operator's Price rows), and the cost of
some tokens at a price. One rule for the ledger's charges, the preflight's estimate and the
budget's ceiling.

The seeds' billing rule: only successful requests are charged (what shards count as
input/output tokens); input tokens served from the prefix cache at the cached price;
failed, cancelled, expired and refused requests cost nothing. Embeddings, score and rerank
have no output tokens, so only their input is priced.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import ROUND_HALF_EVEN, Decimal

from jobs.models import LoraAdapter, Price

MILLION = Decimal(1_000_000)
NANOS = Decimal(10**9)


@dataclass(frozen=True)
class Rate:
    """Batch prices per million tokens, discount applied."""

    input: Decimal = Decimal(0)
    cached: Decimal = Decimal(0)
    output: Decimal = Decimal(0)
    currency: str = "usd"

    def cost_nanos(self, *, input_tokens: int, cached_tokens: int, output_tokens: int) -> int:
        """The cost in billionths of the currency, rounded once. `input_tokens` counts the
        cached ones too (as usage does); they are charged at the cached price."""
        cached = min(cached_tokens, input_tokens)
        value = ((input_tokens - cached) * self.input + cached * self.cached
                 + output_tokens * self.output) * NANOS / MILLION
        return int(value.to_integral_value(rounding=ROUND_HALF_EVEN))


def rate_of(price: Price | None) -> Rate:
    if price is None:
        return Rate()
    keep = (Decimal(100) - Decimal(price.batch_discount_percent)) / Decimal(100)
    cached = (price.cached_input_per_million if price.cached_input_per_million is not None
              else price.input_per_million)
    return Rate(input=Decimal(price.input_per_million) * keep,
                cached=Decimal(cached) * keep,
                output=Decimal(price.output_per_million) * keep, currency=price.currency)


def rates_for(models: set[str], *, base_model: str) -> dict[str, Rate]:
    """The batch rate of each model named (a served model or an adapter of `base_model`):
    its own Price row, else the base model's, else the default's; zero without any. One
    query for all of them."""
    prices = {p.model: p for p in Price.objects.filter(model__in=[*models, base_model, ""])}
    fallback = prices.get(base_model) or prices.get("")
    return {model: rate_of(prices.get(model) or fallback) for model in models}


def rate_for(model: str, *, base_model: str | None = None) -> Rate:
    if base_model is None:
        base_model = (LoraAdapter.objects.filter(name=model).values_list("base_model", flat=True)
                      .first() or model)
    return rates_for({model}, base_model=base_model)[model]


def format_cost(nanos: int, currency: str = "usd") -> str:
    """A cost for people: 6 decimals below one unit, else 2 (what the pages and CSV show)."""
    value = Decimal(nanos) / NANOS
    places = Decimal("0.000001") if abs(value) < 1 else Decimal("0.01")
    return f"{value.quantize(places)} {currency.upper()}"
