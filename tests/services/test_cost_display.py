"""Money as every page shows it (`pricing.format_cost`): with its currency where a price
applies, "not priced" where none does, and each page's own reading of which it is."""

from __future__ import annotations

from decimal import Decimal

import pytest

from jobs.models import LoraAdapter, Price
from jobs.services.budgets import budget_for, estimate
from jobs.services.pricing import any_priced, format_cost, priced_models
from tests.factories import set_quota

pytestmark = pytest.mark.django_db


def test_one_format():
    assert format_cost(0) == "0.00 USD"
    assert format_cost(8_000) == "0.000008 USD"
    assert format_cost(12_346_000_000, "eur") == "12.35 EUR"
    assert format_cost(0, priced=False) == format_cost(5, priced=False) == "not priced"


def test_what_is_priced_follows_the_prices_rule(settings):
    """Own row, else the adapter's base model's, else the default; a row of zeros is none."""
    LoraAdapter.objects.create(name="tuned", base_model="echo-test", source="/nowhere")
    assert priced_models({"echo-test", "tuned", "other"}) == set() and not any_priced()
    Price.objects.create(model="other", input_per_million=0, output_per_million=0)
    assert not any_priced()
    Price.objects.create(model="echo-test", input_per_million=1, output_per_million=1)
    assert priced_models({"echo-test", "tuned", "other"}) == {"echo-test", "tuned"}
    assert any_priced()
    Price.objects.create(model="", input_per_million=1, output_per_million=1)
    # "other" has its own row, of zeros: free, not priced.
    assert priced_models({"other", "new"}) == {"new"}


def test_the_check_and_the_budget_say_not_priced_without_a_price(user):
    ceiling = estimate(model="echo-test", ceilings={"echo-test": [100, 50]})
    assert ceiling.ceiling == "not priced" and ceiling.ceiling_nanos == 0
    set_quota(user, cost_per_month=Decimal("5"))
    budget = budget_for(user)
    # The limit is money the operator set; what was charged has no price behind it.
    assert (budget.show_charged, budget.show_left, budget.show_limit) == (
        "not priced", "5.00 USD", "5.00 USD")
    Price.objects.create(model="echo-test", input_per_million=2, output_per_million=4)
    ceiling = estimate(model="echo-test", ceilings={"echo-test": [100, 50]})
    assert ceiling.ceiling == "0.000200 USD"  # (100 x 2 + 50 x 4) / 1e6, half off
    assert budget_for(user).show_charged == "0.00 USD"


def test_the_admins_ledger_says_it_the_same_way(admin_client, user):
    from django.utils import timezone

    from jobs.models import UsageRecord

    UsageRecord.objects.create(
        owner=user, batch_id="batch_free", shard_id="shard_free", model="echo-test",
        base_model="echo-test", endpoint="/v1/chat/completions", requests_succeeded=2,
        input_tokens=10, output_tokens=4, recorded_at=timezone.now())
    page = admin_client.get("/admin/jobs/usagerecord/").content.decode()
    assert "not priced" in page and "0.000000" not in page
