"""Bounded queries on what is polled or listed most (issue 6, benchmark 4): the batch page's
live partial, a list row, the batch list partial, and GET /v1/batches[/{id}]. Each is
measured on a small and a large case (more shards, more batches); the count must not grow,
and stays under a small absolute bound."""

from __future__ import annotations

from typing import Any

import pytest
from django.urls import reverse

from tests.factories import HTMX, partly_run_batch, query_count, run_batch

pytestmark = pytest.mark.django_db

@pytest.fixture
def api(client, api_key):
    def get(url: str, **params: Any) -> Any:
        return client.get(url, params, HTTP_AUTHORIZATION=f"Bearer {api_key}")
    return get


@pytest.mark.parametrize(("view", "bound"), [("batch_live", 8), ("batch_row", 5)])
def test_batch_partial_queries_do_not_grow_with_shards(site, user, tmp_path, settings, view,
                                                       bound):
    small = partly_run_batch(user, tmp_path, settings, requests=4, shard_size=2, done=1)
    big = partly_run_batch(user, tmp_path, settings, requests=80, shard_size=2, done=25, prefix="b")
    counts = [query_count(lambda b=b: site.get(reverse(view, args=[b.pk]), **HTMX))
              for b in (small, big)]
    assert counts[0] == counts[1] <= bound, counts


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


def test_api_batch_retrieve_queries_do_not_grow_with_shards(api, user, tmp_path, settings):
    small = partly_run_batch(user, tmp_path, settings, requests=4, shard_size=2, done=1)
    big = partly_run_batch(user, tmp_path, settings, requests=80, shard_size=2, done=25, prefix="b")
    counts = [query_count(lambda b=b: api(f"/v1/batches/{b.pk}")) for b in (small, big)]
    assert counts[0] == counts[1] <= 3, counts


def test_api_batch_list_queries_do_not_grow_with_batches(api, user, tmp_path, settings):
    for i in range(3):
        partly_run_batch(user, tmp_path, settings, requests=6, shard_size=2, done=1,
                         prefix=f"a{i}-")
    few = query_count(lambda: api("/v1/batches", limit=20))
    for i in range(30):
        partly_run_batch(user, tmp_path, settings, requests=6, shard_size=2, done=1,
                         prefix=f"b{i}-")
    many = query_count(lambda: api("/v1/batches", limit=20))
    assert api("/v1/batches", limit=20).json()["has_more"] is True
    assert few == many <= 3, (few, many)
    # Paging on: `after` adds only the anchor lookup.
    after = api("/v1/batches", limit=20).json()["last_id"]
    paged = query_count(lambda: api("/v1/batches", limit=20, after=after))
    assert paged <= many + 1, (paged, many)
