"""Polls of an unchanged batch answered before Django (jobs.http.polls): the remembered answer is
Django's own, byte for byte, and it is never given once anything it shows has changed or
the client may no longer see the batch."""

from __future__ import annotations

import time
import types
from datetime import timedelta
from http.cookies import SimpleCookie
from typing import Any

import pytest
from django.contrib.sessions.models import Session
from django.core.handlers.wsgi import WSGIHandler
from django.db import connection

from batchweb.wsgi import application
from jobs.formats.checkpoint_record import Progress
from jobs.http import polls, web
from jobs.lib.compiled import Compiled
from jobs.models import Batch, SpotCheck
from jobs.queries import queue_health
from jobs.services import batches
from jobs.services.keys import revoke_api_key
from jobs.services.stopping import cancel_batch
from jobs.views import batches as views
from tests.factories import claimed_batch, connection_kept, heartbeat, wsgi_call

pytestmark = pytest.mark.django_db


def _stop_the_clock(monkeypatch: Any, now: list[float]) -> None:
    """time.monotonic() as `now[0]`, for the memo and for the views' `remember`."""
    clock = types.SimpleNamespace(monotonic=lambda: now[0])
    monkeypatch.setattr(polls, "time", clock)


@pytest.fixture(autouse=True)
def memo() -> Any:
    application.polls.answers.clear()
    application.polls.shapes.clear()
    application.polls.sizes.clear()
    application.polls.bytes = 0
    return application.polls


@pytest.fixture
def running(user: Any, tmp_path: Any, settings: Any) -> Any:
    return claimed_batch(user, tmp_path, settings)


def _poll(path: str, headers: dict[str, str], memo: Any) -> tuple[tuple, bool]:
    """The answer, and whether it was the remembered one."""
    hits = memo.hits
    answer = wsgi_call(application, "GET", path, headers)
    return answer, memo.hits > hits


def _environ(path: str, auth: dict[str, str]) -> dict[str, Any]:
    """What a server hands the memo for an API poll, for calling it directly."""
    return {"REQUEST_METHOD": "GET", "PATH_INFO": path, "HTTP_HOST": "testserver",
            "wsgi.url_scheme": "http", "HTTP_AUTHORIZATION": auth["Authorization"]}


# --- the API ---


def test_a_repeated_poll_is_djangos_answer_byte_for_byte(running, api_key, memo):
    batch, _ = running
    auth = {"Authorization": f"Bearer {api_key}"}
    path = f"/v1/batches/{batch.pk}"
    first, remembered = _poll(path, auth, memo)
    assert first[0].startswith("200") and not remembered
    again, remembered = _poll(path, auth, memo)
    assert remembered and again == first
    # Exactly what the whole of Django's chain answers.
    assert again == wsgi_call(WSGIHandler(), "GET", path, auth)
    # A server that adds a header to the answer it is handed adds it to that answer only.
    with connection_kept():
        memo.answer(_environ(path, auth))[1].append(("Server-Timing", "app;dur=1"))
    assert _poll(path, auth, memo) == (first, True)

    # Revalidating: Django's 304 first, then the same 304 remembered.
    conditional = {**auth, "If-None-Match": first[1]["ETag"]}
    not_modified, remembered = _poll(path, conditional, memo)
    assert not_modified[0].startswith("304") and not_modified[2] == b"" and not remembered
    assert _poll(path, conditional, memo) == (not_modified, True)
    # A stale ETag gets the whole answer.
    assert _poll(path, {**auth, "If-None-Match": '"old"'}, memo) == (first, True)


@pytest.mark.django_db(transaction=True)
def test_a_thread_answering_from_the_memo_gives_up_an_old_connection(running, api_key, memo):
    batch, _ = running
    auth = {"Authorization": f"Bearer {api_key}"}
    path = f"/v1/batches/{batch.pk}"
    _poll(path, auth, memo)
    connection.ensure_connection()
    old = connection.connection
    connection.close_at = time.monotonic() - 1  # it has outlived DB_CONN_MAX_AGE
    assert memo.answer(_environ(path, auth)) is not None
    assert connection.connection is not None and connection.connection is not old


