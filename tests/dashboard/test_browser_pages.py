"""The dashboard's pages in a real browser where their layout is the point: what a page
shows a batch that failed validation, the S3 fields only for users with a storage grant,
the charts' scales, the long model name, the status of a batch whose requests all failed,
file names, and the Usage page's filter row. Each page is looked at at a desktop's and a
phone's width; screenshots go to tests/artifacts/ (git-ignored)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from tests.dashboard import test_browser
from tests.dashboard.test_browser import ARTIFACTS, CHROMIUM, sign_in
from tests.factories import chat_lines, make_batch, make_file, run_batch

browser = test_browser.browser  # the same headless Chromium

pytestmark = [
    pytest.mark.browser,
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium"),
]

WIDTHS = ((1280, 900), (390, 844))


def pages(browser: Any, live_server: Any) -> Any:
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    sign_in(page, live_server.url)
    return context, page


def look(page: Any, url: str, name: str) -> dict[int, Any]:
    """`url` at each width, its screenshots taken; what each width's check returns is the
    caller's (a dict of width -> scroll width, for the sideways check)."""
    ARTIFACTS.mkdir(exist_ok=True)
    scrolled = {}
    for width, height in WIDTHS:
        page.set_viewport_size({"width": width, "height": height})
        page.goto(url)
        page.screenshot(path=str(ARTIFACTS / f"{name}-{width}.png"), full_page=True)
        scrolled[width] = page.evaluate("document.documentElement.scrollWidth")
    return scrolled


def bad_lines(n: int) -> list[dict]:
    """Lines validation refuses as file problems: no custom_id."""
    return [{"method": "POST", "url": "/v1/chat/completions",
             "body": {"model": "echo-test", "messages": [{"role": "user", "content": "x"}]}}
            for _ in range(n)]


def test_a_batch_that_failed_validation_shows_its_bad_lines(live_server, user, browser,
                                                            tmp_path, settings):
    """Its page lists the first lines validation refused (with a link to all of them),
    not number cards of a run that never happened."""
    from jobs.models import Batch

    batch = make_batch(user, [*chat_lines(3), *bad_lines(25)], tmp_path, settings=settings)
    assert batch.status == Batch.Status.FAILED and len(batch.errors) == 25
    context, page = pages(browser, live_server)
    url = f"{live_server.url}/batches/{batch.pk}/"
    scrolled = look(page, url, "batch-failed-validation")
    for width, height in WIDTHS:
        page.set_viewport_size({"width": width, "height": height})
        page.goto(url)
        table = page.locator("#bad-lines")
        assert table.locator("tbody tr").count() == 10
        first = table.locator("tbody tr").first.inner_text()
        assert first.split()[0] == "4" and "custom_id" in first
        everything = page.locator("#all-bad-lines")
        assert "all 25" in everything.inner_text()
        assert everything.get_attribute("href") == f"/batches/{batch.pk}/errors"
        # No cards of a run: nothing ran.
        assert page.locator("#live .stats").count() == 0
        assert scrolled[width] <= width
    context.close()


def test_storage_fields_only_for_users_with_a_grant(live_server, user, browser):
    """"Read an object in place" needs a read grant, "Deliver results to" a write grant:
    without one the field is not offered."""
    from jobs.models import StorageGrant

    context, page = pages(browser, live_server)
    url = f"{live_server.url}/batches/new"
    look(page, url, "new-batch-no-grant")
    assert page.locator("input[name=source]").count() == 0
    assert page.locator("input[name=output_prefix]").count() == 0
    assert "in place" not in page.inner_text("main")

    StorageGrant.objects.create(user=user, prefix="s3://data/alice/", read=True, write=False)
    page.goto(url)
    assert page.locator("input[name=source]").count() == 1
    assert page.locator("input[name=output_prefix]").count() == 0

    StorageGrant.objects.create(user=user, prefix="s3://data/results/", read=False, write=True)
    scrolled = look(page, url, "new-batch-grants")
    assert page.locator("input[name=source]").count() == 1
    assert page.locator("input[name=output_prefix]").count() == 1
    assert all(scrolled[width] <= width for width, _ in WIDTHS), scrolled
    context.close()


