"""The dashboard's batch pages: the list, a new batch, a batch's page with its partials and
tabs (errors, results, quality flags with their drill-down), downloads and the spot check;
ownership (another user's ids are 404), htmx partials and polling stops, bounded queries,
hostile content; and quality flags from real workers with the echo engine."""

from __future__ import annotations

import io
import json
import random
from datetime import timedelta
from typing import Any

import pytest
from django.core.cache import cache
from django.core.files.base import ContentFile
from django.core.files.storage import default_storage
from django.core.files.uploadedfile import SimpleUploadedFile
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

from jobs.models import ApiKey, Batch, File, Shard, SpotCheck
from jobs.queries import dashboard, flags, results, spot_samples
from jobs.services import preflight
from jobs.services.keys import create_api_key
from jobs.services.progress import refresh_progress
from jobs.services.shard_input import shard_custom_ids
from jobs.storage.objects import new_storage_name
from jobs.templatetags.dashboard import clip
from tests.factories import (
    HTMX,
    chat_line,
    chat_lines,
    jsonl,
    lines_of,
    make_batch,
    make_file,
    partly_run_batch,
    poll_of,
    query_count,
    response_text,
    run_batch,
    run_shard,
    wait_for,
)

pytestmark = pytest.mark.django_db

@pytest.fixture
def other_site(client, other_user):
    client.force_login(other_user)
    return client


# --- batch list ---


def test_batch_list_shows_only_mine_with_progress(site, user, other_user, tmp_path, settings):
    mine = make_batch(user, chat_lines(10), tmp_path, shard_size=5, settings=settings)
    run_shard(Shard.objects.get(batch=mine, index=0))
    theirs = make_batch(other_user, chat_lines(3), tmp_path)
    page = site.get(reverse("batch_list")).content.decode()
    assert mine.pk in page and theirs.pk not in page
    assert "5 / 10" in page
    # A running row polls itself; the htmx script is served locally.
    url, every = poll_of(page)
    assert url.startswith(reverse("batch_row", args=[mine.pk]) + "?")
    assert 1.7 <= every <= 2.3  # 2 s, spread so that open pages do not poll in step
    assert "/static/django_htmx/htmx" in page or "htmx" in page


def test_batch_list_filter_and_partial(site, user, tmp_path):
    running = make_batch(user, chat_lines(2), tmp_path)
    done = run_batch(make_batch(user, chat_lines(2, "d"), tmp_path))
    assert done.status == "completed"
    page = site.get(reverse("batch_list"), {"status": "completed"}).content.decode()
    assert done.pk in page and running.pk not in page
    active = site.get(reverse("batch_list"), {"status": "active"}).content.decode()
    assert running.pk in active and done.pk not in active
    partial = site.get(reverse("batch_list"), {"status": "completed"}, **HTMX).content.decode()
    assert partial.lstrip().startswith('<div id="batch-table">')
    assert "<html" not in partial


def test_batch_list_is_paginated_with_bounded_queries(site, user, tmp_path,
                                                      django_assert_max_num_queries):
    for i in range(3):
        make_batch(user, chat_lines(2, f"a{i}-"), tmp_path)
    with django_assert_max_num_queries(8):
        site.get(reverse("batch_list"))
    for i in range(22):
        make_batch(user, chat_lines(2, f"b{i}-"), tmp_path)
    with django_assert_max_num_queries(8):
        page = site.get(reverse("batch_list")).content.decode()
    assert page.count('<tr id="row-') == 20
    second = site.get(reverse("batch_list"), {"page": 2}).content.decode()
    assert second.count('<tr id="row-') == 5


def test_batch_row_polls_until_ended(site, user, tmp_path):
    batch = make_batch(user, chat_lines(2), tmp_path)
    response = site.get(reverse("batch_row", args=[batch.pk]), **HTMX)
    assert response.status_code == 200 and 1.7 <= poll_of(response.content)[1] <= 2.3
    run_batch(batch)
    response = site.get(reverse("batch_row", args=[batch.pk]), **HTMX)
    assert response.status_code == 286
    assert b"hx-trigger" not in response.content and b"Completed" in response.content


def test_batch_list_partial_queries_do_not_grow_with_batches(site, user, tmp_path, settings):
    def page() -> Any:
        return site.get(reverse("batch_list"), **HTMX)

    for i in range(3):
        partly_run_batch(user, tmp_path, settings, requests=6, shard_size=2, done=1,
                         prefix=f"a{i}-")
    few = query_count(page)
    for i in range(22):
        batch = partly_run_batch(user, tmp_path, settings, requests=6, shard_size=2, done=1,
                                 prefix=f"b{i}-")
        if i % 2:
            run_batch(batch)
    many = query_count(page)
    assert b'<tr id="row-' in page().content
    assert few == many <= 7, (few, many)
    active = query_count(lambda: site.get(reverse("batch_list"), {"status": "active"}, **HTMX))
    assert active <= 7, active


# --- another user's ids ---


def test_other_users_ids_are_404(site, other_user, tmp_path):
    theirs = run_batch(make_batch(other_user, chat_lines(3), tmp_path), fails=lambda c: c == "r1")
    key, _ = create_api_key(owner=other_user, name="theirs")
    gets = ["batch_detail", "batch_live", "batch_row", "batch_cancel", "batch_errors",
            "batch_results", "batch_spot_check"]
    for name in gets:
        assert site.get(reverse(name, args=[theirs.pk])).status_code == 404, name
    for kind in ("input", "output", "errors"):
        assert site.get(reverse("batch_download", args=[theirs.pk, kind])).status_code == 404
    for name in ("batch_cancel", "batch_rerun", "batch_spot_check"):
        assert site.post(reverse(name, args=[theirs.pk]),
                         {"custom_id": "r0", "verdict": "good"}).status_code == 404, name
    file_id = theirs.input_file_id
    assert site.get(reverse("file_download", args=[file_id])).status_code == 404
    assert site.post(reverse("file_delete", args=[file_id])).status_code == 404
    assert File.objects.filter(pk=file_id).exists()
    assert site.post(reverse("key_revoke", args=[key.pk])).status_code == 404
    assert ApiKey.objects.get(pk=key.pk).revoked_at is None
    # Picking another user's file on the new-batch form does not reach it either.
    response = site.post(reverse("batch_new"), {"file_id": file_id, "action": "check",
                                                "completion_window": "24h",
                                                "priority": "default"})
    assert b"No such file" in response.content
    assert not Batch.objects.filter(input_file_id=file_id).exclude(pk=theirs.pk).exists()


