"""The dashboard in a real browser: headless Chromium (Debian's package, driven by
Playwright's Python API) against a live server and a real worker process (echo engine).

Screenshots of the batch page go to tests/artifacts/ (git-ignored) for people to look at.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from jobs.formats.checkpoint_record import Progress
from tests.factories import (
    chat_line,
    chat_lines,
    claimed_batch,
    heartbeat,
    jsonl,
    make_batch,
    run_batch,
    run_shard,
    shared_prefix_lines,
    wait_for,
)

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]

pytestmark = [
    pytest.mark.browser,
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(not CHROMIUM.exists(),
                       reason="needs Debian's chromium at /usr/bin/chromium "
                              "(apt-get install -y chromium)"),
]


@pytest.fixture
def browser(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    from django.db import connection
    from playwright.sync_api import sync_playwright

    # A test reads and writes the database while Playwright's event loop runs in this
    # thread, which Django would otherwise take for async code.
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            # Those queries went through a connection of the loop's context, which
            # Django's teardown does not see: left open, the test database could not be
            # dropped at the end.
            connection.close()
            chromium.close()


def sign_in(page: Any, base: str) -> None:
    page.goto(base + "/accounts/login/")
    page.fill("input[name=username]", "alice")
    page.fill("input[name=password]", "pw-alice-123")
    page.click("button[type=submit]")
    page.wait_for_url(base + "/")


def test_upload_watch_inspect_download_rerun(live_server, user, workers, browser, tmp_path):
    ARTIFACTS.mkdir(exist_ok=True)
    # Slow enough to watch: 40 requests, two at a time, 0.2 s each, in shards of 5.
    workers.start(env={"BATCHWEB_ECHO_SECONDS": "0.2", "BATCHWEB_ECHO_MAX_IN_FLIGHT": "2",
                       "BATCHWEB_SHARD_SIZE": "5"})
    good = [chat_line(f"req-{i}", f"hello number {i}", max_tokens=5) for i in range(39)]
    # Too long for the echo model's context: this request fails at run time.
    good.append(chat_line("too-long", "word " * 3000, max_tokens=10))
    bad_file = tmp_path / "bad.jsonl"
    bad_file.write_bytes(jsonl(good[:3] + ['{"custom_id": "broken", "method": "POST"'] +
                               good[3:]))
    good_file = tmp_path / "good.jsonl"
    good_file.write_bytes(jsonl(good))

    base = live_server.url
    context = browser.new_context(viewport={"width": 1280, "height": 900},
                                  accept_downloads=True)
    page = context.new_page()
    page.on("dialog", lambda dialog: dialog.accept())
    sign_in(page, base)

    # "Check file" says what the batch will cost, and creates nothing.
    page.click("text=New batch")
    page.set_input_files("input[name=upload]", str(good_file))
    page.click("button[value=check]")
    preflight = page.locator("#preflight")
    preflight.wait_for()
    text = preflight.inner_text()
    assert "Requests\n40" in text and "Output tokens (ceiling)" in text
    page.screenshot(path=str(ARTIFACTS / "new-batch-preflight.png"), full_page=True)
    assert page.url.endswith("/batches/new")

    # "Create batch" with a file with one bad line: the line's problem is shown, nothing
    # is created.
    page.goto(f"{base}/batches/new")
    page.set_input_files("input[name=upload]", str(bad_file))
    page.click("#submit-batch")
    problems = page.locator("#problems")
    problems.wait_for()
    assert "1 line to fix" in problems.inner_text()
    assert re.search(r"4\s+invalid_json_line", problems.inner_text())
    page.screenshot(path=str(ARTIFACTS / "new-batch-problems.png"), full_page=True)
    assert page.url.endswith("/batches/new")

    # Fixed: one click on "Create batch" creates it and opens its page.
    page.set_input_files("input[name=upload]", str(good_file))
    page.click("#submit-batch")
    page.wait_for_url(re.compile(r".*/batches/batch_\w+/$"))
    batch_url = page.url
    # Marks this document: if the page reloaded, the mark would be gone.
    page.evaluate("window.__notReloaded = true")

    # Watch the progress move without reloading.
    seen: list[int] = []
    shot_running = False
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        status = page.locator("#status").inner_text().strip()
        done = int(page.locator("#done-count").inner_text().replace(",", ""))
        if not seen or seen[-1] != done:
            seen.append(done)
        # Any count short of the end: the block polls every 2 s, and the batch's 4 s of
        # work may show only one such count on a busy machine.
        if not shot_running and 0 < done < 40:
            page.screenshot(path=str(ARTIFACTS / "batch-running.png"), full_page=True)
            shot_running = True
        if status == "Completed":
            break
        time.sleep(0.25)
    assert status == "Completed", seen
    assert page.evaluate("window.__notReloaded") is True
    assert any(0 < v < 40 for v in seen), f"no intermediate progress seen: {seen}"
    assert seen[-1] == 40 and seen == sorted(seen)
    assert shot_running
    page.locator("#download-output").wait_for()
    page.screenshot(path=str(ARTIFACTS / "batch-completed.png"), full_page=True)
    phone = context.new_page()
    phone.set_viewport_size({"width": 390, "height": 844})
    phone.goto(batch_url)
    phone.screenshot(path=str(ARTIFACTS / "batch-completed-phone.png"), full_page=True)
    phone.close()

    # Download the output and check it.
    with page.expect_download() as info:
        page.click("#download-output")
    download = info.value
    assert re.fullmatch(r"batch_\w+_output\.jsonl", download.suggested_filename)
    rows = [json.loads(line) for line in Path(download.path()).read_text().splitlines()]
    assert sorted(r["custom_id"] for r in rows) == sorted(f"req-{i}" for i in range(39))
    first = next(r for r in rows if r["custom_id"] == "req-3")
    assert first["response"]["body"]["choices"][0]["message"]["content"] == \
        "echo: hello number 3"

    # Errors: the count by code, the failed request with its input, search by custom_id.
    page.click("nav.tabs >> text=Errors")
    page.wait_for_url(re.compile(r".*/errors$"))
    assert "http_400" in page.locator(".code-counts").inner_text()
    errors = page.locator("#error-list")
    assert "too-long" in errors.inner_text()
    assert "maximum context length" in errors.inner_text()
    page.screenshot(path=str(ARTIFACTS / "batch-errors.png"), full_page=True)

    page.click("nav.tabs >> text=Results")
    page.fill("#search-result-list", "req-17")
    page.click("form.search button")
    # A function, not an expression: Playwright evaluates an expression with eval, which
    # the pages' Content-Security-Policy refuses.
    page.wait_for_function(
        "() => document.querySelectorAll('#result-list article').length === 1")
    found = page.locator("#result-list").inner_text()
    assert "req-17" in found and "hello number 17" in found and "echo: hello number 17" in found
    assert page.evaluate("location.search").startswith("?q=req-17")

    # The failed request's prompt is over the context: a rerun would fail the same way, so
    # none is offered; its line is, to fix.
    page.goto(batch_url)
    assert page.locator("#rerun").count() == 0
    with page.expect_download() as info:
        page.click("#download-to-fix")
    to_fix = Path(info.value.path()).read_bytes().splitlines()
    assert [json.loads(line)["custom_id"] for line in to_fix] == ["too-long"]
    page.goto(base + "/")
    page.screenshot(path=str(ARTIFACTS / "batch-list.png"), full_page=True)
    context.close()


def test_rerun_takes_what_may_succeed_and_offers_the_rest_to_fix(live_server, user, browser,
                                                                 tmp_path, settings):
    """An expired batch with two requests the service failed, one refused as invalid and
    four never run: the page offers to rerun the six that may succeed and the invalid one's
    line as a download; the rerun's page says what it left out."""
    from tests.api.test_rerun import expected, stopped_batch

    ARTIFACTS.mkdir(exist_ok=True)
    batch = stopped_batch(user, tmp_path, settings)
    base = live_server.url
    context = browser.new_context(viewport={"width": 1280, "height": 900},
                                  accept_downloads=True)
    page = context.new_page()
    page.on("dialog", lambda dialog: dialog.accept())
    sign_in(page, base)
    batch_url = f"{base}/batches/{batch.pk}/"
    page.goto(batch_url)
    assert page.locator("#rerun").inner_text() == "Rerun failed requests (2)"
    assert page.locator("#rerun-all").inner_text() == "Rerun failed and expired requests (6)"
    assert page.locator("#download-to-fix").inner_text() == "Lines to fix (1)"
    assert "1 failed request was refused as invalid" in page.locator("#to-fix-note").inner_text()
    page.screenshot(path=str(ARTIFACTS / "batch-rerun-offers.png"), full_page=True)
    with page.expect_download() as info:
        page.click("#download-to-fix")
    assert info.value.suggested_filename == f"{batch.pk}_to_fix.jsonl"
    assert Path(info.value.path()).read_bytes() == expected(2)

    page.click("#rerun-all")
    page.wait_for_url(lambda url: url != batch_url and "/batches/batch_" in url)
    assert "Left out: 1 invalid request" in page.locator(".messages").inner_text()
    left_out = page.locator("#left-out")
    assert left_out.inner_text() == ("1 invalid request of the original left out of this "
                                     "rerun: their lines to fix.")
    rerun_url = page.url
    page.screenshot(path=str(ARTIFACTS / "batch-rerun-left-out.png"), full_page=True)
    with page.expect_download() as info:
        left_out.locator("a").click()
    assert Path(info.value.path()).read_bytes() == expected(2)
    phone = context.new_page()
    phone.set_viewport_size({"width": 390, "height": 844})
    for url, name in ((batch_url, "batch-rerun-offers-phone.png"),
                      (rerun_url, "batch-rerun-left-out-phone.png")):
        phone.goto(url)
        phone.screenshot(path=str(ARTIFACTS / name), full_page=True)
    context.close()


