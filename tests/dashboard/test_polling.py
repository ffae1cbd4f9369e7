"""Polling a running batch from the dashboard: the live block of the batch page answers
304 Not Modified while the batch is unchanged and is rendered once per version (then
served from the cache), never showing old counts after a progress write; the polling
interval is spread per page, and each answer carries the version the page needs to stretch
it while the batch does not change; a poll writes no session and reads few rows."""

from __future__ import annotations

import re
import types
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from django.db import connection
from django.middleware.csrf import _does_token_match
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from jobs.formats.checkpoint_record import Progress
from jobs.models import Batch, Shard
from jobs.services.progress import refresh_progress
from jobs.services.shards import finish_shard
from jobs.views import batches as views
from tests.factories import (
    HTMX,
    chat_lines,
    claimed_batch,
    heartbeat,
    make_batch,
    poll_of,
    run_batch,
)

pytestmark = pytest.mark.django_db


@pytest.fixture
def clock(monkeypatch: Any) -> list[float]:
    """The views' clock, fixed (moved by hand) so that the live block's refresh of its
    time-derived figures falls where the test says."""
    now = [1_000_000.0]
    monkeypatch.setattr(views, "time", types.SimpleNamespace(time=lambda: now[0]))
    return now


@pytest.fixture
def running(user: Any, tmp_path: Any, settings: Any) -> tuple[Batch, Shard]:
    return claimed_batch(user, tmp_path, settings)


def _live(site: Any, batch: Batch, etag: str | None = None, url: str | None = None) -> Any:
    extra = {"HTTP_IF_NONE_MATCH": etag} if etag else {}
    # A page's polls carry its jitter seed: without one, each answer would have a new one.
    url = url or reverse("batch_live", args=[batch.pk]) + "?seed=5eed"
    return site.get(url, **HTMX, **extra)


def _warm(site: Any, batch: Batch) -> Any:
    """A first poll (the test client then holds the CSRF cookie a browser would have)."""
    _live(site, batch)
    return _live(site, batch)


def _done(response: Any) -> str:
    return response.content.decode().split('id="done-count">', 1)[1].split("<", 1)[0]


# --- 304 and the cache ---


def test_unchanged_live_block_is_304_with_the_etag_and_no_body(site, running, clock):
    batch, _ = running
    first = _warm(site, batch)
    assert first.status_code == 200 and first["ETag"]
    assert "no-cache" in first["Cache-Control"]
    response = _live(site, batch, first["ETag"])
    assert response.status_code == 304
    assert response["ETag"] == first["ETag"]
    assert response.content == b""


def test_304_reads_no_more_than_the_batch(site, running, clock, django_assert_max_num_queries):
    batch, _ = running
    etag = _warm(site, batch)["ETag"]
    # The session, its user, the batch, the spot-check summary: no shard is read.
    with django_assert_max_num_queries(4):
        assert _live(site, batch, etag).status_code == 304


def test_every_progress_write_shows_the_new_counts(site, running, clock):
    batch, shard = running
    first = _warm(site, batch)
    assert _done(first) == "0"
    etag = first["ETag"]

    heartbeat(shard_id=shard.pk, attempt=shard.attempt,
              progress=Progress(completed=2, failed=1, input_tokens=10, output_tokens=6))
    response = _live(site, batch, etag)
    assert response.status_code == 200 and _done(response) == "3"
    # Without a validator (another tab): the cache holds the new version, not the old.
    assert _done(_live(site, batch)) == "3"
    etag = response["ETag"]
    assert _live(site, batch, etag).status_code == 304

    finish_shard(shard_id=shard.pk, attempt=shard.attempt, output_part="", error_part="",
                 progress=Progress(completed=4, failed=1, input_tokens=20, output_tokens=12))
    response = _live(site, batch, etag)
    assert response.status_code == 200 and _done(response) == "5"
    assert _done(_live(site, batch)) == "5"
    etag = response["ETag"]

    Shard.objects.filter(batch=batch, index=1).update(completed=3, input_tokens=15)
    refresh_progress(batch_id=batch.pk)
    response = _live(site, batch, etag)
    assert response.status_code == 200 and _done(response) == "8"
    assert _done(_live(site, batch)) == "8"


def test_same_version_is_served_from_the_cache(site, running, clock,
                                               django_assert_max_num_queries):
    batch, _ = running
    first = _warm(site, batch)
    with django_assert_max_num_queries(4):
        again = _live(site, batch)
    # The same block inside (the section's own polling attributes are each poll's).
    assert again.status_code == 200
    assert again.content.split(b">", 1)[1] == first.content.split(b">", 1)[1]


def test_time_derived_figures_refresh_within_a_minute(site, running, clock):
    batch, _ = running
    etag = _warm(site, batch)["ETag"]
    clock[0] += views.LIVE_STALE_SECONDS
    assert _live(site, batch, etag).status_code == 200


def test_a_status_change_is_a_full_answer_that_stops_polling(site, running, clock):
    batch, _ = running
    etag = _warm(site, batch)["ETag"]
    Batch.objects.filter(pk=batch.pk).update(status=Batch.Status.CANCELLING)
    response = _live(site, batch, etag)
    assert response.status_code == 200 and "Cancelling" in response.content.decode()
    Batch.objects.filter(pk=batch.pk).update(status=Batch.Status.CANCELLED)
    assert _live(site, batch, response["ETag"]).status_code == 286