def test_a_new_versions_304_is_made_from_its_200(running, api_key, memo):
    batch, shard = running
    auth = {"Authorization": f"Bearer {api_key}"}
    path = f"/v1/batches/{batch.pk}"
    (_, headers, _), _ = _poll(path, auth, memo)
    # Django's first 304 shows the memo how its 304s are made from its 200s...
    assert not _poll(path, {**auth, "If-None-Match": headers["ETag"]}, memo)[1]

    heartbeat(shard_id=shard.pk, attempt=shard.attempt, progress=Progress(completed=2))
    (status, headers, _), remembered = _poll(path, {**auth, "If-None-Match": headers["ETag"]},
                                             memo)
    assert status.startswith("200") and not remembered
    # ...so a new version's first revalidation needs no Django, and gets Django's own 304.
    conditional = {**auth, "If-None-Match": headers["ETag"]}
    not_modified, remembered = _poll(path, conditional, memo)
    assert remembered and not_modified[0].startswith("304")
    assert not_modified == wsgi_call(WSGIHandler(), "GET", path, conditional)
    # Another client's answer of the same shape too.
    other = {"Authorization": f"Bearer {api_key}", "Host": "localhost"}
    (status, headers, _), _ = _poll(path, other, memo)
    assert status.startswith("200")
    assert _poll(path, {**other, "If-None-Match": headers["ETag"]}, memo)[1]


def test_a_poll_reads_one_row(running, api_key, memo, monkeypatch, django_assert_num_queries):
    batch, _ = running
    auth = {"Authorization": f"Bearer {api_key}"}
    wsgi_call(application, "GET", f"/v1/batches/{batch.pk}", auth)
    # One query, on the driver's cursor (Compiled.raw_rows), so Django counts none.
    queries = []
    raw_rows = Compiled.raw_rows
    monkeypatch.setattr(Compiled, "raw_rows",
                        lambda self, **values: queries.append(values) or raw_rows(self, **values))
    with django_assert_num_queries(0):
        assert _poll(f"/v1/batches/{batch.pk}", auth, memo)[1]
    assert len(queries) == 1 and queries[0]["batch_id"] == batch.pk


def test_every_change_of_the_row_is_a_new_answer(running, api_key, memo):
    batch, shard = running
    auth = {"Authorization": f"Bearer {api_key}"}
    path = f"/v1/batches/{batch.pk}"
    _poll(path, auth, memo)
    assert _poll(path, auth, memo)[1]

    heartbeat(shard_id=shard.pk, attempt=shard.attempt,
              progress=Progress(completed=3, failed=1, input_tokens=10, output_tokens=6))
    (status, _, body), remembered = _poll(path, auth, memo)
    assert not remembered and b'"completed": 3' in body and b'"failed": 1' in body
    assert _poll(path, auth, memo) == ((status, _, body), True)

    # A change without a progress write: the status.
    cancel_batch(batch=Batch.objects.get(pk=batch.pk))
    (_, _, body), remembered = _poll(path, auth, memo)
    assert not remembered and b'"status": "cancelling"' in body
    # Nor one written past the ORM's update(): any column.
    Batch.objects.filter(pk=batch.pk).update(metadata={"k": "v"})
    (_, _, body), remembered = _poll(path, auth, memo)
    assert not remembered and b'"k": "v"' in body


def test_a_revoked_key_or_a_deactivated_owner_goes_to_django(running, api_key, user, memo):
    batch, _ = running
    auth = {"Authorization": f"Bearer {api_key}"}
    path = f"/v1/batches/{batch.pk}"
    _poll(path, auth, memo)
    assert _poll(path, auth, memo)[1]
    # Django refuses a deactivated owner once the key's cache entry lapses
    # (jobs.services.keys.KEY_CACHE_SECONDS); the memo stops answering at once.
    user.is_active = False
    user.save(update_fields=["is_active"])
    assert not _poll(path, auth, memo)[1]
    user.is_active = True
    user.save(update_fields=["is_active"])
    _poll(path, auth, memo)
    assert _poll(path, auth, memo)[1]
    revoke_api_key(key=user.apikey_set.get())
    (status, _, _), remembered = _poll(path, auth, memo)
    assert status.startswith("401") and not remembered


def test_another_client_never_gets_the_answer(running, api_key, other_key, memo):
    batch, _ = running
    path = f"/v1/batches/{batch.pk}"
    _poll(path, {"Authorization": f"Bearer {api_key}"}, memo)
    (status, _, _), remembered = _poll(path, {"Authorization": f"Bearer {other_key}"}, memo)
    assert status.startswith("404") and not remembered
    # The same key through another host is another request for Django to judge.
    (status, _, _), remembered = _poll(path, {"Authorization": f"Bearer {api_key}",
                                              "Host": "elsewhere.example"}, memo)
    assert status.startswith("400") and not remembered