def test_polls_come_further_apart_while_the_batch_is_unchanged(live_server, user, browser,
                                                               tmp_path, settings):
    """The live block polls on every tick (about 2 s) while the batch changes, and 4, 8, 16,
    then 30 s apart while it does not, always at the same URL, which the browser revalidates
    with the ETag of the copy it shows. The page's clock is Playwright's, moved by hand."""
    batch, shard = claimed_batch(user, tmp_path, settings)
    context = browser.new_context()
    page = context.new_page()
    sign_in(page, live_server.url)
    polls: list[Any] = []
    page.on("request", lambda request: "/live" in request.url and polls.append(request))
    page.clock.install()
    page.goto(f"{live_server.url}/batches/{batch.pk}/")
    page.evaluate("""() => {
        window.pollTimes = []; window.polling = 0;
        document.body.addEventListener("htmx:beforeRequest", () => {
            window.pollTimes.push(Date.now() / 1000); window.polling++; });
        document.body.addEventListener("htmx:afterRequest", () => { window.polling--; });
    }""")
    page.clock.pause_at(page.evaluate("Date.now()") + 100)

    def run_for(seconds: float) -> list[float]:
        # A quarter of a second at a time, letting each poll's answer land before the
        # clock moves on (the network is not faked).
        for _ in range(round(seconds * 4)):
            page.clock.run_for(250)
            deadline = time.monotonic() + 10
            while page.evaluate("window.polling") and time.monotonic() < deadline:
                time.sleep(0.01)
        return page.evaluate("window.pollTimes")

    times = run_for(85)
    tick = float(page.locator("#live").get_attribute("hx-trigger").split()[1].rstrip("s"))
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    # Ticks come every `tick` s: a poll on the 1st, 2nd, 4th and 8th, then about 30 s apart.
    assert [round(gap / tick) for gap in gaps[:4]] == [1, 2, 4, 8], (tick, gaps)
    # Then 16 ticks or about 30 s apart, whichever comes first: 27-32 s for ticks of
    # 1.7-2.3 s (the page's spread period).
    assert gaps[4:] and all(26 < gap < 30 + tick for gap in gaps[4:]), (tick, gaps)
    assert len(times) <= 7, times  # against ~40 polls without the stretching

    heartbeat(shard_id=shard.pk, attempt=shard.attempt, progress=Progress(completed=3))
    seen = len(times)
    times = run_for(45)
    assert page.locator("#done-count").inner_text() == "3"
    # From the poll that saw the change, every tick again, then stretching once more.
    gaps = [b - a for a, b in zip(times[seen:], times[seen + 1:], strict=False)]
    assert [round(gap / tick) for gap in gaps[:3]] == [1, 1, 2], (tick, gaps)

    assert {request.url for request in polls} == {live_server.url +
                                                 page.locator("#live").get_attribute("hx-get")}
    revalidated = [request.all_headers().get("if-none-match") for request in polls[1:]]
    assert all(revalidated), revalidated
    context.close()


