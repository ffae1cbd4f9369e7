"""Dashboard views: every page and partial, ownership (another user's ids are 404), htmx
partials and polling stops, query counts on lists, streamed downloads, hostile content."""

from __future__ import annotations

import json
import random
from datetime import timedelta

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.urls import reverse
from django.utils import timezone

from jobs.models import ApiKey, Batch, File, Shard, SpotCheck
from jobs.queries import dashboard, results
from jobs.services import spotcheck
from jobs.services.keys import create_api_key
from jobs.services.progress import refresh_progress
from jobs.templatetags.dashboard import clip
from tests.factories import (
    HTMX,
    chat_line,
    chat_lines,
    jsonl,
    lines_of,
    make_batch,
    make_file,
    run_batch,
    run_shard,
)

pytestmark = pytest.mark.django_db

@pytest.fixture
def other_site(client, other_user):
    client.force_login(other_user)
    return client


def body(response) -> str:
    return b"".join(response.streaming_content).decode() if response.streaming else \
        response.content.decode()


# --- sign in ---


def test_pages_need_sign_in(client):
    for url in (reverse("batch_list"), reverse("batch_new"), reverse("file_list"),
                reverse("key_list")):
        response = client.get(url)
        assert response.status_code == 302
        assert response.url.startswith(reverse("login"))


def test_sign_in_and_out(client, user):
    page = client.get(reverse("login"))
    assert page.status_code == 200 and b"csrfmiddlewaretoken" in page.content
    response = client.post(reverse("login"), {"username": "alice", "password": "pw-alice-123"})
    assert response.status_code == 302 and response.url == reverse("batch_list")
    assert client.get(reverse("batch_list")).status_code == 200
    assert client.post(reverse("logout")).status_code == 302
    assert client.get(reverse("batch_list")).status_code == 302


# --- batch list ---


def test_batch_list_shows_only_mine_with_progress(site, user, other_user, tmp_path, settings):
    mine = make_batch(user, chat_lines(10), tmp_path, shard_size=5, settings=settings)
    run_shard(Shard.objects.get(batch=mine, index=0))
    theirs = make_batch(other_user, chat_lines(3), tmp_path)
    page = site.get(reverse("batch_list")).content.decode()
    assert mine.pk in page and theirs.pk not in page
    assert "5 / 10" in page
    # A running row polls itself; the htmx script is served locally.
    assert f'hx-get="{reverse("batch_row", args=[mine.pk])}"' in page
    assert 'hx-trigger="every 2s"' in page
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
    assert response.status_code == 200 and b'hx-trigger="every 2s"' in response.content
    run_batch(batch)
    response = site.get(reverse("batch_row", args=[batch.pk]), **HTMX)
    assert response.status_code == 286
    assert b"hx-trigger" not in response.content and b"Completed" in response.content


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
    assert dashboard.model_throughput("echo-test") == pytest.approx(2.0)
    file = make_file(user, chat_lines(120), tmp_path)
    page = site.post(reverse("batch_new"), {"file_id": file.pk, "action": "check",
                                            "completion_window": "24h",
                                            "priority": "default"}).content.decode()
    assert "1m 00s" in page and "120.0/min" in page


# --- batch page ---


def test_batch_page_running_and_live_partial(site, user, tmp_path, settings):
    batch = make_batch(user, chat_lines(30), tmp_path, shard_size=10, settings=settings)
    now = timezone.now()
    run_shard(Shard.objects.get(batch=batch, index=0), started=now - timedelta(seconds=20),
              seconds=10)
    Shard.objects.filter(batch=batch, index=1).update(
        status="running", attempt=2, failures=1, recomputed=10,
        started_at=now - timedelta(seconds=5),
        completed=4, failed=1, input_tokens=20, output_tokens=12, heartbeat_at=now)
    refresh_progress(batch_id=batch.pk)  # as the worker's heartbeat does
    page = site.get(reverse("batch_detail", args=[batch.pk])).content.decode()
    assert "15</strong> of 30 requests" in page
    assert f'hx-get="{reverse("batch_live", args=[batch.pk])}"' in page
    assert "<svg" in page and "chart-line" in page
    assert "Retry rate" in page and "33.3%" in page  # a failed run's 10 of 30 runs
    assert "ETA" in page
    assert "Results so far" in page and 'id="cancel"' in page
    live = site.get(reverse("batch_live", args=[batch.pk]), **HTMX)
    assert live.status_code == 200
    assert live.content.decode().lstrip().startswith('<section id="live"')


def test_live_partial_stops_polling_when_ended(site, user, tmp_path):
    batch = run_batch(make_batch(user, chat_lines(3), tmp_path), fails=lambda c: c == "r2")
    live = site.get(reverse("batch_live", args=[batch.pk]), **HTMX)
    assert live.status_code == 286
    html = live.content.decode()
    assert "hx-trigger" not in html and "Completed" in html
    assert 'id="download-output"' in html and 'id="download-errors"' in html
    assert 'id="rerun"' in html


