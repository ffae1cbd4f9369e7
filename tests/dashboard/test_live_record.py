"""The batch page's live block: "What ran it" is part of it, so a page opened before any
worker claimed a shard shows the engines once one has (and when the batch ends), as its
Engines card does; and a batch with no price says so, with its tokens, instead of a cost
of zero."""

from __future__ import annotations

import pytest
from django.urls import reverse

from jobs.models import Batch, Price, Shard
from jobs.services import what_ran
from tests.factories import HTMX, chat_lines, make_batch, poll_of, run_batch

pytestmark = pytest.mark.django_db

ENGINE = {"engine": "vllm", "engine_version": "0.9.9", "dtype": "bfloat16",
          "model": "echo-test", "model_source": "pypi:echo", "model_sha256": "ab12" * 16,
          "parallelism": {"tensor_parallel_size": 1}, "sampling_defaults": {},
          "batchweb_version": "1.0"}


def test_what_ran_it_follows_the_first_claim_and_the_end(site, user, tmp_path, settings):
    batch = make_batch(user, chat_lines(4), tmp_path, shard_size=2, settings=settings)
    page = site.get(reverse("batch_detail", args=[batch.pk])).content.decode()
    assert "No worker has claimed a shard yet" in page
    url, _ = poll_of(page)
    first = site.get(url, **HTMX)
    assert "No worker has claimed a shard yet" in first.content.decode()

    # A worker claims a shard: nothing else of the batch changed, yet the next poll is a
    # new answer (not the 304 of the last one) that names the engine, in the card and in
    # the section alike.
    shard = Shard.objects.filter(batch=batch).order_by("index").first()
    shard.batch = Batch.objects.get(pk=batch.pk)
    assert what_ran.record_claim(shard=shard, worker="gpu-1.7.echo-test", engine=ENGINE)
    again = site.get(url, HTTP_IF_NONE_MATCH=first["ETag"], **HTMX)
    assert again.status_code == 200 and again["ETag"] != first["ETag"]
    live = again.content.decode()
    assert "No worker has claimed a shard yet" not in live
    assert 'id="report-engines"' in live and 'id="provenance"' in live
    assert "sha256:" + "ab12" * 4 in live
    assert "gpu-1" not in live  # the owner sees no machine's name

    # The final answer (the one that stops polling) keeps it.
    done = run_batch(Batch.objects.get(pk=batch.pk))
    ended = site.get(url, **HTMX)
    assert ended.status_code == 286 and done.is_ended
    assert "No worker has claimed a shard yet" not in ended.content.decode()
    assert "provenance-entry" in ended.content.decode()
    # A whole page has the section once, inside the live block.
    page = site.get(reverse("batch_detail", args=[batch.pk])).content.decode()
    assert page.count('id="provenance"') == 1
    assert page.index('id="live"') < page.index('id="provenance"')


def test_a_batch_without_prices_says_not_priced_not_a_zero_cost(site, user, tmp_path,
                                                                settings):
    batch = run_batch(make_batch(user, chat_lines(3), tmp_path, settings=settings))
    live = site.get(reverse("batch_live", args=[batch.pk]), **HTMX).content.decode()
    cost = live[live.index('id="batch-cost"'):].split("</dd>")[0]
    assert "0.0" not in cost and "USD" not in cost
    assert cost.split(">", 1)[1].startswith("not priced")  # as every page says it

    Price.objects.create(model="", input_per_million=1, output_per_million=1)
    priced = run_batch(make_batch(user, chat_lines(3), tmp_path, settings=settings))
    live = site.get(reverse("batch_live", args=[priced.pk]), **HTMX).content.decode()
    cost = live[live.index('id="batch-cost"'):].split("</dd>")[0]
    assert "USD" in cost and "not priced" not in cost
