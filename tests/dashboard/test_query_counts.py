"""Bounded queries on what is polled or listed most (issue 6, benchmark 4): the batch page's
live partial, a list row, the batch list partial, and GET /v1/batches[/{id}]. Each is
measured on a small and a large case (more shards, more batches); the count must not grow,
and stays under a small absolute bound."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from jobs.models import Shard
from tests.dashboard_support import make_batch, run_batch, run_shard
from tests.helpers import chat_line

pytestmark = pytest.mark.django_db

HTMX = {"HTTP_HX_REQUEST": "true"}


def lines(n: int, prefix: str = "r") -> list[dict]:
    return [chat_line(f"{prefix}{i}", f"question {i}", max_tokens=10) for i in range(n)]


def running(user: Any, tmp_path: Any, settings: Any, *, requests: int, shard_size: int,
            done: int, prefix: str = "r") -> Any:
    """A running batch with `done` of its shards finished."""
    batch = make_batch(user, lines(requests, prefix), tmp_path, shard_size=shard_size,
                       settings=settings)
    for shard in Shard.objects.filter(batch=batch).order_by("index")[:done]:
        run_shard(shard)
    return batch


def count(get: Callable[[], Any]) -> int:
    get()  # warm: the first use of an API key records last_used_at (once a minute)
    with CaptureQueriesContext(connection) as queries:
        response = get()
    assert response.status_code in (200, 286), response.status_code
    return len(queries)


@pytest.fixture
def api(client, api_key):
    def get(url: str, **params: Any) -> Any:
        return client.get(url, params, HTTP_AUTHORIZATION=f"Bearer {api_key}")
    return get


@pytest.mark.parametrize(("view", "bound"), [("batch_live", 8), ("batch_row", 5)])
def test_batch_partial_queries_do_not_grow_with_shards(site, user, tmp_path, settings, view,
                                                       bound):
    small = running(user, tmp_path, settings, requests=4, shard_size=2, done=1)
    big = running(user, tmp_path, settings, requests=80, shard_size=2, done=25, prefix="b")
    counts = [count(lambda b=b: site.get(reverse(view, args=[b.pk]), **HTMX))
              for b in (small, big)]
    assert counts[0] == counts[1] <= bound, counts


def test_batch_list_partial_queries_do_not_grow_with_batches(site, user, tmp_path, settings):
    def page() -> Any:
        return site.get(reverse("batch_list"), **HTMX)

    for i in range(3):
        running(user, tmp_path, settings, requests=6, shard_size=2, done=1, prefix=f"a{i}-")
    few = count(page)
    for i in range(22):
        batch = running(user, tmp_path, settings, requests=6, shard_size=2, done=1,
                        prefix=f"b{i}-")
        if i % 2:
            run_batch(batch)
    many = count(page)
    assert b'<tr id="row-' in page().content
    assert few == many <= 7, (few, many)
    active = count(lambda: site.get(reverse("batch_list"), {"status": "active"}, **HTMX))
    assert active <= 7, active


def test_api_batch_retrieve_queries_do_not_grow_with_shards(api, user, tmp_path, settings):
    small = running(user, tmp_path, settings, requests=4, shard_size=2, done=1)
    big = running(user, tmp_path, settings, requests=80, shard_size=2, done=25, prefix="b")
    counts = [count(lambda b=b: api(f"/v1/batches/{b.pk}")) for b in (small, big)]
    assert counts[0] == counts[1] <= 3, counts


def test_api_batch_list_queries_do_not_grow_with_batches(api, user, tmp_path, settings):
    for i in range(3):
        running(user, tmp_path, settings, requests=6, shard_size=2, done=1, prefix=f"a{i}-")
    few = count(lambda: api("/v1/batches", limit=20))
    for i in range(30):
        running(user, tmp_path, settings, requests=6, shard_size=2, done=1, prefix=f"b{i}-")
    many = count(lambda: api("/v1/batches", limit=20))
    assert api("/v1/batches", limit=20).json()["has_more"] is True
    assert few == many <= 3, (few, many)
    # Paging on: `after` adds only the anchor lookup.
    after = api("/v1/batches", limit=20).json()["last_id"]
    paged = count(lambda: api("/v1/batches", limit=20, after=after))
    assert paged <= many + 1, (paged, many)