def test_an_answer_is_kept_for_a_minute_at_most(running, api_key, memo, monkeypatch):
    batch, _ = running
    auth = {"Authorization": f"Bearer {api_key}"}
    path = f"/v1/batches/{batch.pk}"
    now = [time.monotonic()]
    _stop_the_clock(monkeypatch, now)
    _poll(path, auth, memo)
    now[0] += polls.REMEMBER_SECONDS - 1
    assert _poll(path, auth, memo)[1]
    now[0] += 2
    assert not _poll(path, auth, memo)[1]


def test_the_memo_is_bounded(running, api_key, memo, monkeypatch):
    batch, _ = running
    monkeypatch.setattr(polls, "MAX_ANSWERS", 2)
    auth = {"Authorization": f"Bearer {api_key}"}
    for query in ("a=1", "a=2", "a=3"):  # Django ignores these: each is a URL of its own
        _poll(f"/v1/batches/{batch.pk}?{query}", auth, memo)
    assert len(memo.answers) == 2
    assert not _poll(f"/v1/batches/{batch.pk}?a=1", auth, memo)[1]


def test_a_client_keeps_one_answer_whatever_headers_it_sends(running, api_key, memo):
    batch, _ = running
    auth = {"Authorization": f"Bearer {api_key}"}
    path = f"/v1/batches/{batch.pk}"
    for i in range(20):
        _poll(path, {**auth, "Cookie": f"junk={i}", "X-Forwarded-Host": f"h{i}.example"}, memo)
    assert len(memo.answers) == 1
    # Replayed only to a request that sends what the remembered one sent.
    last = {**auth, "Cookie": "junk=19", "X-Forwarded-Host": "h19.example"}
    assert _poll(path, last, memo)[1]
    assert not _poll(path, {**last, "Cookie": "junk=0"}, memo)[1]
    assert _poll(path, {**last, "Cookie": "junk=0"}, memo)[1]  # now its answer