def test_other_users_batch_is_404(site, other_user, tmp_path, settings):
    theirs = flagged_batch(other_user, tmp_path, settings, n=5)
    assert site.get(reverse("batch_flags", args=[theirs.pk])).status_code == 404
    assert site.get(reverse("batch_flags", args=[theirs.pk]), {"flag": "repetition"},
                    **HTMX).status_code == 404
    assert site.get(reverse("batch_spot_check", args=[theirs.pk]),
                    {"flagged": "1"}).status_code == 404
    assert site.post(reverse("batch_spot_check", args=[theirs.pk]),
                     {"custom_id": "r0", "verdict": "good", "flagged": "1"}
                     ).status_code == 404
    assert not SpotCheck.objects.exists()


# --- new batch ---


def upload(content: bytes, name: str = "in.jsonl") -> SimpleUploadedFile:
    return SimpleUploadedFile(name, content, content_type="application/jsonl")


def test_new_batch_shows_line_problems_and_stores_nothing(site, user):
    bad = jsonl([chat_line("a", "hi"), "{not json", chat_line("c", "x", model="nope")])
    files_before = File.objects.count()
    response = site.post(reverse("batch_new"), {
        "upload": upload(bad), "action": "check", "completion_window": "24h",
        "priority": "default"})
    page = response.content.decode()
    assert response.status_code == 200
    assert "2 lines to fix" in page
    assert "invalid_json_line" in page and "model_not_found" in page
    assert '<td class="num">2</td>' in page and '<td class="num">3</td>' in page
    assert File.objects.count() == files_before and not Batch.objects.exists()


def test_new_batch_is_created_in_one_click_from_a_new_upload(site, user):
    response = site.post(reverse("batch_new"), {
        "upload": upload(jsonl(chat_lines(4))), "action": "submit",
        "completion_window": "24h", "priority": "default", "metadata": "project=beta"})
    batch = Batch.objects.get(owner=user)
    assert response.status_code == 302 and response.url == reverse("batch_detail",
                                                                   args=[batch.pk])
    assert batch.input_file.line_count == 4 and batch.metadata == {"project": "beta"}


def test_one_click_with_a_bad_upload_shows_its_problems_and_creates_nothing(site, user):
    bad = jsonl([chat_line("a", "hi"), "{not json"])
    response = site.post(reverse("batch_new"), {
        "upload": upload(bad), "action": "submit", "completion_window": "24h",
        "priority": "default"})
    assert response.status_code == 200 and "1 line to fix" in response.content.decode()
    assert not File.objects.exists() and not Batch.objects.exists()


def test_new_batch_preflight_then_submit(site, user):
    good = jsonl(chat_lines(4))
    response = site.post(reverse("batch_new"), {
        "upload": upload(good), "action": "check", "completion_window": "24h",
        "priority": "low", "metadata": "project=alpha"})
    page = response.content.decode()
    file = File.objects.get(owner=user)
    assert "Ready" in page and ">4<" in page
    assert "Output tokens (ceiling)" in page and ">40<" in page
    assert "unknown" in page  # no history for echo-test yet
    assert f'value="{file.pk}" selected' in page
    assert 'id="submit-batch"' in page
    response = site.post(reverse("batch_new"), {
        "file_id": file.pk, "action": "submit", "completion_window": "24h",
        "priority": "low", "metadata": "project=alpha", "endpoint": "", "model": ""})
    batch = Batch.objects.get(owner=user)
    assert response.status_code == 302 and response.url == reverse("batch_detail",
                                                                   args=[batch.pk])
    assert batch.input_file_id == file.pk and batch.priority == "low"
    assert batch.metadata == {"project": "alpha"} and batch.endpoint == "/v1/chat/completions"


def test_new_batch_with_htmx_returns_partial_and_client_redirect(site, user, tmp_path):
    file = make_file(user, chat_lines(2), tmp_path)
    response = site.post(reverse("batch_new"), {"file_id": file.pk, "action": "check",
                                                "completion_window": "24h",
                                                "priority": "default"}, **HTMX)
    assert response.content.decode().lstrip().startswith('<div id="new-batch">')
    response = site.post(reverse("batch_new"), {"file_id": file.pk, "action": "submit",
                                                "completion_window": "24h",
                                                "priority": "default"}, **HTMX)
    batch = Batch.objects.get(owner=user)
    assert response["HX-Redirect"] == reverse("batch_detail", args=[batch.pk])


def test_new_batch_refuses_bad_window_and_metadata(site, user, tmp_path):
    file = make_file(user, chat_lines(2), tmp_path)
    response = site.post(reverse("batch_new"), {"file_id": file.pk, "action": "submit",
                                                "completion_window": "2days",
                                                "priority": "default"})
    assert b"completion_window must be whole hours" in response.content
    response = site.post(reverse("batch_new"), {"file_id": file.pk, "action": "submit",
                                                "completion_window": "24h",
                                                "priority": "default", "metadata": "oops"})
    assert b"key=value" in response.content
    assert not Batch.objects.exists()


def test_new_batch_other_model_rewrites_the_file(site, user, tmp_path):
    file = make_file(user, chat_lines(3), tmp_path)
    site.post(reverse("batch_new"), {"file_id": file.pk, "action": "submit",
                                     "completion_window": "24h", "priority": "default",
                                     "model": "SmolLM2-135M-Instruct"})
    batch = Batch.objects.get(owner=user)
    assert batch.input_file_id != file.pk
    sent = lines_of(user, batch.input_file_id)
    assert [line["custom_id"] for line in sent] == ["r0", "r1", "r2"]
    assert {line["body"]["model"] for line in sent} == {"SmolLM2-135M-Instruct"}