def test_each_browser_gets_its_own_csrf_token(site, running, clock):
    """The cached block holds the cancel form's CSRF token: another browser of the same
    user must get one for its own cookie, not the first browser's."""
    batch, _ = running
    mine = _warm(site, batch)
    other = Client()
    other.force_login(batch.owner)
    _live(other, batch)
    theirs = _live(other, batch)
    assert mine["ETag"] != theirs["ETag"]
    for browser, response in ((site, mine), (other, theirs)):
        token = response.content.decode().split('name="csrfmiddlewaretoken" value="', 1)[1]
        assert _does_token_match(token.split('"', 1)[0], browser.cookies["csrftoken"].value)


# --- intervals ---


def test_interval_is_spread_per_page(site, running):
    batch, _ = running
    polls = [poll_of(site.get(reverse("batch_detail", args=[batch.pk])).content)
             for _ in range(12)]
    intervals = {every for _, every in polls}
    assert all(1.7 <= every <= 2.3 for every in intervals), intervals
    assert len(intervals) > 1, intervals  # pages do not all poll in step
    # The same poll gets the same answer (so its ETag holds): the spread is the page's own.
    url, _ = polls[0]
    again = [poll_of(_live(site, batch, url=url).content) for _ in range(2)]
    assert again[0] == again[1]


def _version(html: bytes) -> str:
    return html.decode().split('data-poll-version="', 1)[1].split('"', 1)[0]


@pytest.mark.parametrize("view", ["batch_detail", "batch_row"])
def test_the_polling_url_stays_and_the_version_shows_each_change(site, running, view):
    # The page stretches the period while the version stays (static/js/app.js, tried in a
    # browser in test_browser.py); the URL stays the page's own so that the browser
    # revalidates its copy.
    batch, shard = running
    page = site.get(reverse("batch_detail", args=[batch.pk]) if view == "batch_detail"
                    else reverse("batch_list"))
    url, every = poll_of(page.content)
    assert parse_qs(urlsplit(url).query).keys() == {"seed"}
    assert 'data-poll-max="30"' in page.content.decode()
    versions = {_version(page.content)}
    for _ in range(3):
        answer = site.get(url, **HTMX)
        assert poll_of(answer.content) == (url, every)
        versions.add(_version(answer.content))
    assert len(versions) == 1

    heartbeat(shard_id=shard.pk, attempt=shard.attempt, progress=Progress(completed=1))
    answer = site.get(url, **HTMX)
    assert poll_of(answer.content) == (url, every)
    assert _version(answer.content) not in versions


def test_a_bad_seed_gets_a_new_one(site, running):
    batch, _ = running
    base = reverse("batch_live", args=[batch.pk])
    for query in ("seed=<script>", "seed=" + "a" * 17, "seed=", "every=x&v=0"):
        url, every = poll_of(site.get(f"{base}?{query}", **HTMX).content)
        assert 1.7 <= every <= 2.3 and "<" not in url, (query, url)
        assert re.fullmatch(r"seed=[0-9a-f]{8}", urlsplit(url).query), (query, url)


# --- a light poll ---


def test_a_poll_writes_no_session(site, running):
    batch, _ = running
    _warm(site, batch)
    with CaptureQueriesContext(connection) as queries:
        response = _live(site, batch)
        row = site.get(reverse("batch_row", args=[batch.pk]), **HTMX)
    assert response.status_code == row.status_code == 200
    assert "sessionid" not in response.cookies and "sessionid" not in row.cookies
    writes = [q["sql"] for q in queries if not q["sql"].lstrip().upper().startswith("SELECT")]
    assert writes == [], writes


# --- the list: ended rows rendered once ---


def _row_html(page: bytes, batch: Batch) -> str:
    text = page.decode()
    start = text.index(f'<tr id="row-{batch.pk}"')
    return text[start:text.index("</tr>", start)]


def test_an_ended_row_is_the_same_from_the_cache(site, user, tmp_path, settings):
    batch = run_batch(make_batch(user, chat_lines(4), tmp_path, shard_size=2, settings=settings))
    first = _row_html(site.get(reverse("batch_list"), **HTMX).content, batch)
    assert "Completed" in first and "4 / 4" in first and "hx-get" not in first
    views._ENDED_ROWS.clear()
    # Rendered afresh, then (the second time) from the cache: the same row.
    assert _row_html(site.get(reverse("batch_list"), **HTMX).content, batch) == first
    assert _row_html(site.get(reverse("batch_list"), **HTMX).content, batch) == first


def test_a_row_shows_every_change_of_an_ended_batch(site, user, tmp_path, settings):
    running, shard = claimed_batch(user, tmp_path, settings)
    row = _row_html(site.get(reverse("batch_list"), **HTMX).content, running)
    assert "hx-get" in row and "st-in_progress" in row
    # The batch ends: its row stops polling and shows the end.
    Batch.objects.filter(pk=running.pk).update(status=Batch.Status.CANCELLED)
    row = _row_html(site.get(reverse("batch_list"), **HTMX).content, running)
    assert "hx-get" not in row and "st-cancelled" in row
    # Anything the row shows, changed on the ended batch, shows.
    Batch.objects.filter(pk=running.pk).update(model="another-model", metadata={"k": "v2"})
    row = _row_html(site.get(reverse("batch_list"), **HTMX).content, running)
    assert "another-model" in row and "k=v2" in row
    Shard.objects.filter(batch=running, index=0).update(completed=3)
    refresh_progress(batch_id=running.pk)
    assert "3 / 10" in _row_html(site.get(reverse("batch_list"), **HTMX).content, running)