def test_phone_layout_and_no_javascript(live_server, user, browser):
    """Pages fit a phone, and a browser without JavaScript still signs in and navigates."""
    base = live_server.url
    context = browser.new_context(viewport={"width": 390, "height": 844},
                                  java_script_enabled=False)
    page = context.new_page()
    sign_in(page, base)
    for path in ("/", "/batches/new", "/files/", "/keys/"):
        page.goto(base + path)
        width = page.evaluate("document.documentElement.scrollWidth")
        assert width <= 390, (path, width)
    page.goto(base + "/keys/")
    page.fill("input[name=name]", "phone")
    page.click("text=Create key")
    assert page.locator("#new-key").inner_text().startswith("sk-bw-")
    context.close()


def test_usage_page_chart_filters_and_csv(live_server, user, workers, browser, tmp_path):
    """A batch run by a real worker, then the Usage page: its chart has a bar for today,
    the table and the totals show what the ledger charged, the period and key filters and
    the CSV export work, and the batch page shows the same cost."""
    import csv
    import io

    from jobs.models import Batch, Price, Quota, UsageRecord
    from jobs.services.batches import create_batch
    from jobs.services.files import create_input_file
    from jobs.services.pricing import format_cost

    ARTIFACTS.mkdir(exist_ok=True)
    Price.objects.create(model="echo-test", input_per_million=3, output_per_million=15)
    Quota.objects.create(user=user, cost_per_month=5)
    path = tmp_path / "in.jsonl"
    path.write_bytes(jsonl([chat_line(f"u{i}", f"usage question {i}", max_tokens=6)
                            for i in range(12)]))
    file = create_input_file(owner=user, path=path, filename="in.jsonl", purpose="batch")
    batch = create_batch(owner=user, input_file_id=file.pk, endpoint="/v1/chat/completions",
                         completion_window="24h")
    workers.start(env={"BATCHWEB_SHARD_SIZE": "4"})
    deadline = time.monotonic() + 60
    while Batch.objects.get(pk=batch.pk).status != "completed":
        assert time.monotonic() < deadline, "the batch did not complete"
        time.sleep(0.3)
    charged = sum(UsageRecord.objects.filter(batch_id=batch.pk).values_list(
        "cost_nanos", flat=True))
    assert UsageRecord.objects.filter(batch_id=batch.pk).count() == 3 and charged > 0

    base = live_server.url
    context = browser.new_context(viewport={"width": 1280, "height": 900},
                                  accept_downloads=True)
    page = context.new_page()
    sign_in(page, base)
    page.click("nav >> text=Usage")
    page.wait_for_url(base + "/usage/")
    assert page.locator("#usage-chart svg rect").count() == 1
    assert page.text_content("#usage-cost").strip() == format_cost(charged)
    assert "echo-test" in page.text_content("#usage-chart .chart-legend")
    assert page.locator("#usage-table tbody tr").count() == 1
    assert "12" in page.text_content("#usage-table tbody tr")
    left = format_cost(5 * 10**9 - charged)
    assert left in page.text_content("#budget-left")
    page.screenshot(path=str(ARTIFACTS / "usage.png"), full_page=True)

    with page.expect_download() as download_info:
        page.click("#usage-csv")
    rows = list(csv.DictReader(io.StringIO(Path(download_info.value.path()).read_text())))
    assert [(r["model"], r["requests_succeeded"]) for r in rows] == [("echo-test", "12")]

    page.select_option("#usage-filters select[name=days]", "7")
    page.click("#usage-filters button[type=submit]")
    page.wait_for_url(re.compile(r".*days=7.*"))
    assert page.locator("#usage-chart svg rect").count() == 1
    # An API key filter with a key that ran nothing: no usage.
    from jobs.services.keys import create_api_key
    create_api_key(owner=user, name="unused")
    page.goto(base + "/usage/")
    page.select_option("#usage-filters select[name=key]", label="unused")
    page.click("#usage-filters button[type=submit]")
    page.wait_for_url(re.compile(r".*key=.*"))
    assert "No usage in this period" in page.text_content("#usage-chart")

    page.goto(f"{base}/batches/{batch.pk}/")
    assert format_cost(charged) in page.text_content("#batch-cost")
    context.close()


