"""The numbers of progress and usage in a real browser (Chromium, a live server and a real
worker process on the echo engine), at a desktop's and a phone's width: throughput counts
what the engine ran, money is shown one way on every page (with its currency, or "not
priced"), and the Usage page's request count says what it counts. Screenshots go to
tests/artifacts/ (git-ignored)."""

from __future__ import annotations

import re
from decimal import Decimal
from typing import Any

import pytest

from tests.dashboard.test_browser import ARTIFACTS, CHROMIUM, browser, sign_in  # noqa: F401
from tests.factories import chat_line, jsonl, make_batch, set_quota, wait_for

pytestmark = [
    pytest.mark.browser,
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium"),
]

WIDTHS = ((1280, 900), (390, 844))
MONEY = re.compile(r"\d+\.\d{2,6} USD")


@pytest.fixture
def chromium(request: Any) -> Any:
    """test_browser's `browser` (imported above, so pytest finds it)."""
    return request.getfixturevalue("browser")


def ended(batch_id: str) -> bool:
    from jobs.models import Batch

    return Batch.objects.get(pk=batch_id).is_ended


def at_each_width(page: Any, url: str, name: str) -> Any:
    """Each width in turn, the page loaded and its screenshot taken; yields the width."""
    ARTIFACTS.mkdir(exist_ok=True)
    for width, height in WIDTHS:
        page.set_viewport_size({"width": width, "height": height})
        page.goto(url)
        page.screenshot(path=str(ARTIFACTS / f"{name}-{width}.png"), full_page=True)
        assert page.evaluate("document.documentElement.scrollWidth") <= width, (name, width)
        yield width


def card(page: Any, label: str) -> str:
    """The value of the batch page's card named `label`."""
    return page.locator(f"#live dl.stats > div:has(dt:text-is('{label}')) dd").inner_text()


def check_file(page: Any, base: str, path: Any) -> str:
    page.goto(f"{base}/batches/new")
    page.set_input_files("input[name=upload]", str(path))
    page.click("button[value=check]")
    page.locator("#preflight").wait_for()
    return page.locator("#cost-ceiling").inner_text()


def test_throughput_counts_only_what_the_engine_ran(live_server, user, workers, chromium,
                                                    tmp_path, settings):
    """Three refused lines end in a moment: no throughput and no chart; nine lines of three
    distinct prompts: the mean context is one prompt's tokens, not a third of it."""
    workers.start(env={"BATCHWEB_SHARD_SIZE": "9"})
    refused = make_batch(user, [chat_line(f"r-{i}", "hi", temperature=9) for i in range(3)],
                         tmp_path, settings=settings)
    copies = make_batch(user, [chat_line(f"d-{i}", f"{'word ' * 30}{i % 3}", temperature=0,
                                         max_tokens=5) for i in range(9)],
                        tmp_path, settings=settings)
    for batch in (refused, copies):
        wait_for(lambda b=batch: ended(b.pk), timeout=60, message="the batch ended")
    context = chromium.new_context()
    page = context.new_page()
    sign_in(page, live_server.url)
    for _ in at_each_width(page, f"{live_server.url}/batches/{refused.pk}/",
                           "numbers-refused"):
        assert card(page, "Failed") == "3"
        assert card(page, "Throughput average") == "0.0/min"
        assert "The engine ran none of its requests." in page.locator("#live .chart").inner_text()
    for _ in at_each_width(page, f"{live_server.url}/batches/{copies.pk}/", "numbers-copies"):
        tokens_in = int(card(page, "Tokens in / out").split("/")[0].replace(",", ""))
        assert tokens_in % 3 == 0
        # 3 prompts computed, 9 requests answered.
        assert card(page, "Mean context length").split()[0] == f"{tokens_in / 3:.1f}"
    context.close()