def test_the_memo_is_bounded_in_bytes(running, api_key, memo, monkeypatch):
    batch, _ = running
    auth = {"Authorization": f"Bearer {api_key}"}
    _poll(f"/v1/batches/{batch.pk}", auth, memo)
    one = memo.bytes
    assert one > len(memo.answers[next(iter(memo.answers))].whole[2])
    monkeypatch.setattr(polls, "MAX_BYTES", 2 * one + one // 2)
    for query in ("a=1", "a=2", "a=3"):
        _poll(f"/v1/batches/{batch.pk}?{query}", auth, memo)
        assert memo.bytes <= polls.MAX_BYTES
    assert [key[1] for key in memo.answers] == ["a=2", "a=3"]
    assert memo.bytes == sum(memo.sizes.values()) and set(memo.sizes) == set(memo.answers)


def test_a_large_answer_is_not_kept(running, api_key, memo, monkeypatch):
    batch, _ = running
    auth = {"Authorization": f"Bearer {api_key}"}
    path = f"/v1/batches/{batch.pk}"
    first, _ = _poll(path, auth, memo)
    monkeypatch.setattr(polls, "MAX_ANSWER_BYTES", len(first[2]))
    memo.answers.clear()
    memo.sizes.clear()
    memo.bytes = 0
    assert not _poll(path, auth, memo)[1]
    assert not _poll(path, auth, memo)[1] and not memo.answers and memo.bytes == 0


def test_expired_answers_leave_the_memo(running, api_key, memo, monkeypatch):
    batch, _ = running
    path = f"/v1/batches/{batch.pk}"
    now = [time.monotonic()]
    _stop_the_clock(monkeypatch, now)
    for query in ("a=1", "a=2"):
        _poll(f"{path}?{query}", {"Authorization": f"Bearer {api_key}"}, memo)
    now[0] += polls.REMEMBER_SECONDS + 1
    # Filing any answer lets the expired ones go, though nobody polls them again.
    _poll("/v1/batches", {"Authorization": f"Bearer {api_key}"}, memo)
    assert [key[0] for key in memo.answers] == ["/v1/batches"]
    assert memo.bytes == sum(memo.sizes.values())


def test_other_api_answers_are_never_remembered(running, api_key, memo):
    batch, _ = running
    auth = {"Authorization": f"Bearer {api_key}"}
    for path in (f"/v1/batches/{batch.pk}/results", "/v1/models", "/v1/files"):
        wsgi_call(application, "GET", path, auth)
        assert not _poll(path, auth, memo)[1]
    assert not memo.answers


# --- the batch page's live block ---


def _signed_in(site: Any, batch: Batch) -> tuple[str, dict[str, str]]:
    """The live block's URL and a browser's headers for it (session and CSRF cookies), as
    after the page loaded (its URL carries the page's jitter seed)."""
    path = f"/batches/{batch.pk}/live?seed=5eed"
    cookie = f"sessionid={site.cookies['sessionid'].value}"
    _, headers, _ = wsgi_call(application, "GET", path, {"Cookie": cookie, "HX-Request": "true"})
    csrf = SimpleCookie(headers["Set-Cookie"])["csrftoken"].value
    return path, {"Cookie": f"{cookie}; csrftoken={csrf}", "HX-Request": "true"}


def _revalidated(site: Any, batch: Batch, memo: Any) -> tuple[str, dict[str, str]]:
    path, browser = _signed_in(site, batch)
    status, headers, _ = wsgi_call(application, "GET", path, browser)
    assert status.startswith("200") and "Set-Cookie" in headers  # renews the CSRF cookie
    browser = {**browser, "If-None-Match": headers["ETag"]}
    learned = bool(memo.shapes)
    first, remembered = _poll(path, browser, memo)
    # Django's 304, or once the memo has seen one, the same made from the 200.
    assert first[0].startswith("304") and remembered == learned
    assert _poll(path, browser, memo) == (first, True)
    return path, browser


def test_the_live_block_revalidates_without_django(site, running, memo):
    batch, _ = running
    path, browser = _revalidated(site, batch, memo)
    # A whole answer carries a cookie: never remembered.
    assert not _poll(path, {k: v for k, v in browser.items() if k != "If-None-Match"},
                     memo)[1]


def test_the_live_block_changes_with_marks_and_the_queue(site, running, user, memo):
    batch, shard = running
    path, browser = _revalidated(site, batch, memo)
    SpotCheck.objects.create(batch=batch, custom_id="r0", verdict="good", marked_by=user)
    (status, _, _), remembered = _poll(path, browser, memo)
    assert status.startswith("200") and not remembered

    path, browser = _revalidated(site, batch, memo)
    queue_health._blockers[batch.model] = (time.monotonic(), "the queue (Redis) cannot be reached")
    (status, _, _), remembered = _poll(path, browser, memo)
    assert status.startswith("200") and not remembered

    path, browser = _revalidated(site, batch, memo)
    heartbeat(shard_id=shard.pk, attempt=shard.attempt, progress=Progress(completed=1))
    (status, _, _), remembered = _poll(path, browser, memo)
    assert status.startswith("200") and not remembered


def test_the_live_blocks_new_version_revalidates_without_django(site, running, memo):
    batch, shard = running
    path, browser = _revalidated(site, batch, memo)
    heartbeat(shard_id=shard.pk, attempt=shard.attempt, progress=Progress(completed=1))
    (status, headers, _), remembered = _poll(path, browser, memo)
    # The new version's whole answer renews the CSRF cookie, so it is never replayed...
    assert status.startswith("200") and "Set-Cookie" in headers and not remembered
    # ...but the 304 made from it is Django's, which sets no cookie.
    browser = {**browser, "If-None-Match": headers["ETag"]}
    not_modified, remembered = _poll(path, browser, memo)
    assert remembered and not_modified[0].startswith("304")
    assert "Set-Cookie" not in not_modified[1]
    assert not_modified == wsgi_call(WSGIHandler(), "GET", path, browser)


def test_a_signed_out_browser_is_sent_to_sign_in(site, running, memo):
    batch, _ = running
    path, browser = _revalidated(site, batch, memo)
    Session.objects.all().delete()
    (status, headers, _), remembered = _poll(path, browser, memo)
    assert status.startswith("302") and "/accounts/login/" in headers["Location"]
    assert not remembered


# --- the first page of GET /v1/batches ---


def test_the_first_page_of_the_list_is_remembered_until_a_batch_on_it_changes(
        running, api_key, user, tmp_path, settings, memo):
    batch, shard = running
    auth = {"Authorization": f"Bearer {api_key}"}
    for path in ("/v1/batches", "/v1/batches?limit=1"):
        first, remembered = _poll(path, auth, memo)
        assert first[0].startswith("200") and not remembered
        assert _poll(path, auth, memo) == (first, True), path
        assert first == wsgi_call(WSGIHandler(), "GET", path, auth)

    heartbeat(shard_id=shard.pk, attempt=shard.attempt, progress=Progress(completed=2))
    (_, _, body), remembered = _poll("/v1/batches", auth, memo)
    assert not remembered and b'"completed": 2' in body
    # A new batch is a new first page.
    newer, _ = claimed_batch(user, tmp_path, settings)
    (_, _, body), remembered = _poll("/v1/batches?limit=1", auth, memo)
    assert not remembered and newer.pk.encode() in body and batch.pk.encode() not in body


def test_only_the_unfiltered_first_page_is_remembered(running, api_key, memo):
    batch, _ = running
    auth = {"Authorization": f"Bearer {api_key}"}
    for query in ("limit=0", "limit=101", "limit=20&order=asc", f"after={batch.pk}",
                  "status=in_progress", "metadata[k]=v"):
        path = f"/v1/batches?{query}"
        _poll(path, auth, memo)
        assert not _poll(path, auth, memo)[1], query


# --- the dashboard's table of batches ---


def test_the_batch_table_is_remembered_until_a_batch_on_it_changes(site, running, user,
                                                                   tmp_path, settings, memo):
    batch, shard = running
    cookie = f"sessionid={site.cookies['sessionid'].value}"
    browser = {"Cookie": cookie, "HX-Request": "true"}
    first, remembered = _poll("/", browser, memo)
    assert first[0].startswith("200") and batch.pk.encode() in first[2] and not remembered
    assert "Set-Cookie" not in first[1]
    assert _poll("/", browser, memo) == (first, True)

    heartbeat(shard_id=shard.pk, attempt=shard.attempt, progress=Progress(completed=3))
    assert not _poll("/", browser, memo)[1]
    assert _poll("/", browser, memo)[1]
    newer, _ = claimed_batch(user, tmp_path, settings)
    (_, _, body), remembered = _poll("/", browser, memo)
    assert not remembered and newer.pk.encode() in body
    # The whole page, a boosted request, another page or filter: Django's.
    for path, headers in (("/", {"Cookie": cookie}), ("/", {**browser, "HX-Boosted": "true"}),
                          ("/?page=2", browser), ("/?status=active", browser)):
        _poll(path, headers, memo)
        assert not _poll(path, headers, memo)[1], (path, headers)
    Session.objects.all().delete()
    (status, _, _), remembered = _poll("/", browser, memo)
    assert status.startswith("302") and not remembered


def test_the_batch_table_changes_with_a_batch_beyond_its_first_page(site, running, memo):
    batch, _ = running
    older = Batch.objects.get(pk=batch.pk)
    for i in range(web.LIST_PAGE_SIZE):  # older batches: the first page is full
        older.pk = f"batch_older{i:02d}"
        older.save(force_insert=True)
        Batch.objects.filter(pk=older.pk).update(
            created_at=batch.created_at - timedelta(hours=1, minutes=i))
    browser = {"Cookie": f"sessionid={site.cookies['sessionid'].value}", "HX-Request": "true"}
    first, _ = _poll("/", browser, memo)
    assert b"Page 1 of 2" in first[2] and _poll("/", browser, memo) == (first, True)
    # The oldest is on the second page, but the table offers one page fewer.
    Batch.objects.filter(pk=older.pk).delete()
    (_, _, body), remembered = _poll("/", browser, memo)
    assert not remembered and b"Page 1 of 2" not in body


def test_the_batch_table_shows_its_running_batches_etas_within_seconds(
        site, running, memo, monkeypatch):
    cookie = f"sessionid={site.cookies['sessionid'].value}"
    browser = {"Cookie": cookie, "HX-Request": "true"}
    now = [time.monotonic()]
    _stop_the_clock(monkeypatch, now)
    _poll("/", browser, memo)
    assert _poll("/", browser, memo)[1]
    now[0] += views.LIST_STALE_SECONDS + 1
    assert not _poll("/", browser, memo)[1]


def test_an_answer_whose_rows_changed_while_django_answered_is_not_kept(
        running, api_key, memo, monkeypatch):
    """A change made while Django answers, and undone after: the answer shows the change,
    so it must not be filed under the rows as they were before (and are again)."""
    batch, _ = running
    auth = {"Authorization": f"Bearer {api_key}"}
    path = f"/v1/batches/{batch.pk}"
    read = batches.get_openai_batch_for_user

    def changed_then_read(**kwargs: Any) -> Batch:
        Batch.objects.filter(pk=batch.pk).update(metadata={"k": "for a moment"})
        return read(**kwargs)

    monkeypatch.setattr(batches, "get_openai_batch_for_user", changed_then_read)
    (_, _, body), _ = _poll(path, auth, memo)
    assert b"for a moment" in body
    monkeypatch.setattr(batches, "get_openai_batch_for_user", read)
    Batch.objects.filter(pk=batch.pk).update(metadata={})
    (_, _, body), remembered = _poll(path, auth, memo)
    assert not remembered and b"for a moment" not in body