def _page_batches(user: Any, tmp_path: Path, settings: Any) -> dict[str, Any]:
    """Batches in the states the batch page shows most: completed with some failures,
    running with retries, and completed with a full run report (prefix plan, cache hits,
    cost ceiling, the engine that ran it, an eval)."""
    from jobs.models import Batch, Shard

    failed = run_batch(make_batch(user, chat_lines(60), tmp_path, shard_size=20,
                                  settings=settings),
                       fails=lambda custom_id: custom_id.endswith("7"))

    running = make_batch(user, chat_lines(60), tmp_path, shard_size=20, settings=settings)
    first = Shard.objects.get(batch=running, index=0)
    run_shard(first)
    Shard.objects.filter(pk=first.pk).update(attempt=2, failures=1, recomputed=20,
                                             json_retries=2)

    report = make_batch(user, shared_prefix_lines(48, groups=4), tmp_path, shard_size=12,
                        settings=settings)
    Shard.objects.filter(batch=report).update(cached_tokens=30, cacheable_tokens=45)
    report = run_batch(report)
    engine = {"engine": "vllm", "engine_version": "0.8.5", "dtype": "bfloat16",
              "model": "echo-test", "model_source": "/models/echo-test",
              "model_sha256": "9f2c" * 16, "parallelism": {"tensor_parallel": 1},
              "sampling_defaults": {"temperature": 0.7}, "batchweb_version": "1.4.0"}
    Batch.objects.filter(pk=report.pk).update(
        dedup_saved=3, cost_ceiling_nanos=12_345_000,
        provenance=[{"engine": engine, "workers": ["gpu-1", "gpu-2"], "adapters": []}],
        evaluations=[{"eval_set": "smoke", "score": 0.95, "status": "scored",
                      "drifted": False},
                     {"eval_set": "regressions", "score": 0.7, "status": "scored",
                      "drifted": True}])
    return {"failed": failed, "running": running, "report": report}


