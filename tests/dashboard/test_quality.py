"""Dashboard and quality flags: counts per flag on the batch page, the flags tab with its
drill-down and offset paging (while running and once ended), the retry rate counting JSON
retries, the flagged-only spot check, ownership (404) and bounded queries; and the same
with real workers and the echo engine."""

from __future__ import annotations

import io
import json

import pytest
from django.core.files.base import ContentFile
from django.core.files.storage import default_storage
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from jobs.models import Batch, Shard, SpotCheck
from jobs.queries import dashboard, flags, results
from jobs.services import spotcheck
from jobs.services.files import new_storage_name
from jobs.services.shard_input import shard_custom_ids
from tests.factories import HTMX, chat_line, chat_lines, make_batch, run_batch, run_shard, wait_for

pytestmark = pytest.mark.django_db

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


# --- counts ---


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


# --- spot check, flagged only ---


def test_spot_check_flagged_only_samples_among_flagged(site, user, tmp_path, settings):
    batch = flagged_batch(user, tmp_path, settings, n=600, shard_size=200)
    flagged = set(expected(600))
    sample = spotcheck.flagged_sample(batch)
    # 5% of the 360 flagged requests, at least 10: 18, all flagged, stable.
    assert len(flagged) == 360 and len(sample) == 18
    assert {item.custom_id for item in sample} <= flagged
    assert [i.custom_id for i in sample] == [i.custom_id for i in
                                             spotcheck.flagged_sample(batch)]
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
    flagged_ids = [item.custom_id for item in spotcheck.flagged_sample(batch)]
    regular = {item.custom_id for item in spotcheck.spot_sample(batch)}
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


