"""Monthly budgets: a money limit per user (Quota.cost_per_month, set in the admin beside
the other quotas, the site-wide default row applying to users without their own), checked
against the usage ledger whenever a batch is created (the OpenAI and Anthropic APIs and the
dashboard all create through `jobs.services.batches.create_batch`).

What is left: the limit minus what the ledger charged the user since the 1st of the month
(TIME_ZONE, UTC). A new batch is refused (429 insufficient_quota, naming the limit, what is
left and the estimate) when its cost ceiling exceeds what is left. The ceiling is the
preflight's estimate of its input tokens plus the sum of its requests' max output tokens,
priced at the batch's model's price, without the cached discount: what it could cost at
most, so accepted batches stay within the budget unless several run at once.

During a run nothing is stopped: each shard is charged as it finishes, and a batch already
accepted runs to its end even if the month's charges pass the limit (several batches
accepted together, or input tokens above the estimate). Its results are kept and charged;
new batches are refused until the month resets or the limit is raised.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from jobs.errors import ServiceError
from jobs.models import UsageRecord
from jobs.services.pricing import NANOS, Rate, format_cost, rate_for
from jobs.services.quotas import cost_nanos_since, limits_for, period_starts


@dataclass
class Budget:
    limit_nanos: int | None  # None: no budget
    charged_nanos: int
    currency: str

    @property
    def left_nanos(self) -> int | None:
        return None if self.limit_nanos is None else self.limit_nanos - self.charged_nanos

    def show(self, nanos: int | None) -> str:
        return "no limit" if nanos is None else format_cost(nanos, self.currency)

    @property
    def show_limit(self) -> str:
        return self.show(self.limit_nanos)

    @property
    def show_left(self) -> str:
        left = self.left_nanos
        return self.show(None if left is None else max(left, 0))

    @property
    def percent(self) -> float | None:
        if not self.limit_nanos:
            return None
        return min(100.0, round(100.0 * self.charged_nanos / self.limit_nanos, 1))


@dataclass
class Estimate:
    """What a batch input is expected to cost: its estimated input tokens and the sum of its
    max output tokens, priced."""

    model: str
    input_tokens: int
    output_tokens_ceiling: int
    ceiling_nanos: int
    currency: str

    @property
    def ceiling(self) -> str:
        return format_cost(self.ceiling_nanos, self.currency)


def charged_this_month(owner: Any) -> tuple[int, str]:
    """(nanos the ledger charged the user this month, their currency)."""
    _, month = period_starts()
    currency = (UsageRecord.objects.filter(owner=owner).order_by("-recorded_at")
                .values_list("currency", flat=True).first()) or rate_for("").currency
    return cost_nanos_since(owner, month), currency


def budget_for(owner: Any) -> Budget:
    limit = limits_for(owner)["cost_per_month"]
    charged, currency = charged_this_month(owner)
    return Budget(limit_nanos=None if limit is None else int(Decimal(limit) * NANOS),
                  charged_nanos=charged, currency=currency)


def estimate(*, model: str | None, input_tokens: int, output_tokens_ceiling: int) -> Estimate:
    rate: Rate = rate_for(model or "")
    nanos = rate.cost_nanos(input_tokens=input_tokens, cached_tokens=0,
                            output_tokens=output_tokens_ceiling)
    return Estimate(model=model or "", input_tokens=input_tokens,
                    output_tokens_ceiling=output_tokens_ceiling, ceiling_nanos=nanos,
                    currency=rate.currency)


def check_budget(*, owner: Any, estimate_of: Callable[[], Estimate]) -> None:
    """Refuse (ServiceError 429) a batch whose cost ceiling exceeds what is left of the
    owner's monthly budget. `estimate_of` (the batch input's preflight: a pass over the
    file, cached) is called only when a budget applies."""
    budget = budget_for(owner)
    left = budget.left_nanos
    if left is None:
        return
    est = estimate_of()
    if est.ceiling_nanos <= left:
        return
    raise ServiceError(
        f"Budget exceeded (cost per month): this batch could cost up to {est.ceiling} "
        f"({est.input_tokens:,} input tokens estimated + {est.output_tokens_ceiling:,} max "
        f"output tokens), and {budget.show_left} is left of your monthly budget of "
        f"{budget.show(budget.limit_nanos)}. Lower max_tokens, split the batch, or wait "
        "for the budget to reset on the 1st.",
        status=429, code="cost_per_month_exceeded", type="insufficient_quota")