CARD_HEIGHTS = """(label) => {
    const card = [...document.querySelectorAll('#live .stats > div')]
        .find(div => div.querySelector('dt').textContent.trim() === label);
    const style = getComputedStyle(card);
    const inner = [...card.children].reduce((sum, child) => {
        const s = getComputedStyle(child);
        return sum + child.getBoundingClientRect().height + parseFloat(s.marginTop)
            + parseFloat(s.marginBottom); }, 0);
    const frame = parseFloat(style.paddingTop) + parseFloat(style.paddingBottom)
        + parseFloat(style.borderTopWidth) + parseFloat(style.borderBottomWidth);
    return [card.getBoundingClientRect().height, inner + frame];
}"""

ONE_LINE = """() => [...document.querySelectorAll('#live .stats dd .note')]
    .filter(note => note.getClientRects().length > 1
                    || note.getBoundingClientRect().height
                       > 1.6 * parseFloat(getComputedStyle(note).lineHeight))
    .map(note => note.textContent.trim())"""


def test_batch_page_cards_fit_their_numbers(live_server, user, browser, tmp_path, settings):
    """The batch page's number cards are as tall as their number and its one-line note,
    not stretched to the run report beside them, at a desktop's and a phone's width; the
    notes' detail is on hover (title), and nothing scrolls sideways on the phone."""
    ARTIFACTS.mkdir(exist_ok=True)
    batches = _page_batches(user, tmp_path, settings)
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    sign_in(page, live_server.url)
    wrong: list[tuple] = []  # every page looked at (and its screenshot taken) first
    for width in (1280, 390):
        page.set_viewport_size({"width": width, "height": 900 if width > 400 else 844})
        for name, batch in batches.items():
            page.goto(f"{live_server.url}/batches/{batch.pk}/")
            page.screenshot(path=str(ARTIFACTS / f"batch-page-{name}-{width}.png"),
                            full_page=True)
            for label in ("Completed", "Failed", "Remaining"):
                height, content = page.evaluate(CARD_HEIGHTS, label)
                if height > content + 2:
                    wrong.append((name, width, label, height, content))
            if notes := page.evaluate(ONE_LINE):
                wrong.append((name, width, "notes on more than one line", notes))
            if (scrolled := page.evaluate("document.documentElement.scrollWidth")) > width:
                wrong.append((name, width, "scrolls sideways", scrolled))
    assert wrong == []
    page.goto(f"{live_server.url}/batches/{batches['running'].pk}/")
    retry = page.locator("#retry-rate")
    assert "1 failed of 2 shard runs" in retry.locator("[title]").first.get_attribute("title")
    context.close()


