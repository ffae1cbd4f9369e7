"""The Batches and Models APIs: creation, validation errors, listing, cancel, isolation.

These run the validation job in-process (no worker): the engine-side path is in
tests/worker/test_execution.py. The queries of GET /v1/batches[/{id}] are bounded."""

from __future__ import annotations

from typing import Any

import pytest
import requests

from jobs.models import Batch, Shard
from jobs.tasks import validate_batch
from tests.factories import (
    chat_line,
    jsonl,
    lazy_import,
    new_batch,
    partly_run_batch,
    query_count,
    upload,
)

openai = lazy_import("openai")

pytestmark = pytest.mark.django_db(transaction=True)


def test_create_validate_and_retrieve(openai_client, settings):
    settings.BATCHWEB = {**settings.BATCHWEB, "SHARD_SIZE": 2}
    file_id = upload(openai_client, jsonl([chat_line(f"r{i}", f"hi {i}") for i in range(5)])).id
    batch = new_batch(openai_client, file_id, metadata={"project": "demo"})
    assert batch.status == "validating"
    assert batch.input_file_id == file_id
    assert batch.metadata == {"project": "demo"}
    assert batch.expires_at - batch.created_at == 24 * 3600
    assert batch.request_counts.total == 0

    validate_batch(batch.id)
    batch = openai_client.batches.retrieve(batch.id)
    assert batch.status == "in_progress"
    assert batch.in_progress_at is not None
    assert batch.model == "echo-test"
    assert batch.request_counts.total == 5
    shards = list(Shard.objects.filter(batch_id=batch.id).order_by("index"))
    assert [s.request_count for s in shards] == [2, 2, 1]
    assert [s.first_line for s in shards] == [1, 3, 5]
    # Fair share: only a couple of a batch's shards wait in Redis at a time.
    assert sum(1 for s in shards if s.enqueued_at) == 2


def test_validation_reports_every_bad_line(openai_client):
    lines = [
        chat_line("ok-1", "fine"),
        chat_line("ok-1", "duplicate id"),
        {"custom_id": "m", "method": "GET", "url": "/v1/chat/completions", "body": {}},
        {"custom_id": "u", "method": "POST", "url": "/v1/completions",
         "body": {"model": "echo-test", "prompt": "x"}},
        chat_line("nomodel", "x", model="gpt-unknown"),
        {"custom_id": "b", "method": "POST", "url": "/v1/chat/completions", "body": [1]},
        chat_line("neg", "x", max_tokens=-5),
        {"method": "POST", "url": "/v1/chat/completions", "body": {"model": "echo-test"}},
    ]
    file_id = upload(openai_client, jsonl(lines)).id
    file_problems = {
        (2, "duplicate_custom_id"), (3, "invalid_method"), (4, "mismatched_endpoint"),
        (5, "model_not_found"), (6, "invalid_body"), (8, "missing_required_parameter")}
    # Line 7's body is its request's own problem, a file problem only in a strict batch.
    for extra, expected in (({}, file_problems),
                            ({"strict": True}, {*file_problems, (7, "invalid_parameter")})):
        batch = new_batch(openai_client, file_id, extra_body=extra)
        validate_batch(batch.id)
        batch = openai_client.batches.retrieve(batch.id)
        assert batch.status == "failed"
        assert batch.failed_at is not None
        assert {(e.line, e.code) for e in batch.errors.data} == expected
        assert not Shard.objects.filter(batch_id=batch.id).exists()


def test_mixed_models_fail_validation(openai_client, settings):
    settings.BATCHWEB_MODELS = [*settings.BATCHWEB_MODELS,
                                {**settings.ECHO_MODEL, "name": "echo-other"}]
    batch = new_batch(openai_client, upload(openai_client, jsonl([
        chat_line("a", "x"), chat_line("b", "y", model="echo-other")])).id)
    validate_batch(batch.id)
    batch = openai_client.batches.retrieve(batch.id)
    assert batch.status == "failed"
    assert [(e.line, e.code) for e in batch.errors.data] == [(2, "mismatched_model")]


@pytest.mark.parametrize("field, value, param", [
    ("endpoint", "/v1/images", "endpoint"),
    ("completion_window", "forever", "completion_window"),
    ("completion_window", "0h", "completion_window"),
    ("metadata", {f"k{i}": "v" for i in range(17)}, "metadata"),
    ("metadata", {"k": "v" * 513}, "metadata.k"),
])
def test_bad_create_parameters_are_400(openai_client, field, value, param):
    file_id = upload(openai_client, jsonl([chat_line("a", "x")])).id
    args = {"input_file_id": file_id, "endpoint": "/v1/chat/completions",
            "completion_window": "24h", field: value}
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.batches.create(**args)
    assert caught.value.body["param"] == param
    assert Batch.objects.count() == 0