AXIS = """(selector) => {
    const chart = document.querySelector(selector);
    const svg = chart.querySelector('svg').getBoundingClientRect();
    const ticks = [...chart.querySelectorAll('.chart-y .tick')];
    return {title: chart.querySelector('.chart-y-title').textContent.trim(),
            ticks: ticks.map(t => t.textContent.trim()),
            grid: chart.querySelectorAll('svg .chart-grid').length,
            left: Math.max(...ticks.map(t => t.getBoundingClientRect().right)) <= svg.left + 1,
            top: ticks[0].getBoundingClientRect().top - svg.top,
            bottom: svg.bottom - ticks[ticks.length - 1].getBoundingClientRect().bottom};
}"""

ONE_LINE_NAME = """() => {
    const name = document.querySelector('#provenance .model-name');
    const card = name.closest('div').getBoundingClientRect();
    const box = name.getBoundingClientRect();
    return {lines: name.getClientRects().length, inside: box.right <= card.right + 0.5,
            text: name.textContent};
}"""


def test_throughput_chart_has_a_scale_and_the_model_name_fits(live_server, user, browser,
                                                                tmp_path, settings):
    """The batch page's throughput chart has a y axis (its unit and a scale from 0 to a
    round top, with grid lines), and the long name of the model that ran it stays on one
    line inside its card."""
    from jobs.models import Batch

    batch = run_batch(make_batch(user, chat_lines(40), tmp_path, shard_size=10,
                                 settings=settings))
    engine = {"engine": "vllm", "engine_version": "0.8.5", "dtype": "bfloat16",
              "model": "SmolLM2-135M-Instruct", "model_source": "/models/SmolLM2-135M-Instruct",
              "model_sha256": "9f2c" * 16, "parallelism": {}, "sampling_defaults": {},
              "batchweb_version": "1.4.0"}
    Batch.objects.filter(pk=batch.pk).update(
        provenance=[{"engine": engine, "workers": ["w1"], "adapters": []}])
    context, page = pages(browser, live_server)
    url = f"{live_server.url}/batches/{batch.pk}/"
    scrolled = look(page, url, "batch-chart-model")
    for width, height in WIDTHS:
        page.set_viewport_size({"width": width, "height": height})
        page.goto(url)
        axis = page.evaluate(AXIS, "#live .chart")
        assert axis["title"] == "requests / min"
        assert axis["ticks"][-1] == "0" and len(axis["ticks"]) == 3, axis
        top = float(axis["ticks"][0].replace(",", ""))
        assert top > 0 and axis["grid"] == 3, axis
        # The labels beside the plot, the top one at its top, 0 at its bottom.
        assert axis["left"] and abs(axis["top"]) < 12 and abs(axis["bottom"]) < 12, axis
        name = page.evaluate(ONE_LINE_NAME)
        assert name == {"lines": 1, "inside": True, "text": "SmolLM2-135M-Instruct"}, (
            width, name)
        assert scrolled[width] <= width
    context.close()


def test_a_batch_whose_requests_all_failed_does_not_say_completed_in_green(
        live_server, user, browser, tmp_path, settings):
    """Completed with no request succeeding: the badge says so, in the failure colour, on
    the batch page and in the list; one with some successes stays plainly completed."""
    all_failed = run_batch(make_batch(user, chat_lines(6), tmp_path, settings=settings),
                           fails=lambda custom_id: True)
    some_failed = run_batch(make_batch(user, chat_lines(6, "s"), tmp_path, settings=settings),
                            fails=lambda custom_id: custom_id.endswith("1"))
    assert all_failed.status == some_failed.status == "completed"
    context, page = pages(browser, live_server)
    url = f"{live_server.url}/batches/{all_failed.pk}/"
    scrolled = look(page, url, "batch-all-failed")
    badge = page.locator("#status")
    assert badge.inner_text() == "Completed, all failed"
    assert "st-failed" in badge.get_attribute("class").split()
    page.goto(f"{live_server.url}/batches/{some_failed.pk}/")
    assert page.locator("#status").inner_text() == "Completed"
    assert "st-completed" in page.locator("#status").get_attribute("class").split()
    look(page, f"{live_server.url}/", "batch-list-all-failed")
    row = page.locator(f"#row-{all_failed.pk} .badge").first
    assert row.inner_text() == "Completed, all failed"
    assert "st-failed" in row.get_attribute("class").split()
    assert all(scrolled[width] <= width for width, _ in WIDTHS), scrolled
    context.close()