def test_batch_page_eta_is_the_plans_projection(live_server, user, browser, tmp_path,
                                                settings):
    """The batch page's and list's ETA is the capacity plan's projection, the figure the API
    gives as `expected_completion_at`: for a batch no worker serves, how long after a worker
    starts (never a moment already past); for a running one, the same moment."""
    from datetime import datetime, timedelta

    from django.utils import timezone

    from jobs.capacity import fleet
    from jobs.lib import queues
    from jobs.models import Batch
    from jobs.services import deadlines
    from jobs.templatetags.dashboard import duration

    ARTIFACTS.mkdir(exist_ok=True)
    fleet.report_cold_start(queues.connection(), "echo-test", 90.0)
    batch = make_batch(user, chat_lines(50), tmp_path, shard_size=10, settings=settings)
    deadlines.refresh()
    row = Batch.objects.get(pk=batch.pk)
    waits = duration((row.expected_completion_at - row.planned_at).total_seconds())
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    sign_in(page, live_server.url)
    for width in (1280, 390):
        page.set_viewport_size({"width": width, "height": 900 if width > 400 else 844})
        time.sleep(1.1)  # read later than planned: the wait is the same, the end moved on
        page.goto(f"{live_server.url}/batches/{batch.pk}/")
        assert page.locator("#eta").inner_text() == f"ETA {waits} if a worker starts now"
        expected = page.locator("#expected").inner_text()
        assert expected == (f"expected in {waits}, counting the start of a worker, which is "
                            "asked for (none of its model runs now)"), expected
        page.screenshot(path=str(ARTIFACTS / f"batch-page-waiting-{width}.png"),
                        full_page=True)
        page.goto(f"{live_server.url}/")
        assert page.locator(f"#row-{batch.pk} td.eta").inner_text() == waits
        assert page.locator(f"#row-{batch.pk} .waiting").inner_text() == "waits for a worker"
        page.screenshot(path=str(ARTIFACTS / f"batch-list-waiting-{width}.png"), full_page=True)
    # A worker serves it and 8 of 50 are answered, at its own pace since: the page's ETA
    # is the moment the API gives.
    fleet.report_rate(queues.connection(), "echo-test", fleet.WorkerRate(
        name="w0", output_tokens_per_second=100, stamp=time.time()), 5)
    Batch.objects.filter(pk=batch.pk).update(
        completed=8, pace_at=timezone.now() - timedelta(seconds=30), pace_answered=2)
    deadlines.refresh()
    shown = Batch.objects.get(pk=batch.pk).to_openai()
    assert shown["waits_for"] is None and shown["expected_completion_at"] > time.time()
    page.set_viewport_size({"width": 1280, "height": 900})
    page.goto(f"{live_server.url}/batches/{batch.pk}/")
    moment = page.locator("#eta time").get_attribute("datetime")
    assert datetime.fromisoformat(moment).timestamp() == shown["expected_completion_at"]
    assert page.locator("#expected time").get_attribute("datetime") == moment
    page.screenshot(path=str(ARTIFACTS / "batch-page-projected-1280.png"), full_page=True)
    context.close()


