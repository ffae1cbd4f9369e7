"""Prices: what a model's tokens cost a batch (the operator's Price rows), and the cost of
some tokens at a price. One rule for the ledger's charges, the preflight's estimate and the
budget's ceiling.

The seeds' billing rule: only successful requests are charged (what shards count as
input/output tokens); input tokens served from the prefix cache at the cached price;
failed, cancelled, expired and refused requests cost nothing. Embeddings, score and rerank
have no output tokens, so only their input is priced.
"""

from __future__ import annotations

from collections.abc import Iterable
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

    @property
    def priced(self) -> bool:
        """Whether a price applies: with none (no row, or a row of zeros) usage is recorded
        at no cost, and a cost of zero would say nothing of what the tokens are worth."""
        return any((self.input, self.cached, self.output))

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


def priced_models(models: Iterable[str]) -> set[str]:
    """Those of `models` (served models or adapters) a price applies to now, by `rates_for`'s
    rule (own row, else the adapter's base model's, else the default): two queries."""
    names = set(models)
    bases = dict(LoraAdapter.objects.filter(name__in=names).values_list("name", "base_model"))
    prices = {p.model: rate_of(p) for p in Price.objects.filter(
        model__in=[*names, *bases.values(), ""])}
    fallback = Rate()
    return {name for name in names
            if (prices.get(name) or prices.get(bases.get(name, name)) or prices.get("")
                or fallback).priced}


def any_priced() -> bool:
    """Whether the operator set a price for any model (a Price row that is not all zeros)."""
    return any(rate_of(price).priced for price in Price.objects.all())


NOT_PRICED = "not priced"


def format_cost(nanos: int, currency: str = "usd", *, priced: bool = True) -> str:
    """Money as every page shows it: the amount with its currency, 6 decimals below one
    unit (a few requests cost millionths), else 2, and 2 for nothing at all; or "not priced"
    where no price applies (`Rate.priced`), whatever the amount (zero)."""
    if not priced:
        return NOT_PRICED
    value = Decimal(nanos) / NANOS
    places = Decimal("0.000001") if 0 < abs(value) < 1 else Decimal("0.01")
    return f"{value.quantize(places)} {currency.upper()}"