def test_batch_stats_report():
    start = timezone.now() - timedelta(minutes=10)
    batch = Batch(status=Batch.Status.IN_PROGRESS, total=100, in_progress_at=start)
    batch.completed, batch.failed, batch.input_tokens, batch.output_tokens = 45, 5, 900, 100
    now = start + timedelta(minutes=5)
    rows = [
        dashboard.ShardRow("b", "done", start, start + timedelta(minutes=2), 25, 0, 1, 0, 500,
                           50),
        dashboard.ShardRow("b", "running", start + timedelta(minutes=3), None, 20, 5, 2, 1,
                           400, 50),
        dashboard.ShardRow("b", "abandoned", None, now, 0, 30, 0, 0, 0, 0),
    ]
    rate_now, rate_avg, elapsed = dashboard._rates(batch, rows, now)
    assert elapsed == 300
    assert rate_avg == pytest.approx(50 / 300)
    # The last two minutes hold the running shard's 25 requests.
    assert rate_now == pytest.approx(25 / 120)
    assert dashboard.eta_seconds(batch, rows, 50, now) == pytest.approx(50 / (25 / 120))
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
            rows.append(dashboard.ShardRow(
                "b", "running" if running else rng.choice(["done", "done", "abandoned"]),
                began, None if running else finished, rng.randrange(50), rng.randrange(5),
                1, 0, 0, 0))
        buckets = 7
        end = dashboard.ended_at(batch) or now
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
    batch = run_batch(batch, fails=lambda c: c in {"r1", "r7", "r11"})
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
    got = [json.loads(x)["custom_id"] for x in body(partial).splitlines()]
    assert sorted(got) == ["r0", "r1", "r2", "r4"]
    errors = body(site.get(reverse("batch_download", args=[batch.pk, "errors"])))
    assert [json.loads(x)["custom_id"] for x in errors.splitlines()] == ["r3"]

    batch = run_batch(batch)
    output = site.get(reverse("batch_download", args=[batch.pk, "output"]))
    assert output["Content-Disposition"] == f'attachment; filename="{batch.pk}_output.jsonl"'
    assert output["Content-Type"] == "application/jsonl"
    assert len(body(output).splitlines()) == 9
    source = site.get(reverse("batch_download", args=[batch.pk, "input"]))
    assert source["Content-Disposition"] == 'attachment; filename="in.jsonl"'
    assert body(source).encode() == jsonl(chat_lines(10))
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


# --- spot check ---


def test_spot_check_sample_and_marks(site, user, tmp_path):
    batch = run_batch(make_batch(user, chat_lines(300), tmp_path))
    assert spotcheck.spot_sample_size(300) == 15
    assert spotcheck.spot_sample_size(5) == 5 and spotcheck.spot_sample_size(10_000) == 200
    page = site.get(reverse("batch_spot_check", args=[batch.pk])).content.decode()
    assert page.count('<article class="result spot') == 15
    sample = spotcheck.spot_sample(batch)
    assert [s.custom_id for s in sample] == [s.custom_id for s in spotcheck.spot_sample(batch)]
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


# --- files ---


def test_files_page_download_delete(site, user, other_user, tmp_path,
                                    django_assert_max_num_queries):
    batch = run_batch(make_batch(user, chat_lines(3), tmp_path))
    theirs = make_file(other_user, chat_lines(1), tmp_path, name="secret.jsonl")
    spare = make_file(user, chat_lines(2), tmp_path, name="spare.jsonl")
    with django_assert_max_num_queries(6):
        page = site.get(reverse("file_list")).content.decode()
    assert "spare.jsonl" in page and f"{batch.pk}_output.jsonl" in page
    assert "secret.jsonl" not in page and theirs.pk not in page
    only = site.get(reverse("file_list"), {"purpose": "batch_output"}).content.decode()
    assert "spare.jsonl" not in only
    download = site.get(reverse("file_download", args=[spare.pk]))
    assert download["Content-Disposition"] == 'attachment; filename="spare.jsonl"'
    assert body(download).encode() == jsonl(chat_lines(2))
    assert site.post(reverse("file_delete", args=[spare.pk])).status_code == 302
    assert not File.objects.filter(pk=spare.pk).exists()
    assert site.get(reverse("file_download", args=[spare.pk])).status_code == 404
    running = make_batch(user, chat_lines(2, "x"), tmp_path)
    refused = site.post(reverse("file_delete", args=[running.input_file_id]), follow=True)
    assert b"still running" in refused.content
    assert File.objects.filter(pk=running.input_file_id).exists()


# --- API keys ---


def test_keys_create_once_list_revoke(site, user):
    response = site.post(reverse("key_list"), {"name": "laptop"})
    page = response.content.decode()
    assert "no-cache" in response["Cache-Control"] or "max-age=0" in response["Cache-Control"]
    key = ApiKey.objects.get(owner=user, name="laptop")
    secret = page.split('<pre class="key" id="new-key">')[1].split("</pre>")[0]
    assert secret.startswith("sk-bw-") and secret[:12] == key.prefix
    listing = site.get(reverse("key_list")).content.decode()
    assert "laptop" in listing and secret not in listing and key.prefix in listing
    assert site.post(reverse("key_revoke", args=[key.pk])).status_code == 302
    assert ApiKey.objects.get(pk=key.pk).revoked_at is not None
    assert "revoked" in site.get(reverse("key_list")).content.decode()


def test_static_and_htmx_are_local(site):
    page = site.get(reverse("batch_list")).content.decode()
    assert "cdn" not in page.lower() and "unpkg" not in page
    assert "django_htmx/htmx" in page


def test_every_form_has_csrf(site, user, tmp_path):
    batch = run_batch(make_batch(user, chat_lines(12), tmp_path), fails=lambda c: c == "r1")
    running = make_batch(user, chat_lines(2, "x"), tmp_path)
    for url in (reverse("batch_new"), reverse("key_list"), reverse("file_list"),
                reverse("batch_detail", args=[batch.pk]),
                reverse("batch_detail", args=[running.pk]),
                reverse("batch_cancel", args=[running.pk]),
                reverse("batch_spot_check", args=[batch.pk])):
        page = site.get(url).content.decode()
        posts = page.count('method="post"')
        assert posts and page.count("csrfmiddlewaretoken") >= posts, url


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



