"""Monthly budgets: a money limit per user (Quota.cost_per_month, set in the admin beside
the other quotas, the site-wide default row applying to users without their own), checked
whenever a batch is created (the OpenAI and Anthropic APIs and the dashboard all create
through `jobs.services.batches.create_batch`).

What is left: the limit, less what the ledger charged the user since the 1st of the month
(TIME_ZONE, UTC), less what the user's batches that have not ended may still cost (each
one's ceiling less what it was charged so far: `reserved_nanos`). A new batch is refused
(429 insufficient_quota, naming the limit, what is left and the ceiling) when its ceiling
exceeds what is left. The check and the new batch's row are one transaction that holds a
lock on the owner's row, so two creates of one owner cannot both take the same room.

The ceiling is the most a batch could cost: for each request, a bound of the prompt tokens
the engine will count (`jobs.formats.prompts.prompt_bound`: rendered by the model's own tokenizer
and chat template, tools, tool calls and results included, where this host has them; else
one token per UTF-8 byte of everything the template renders) and its output limit (the
one it names, else the one it is sent to the engine with: the model's context less the
prompt, at most the service's cap), times its answers; priced at the price of the model
each request names (an adapter's own), without the cached discount;
plus, for an attached eval set, the same for the set's requests. Accepted batches cannot
together be charged past the budget.

During a run nothing is stopped: each shard is charged as it finishes, and a batch already
accepted runs to its end. Its results are kept and charged.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from django.contrib.auth import get_user_model
from django.db.models import Q, Sum

from jobs.lib.errors import ServiceError
from jobs.models import Batch, EvalRun, UsageRecord
from jobs.services.pricing import NANOS, Rate, any_priced, format_cost, rate_for, rates_for
from jobs.services.quotas import cost_nanos_since, limits_for, period_starts


@dataclass
class Budget:
    limit_nanos: int | None  # None: no budget
    charged_nanos: int
    currency: str
    # Whether a price applies to the owner's usage (something was charged, or some model
    # has a price): what was charged shows as "not priced" otherwise. The limit and what
    # is left of it are money the operator set, priced or not.
    priced: bool = True

    @property
    def left_nanos(self) -> int | None:
        return None if self.limit_nanos is None else self.limit_nanos - self.charged_nanos

    def show(self, nanos: int | None) -> str:
        return "no limit" if nanos is None else format_cost(nanos, self.currency)

    @property
    def show_charged(self) -> str:
        return format_cost(self.charged_nanos, self.currency, priced=self.priced)

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
    """What a batch input is expected to cost at most: the bound of its input tokens and
    the sum of its output limits, priced by the model each request names."""

    model: str
    input_tokens: int
    output_tokens_ceiling: int
    ceiling_nanos: int
    currency: str
    # Whether a price applies to any of its models (else the ceiling shows "not priced").
    priced: bool = True

    @property
    def ceiling(self) -> str:
        return format_cost(self.ceiling_nanos, self.currency, priced=self.priced)

    def plus(self, other: Estimate) -> Estimate:
        return Estimate(model=self.model, input_tokens=self.input_tokens + other.input_tokens,
                        output_tokens_ceiling=self.output_tokens_ceiling
                        + other.output_tokens_ceiling,
                        ceiling_nanos=self.ceiling_nanos + other.ceiling_nanos,
                        currency=self.currency, priced=self.priced or other.priced)


def charged_this_month(owner: Any) -> tuple[int, str]:
    """(nanos the ledger charged the user this month, their currency)."""
    _, month = period_starts()
    currency = (UsageRecord.objects.filter(owner=owner).order_by("-recorded_at")
                .values_list("currency", flat=True).first()) or rate_for("").currency
    return cost_nanos_since(owner, month), currency


def reserved_nanos(owner: Any) -> int:
    """What the owner's batches that have not ended may still cost: each one's ceiling
    less what the ledger charged it so far (its attached eval run's requests included,
    which are charged to the owner as they finish). A batch still validating without a
    ceiling (created while no budget applied) reserves nothing until validation sets it."""
    open_batches = {pk: ceiling for pk, ceiling in Batch.objects.filter(owner=owner).filter(
        ~Q(status__in=Batch.ENDED)
        | Q(eval_runs__trigger=EvalRun.Trigger.BATCH,
            eval_runs__run_batch__status__in=Batch.ACTIVE)).exclude(
        cost_ceiling_nanos__isnull=True).values_list("pk", "cost_ceiling_nanos").distinct()
        if ceiling is not None}
    if not open_batches:
        return 0
    runs = dict(EvalRun.objects.filter(batch_id__in=open_batches, trigger=EvalRun.Trigger.BATCH,
                                       run_batch__isnull=False)
                .values_list("run_batch_id", "batch_id"))
    charged: dict[str, int] = dict.fromkeys(open_batches, 0)
    for batch_id, nanos in (UsageRecord.objects.filter(
            owner=owner, batch_id__in=[*open_batches, *runs]).order_by()
            .values_list("batch_id").annotate(total=Sum("cost_nanos"))):
        charged[runs.get(batch_id, batch_id)] += int(nanos or 0)
    return sum(max(0, ceiling - charged[pk]) for pk, ceiling in open_batches.items())


def budget_for(owner: Any) -> Budget:
    limit = limits_for(owner)["cost_per_month"]
    charged, currency = charged_this_month(owner)
    return Budget(limit_nanos=None if limit is None else int(Decimal(limit) * NANOS),
                  charged_nanos=charged, currency=currency,
                  priced=charged > 0 or any_priced())


def applies(owner: Any) -> bool:
    """Whether the owner has a monthly budget (else no ceiling need be computed)."""
    return limits_for(owner)["cost_per_month"] is not None


def estimate(*, model: str | None, ceilings: dict[str, list[int]]) -> Estimate:
    """The price of `ceilings` ([input, output] tokens by the model each request names: a
    served model, or an adapter of `model`), each at its own model's price."""
    base = model or ""
    rates: dict[str, Rate] = rates_for(set(ceilings) or {base}, base_model=base)
    nanos = sum(rates[name].cost_nanos(input_tokens=tokens_in, cached_tokens=0,
                                       output_tokens=tokens_out)
                for name, (tokens_in, tokens_out) in ceilings.items())
    return Estimate(model=base, input_tokens=sum(t[0] for t in ceilings.values()),
                    output_tokens_ceiling=sum(t[1] for t in ceilings.values()),
                    ceiling_nanos=nanos, currency=rates[next(iter(rates))].currency,
                    priced=any(rate.priced for rate in rates.values()))


