"""The engine mode of a provenance record (eager or compiled, engine/compile_cache.py)
reaches the batch object of the API and the batch page's "What ran it"."""

from __future__ import annotations

import pytest
from django.urls import reverse

from engine.provenance import Provenance
from jobs.models import Batch, Shard
from jobs.services import what_ran
from tests.factories import chat_lines, make_batch

pytestmark = pytest.mark.django_db


def _claimed(batch: Batch, mode: str) -> None:
    engine = Provenance(model="echo-test", model_source="pypi:echo", model_sha256="ab12" * 16,
                        engine="vllm", engine_version="0.32.0", dtype="float32",
                        engine_mode=mode).as_json()
    shard = Shard.objects.filter(batch=batch).order_by("index").first()
    shard.batch = Batch.objects.get(pk=batch.pk)
    assert what_ran.record_claim(shard=shard, worker=f"host.{mode}.echo-test", engine=engine)


def test_the_batch_says_which_mode_ran_it(site, client, user, api_key, tmp_path, settings):
    batch = make_batch(user, chat_lines(4), tmp_path, shard_size=2, settings=settings)
    _claimed(batch, "compiled")

    answer = client.get(f"/v1/batches/{batch.pk}", HTTP_AUTHORIZATION=f"Bearer {api_key}")
    assert answer.status_code == 200, answer.content
    engines = answer.json()["provenance"]["workers"]
    assert [entry["engine"]["engine_mode"] for entry in engines] == ["compiled"]

    page = site.get(reverse("batch_detail", args=[batch.pk])).content.decode()
    assert '<span class="engine-mode">compiled</span>' in page


def test_workers_in_both_modes_are_two_engine_records(client, user, api_key, tmp_path,
                                                      settings):
    batch = make_batch(user, chat_lines(4), tmp_path, shard_size=2, settings=settings)
    _claimed(batch, "eager")
    _claimed(batch, "compiled")
    answer = client.get(f"/v1/batches/{batch.pk}", HTTP_AUTHORIZATION=f"Bearer {api_key}")
    record = answer.json()["provenance"]
    assert record["consistent"] is False
    assert sorted(e["engine"]["engine_mode"] for e in record["workers"]) == ["compiled", "eager"]