def test_preflight_estimates_time_from_recent_history(site, user, tmp_path):
    done = make_batch(user, chat_lines(20), tmp_path)
    run_batch(done, seconds=10)  # 20 requests in 10 s: 2 requests/s
    assert preflight.model_throughput("echo-test") == pytest.approx(2.0)
    file = make_file(user, chat_lines(120), tmp_path)
    page = site.post(reverse("batch_new"), {"file_id": file.pk, "action": "check",
                                            "completion_window": "24h",
                                            "priority": "default"}).content.decode()
    assert "1m 00s" in page and "120.0/min" in page


def test_upload_reads_stream_not_memory(site, user, settings):
    # A file bigger than the in-memory upload limit arrives as a temporary file and is
    # checked from disk; the whole flow still works.
    settings.FILE_UPLOAD_MAX_MEMORY_SIZE = 1024
    big = jsonl(chat_lines(200))
    assert len(big) > 1024
    response = site.post(reverse("batch_new"), {
        "upload": SimpleUploadedFile("big.jsonl", big), "action": "check",
        "completion_window": "24h", "priority": "default"})
    assert b"Ready" in response.content
    assert File.objects.get(owner=user).line_count == 200


# --- batch page ---


def test_batch_page_running_and_live_partial(site, user, tmp_path, settings):
    batch = make_batch(user, chat_lines(30), tmp_path, shard_size=10, settings=settings)
    now = timezone.now()
    run_shard(Shard.objects.get(batch=batch, index=0), started=now - timedelta(seconds=20),
              seconds=10)
    Shard.objects.filter(batch=batch, index=1).update(
        status="running", attempt=2, failures=1, recomputed=10,
        started_at=now - timedelta(seconds=5),
        completed=4, failed=1, ran_ok=4, ran_failed=1, input_tokens=20, output_tokens=12,
        heartbeat_at=now)
    refresh_progress(batch_id=batch.pk)  # as the worker's heartbeat does
    page = site.get(reverse("batch_detail", args=[batch.pk])).content.decode()
    assert "15</strong> of 30 requests" in page
    assert poll_of(page)[0].startswith(reverse("batch_live", args=[batch.pk]) + "?")
    assert "<svg" in page and "chart-line" in page
    assert "Retry rate" in page and "33.3%" in page  # a failed run's 10 of 30 runs
    assert "ETA" in page
    assert "Results so far" in page and 'id="cancel"' in page
    live = site.get(reverse("batch_live", args=[batch.pk]), **HTMX)
    assert live.status_code == 200
    assert live.content.decode().lstrip().startswith('<section id="live"')


def test_live_partial_stops_polling_when_ended(site, user, tmp_path):
    # r2 failed as the service failed it (HTTP 500): a rerun may succeed.
    batch = run_batch(make_batch(user, chat_lines(3), tmp_path), fails=lambda c: c == "r2",
                      status=lambda c: 500)
    live = site.get(reverse("batch_live", args=[batch.pk]), **HTMX)
    assert live.status_code == 286
    html = live.content.decode()
    assert "hx-trigger" not in html and "Completed" in html
    assert 'id="download-output"' in html and 'id="download-errors"' in html
    assert 'id="rerun"' in html


# batch_live: 8, and 2 for the cost (the ledger's sum, and before the first charge the
# currency of the batch's price).
@pytest.mark.parametrize(("view", "bound"), [("batch_live", 10), ("batch_row", 5)])
def test_batch_partial_queries_do_not_grow_with_shards(site, user, tmp_path, settings, view,
                                                       bound):
    small = partly_run_batch(user, tmp_path, settings, requests=4, shard_size=2, done=1)
    big = partly_run_batch(user, tmp_path, settings, requests=80, shard_size=2, done=25, prefix="b")
    # Every poll rendered afresh (not from the live block's cache): the bound is the render's.
    counts = [query_count(lambda b=b: (cache.clear(), site.get(reverse(view, args=[b.pk]),
                                                              **HTMX))[1])
              for b in (small, big)]
    assert counts[0] == counts[1] <= bound, counts


def test_batch_stats_report():
    start = timezone.now() - timedelta(minutes=10)
    batch = Batch(status=Batch.Status.IN_PROGRESS, total=100, in_progress_at=start)
    batch.completed, batch.failed, batch.input_tokens, batch.output_tokens = 45, 5, 900, 100
    now = start + timedelta(minutes=5)
    rows = [
        dashboard.ShardRow("b", "done", start, start + timedelta(minutes=2), 25, 0, 1, 0, 500,
                           50, ran_ok=25),
        dashboard.ShardRow("b", "running", start + timedelta(minutes=3), None, 20, 5, 2, 1,
                           400, 50, ran_ok=20, ran_failed=5),
        dashboard.ShardRow("b", "abandoned", None, now, 0, 30, 0, 0, 0, 0),
    ]
    rate_now, rate_avg, elapsed = dashboard._rates(batch, rows, now)
    assert elapsed == 300
    assert rate_avg == pytest.approx(50 / 300)
    # The last two minutes hold the running shard's 25 requests.
    assert rate_now == pytest.approx(25 / 120)
    series = dashboard.throughput_series(batch, rows, now, buckets=5)
    assert sum(series) / 60 * 60 == pytest.approx(50, rel=0.01)  # 1-minute buckets


