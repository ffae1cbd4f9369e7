"""Polling GET /v1/batches/{id}: an ETag on every answer, 304 Not Modified (the ETag, no
body) while the batch is unchanged, a full answer with the new counts after any progress
write, and the same body as ever for a client that sends no If-None-Match; the API key
from the cache (revoking takes effect at once), so a poll reads the batch row only."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
from django.core.cache import cache

from jobs.formats.checkpoint_record import Progress
from jobs.models import ApiKey, Batch, Shard
from jobs.services.keys import authenticate_key, revoke_api_key
from jobs.services.progress import refresh_progress
from jobs.services.shards import finish_shard
from tests.factories import Api, claimed_batch, heartbeat

pytestmark = pytest.mark.django_db


@pytest.fixture
def api(api_key: str) -> Api:
    return Api(api_key)


@pytest.fixture
def running(user: Any, tmp_path: Any, settings: Any) -> tuple[Batch, Shard]:
    return claimed_batch(user, tmp_path, settings)


def _poll(api: Api, batch: Batch, etag: str | None = None) -> Any:
    extra = {"HTTP_IF_NONE_MATCH": etag} if etag else {}
    return api.get(f"/v1/batches/{batch.pk}", **extra)


def test_without_if_none_match_the_answer_is_unchanged(api, running):
    batch, _ = running
    response = _poll(api, batch)
    assert response.status_code == 200
    assert response.json() == Batch.objects.get(pk=batch.pk).to_openai()
    assert response["ETag"].startswith('"') and response["ETag"].endswith('"')
    assert "no-cache" in response["Cache-Control"] and "private" in response["Cache-Control"]


def test_unchanged_batch_is_304_with_the_etag_and_no_body(api, running):
    batch, _ = running
    etag = _poll(api, batch)["ETag"]
    response = _poll(api, batch, etag)
    assert response.status_code == 304
    assert response["ETag"] == etag
    assert response.content == b""
    # A list of validators, one of them current, is unchanged too; another one is not.
    assert _poll(api, batch, f'"other", {etag}').status_code == 304
    assert _poll(api, batch, '"other"').status_code == 200


def test_every_progress_write_makes_the_next_poll_a_full_answer(api, running):
    batch, shard = running
    etag = _poll(api, batch)["ETag"]

    heartbeat(shard_id=shard.pk, attempt=shard.attempt,
              progress=Progress(completed=2, failed=1, input_tokens=10, output_tokens=6))
    response = _poll(api, batch, etag)
    assert response.status_code == 200
    assert response.json()["request_counts"] == {"total": 10, "completed": 2, "failed": 1}
    etag = response["ETag"]
    assert _poll(api, batch, etag).status_code == 304

    finish_shard(shard_id=shard.pk, attempt=shard.attempt, output_part="", error_part="",
                 progress=Progress(completed=4, failed=1, input_tokens=20, output_tokens=12))
    response = _poll(api, batch, etag)
    assert response.status_code == 200
    assert response.json()["request_counts"] == {"total": 10, "completed": 4, "failed": 1}
    etag = response["ETag"]

    # A write straight to a shard's counters, then the refresh every writer calls.
    Shard.objects.filter(batch=batch, index=1).update(completed=3, input_tokens=15)
    refresh_progress(batch_id=batch.pk)
    response = _poll(api, batch, etag)
    assert response.status_code == 200
    assert response.json()["request_counts"] == {"total": 10, "completed": 7, "failed": 1}


def test_a_status_change_without_progress_is_a_full_answer(api, running):
    batch, _ = running
    etag = _poll(api, batch)["ETag"]
    Batch.objects.filter(pk=batch.pk).update(status=Batch.Status.CANCELLING)
    response = _poll(api, batch, etag)
    assert response.status_code == 200 and response.json()["status"] == "cancelling"


def test_progress_writes_bump_the_version_only_when_the_sums_change(running):
    batch, shard = running
    before = Batch.objects.get(pk=batch.pk).progress_version
    heartbeat(shard_id=shard.pk, attempt=shard.attempt, progress=Progress(completed=1))
    assert Batch.objects.get(pk=batch.pk).progress_version == before + 1
    # A heartbeat with nothing new finished leaves the row, and so every poll's answer, as
    # it was.
    heartbeat(shard_id=shard.pk, attempt=shard.attempt, progress=Progress(completed=1))
    assert Batch.objects.get(pk=batch.pk).progress_version == before + 1
    heartbeat(shard_id=shard.pk, attempt=shard.attempt,
              progress=Progress(completed=1, output_tokens=5))
    after = Batch.objects.get(pk=batch.pk)
    assert after.progress_version == before + 2 and after.output_tokens == 5


def test_another_users_etag_poll_is_still_404(running, other_key):
    batch, _ = running
    response = Api(other_key).get(f"/v1/batches/{batch.pk}", HTTP_IF_NONE_MATCH="*")
    assert response.status_code == 404


# --- a light poll: the key from the cache, the batch row and nothing else ---


def test_a_poll_reads_only_the_batch_row(api, running, django_assert_max_num_queries):
    batch, _ = running
    etag = _poll(api, batch)["ETag"]  # the key's first use records last_used_at
    with django_assert_max_num_queries(1):
        assert _poll(api, batch).status_code == 200
    with django_assert_max_num_queries(1):
        assert _poll(api, batch, etag).status_code == 304


def test_a_revoked_key_is_refused_at_once(api, api_key, running):
    batch, _ = running
    assert _poll(api, batch).status_code == 200  # now in the cache
    revoke_api_key(key=ApiKey.objects.get())
    assert _poll(api, batch).status_code == 401
    assert authenticate_key(api_key) is None


def test_the_cached_key_holds_no_password_hash(api, api_key, running):
    batch, _ = running
    _poll(api, batch)
    key = cache.get(f"api-key:{hashlib.sha256(api_key.encode()).hexdigest()}")
    assert key is not None and key.owner_id == batch.owner_id
    assert "password" not in key.owner.__dict__


def test_without_the_cache_keys_still_work(api, running, monkeypatch):
    batch, _ = running

    def down(*args: Any, **kwargs: Any) -> Any:
        raise ConnectionError("redis down")

    for name in ("get", "set", "delete"):
        monkeypatch.setattr(cache, name, down)
    assert _poll(api, batch).status_code == 200
    revoke_api_key(key=ApiKey.objects.get())
    assert _poll(api, batch).status_code == 401