WORDS_BROKEN = """() => [...document.querySelectorAll('.files .filename')].map(name => {
    // Each line box of the name: where it starts in the text. A line must start at the
    // beginning of the name or just after a separator, never inside a word.
    const text = name.textContent;
    const range = document.createRange();
    const starts = [];
    let top = null;
    const walker = document.createTreeWalker(name, NodeFilter.SHOW_TEXT);
    let offset = 0;
    for (let node = walker.nextNode(); node; node = walker.nextNode()) {
        for (let i = 0; i < node.length; i++) {
            range.setStart(node, i); range.setEnd(node, i + 1);
            const rect = range.getBoundingClientRect();
            if (rect.height && (top === null || rect.top > top + 2)) {
                starts.push(offset + i); top = rect.top; }
        }
        offset += node.length;
    }
    return [text, starts.filter(i => i > 0 && !'_-.'.includes(text[i - 1]))];
})"""


def test_file_names_wrap_between_their_parts(live_server, user, browser, tmp_path):
    """A long file name on the files page wraps after '_', '-' or '.', never mid-word."""
    make_file(user, chat_lines(2), tmp_path,
              name="batch_6f1c2a9e0b7d4c3a8e5f_output-2026-12-07.jsonl")
    make_file(user, chat_lines(2), tmp_path,
              name="customer_support_transcripts_quarterly_review_final_v2.jsonl")
    context, page = pages(browser, live_server)
    url = f"{live_server.url}/files/"
    scrolled = look(page, url, "files")
    for width, height in WIDTHS:
        page.set_viewport_size({"width": width, "height": height})
        page.goto(url)
        for text, inside in page.evaluate(WORDS_BROKEN):
            assert inside == [], (width, text, inside)
        assert scrolled[width] <= width, scrolled
    context.close()


def test_usage_page_filters_clear_of_the_cards_and_chart_with_a_scale(live_server, user,
                                                                       browser):
    """The Usage page's filter row ends above its summary cards, and its chart has a y
    axis: the unit (tokens, no price set) and a scale from 0."""
    from jobs.models import UsageRecord
    from jobs.services.ledger import add_to_days

    now = timezone.now()
    for days_ago, tokens in ((0, 900), (1, 2500), (3, 400)):
        UsageRecord.objects.create(owner=user, batch_id=f"batch_u{days_ago}",
                                   shard_id=f"shard_u{days_ago}", model="echo-test",
                                   base_model="echo-test", endpoint="/v1/chat/completions",
                                   requests_succeeded=5, input_tokens=tokens,
                                   output_tokens=tokens // 2,
                                   recorded_at=now - timedelta(days=days_ago))
    add_to_days(list(UsageRecord.objects.filter(owner=user)))  # as the ledger does
    context, page = pages(browser, live_server)
    url = f"{live_server.url}/usage/"
    scrolled = look(page, url, "usage")
    for width, height in WIDTHS:
        page.set_viewport_size({"width": width, "height": height})
        page.goto(url)
        filters = page.locator("#usage-filters").bounding_box()
        cards = page.locator("#usage-totals").bounding_box()
        assert filters["y"] + filters["height"] + 8 <= cards["y"], (width, filters, cards)
        axis = page.evaluate(AXIS, "#usage-chart")
        assert axis["title"] == "tokens a day" and axis["ticks"][-1] == "0", axis
        assert float(axis["ticks"][0].replace(",", "")) >= 3750, axis
        assert axis["left"] and abs(axis["top"]) < 12 and abs(axis["bottom"]) < 12, axis
        assert scrolled[width] <= width, scrolled
    context.close()



def test_usage_chart_scale_in_money(site, user):
    """Priced usage: the axis's unit is the currency a day, its ticks the amounts in it,
    down to the millionths a few requests cost."""
    from jobs.models import UsageRecord
    from jobs.services.ledger import add_to_days

    UsageRecord.objects.create(owner=user, batch_id="batch_p", shard_id="shard_p",
                               model="echo-test", base_model="echo-test",
                               endpoint="/v1/chat/completions", requests_succeeded=12,
                               input_tokens=36, output_tokens=48, cost_nanos=414_000)
    add_to_days(list(UsageRecord.objects.filter(owner=user)))
    page = site.get("/usage/").content.decode()
    axis = page[page.index('class="chart-y-title'):page.index("</svg>")]
    assert ">USD a day<" in axis
    ticks = [t.split("<")[0] for t in axis.split('<span class="tick">')[1:]]
    assert ticks == ["0.0005", "0.00025", "0"]