def test_throughput_series_matches_its_definition_bucket_by_bucket():
    """The series is computed in one pass over the shards; each bucket must still hold
    what the shards finished within it (`ShardRow.done_between`), ended or running."""
    rng = random.Random(7)
    start = timezone.now() - timedelta(minutes=30)
    for ended in (False, True):
        now = start + timedelta(minutes=30)
        batch = Batch(status=Batch.Status.COMPLETED if ended else Batch.Status.IN_PROGRESS,
                      total=10_000, in_progress_at=start,
                      completed_at=now - timedelta(minutes=1) if ended else None)
        rows = []
        for _ in range(200):
            began = start + timedelta(seconds=rng.uniform(0, 1700))
            length = rng.choice([0, 0.5, 3, 60, 400])
            finished = began + timedelta(seconds=length)
            running = not ended and rng.random() < 0.2
            ok, failed = rng.randrange(50), rng.randrange(5)
            rows.append(dashboard.ShardRow(
                "b", "running" if running else rng.choice(["done", "done", "abandoned"]),
                began, None if running else finished, ok, failed, 1, 0, 0, 0,
                ran_ok=ok, ran_failed=failed))
        buckets = 7
        end = batch.ended_at or now
        step = (end - start) / buckets
        expected = []
        for i in range(buckets):
            b_end = start + step * (i + 1) + (timedelta(seconds=1) if i == buckets - 1
                                              else timedelta(0))
            count = sum(r.done_between(start + step * i, b_end, now) for r in rows)
            expected.append(count / step.total_seconds() * 60)
        assert dashboard.throughput_series(batch, rows, now, buckets=buckets) == \
            pytest.approx(expected)


def test_cancel_confirm_page_and_post(site, user, tmp_path):
    batch = make_batch(user, chat_lines(3), tmp_path)
    page = site.get(reverse("batch_cancel", args=[batch.pk]))
    assert page.status_code == 200 and b"Cancel this batch?" in page.content
    response = site.post(reverse("batch_cancel", args=[batch.pk]))
    assert response.status_code == 302
    assert Batch.objects.get(pk=batch.pk).status == "cancelling"
    # Cancelling an ended batch is refused with a message, not an error page.
    ended = run_batch(make_batch(user, chat_lines(2, "e"), tmp_path))
    response = site.post(reverse("batch_cancel", args=[ended.pk]), follow=True)
    assert b"Cannot cancel a batch that is completed" in response.content


def test_rerun_failed_creates_batch_of_exactly_the_failed_lines(site, user, tmp_path,
                                                                 settings):
    batch = make_batch(user, chat_lines(12), tmp_path, shard_size=5, settings=settings,
                       metadata={"team": "x"})
    batch = run_batch(batch, fails=lambda c: c in {"r1", "r7", "r11"},
                      status=lambda c: 503)
    response = site.post(reverse("batch_rerun", args=[batch.pk]))
    new = Batch.objects.exclude(pk=batch.pk).get(owner=user)
    assert response.status_code == 302 and response.url == reverse("batch_detail",
                                                                   args=[new.pk])
    assert [line["custom_id"] for line in lines_of(user, new.input_file_id)] == [
        "r1", "r7", "r11"]
    assert new.metadata == {"team": "x", "rerun_of": batch.pk}
    # Byte for byte the original lines.
    original = {line["custom_id"]: line for line in lines_of(user, batch.input_file_id)}
    assert lines_of(user, new.input_file_id)[0] == original["r1"]
    # Nothing failed: a message, no batch.
    clean = run_batch(make_batch(user, chat_lines(2, "ok"), tmp_path))
    response = site.post(reverse("batch_rerun", args=[clean.pk]), follow=True)
    assert b"no failed requests" in response.content


# --- downloads ---


def test_downloads_final_and_partial(site, user, tmp_path, settings):
    batch = make_batch(user, chat_lines(10), tmp_path, shard_size=5, settings=settings)
    run_shard(Shard.objects.get(batch=batch, index=0), fails=lambda c: c == "r3")
    partial = site.get(reverse("batch_download", args=[batch.pk, "output"]))
    assert partial.status_code == 200 and partial.streaming
    assert partial["Content-Disposition"] == (
        f'attachment; filename="{batch.pk}_output_partial.jsonl"')
    got = [json.loads(x)["custom_id"] for x in response_text(partial).splitlines()]
    assert sorted(got) == ["r0", "r1", "r2", "r4"]
    errors = response_text(site.get(reverse("batch_download", args=[batch.pk, "errors"])))
    assert [json.loads(x)["custom_id"] for x in errors.splitlines()] == ["r3"]

    batch = run_batch(batch)
    output = site.get(reverse("batch_download", args=[batch.pk, "output"]))
    assert output["Content-Disposition"] == f'attachment; filename="{batch.pk}_output.jsonl"'
    assert output["Content-Type"] == "application/jsonl"
    assert len(response_text(output).splitlines()) == 9
    source = site.get(reverse("batch_download", args=[batch.pk, "input"]))
    assert source["Content-Disposition"] == 'attachment; filename="in.jsonl"'
    assert response_text(source).encode() == jsonl(chat_lines(10))
    assert site.get(reverse("batch_download", args=[batch.pk, "nope"])).status_code == 404


# --- errors tab ---


def test_errors_tab_counts_filter_search_and_paging(site, user, tmp_path, settings):
    batch = make_batch(user, chat_lines(60), tmp_path, shard_size=10, settings=settings)
    batch = run_batch(batch, fails=lambda c: int(c[1:]) % 2 == 0 or int(c[1:]) > 54)
    page = site.get(reverse("batch_errors", args=[batch.pk])).content.decode()
    assert "http_400" in page and '<span class="count">33</span>' in page
    assert page.count('<article class="result"') == results.PAGE_SIZE
    # Each error shows the request it belongs to.
    assert "user: question 0" in page and "maximum context length" in page
    assert "Next page" in page
    # Page 2 continues by byte offset.
    first = results.read_page(batch, "error")
    second = site.get(reverse("batch_errors", args=[batch.pk]),
                      {"cursor": first.next_cursor}).content.decode()
    assert second.count('<article class="result"') == 33 - results.PAGE_SIZE
    assert "First page" in second
    # Search by custom_id (htmx: only the list).
    found = site.get(reverse("batch_errors", args=[batch.pk]), {"q": "r38"}, **HTMX)
    html = found.content.decode()
    assert html.lstrip().startswith('<section id="error-list"')
    assert html.count('<article class="result"') == 1 and "question 38" in html
    none = site.get(reverse("batch_errors", args=[batch.pk]), {"code": "batch_expired"})
    assert b"No error matches" in none.content
    bad = site.get(reverse("batch_errors", args=[batch.pk]), {"cursor": "../etc:0"})
    assert bad.status_code == 404