def test_other_completion_windows(openai_client):
    file_id = upload(openai_client, jsonl([chat_line("a", "x")])).id
    batch = openai_client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                         completion_window="1h")
    assert batch.expires_at - batch.created_at == 3600


def test_list_batches_paginates(openai_client):
    file_id = upload(openai_client, jsonl([chat_line("a", "x")])).id
    ids = [new_batch(openai_client, file_id).id for _ in range(5)]
    page = openai_client.batches.list(limit=2)
    assert [b.id for b in page.data] == ids[::-1][:2]
    assert page.has_more
    assert [b.id for b in openai_client.batches.list(limit=2)] == ids[::-1]
    assert [b.id for b in openai_client.batches.list(after=ids[2], limit=10).data] == ids[:2][::-1]


@pytest.mark.parametrize("query", ["limit=0", "limit=101", "limit=abc", "after=batch_nope"])
def test_bad_pagination_is_400(live_server, api_key, query):
    response = requests.get(f"{live_server.url}/v1/batches?{query}",
                            headers={"Authorization": f"Bearer {api_key}"})
    assert response.status_code == 400
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_cancel_before_running(openai_client):
    from jobs.tasks import finalize_batch

    data = jsonl([chat_line(f"r{i}", "x") for i in range(3)])
    batch = new_batch(openai_client, upload(openai_client, data).id)
    validate_batch(batch.id)
    cancelled = openai_client.batches.cancel(batch.id)
    assert cancelled.status == "cancelling"
    assert cancelled.cancelling_at is not None
    finalize_batch(batch.id)
    batch = openai_client.batches.retrieve(batch.id)
    assert batch.status == "cancelled"
    assert batch.request_counts.failed == 3
    assert batch.output_file_id is None
    errors = openai_client.files.content(batch.error_file_id).text.splitlines()
    assert len(errors) == 3
    assert all('"batch_cancelled"' in line for line in errors)
    with pytest.raises(openai.ConflictError):
        openai_client.batches.cancel(batch.id)


def test_models_lists_the_deployment(openai_client, settings):
    names = [m.id for m in openai_client.models.list()]
    assert names == [m["name"] for m in settings.BATCHWEB_MODELS]


def test_another_users_batches_are_404(openai_client, other_client):
    file_id = upload(openai_client, jsonl([chat_line("a", "x")])).id
    batch = new_batch(openai_client, file_id)
    with pytest.raises(openai.NotFoundError):
        other_client.batches.retrieve(batch.id)
    with pytest.raises(openai.NotFoundError):
        other_client.batches.cancel(batch.id)
    with pytest.raises(openai.NotFoundError):
        new_batch(other_client, file_id)
    assert other_client.batches.list().data == []
    assert Batch.objects.get(pk=batch.id).status == "validating"


def test_json_body_errors(live_server, api_key):
    headers = {"Authorization": f"Bearer {api_key}"}
    response = requests.post(f"{live_server.url}/v1/batches", data="{nope",
                             headers={**headers, "Content-Type": "application/json"})
    assert response.status_code == 400
    response = requests.post(f"{live_server.url}/v1/batches", data="a=b",
                             headers={**headers, "Content-Type": "text/plain"})
    assert response.status_code == 400
    assert "application/json" in response.json()["error"]["message"]


# Bounded queries on what is listed and polled most: the count must not grow with the
# shards or batches, and stays under a small absolute bound.


@pytest.fixture
def api(client: Any, api_key: str) -> Any:
    """GET through Django's test client with the user's key."""
    def get(url: str, **params: Any) -> Any:
        return client.get(url, params, HTTP_AUTHORIZATION=f"Bearer {api_key}")
    return get


@pytest.mark.django_db
def test_api_batch_retrieve_queries_do_not_grow_with_shards(api, user, tmp_path, settings):
    small = partly_run_batch(user, tmp_path, settings, requests=4, shard_size=2, done=1)
    big = partly_run_batch(user, tmp_path, settings, requests=80, shard_size=2, done=25, prefix="b")
    counts = [query_count(lambda b=b: api(f"/v1/batches/{b.pk}")) for b in (small, big)]
    assert counts[0] == counts[1] <= 3, counts


@pytest.mark.django_db
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