def lock_owner(owner: Any) -> None:
    """Serialise the owner's batch creations until the transaction ends: a row lock on the
    user (PostgreSQL; SQLite runs one writing transaction at a time anyway)."""
    get_user_model().objects.select_for_update().filter(pk=owner.pk).first()


def check_budget(*, owner: Any, ceiling: Estimate | None) -> None:
    """Refuse (ServiceError 429) a batch whose `ceiling` exceeds what is left of the
    owner's monthly budget, reservations of their open batches counted. Call inside the
    transaction that creates the batch, after `lock_owner`."""
    budget = budget_for(owner)
    if budget.left_nanos is None or ceiling is None:
        return
    reserved = reserved_nanos(owner)
    left = budget.left_nanos - reserved
    if ceiling.ceiling_nanos <= left:
        return
    held = (f" ({budget.show(reserved)} of it held by your batches still running)"
            if reserved else "")
    raise ServiceError(
        f"Budget exceeded (cost per month): this batch could cost up to {ceiling.ceiling} "
        f"({ceiling.input_tokens:,} input tokens at most + {ceiling.output_tokens_ceiling:,} "
        f"max output tokens), and {budget.show(max(left, 0))} is left of your monthly "
        f"budget of {budget.show(budget.limit_nanos)}{held}. Lower max_tokens, split the "
        "batch, or wait for your batches to end or the budget to reset on the 1st.",
        status=429, code="cost_per_month_exceeded", type="insufficient_quota")