def test_errors_tab_for_failed_validation(site, user, tmp_path):
    file = make_file(user, [chat_line("a", "x"), chat_line("a", "y")], tmp_path)
    from jobs.services.batches import create_batch
    from jobs.services.validation import run_validation

    batch = create_batch(owner=user, input_file_id=file.pk, endpoint="/v1/chat/completions",
                         completion_window="24h")
    run_validation(batch_id=batch.pk)
    page = site.get(reverse("batch_errors", args=[batch.pk])).content.decode()
    assert "Input problems" in page and "duplicate_custom_id" in page
    detail = site.get(reverse("batch_detail", args=[batch.pk])).content.decode()
    assert "The input file has problems" in detail


def test_hostile_content_is_escaped_and_truncated(site, user, tmp_path):
    evil_id = '<script>alert("id")</script>\u202egnp.exe'
    huge = "<img src=x onerror=alert(1)>" + "A" * 50_000
    batch = make_batch(user, [chat_line(evil_id, huge), chat_line("z\u0301\u0301\u0301\u0301",
                                                                  "ok")], tmp_path)
    batch = run_batch(batch, fails=lambda c: c == evil_id, answer=lambda c: huge)
    for name in ("batch_errors", "batch_results", "batch_spot_check", "batch_list"):
        args = [] if name == "batch_list" else [batch.pk]
        page = site.get(reverse(name, args=args)).content.decode()
        assert "<script>alert" not in page and "<img src=x" not in page, name
        assert "A" * 10_000 not in page, name
        assert "\u202e" not in page, name
    page = site.get(reverse("batch_errors", args=[batch.pk])).content.decode()
    assert "&lt;script&gt;alert(&quot;id&quot;)&lt;/script&gt;\\u202egnp.exe" in page
    assert "characters)" in page  # the cut is said


def test_clip_filter():
    assert clip("abc", 2) == "ab… (+1 characters)"
    assert clip("a\u200bb\u0000c") == "a\\u200bb\\u0000c"
    assert clip("e" + "\u0301" * 10) == "e\u0301\u0301"
    assert clip(None) == ""


# --- results tab ---


def test_results_tab_while_running_and_search(site, user, tmp_path, settings):
    batch = make_batch(user, chat_lines(10), tmp_path, shard_size=5, settings=settings)
    empty = site.get(reverse("batch_results", args=[batch.pk])).content.decode()
    assert "No shard has finished yet" in empty
    run_shard(Shard.objects.get(batch=batch, index=1))
    page = site.get(reverse("batch_results", args=[batch.pk])).content.decode()
    assert page.count('<article class="result"') == 5
    assert "user: question 7" in page and "echo: r7" in page  # input beside output
    assert "Download results so far" in page
    found = site.get(reverse("batch_results", args=[batch.pk]), {"q": "r9"}, **HTMX)
    assert found.content.decode().count('<article class="result"') == 1
    # A cursor from while it ran still works after it ended (starts over).
    cursor = results.read_page(batch, "output", size=2).next_cursor
    batch = run_batch(batch)
    again = site.get(reverse("batch_results", args=[batch.pk]), {"cursor": cursor})
    assert again.status_code == 200


# --- quality flags: counts on the batch page ---


def flags_of(custom_id: str) -> list[str]:
    """Which flags a test request gets, from its number: every 3rd repetition, every 4th
    length_limit, every 5th empty_output."""
    n = int(custom_id.lstrip("rx"))
    found = []
    if n % 5 == 0:
        found.append("empty_output")
    if n % 4 == 0:
        found.append("length_limit")
    if n % 3 == 0:
        found.append("repetition")
    return found


def answer(custom_id: str) -> str:
    flags = flags_of(custom_id)
    if "empty_output" in flags:
        return ""
    if "repetition" in flags:
        return "na " * 30
    return f"<b>echo</b> {custom_id}"


def run_flagged_shard(shard: Shard, *, json_retries: int = 0) -> None:
    """What a worker does for a shard, with its flags part and counts."""
    run_shard(shard, answer=answer)
    part = io.BytesIO()
    counts: dict[str, int] = {}
    for custom_id in shard_custom_ids(shard):
        flags = flags_of(custom_id)
        if flags:
            part.write(json.dumps({"custom_id": custom_id, "flags": flags}).encode() + b"\n")
            for flag in flags:
                counts[flag] = counts.get(flag, 0) + 1
    name = default_storage.save(new_storage_name(f"parts/{shard.batch_id}"),
                                ContentFile(part.getvalue())) if part.tell() else ""
    Shard.objects.filter(pk=shard.pk).update(flags_part=name, flag_counts=counts,
                                             json_retries=json_retries)


def flagged_batch(user, tmp_path, settings, *, n: int = 60, shard_size: int = 20,
                  run: int | None = None, end: bool = True) -> Batch:
    batch = make_batch(user, chat_lines(n), tmp_path, shard_size=shard_size, settings=settings)
    shards = list(Shard.objects.filter(batch=batch).order_by("index"))
    for shard in shards[:run]:
        run_flagged_shard(shard, json_retries=1)
    if end:
        batch = run_batch(batch)
    return Batch.objects.get(pk=batch.pk)


def expected(n: int, flag: str | None = None) -> list[str]:
    return [f"r{i}" for i in range(n) if flags_of(f"r{i}") and
            (flag is None or flag in flags_of(f"r{i}"))]


def cids(html: str) -> list[str]:
    import re

    return re.findall(r'<code class="cid">([^<]*)</code>', html)