def test_queue_health_shows_a_busy_worker_its_shard_and_its_speed(
        live_server, user, workers, browser, tmp_path, settings, django_user_model):
    """A worker whose RQ job has handed its shard to the engine (RQ calls it idle, with no
    current job) is busy with that shard; its tokens per second are shown, and the At-risk
    cell says how many batches are at risk."""
    from rq import Worker

    from jobs.capacity import fleet
    from jobs.lib import queues
    from jobs.models import Shard
    from jobs.queries import queue_health

    ARTIFACTS.mkdir(exist_ok=True)
    django_user_model.objects.create_superuser("root", "root@example.com", "pw-root-123")
    # One shard of 6 requests, all in the engine at once, each taking 4 s.
    workers.start(env={"BATCHWEB_ECHO_SECONDS": "4", "BATCHWEB_ECHO_MAX_IN_FLIGHT": "16",
                       "BATCHWEB_HEARTBEAT_SECONDS": "1"})
    wait_for(lambda: Worker.count(connection=queues.connection()) == 1, timeout=60,
             message="the worker to register")
    batch = make_batch(user, chat_lines(6), tmp_path, settings=settings)

    def handed_over():
        shard = Shard.objects.filter(batch=batch, status=Shard.Status.RUNNING).first()
        (rq_worker,) = Worker.all(connection=queues.connection())
        return shard and rq_worker.get_state() == "idle" and shard

    shard = wait_for(handed_over, timeout=30, every=0.1, message="a shard in the engine")
    echo = next(m for m in queue_health.queue_health().models if m.model == "echo-test")
    (info,) = echo.workers
    assert (info.status, info.job, info.shards_held) == ("busy", shard.pk, 1)

    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    page.goto(live_server.url + "/admin/login/")
    page.fill("input[name=username]", "root")
    page.fill("input[name=password]", "pw-root-123")
    page.click("input[type=submit]")
    page.goto(live_server.url + "/admin/jobs/shard/health/")
    model = page.locator("#model-echo-test")
    assert model.locator(".model-worker .worker-state").inner_text() == "busy"
    assert model.locator(".model-worker .worker-job").inner_text() == shard.pk
    assert page.locator("#hosts tr.worker .worker-state").inner_text() == "busy"
    assert page.locator("#hosts tr.worker .worker-job").inner_text() == shard.pk
    assert model.locator(".at-risk-count").inner_text().strip() == "0"
    assert model.locator(".projected-on").inner_text() == "1 worker alive"
    # Its speed once it has answered: what its presence thread reports.
    wait_for(lambda: Shard.objects.get(pk=shard.pk).status == Shard.Status.DONE, timeout=30,
             message="the shard to finish")
    wait_for(lambda: any(r.output_tokens_per_second > 0 for r in fleet.worker_rates(
        queues.connection(), "echo-test", max_age=30)), timeout=30, message="a measured rate")
    for width in (1280, 390):
        page.set_viewport_size({"width": width, "height": 900 if width > 400 else 844})
        page.goto(live_server.url + "/admin/jobs/shard/health/")
        page.screenshot(path=str(ARTIFACTS / f"queue-health-{width}.png"), full_page=True)
    shown = model.locator(".model-worker .worker-rate").inner_text()
    measured = re.fullmatch(r"([\d.]+) / ([\d.]+), (\d+)%", shown)
    assert measured and float(measured[2]) > 0, shown
    context.close()