def test_cost_reads_one_way_on_every_page(live_server, user, workers, chromium, tmp_path,
                                          settings):
    """The check before a batch, the batch page, the Usage page and the account: "not
    priced" while no price is set, then money with its currency, never a bare number."""
    from jobs.models import Price

    set_quota(user, cost_per_month=Decimal("5"))
    workers.start()
    good = tmp_path / "good.jsonl"
    good.write_bytes(jsonl([chat_line(f"p-{i}", "hello", max_tokens=5) for i in range(4)]))
    free = make_batch(user, [chat_line(f"f-{i}", "hello", max_tokens=5) for i in range(3)],
                      tmp_path, settings=settings)
    wait_for(lambda: ended(free.pk), timeout=60, message="the batch ended")
    context = chromium.new_context()
    page = context.new_page()
    sign_in(page, live_server.url)
    base = live_server.url
    for width, height in WIDTHS:
        page.set_viewport_size({"width": width, "height": height})
        assert check_file(page, base, good).startswith("not priced")
        page.screenshot(path=str(ARTIFACTS / f"numbers-check-free-{width}.png"),
                        full_page=True)
    for _ in at_each_width(page, f"{base}/batches/{free.pk}/", "numbers-batch-free"):
        assert card(page, "Cost").startswith("not priced")
    for _ in at_each_width(page, f"{base}/usage/", "numbers-usage-free"):
        assert page.locator("#usage-cost").inner_text() == "not priced"
        assert page.locator("#usage-table tbody td").last.inner_text() == "not priced"
    for _ in at_each_width(page, f"{base}/account/", "numbers-account-free"):
        row = page.locator("#quota-cost_per_month")
        assert row.locator("#cost-used").inner_text() == "not priced"
        assert row.locator("td.limit").inner_text() == "5.00 USD"
        assert "(5.00 USD left)" in row.locator("td.used").inner_text()

    Price.objects.create(model="", input_per_million=Decimal("0.5"),
                         output_per_million=Decimal("1.5"))
    priced = make_batch(user, [chat_line(f"q-{i}", "hello", max_tokens=5) for i in range(3)],
                        tmp_path, settings=settings)
    wait_for(lambda: ended(priced.pk), timeout=60, message="the batch ended")
    for width, height in WIDTHS:
        page.set_viewport_size({"width": width, "height": height})
        assert MONEY.match(check_file(page, base, good))
        page.screenshot(path=str(ARTIFACTS / f"numbers-check-priced-{width}.png"),
                        full_page=True)
    for _ in at_each_width(page, f"{base}/batches/{priced.pk}/", "numbers-batch-priced"):
        assert MONEY.match(card(page, "Cost"))
    for _ in at_each_width(page, f"{base}/usage/", "numbers-usage-priced"):
        assert MONEY.fullmatch(page.locator("#usage-cost").inner_text())
    for _ in at_each_width(page, f"{base}/account/", "numbers-account-priced"):
        assert MONEY.fullmatch(page.locator("#cost-used").inner_text())
    context.close()


def test_usage_page_says_how_many_requests_in_all(live_server, user, chromium):
    """84 succeeded and 14 failed are 98 requests, and the card says which is which."""
    from django.utils import timezone

    from jobs.models import UsageRecord
    from jobs.services.ledger import add_to_days

    # As the ledger writes two shards' charges, one after the other: the rows and their
    # day's sums.
    for i, (ok, failed) in enumerate(((50, 4), (34, 10))):
        add_to_days([UsageRecord.objects.create(
            owner=user, batch_id=f"batch_r{i}", shard_id=f"shard_r{i}", model="echo-test",
            base_model="echo-test", endpoint="/v1/chat/completions", requests_succeeded=ok,
            requests_failed=failed, input_tokens=100, output_tokens=10,
            recorded_at=timezone.now())])
    context = chromium.new_context()
    page = context.new_page()
    sign_in(page, live_server.url)
    for _ in at_each_width(page, f"{live_server.url}/usage/", "numbers-usage-requests"):
        text = " ".join(page.locator("#usage-requests").inner_text().split())
        assert text == "98 84 succeeded, 14 failed (free)"
        headers = page.locator("#usage-table thead th").all_inner_texts()
        assert headers[2:4] == ["Succeeded", "Failed"]
    context.close()