def test_flag_counts_sum_the_shards_in_one_query(user, tmp_path, settings,
                                                 django_assert_num_queries):
    batch = flagged_batch(user, tmp_path, settings)
    with django_assert_num_queries(1):
        counts = flags.flag_counts(batch)
    assert counts == [
        ("empty_output", "Empty output", 12),
        ("length_limit", "Stopped by the length limit", 15),
        ("repetition", "Degenerate repetition", 20),
        ("invalid_json", "Not valid JSON / not matching the schema", 0),
    ]


def test_batch_page_shows_counts_linking_to_drill_down(site, user, tmp_path, settings):
    batch = flagged_batch(user, tmp_path, settings)
    page = site.get(reverse("batch_detail", args=[batch.pk])).content.decode()
    assert "Quality flags" in page
    link = f'{reverse("batch_flags", args=[batch.pk])}?flag=repetition'
    assert f'href="{link}"' in page
    assert 'id="flag-repetition"' in page and "Degenerate repetition" in page
    # The live partial (polled) carries them too.
    live = site.get(reverse("batch_live", args=[batch.pk]), **HTMX).content.decode()
    assert 'id="flag-length_limit"' in live and ">15<" in live.replace(" ", "")


def test_retry_rate_counts_json_retries(site, user, tmp_path, settings):
    # 3 shards of 20 requests, each run once with 1 JSON retry; shard 1 also failed once,
    # after computing all 20 of its requests and checkpointing none (computed again).
    batch = flagged_batch(user, tmp_path, settings, end=False)
    Shard.objects.filter(batch=batch, index=1).update(attempt=2, failures=1, recomputed=20)
    report = dashboard.batch_stats(batch).report
    assert report.json_retries == 3
    assert report.retried_requests == 20 + 3
    assert report.request_runs == 80 + 3
    assert report.retry_rate == pytest.approx(23 / 83)
    page = site.get(reverse("batch_detail", args=[batch.pk])).content.decode()
    assert "27.7%" in page
    assert "3 JSON retries" in page and "1 failed of 4 shard runs" in page


# --- the flags tab ---


def test_flags_tab_lists_all_then_one_flag_with_paging(site, user, tmp_path, settings):
    batch = flagged_batch(user, tmp_path, settings, n=120, shard_size=20)
    url = reverse("batch_flags", args=[batch.pk])
    page = site.get(url).content.decode()
    assert page.count('<article class="result flagged">') == results.PAGE_SIZE
    assert cids(page) == expected(120)[:25]
    # Input beside output.
    assert "user: question 3" in page and "na na na" in page
    # One flag, page by page, following the next links until the end (no JavaScript).
    seen: list[str] = []
    next_url = f"{url}?flag=repetition"
    while next_url:
        html = site.get(next_url).content.decode()
        seen += cids(html)
        found = [part for part in html.split('href="')[1:] if "cursor=" in part]
        next_url = (url + found[0].split('"')[0].replace("&amp;", "&")) if found else None
        assert "↑ First page" in html or seen == cids(html)
    assert seen == expected(120, "repetition")
    assert len(seen) == 40


def test_flags_tab_htmx_partial_and_paging_cursor(site, user, tmp_path, settings):
    batch = flagged_batch(user, tmp_path, settings)
    url = reverse("batch_flags", args=[batch.pk])
    cursor = flags.read_flag_page(batch, size=5).next_cursor
    assert cursor and cursor.startswith("s")
    partial = site.get(url, {"cursor": cursor}, **HTMX).content.decode()
    assert partial.lstrip().startswith('<section id="flag-list"')
    assert "<html" not in partial
    assert cids(partial)[0] == expected(60)[5]
    assert 'hx-target="#flag-list"' in site.get(url).content.decode()


def test_flags_tab_while_running_reads_shard_parts(site, user, tmp_path, settings):
    batch = flagged_batch(user, tmp_path, settings, run=1, end=False)
    assert batch.status == "in_progress"
    html = site.get(reverse("batch_flags", args=[batch.pk]),
                    {"flag": "empty_output"}).content.decode()
    assert cids(html) == ["r0", "r5", "r10", "r15"]
    assert "so far" in html
    # An empty output is shown as such, beside its input.
    assert "user: question 5" in html


def test_flags_tab_after_cleanup_reads_the_output_file(site, user, tmp_path, settings):
    batch = flagged_batch(user, tmp_path, settings)
    # What cleanup does to merged parts: the outputs are then only in the output file.
    for name in Shard.objects.filter(batch=batch).values_list("output_part", flat=True):
        default_storage.delete(name)
    Shard.objects.filter(batch=batch).update(output_part="", error_part="")
    html = site.get(reverse("batch_flags", args=[batch.pk]),
                    {"flag": "repetition"}).content.decode()
    assert cids(html) == expected(60, "repetition")
    assert "na na na" in html and "was not found" not in html


def test_flags_tab_escapes_and_truncates(site, user, tmp_path, settings):
    batch = flagged_batch(user, tmp_path, settings, n=5)
    html = site.get(reverse("batch_flags", args=[batch.pk]),
                    {"flag": "length_limit"}).content.decode()
    assert cids(html) == ["r0", "r4"]
    assert "<b>echo</b>" not in html and "&lt;b&gt;echo&lt;/b&gt;" in html


def test_flags_tab_bad_flag_and_cursor_are_404_and_empty_is_explained(site, user, tmp_path,
                                                                      settings):
    batch = flagged_batch(user, tmp_path, settings, n=5)
    url = reverse("batch_flags", args=[batch.pk])
    assert site.get(url, {"flag": "nope"}).status_code == 404
    assert site.get(url, {"cursor": "zz:1"}).status_code == 404
    html = site.get(url, {"flag": "invalid_json"}).content.decode()
    assert "No request has the flag" in html
    clean = run_batch(make_batch(user, chat_lines(3, "x"), tmp_path))
    html = site.get(reverse("batch_flags", args=[clean.pk])).content.decode()
    assert "No flagged requests" in html


def test_flags_tab_queries_do_not_grow_with_shards(site, user, tmp_path, settings):
    small = flagged_batch(user, tmp_path, settings, n=40, shard_size=20)
    big = flagged_batch(user, tmp_path, settings, n=200, shard_size=10)
    counts = []
    for batch in (small, big):
        with CaptureQueriesContext(connection) as queries:
            assert site.get(reverse("batch_flags", args=[batch.pk])).status_code == 200
        counts.append(len(queries))
    assert counts[0] == counts[1] and counts[1] <= 12


# --- spot check ---


def test_spot_check_sample_and_marks(site, user, tmp_path):
    batch = run_batch(make_batch(user, chat_lines(300), tmp_path))
    assert spot_samples.spot_sample_size(300) == 15
    assert spot_samples.spot_sample_size(5) == 5 and spot_samples.spot_sample_size(10_000) == 200
    page = site.get(reverse("batch_spot_check", args=[batch.pk])).content.decode()
    assert page.count('<article class="result spot') == 15
    sample = spot_samples.spot_sample(batch)
    assert [s.custom_id for s in sample] == [s.custom_id for s in spot_samples.spot_sample(batch)]
    first, second = sample[0].custom_id, sample[1].custom_id
    response = site.post(reverse("batch_spot_check", args=[batch.pk]),
                         {"custom_id": first, "verdict": "good", "note": "fine"}, **HTMX)
    html = response.content.decode()
    assert response.status_code == 200 and "marked-good" in html
    assert 'hx-swap-oob="true"' in html and "100%" in html
    site.post(reverse("batch_spot_check", args=[batch.pk]),
              {"custom_id": second, "verdict": "bad"})
    assert SpotCheck.objects.filter(batch=batch).count() == 2
    detail = site.get(reverse("batch_detail", args=[batch.pk])).content.decode()
    assert "50% good" in detail
    outside = site.post(reverse("batch_spot_check", args=[batch.pk]),
                        {"custom_id": "not-in-sample", "verdict": "good"})
    assert outside.status_code == 400


def test_spot_check_flagged_only_samples_among_flagged(site, user, tmp_path, settings):
    batch = flagged_batch(user, tmp_path, settings, n=600, shard_size=200)
    flagged = set(expected(600))
    sample = spot_samples.flagged_sample(batch)
    # 5% of the 360 flagged requests, at least 10: 18, all flagged, stable.
    assert len(flagged) == 360 and len(sample) == 18
    assert {item.custom_id for item in sample} <= flagged
    assert [i.custom_id for i in sample] == [i.custom_id for i in
                                             spot_samples.flagged_sample(batch)]
    assert all(item.flags == tuple(flags_of(item.custom_id)) for item in sample)
    url = reverse("batch_spot_check", args=[batch.pk])
    page = site.get(url, {"flagged": "1"}).content.decode()
    assert page.count('<article class="result spot') == 18
    assert set(cids(page)) == {item.custom_id for item in sample}
    assert 'name="flagged" value="1"' in page and "Flagged outputs only" in page
    assert f'href="{url}?flagged=1"' in page
    # The default sample still draws from every finished request.
    assert 'name="flagged"' not in site.get(url).content.decode()


def test_spot_check_flagged_marks(site, user, tmp_path, settings):
    batch = flagged_batch(user, tmp_path, settings, n=60)
    url = reverse("batch_spot_check", args=[batch.pk])
    flagged_ids = [item.custom_id for item in spot_samples.flagged_sample(batch)]
    regular = {item.custom_id for item in spot_samples.spot_sample(batch)}
    target = flagged_ids[0]
    response = site.post(url, {"custom_id": target, "verdict": "bad", "flagged": "1"},
                         **HTMX)
    assert response.status_code == 200 and "marked-bad" in response.content.decode()
    assert 'name="flagged" value="1"' in response.content.decode()
    # Without JavaScript: a redirect back to the flagged sample.
    other = next(c for c in flagged_ids[1:])
    response = site.post(url, {"custom_id": other, "verdict": "good", "flagged": "1"})
    assert response.status_code == 302 and "?flagged=1#spot-" in response.url
    assert SpotCheck.objects.filter(batch=batch).count() == 2
    # A flagged id outside the regular sample cannot be marked without the option.
    outside = next((c for c in flagged_ids if c not in regular), None)
    if outside is not None:
        assert site.post(url, {"custom_id": outside, "verdict": "good"}).status_code == 400
    unflagged = next(f"r{i}" for i in range(60) if not flags_of(f"r{i}"))
    assert site.post(url, {"custom_id": unflagged, "verdict": "good",
                           "flagged": "1"}).status_code == 400


def test_spot_check_flagged_empty(site, user, tmp_path):
    batch = run_batch(make_batch(user, chat_lines(3, "x"), tmp_path))
    html = site.get(reverse("batch_spot_check", args=[batch.pk]),
                    {"flagged": "1"}).content.decode()
    assert "No flagged outputs" in html


# --- with workers and the echo engine ---


@pytest.mark.django_db(transaction=True)
def test_real_worker_flags_on_the_dashboard(client, user, workers, tmp_path):
    from jobs.services.batches import create_batch
    from tests.factories import make_file

    file = make_file(user, [
        chat_line("plain", "a normal question"),
        chat_line("cut", "one two three four five", max_tokens=3),
        chat_line("loop", "na " * 30),
        chat_line("json", "give me json", response_format={"type": "json_object"}),
    ], tmp_path)
    batch = create_batch(owner=user, input_file_id=file.pk, endpoint="/v1/chat/completions",
                         completion_window="24h")
    workers.start()
    wait_for(lambda: Batch.objects.get(pk=batch.pk).status == "completed", timeout=60,
             message="the batch to complete")
    client.force_login(user)
    page = client.get(reverse("batch_detail", args=[batch.pk])).content.decode()
    assert "1 JSON retry" in page
    counts = {flag: n for flag, _, n in flags.flag_counts(batch)}
    assert counts == {"empty_output": 0, "length_limit": 1, "repetition": 1,
                      "invalid_json": 1}
    html = client.get(reverse("batch_flags", args=[batch.pk])).content.decode()
    assert cids(html) == ["cut", "loop", "json"]
    html = client.get(reverse("batch_flags", args=[batch.pk]),
                      {"flag": "invalid_json"}).content.decode()
    assert cids(html) == ["json"] and "give me json" in html
    spot = client.get(reverse("batch_spot_check", args=[batch.pk]),
                      {"flagged": "1"}).content.decode()
    assert sorted(cids(spot)) == ["cut", "json", "loop"]


# --- a Message Batch (Anthropic's API) on the same pages ---


@pytest.mark.django_db(transaction=True)
def test_message_batch_page_labels_it_and_previews_messages(site, user, tmp_path, settings):
    from engine.base import ModelSpec
    from engine.echo import EchoEngine
    from jobs.services.message_batches import create_message_batch
    from jobs.services.validation import run_validation
    from jobs.worker.pipeline import Pipeline
    from tests.factories import finalized, run_all_shards

    params = {"model": "echo-test", "max_tokens": 8, "system": "Be brief.",
              "messages": [{"role": "user", "content": [{"type": "text",
                                                         "text": "hello there"}]}]}
    body = json.dumps({"requests": [
        {"custom_id": "m1", "params": params},
        {"custom_id": "m2", "params": {**params, "top_k": -1}}]}).encode()
    batch = create_message_batch(owner=user, body=io.BytesIO(body), declared_length=len(body))
    run_validation(batch_id=batch.pk)
    pipeline = Pipeline(EchoEngine(ModelSpec(name="echo-test", backend="echo")),
                        worker_name="test-worker", inbox_size=8, reconcile_every=0)
    pipeline.start()
    try:
        run_all_shards(pipeline, Batch.objects.get(pk=batch.pk))
    finally:
        pipeline.close()
    batch, out, err = finalized(batch)
    assert [line["custom_id"] for line in out] == ["m1"]
    assert out[0]["response"]["body"]["type"] == "message"
    # The refused request never reached the engine: its shard wrote the problem.
    assert [(e["custom_id"], e["response"]["status_code"],
             e["response"]["body"]["error"]["code"]) for e in err] == [
        ("m2", 400, "invalid_parameter")]

    page = site.get(reverse("batch_detail", args=[batch.pk])).content.decode()
    assert "Anthropic Message Batch" in page and "/v1/messages" in page
    results_page = site.get(reverse("batch_results", args=[batch.pk])).content.decode()
    assert "system: Be brief." in results_page and "user: hello there" in results_page
    assert "echo: hello there" in results_page
    errors_page = site.get(reverse("batch_errors", args=[batch.pk])).content.decode()
    assert "params.top_k must be a non-negative integer." in errors_page
    assert "(Anthropic)" in site.get(reverse("batch_list")).content.decode()


# --- score and rerank batches (vLLM's pooling endpoints) on the same pages ---


@pytest.mark.django_db(transaction=True)
def test_score_and_rerank_batches_from_the_form_preview_their_scores(site, user):
    from engine.base import ModelSpec
    from engine.echo import EchoEngine
    from jobs.services.validation import run_validation
    from jobs.worker.pipeline import Pipeline
    from tests.factories import finalized, run_all_shards

    form = site.get(reverse("batch_new")).content.decode()
    assert '<option value="/v1/score">' in form and '<option value="/v1/rerank">' in form
    kinds = {
        "/v1/score": [{"custom_id": "s1", "method": "POST", "url": "/v1/score", "body": {
            "model": "echo-test", "queries": "a cat", "documents": ["a kitten", "taxes"]}}],
        "/v1/rerank": [{"custom_id": "r1", "method": "POST", "url": "/v1/rerank", "body": {
            "model": "echo-test", "query": "a cat", "documents": ["taxes", "a cat"],
            "top_n": 2}}],
    }
    pipeline = Pipeline(EchoEngine(ModelSpec(name="echo-test", backend="echo")),
                        worker_name="test-worker", inbox_size=8, reconcile_every=0)
    pipeline.start()
    pages = {}
    try:
        for endpoint, lines in kinds.items():
            response = site.post(reverse("batch_new"), {
                "upload": upload(jsonl(lines)), "action": "submit", "endpoint": endpoint,
                "completion_window": "24h", "priority": "default"})
            batch = Batch.objects.get(owner=user, endpoint=endpoint)
            assert response.status_code == 302
            run_validation(batch_id=batch.pk)
            run_all_shards(pipeline, Batch.objects.get(pk=batch.pk))
            batch, out, err = finalized(batch)
            assert batch.status == "completed" and not err and len(out) == 1
            assert batch.output_tokens == 0 and batch.input_tokens > 0
            pages[endpoint] = (
                site.get(reverse("batch_detail", args=[batch.pk])).content.decode(),
                site.get(reverse("batch_results", args=[batch.pk])).content.decode(),
                out[0]["response"]["body"])
    finally:
        pipeline.close()

    detail, results_page, body = pages["/v1/score"]
    assert "/v1/score" in detail
    # The request's two sides, then one score a pair.
    assert "queries: a cat" in results_page and "documents[1]: taxes" in results_page
    assert f"pair 0: {body['data'][0]['score']:.4f}" in results_page
    assert f"pair 1: {body['data'][1]['score']:.4f}" in results_page
    detail, results_page, body = pages["/v1/rerank"]
    assert "/v1/rerank" in detail
    assert "query: a cat" in results_page and "documents[0]: taxes" in results_page
    # The documents by relevance: the query's own text first, with a score of 1.
    assert "1.0000 documents[1]: a cat" in results_page
    listed = site.get(reverse("batch_list")).content.decode()
    assert "/v1/score" in listed and "/v1/rerank" in listed
