"""Rerunning what did not succeed, by API: `POST /v1/batches/{id}/rerun` through the openai
client's generic post and `POST /v1/messages/batches/{id}/rerun` through the anthropic
client's, each answering the new batch in its face's shape; the new batch holds exactly the
failed, expired, cancelled or invalid requests' input lines byte for byte, carries
`rerun_of` (and `rerun_left_out`: the invalid ones a default rerun leaves out), and is made
as any batch (quotas, the budget on its own ceiling; nothing left when refused); every
refusal in the face's error shape. The dashboard's buttons use the same service, and offer
the invalid requests' lines as a download to fix."""

from __future__ import annotations

import json
from datetime import timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from django.core.files.storage import default_storage
from django.urls import reverse
from django.utils import timezone

from jobs.models import ApiKey, Batch, File, Price, Quota, Shard
from jobs.services.batches import create_batch
from jobs.services.finalize import finalize_batch
from jobs.services.message_batches import create_message_batch
from jobs.services.stopping import cancel_batch, expire_due_batches
from jobs.services.validation import run_validation
from tests.factories import (
    Api,
    assert_openai_error,
    chat_line,
    lazy_import,
    make_batch,
    make_file,
    run_batch,
    run_shard,
    submit,
    wait_status,
)

openai = lazy_import("openai")
anthropic = lazy_import("anthropic")


def raw_line(i: int) -> str:
    """An input line written as no JSON library would write it again (key order, spacing,
    an escaped character): a rerun must copy it, not re-serialize it."""
    return ('{"body":{"max_tokens":10,  "messages":[{"content":"question \\u00e9 '
            + str(i) + '","role":"user"}],"model":"echo-test"},"url":"/v1/chat/completions",'
            '"method":"POST",   "custom_id":"r' + str(i) + '"}')


LINES = [raw_line(i) for i in range(12)]


def stopped_batch(owner: Any, tmp_path: Path, settings: Any, *, how: str = "expire",
                  **extra: Any) -> Batch:
    """An ended batch of 12 requests in 3 shards: r1 and r5 failed as the service failed
    them (a server error, a time-out: they may succeed if sent again), r2 failed as invalid
    (the engine's 400: it would fail again), r0, r3, r4, r6, r7 succeeded, r8-r11 never ran
    (expired, or cancelled)."""
    settings.BATCHWEB = {**settings.BATCHWEB, "SHARD_SIZE": 4}
    file = make_file(owner, LINES, tmp_path)
    batch = create_batch(owner=owner, input_file_id=file.pk, endpoint="/v1/chat/completions",
                         completion_window="24h", **extra)
    run_validation(batch_id=batch.pk)
    run_shard(Shard.objects.get(batch=batch, index=0), fails=lambda c: c in ("r1", "r2"),
              status=lambda c: 500 if c == "r1" else 400)
    run_shard(Shard.objects.get(batch=batch, index=1), fails=lambda c: c == "r5",
              status=lambda c: 504)
    if how == "expire":
        Batch.objects.filter(pk=batch.pk).update(expires_at=timezone.now() - timedelta(1))
        assert expire_due_batches() == [batch.pk]
    else:
        cancel_batch(batch=Batch.objects.get(pk=batch.pk))
    finalize_batch(batch_id=batch.pk)
    batch = Batch.objects.get(pk=batch.pk)
    assert batch.status == {"expire": "expired", "cancel": "cancelled"}[how]
    return batch


def input_bytes(batch_id: str) -> bytes:
    file = File.objects.get(pk=Batch.objects.get(pk=batch_id).input_file_id)
    with default_storage.open(file.storage_name, "rb") as handle:
        return handle.read()


def expected(*numbers: int) -> bytes:
    return b"".join(LINES[i].encode() + b"\n" for i in numbers)


# --- the OpenAI face, through the official client ---


@pytest.mark.django_db(transaction=True)
def test_openai_rerun_of_failed_expired_and_both(openai_client, user, tmp_path, settings):
    batch = stopped_batch(user, tmp_path, settings, metadata={"team": "x"})

    def rerun(**body: Any) -> Any:
        return openai_client.post(f"/batches/{batch.pk}/rerun", body=body,
                                  cast_to=openai.types.Batch)

    # Without `requests`: every request that may succeed if sent again, and a count of the
    # invalid one left out.
    default = rerun()
    assert isinstance(default, openai.types.Batch) and default.id != batch.pk
    assert default.status == "validating" and default.endpoint == "/v1/chat/completions"
    assert default.metadata == {"team": "x", "rerun_of": batch.pk, "rerun_left_out": "1"}
    assert input_bytes(default.id) == expected(1, 5, 8, 9, 10, 11)  # byte for byte, in order
    failed = rerun(requests="failed")
    assert failed.metadata["rerun_left_out"] == "1"
    assert input_bytes(failed.id) == expected(1, 5)
    # The invalid one only when asked for by name.
    assert input_bytes(rerun(requests="invalid").id) == expected(2)
    every = rerun(requests=["failed", "invalid"])
    assert input_bytes(every.id) == expected(1, 2, 5)
    assert "rerun_left_out" not in every.metadata
    expired = rerun(requests="expired")
    assert input_bytes(expired.id) == expected(8, 9, 10, 11)
    both = rerun(requests="both")
    assert input_bytes(both.id) == expected(1, 5, 8, 9, 10, 11)
    assert openai_client.batches.retrieve(both.id).metadata["rerun_of"] == batch.pk
    # Made as any batch is: validated, run, charged under the key that asked.
    new = Batch.objects.get(pk=both.id)
    assert new.api == "openai" and new.api_key == ApiKey.objects.get(owner=user)
    run_validation(batch_id=new.pk)
    done = run_batch(Batch.objects.get(pk=new.pk))
    assert (done.status, done.total, done.completed) == ("completed", 6, 6)
    # A rerun of a rerun points at its own original.
    assert rerun(requests="failed").metadata["rerun_of"] == batch.pk


@pytest.mark.django_db(transaction=True)
def test_requests_refused_as_invalid_are_not_rerun_but_offered_to_fix(openai_client, workers,
                                                                     site):
    """Run by real workers: three requests with temperature 9 fail with the endpoint's 400.
    A rerun of them would fail the same way: it is refused, leaving no file behind, unless
    they are asked for by name; the batch page offers their lines to fix instead."""
    hot = [chat_line(f"hot-{i}", f"question {i}", temperature=9) for i in range(3)]
    batch = submit(openai_client, [chat_line("ok", "hello"), *hot])
    workers.start()
    batch = wait_status(openai_client, batch.id, {"completed"})
    assert (batch.request_counts.completed, batch.request_counts.failed) == (1, 3)
    files = set(File.objects.values_list("pk", flat=True))
    for body in ({}, {"requests": "failed"}, {"requests": "both"}):
        with pytest.raises(openai.BadRequestError) as caught:
            openai_client.post(f"/batches/{batch.id}/rerun", body=body,
                               cast_to=openai.types.Batch)
        assert caught.value.code == "nothing_to_rerun", body
        assert "its 3 failed requests were refused as invalid" in \
            caught.value.body["message"]
    assert set(File.objects.values_list("pk", flat=True)) == files
    assert list(Batch.objects.values_list("pk", flat=True)) == [batch.id]
    page = site.get(reverse("batch_detail", args=[batch.id])).content.decode()
    assert 'id="rerun"' not in page and "Lines to fix (3)" in page
    download = site.get(reverse("batch_lines_to_fix", args=[batch.id]))
    assert [json.loads(line) for line in b"".join(download.streaming_content).splitlines()] \
        == hot
    # Asked for by name, they run again as they are.
    invalid = openai_client.post(f"/batches/{batch.id}/rerun", body={"requests": "invalid"},
                                 cast_to=openai.types.Batch)
    assert [json.loads(line) for line in input_bytes(invalid.id).splitlines()] == hot


@pytest.mark.django_db
def test_openai_rerun_refusals_in_its_error_shape(user, api_key, other_key, tmp_path,
                                                 settings):
    api = Api(api_key)
    path = "/v1/batches/{}/rerun"
    running = make_batch(user, [{"custom_id": "a", "method": "POST",
                                 "url": "/v1/chat/completions",
                                 "body": {"model": "echo-test", "messages": []}}], tmp_path)
    assert_openai_error(api.post_json(path.format(running.pk), {}), 409, code="invalid_state",
                        fragment="ended")
    batch = stopped_batch(user, tmp_path, settings)
    assert_openai_error(api.post_json(path.format(batch.pk), {"requests": "everything"}), 400,
                        param="requests",
                        fragment="'failed', 'expired', 'cancelled', 'invalid', 'both'")
    assert_openai_error(api.post_json(path.format(batch.pk), {"requests": "errored"}), 400,
                        param="requests")  # Anthropic's word, not this face's
    assert_openai_error(api.post_json(path.format(batch.pk), {"requests": "cancelled"}), 400,
                        code="nothing_to_rerun", fragment="no cancelled requests")
    assert_openai_error(api.post_json(path.format(batch.pk), "[1]"), 400,
                        fragment="must be a JSON object")
    assert_openai_error(Api(other_key).post_json(path.format(batch.pk), {}), 404,
                        code="not_found")
    assert_openai_error(api.get(path.format(batch.pk)), 405)
    clean = run_batch(make_batch(user, [{"custom_id": "ok", "method": "POST",
                                         "url": "/v1/chat/completions",
                                         "body": {"model": "echo-test", "messages": [
                                             {"role": "user", "content": "hi"}]}}], tmp_path))
    assert_openai_error(api.post_json(path.format(clean.pk), {}), 400, code="nothing_to_rerun",
                        fragment="no failed, expired or cancelled requests")
    File.objects.filter(pk=batch.input_file_id).delete()
    assert_openai_error(api.post_json(path.format(batch.pk), {}), 400,
                        code="input_file_deleted")
    # Nothing was created by any refusal.
    assert set(Batch.objects.values_list("pk", flat=True)) == {running.pk, batch.pk, clean.pk}
    # A Message Batch is not one of this face's (and the other way round).
    message_batch = create_message_batch(owner=user, body=_body(), declared_length=0)
    assert_openai_error(api.post_json(path.format(message_batch.pk), {}), 404)
    answer = api.post_json(f"/v1/messages/batches/{batch.pk}/rerun", {})
    assert answer.status_code == 404 and answer.json()["error"]["type"] == "not_found_error"


@pytest.mark.django_db
def test_a_cancelled_batch_reruns_its_cancelled_requests_by_default_or_by_name(
        user, api_key, tmp_path, settings):
    api = Api(api_key)
    batch = stopped_batch(user, tmp_path, settings, how="cancel")
    both = api.post_json(f"/v1/batches/{batch.pk}/rerun", {"requests": "both"}).json()
    assert input_bytes(both["id"]) == expected(1, 5)  # no expired; cancelled not asked for
    cancelled = api.post_json(f"/v1/batches/{batch.pk}/rerun",
                              {"requests": ["failed", "cancelled"]}).json()
    assert input_bytes(cancelled["id"]) == expected(1, 5, 8, 9, 10, 11)
    assert_openai_error(api.post_json(f"/v1/batches/{batch.pk}/rerun",
                                      {"requests": "expired"}), 400, code="nothing_to_rerun")
    # No body at all is a rerun of what may succeed again: the cancelled ones too.
    bare = api.client.generic("POST", f"/v1/batches/{batch.pk}/rerun", **api.headers)
    assert bare.status_code == 200
    assert input_bytes(bare.json()["id"]) == expected(1, 5, 8, 9, 10, 11)


@pytest.mark.django_db
def test_a_rerun_is_made_as_any_batch_and_leaves_nothing_when_refused(
        user, api_key, tmp_path, settings, django_capture_on_commit_callbacks):
    api = Api(api_key)
    batch = stopped_batch(user, tmp_path, settings)
    # A quota: one active batch at most, and one is running.
    busy = make_batch(user, [{"custom_id": "busy", "method": "POST",
                              "url": "/v1/chat/completions",
                              "body": {"model": "echo-test", "messages": []}}], tmp_path)
    Quota.objects.update_or_create(user=user, defaults={"max_active_batches": 1})
    files_before = set(File.objects.values_list("pk", flat=True))
    stored_before = sorted(p for p in Path(settings.STORAGE_DIR).rglob("*") if p.is_file())
    with django_capture_on_commit_callbacks(execute=True):  # the refused input's removal
        assert_openai_error(api.post_json(f"/v1/batches/{batch.pk}/rerun", {}), 429,
                            code="max_active_batches_exceeded")
    Quota.objects.filter(user=user).update(max_active_batches=None)
    assert set(File.objects.values_list("pk", flat=True)) == files_before
    run_batch(busy)  # ended: nothing of the budget is held by it
    files_before = set(File.objects.values_list("pk", flat=True))
    stored_before = sorted(p for p in Path(settings.STORAGE_DIR).rglob("*") if p.is_file())
    # The monthly budget, on the rerun's own ceiling: 10 output tokens a request at $1,000
    # per million (half off in a batch) is $0.005 a request.
    Price.objects.create(model="", input_per_million=0, output_per_million=1000)
    Quota.objects.filter(user=user).update(cost_per_month=Decimal("0.008"))
    with django_capture_on_commit_callbacks(execute=True):
        assert_openai_error(api.post_json(f"/v1/batches/{batch.pk}/rerun",
                                          {"requests": "both"}),
                            429, code="cost_per_month_exceeded")
    assert set(File.objects.values_list("pk", flat=True)) == files_before
    assert sorted(p for p in Path(settings.STORAGE_DIR).rglob("*")
                  if p.is_file()) == stored_before
    # Two requests fit where six did not: it is priced on what it holds.
    Quota.objects.filter(user=user).update(cost_per_month=Decimal("0.02"))
    answer = api.post_json(f"/v1/batches/{batch.pk}/rerun", {"requests": "failed"})
    assert answer.status_code == 200, answer.content
    assert Batch.objects.get(pk=answer.json()["id"]).cost_ceiling_nanos is not None


# --- the Anthropic face ---


def _body(count: int = 12) -> Any:
    import io
    import json

    return io.BytesIO(json.dumps({"requests": [
        {"custom_id": f"m{i}", "params": {"model": "echo-test", "max_tokens": 8,
                                          "messages": [{"role": "user", "content": f"q {i}"}]}}
        for i in range(count)]}).encode())


@pytest.mark.django_db(transaction=True)
def test_anthropic_rerun_through_the_client(anthropic_client, user, settings, api_key):
    settings.BATCHWEB = {**settings.BATCHWEB, "SHARD_SIZE": 4}
    batch = create_message_batch(owner=user, body=_body(), declared_length=0)
    run_validation(batch_id=batch.pk)
    run_shard(Shard.objects.get(batch=batch, index=0), fails=lambda c: c in ("m2", "m3"),
              status=lambda c: 500 if c == "m2" else 400)
    Batch.objects.filter(pk=batch.pk).update(expires_at=timezone.now() - timedelta(1))
    expire_due_batches()
    finalize_batch(batch_id=batch.pk)
    kinds = {r.custom_id: r.result.type for r in anthropic_client.messages.batches.results(
        batch.pk)}
    assert kinds["m2"] == "errored" and kinds["m11"] == "expired"
    original = input_bytes(batch.pk).splitlines(keepends=True)
    MessageBatch = anthropic.types.messages.MessageBatch

    def rerun(**body: Any) -> Any:
        return anthropic_client.post(f"/v1/messages/batches/{batch.pk}/rerun", body=body,
                                     cast_to=MessageBatch)

    # Without `requests`: what may succeed if sent again (m2, the expired m4-m11); m3, whose
    # request was refused, is left out and counted.
    default = rerun()
    assert default.request_counts.processing == 9
    assert (default.model_extra["rerun_of"], default.model_extra["rerun_left_out"]) == (
        batch.pk, 1)
    errored = rerun(requests="errored")
    assert isinstance(errored, MessageBatch) and errored.id.startswith("msgbatch_")
    assert errored.processing_status == "in_progress"
    assert errored.request_counts.processing == 1
    assert errored.model_extra["rerun_of"] == batch.pk
    assert input_bytes(errored.id) == original[2]
    invalid = rerun(requests="invalid")
    assert input_bytes(invalid.id) == original[3] and invalid.model_extra["rerun_left_out"] == 0
    both = rerun(requests="both")
    assert both.request_counts.processing == 9
    assert input_bytes(both.id) == b"".join(original[i] for i in (2, *range(4, 12)))
    assert anthropic_client.messages.batches.retrieve(both.id).model_extra["rerun_of"] == \
        batch.pk
    assert Batch.objects.get(pk=both.id).completion_window == "24h"
    # Refusals in Anthropic's shape: an unknown word, nothing of a kind, a running batch
    # (a 400: Anthropic documents no 409).
    with pytest.raises(anthropic.BadRequestError) as caught:
        rerun(requests="failed")  # the OpenAI face's word
    assert caught.value.body["error"]["type"] == "invalid_request_error"
    assert "'errored', 'expired', 'canceled', 'invalid', 'both'" in \
        caught.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError, match="no canceled requests"):
        rerun(requests="canceled")
    with pytest.raises(anthropic.BadRequestError, match="has ended"):
        anthropic_client.post(f"/v1/messages/batches/{both.id}/rerun", body={},
                              cast_to=MessageBatch)
    with pytest.raises(anthropic.NotFoundError):
        anthropic_client.post("/v1/messages/batches/msgbatch_nope/rerun", body={},
                              cast_to=MessageBatch)


# --- the dashboard ---


@pytest.mark.django_db
def test_the_dashboard_offers_failed_expired_and_both(site, user, tmp_path, settings):
    batch = stopped_batch(user, tmp_path, settings)
    page = site.get(reverse("batch_detail", args=[batch.pk])).content.decode()
    assert 'id="rerun"' in page and "Rerun failed requests (2)" in page
    assert 'id="rerun-expired"' in page and "Rerun expired requests (4)" in page
    assert 'id="rerun-all"' in page and "Rerun failed and expired requests (6)" in page
    assert 'id="rerun-cancelled"' not in page
    # The invalid request is not rerun: its line is offered to fix.
    assert 'id="download-to-fix"' in page and "Lines to fix (1)" in page
    assert "1 failed request was refused as invalid and would fail the same way" in page
    download = site.get(reverse("batch_lines_to_fix", args=[batch.pk]))
    assert download.status_code == 200
    assert download["Content-Disposition"] == f'attachment; filename="{batch.pk}_to_fix.jsonl"'
    assert b"".join(download.streaming_content) == expected(2)
    answer = site.post(reverse("batch_rerun", args=[batch.pk]), {"requests": "expired"})
    new = Batch.objects.exclude(pk=batch.pk).get(owner=user)
    assert answer.status_code == 302 and answer.url == reverse("batch_detail", args=[new.pk])
    assert input_bytes(new.pk) == expected(8, 9, 10, 11)
    # Linked both ways: the rerun names its original, the original lists its reruns.
    shown = site.get(answer.url).content.decode()
    assert f'<a href="{reverse("batch_detail", args=[batch.pk])}" id="rerun-of">' in shown
    listed = site.get(reverse("batch_detail", args=[batch.pk])).content.decode()
    assert "Rerun as" in listed and reverse("batch_detail", args=[new.pk]) in listed
    both = site.post(reverse("batch_rerun", args=[batch.pk]), {"requests": "failed,expired"},
                     follow=True)
    assert b"Rerunning the failed and expired requests" in both.content
    assert b"Left out: 1 invalid request" in both.content
    # The rerun's page says what it left out, and links the lines to fix.
    assert 'id="left-out"' in both.content.decode()
    assert reverse("batch_lines_to_fix", args=[batch.pk]) in both.content.decode()
    # A cancelled batch offers its cancelled requests.
    cancelled = stopped_batch(user, tmp_path, settings, how="cancel")
    page = site.get(reverse("batch_detail", args=[cancelled.pk])).content.decode()
    assert "Rerun cancelled requests (4)" in page and 'id="rerun-expired"' not in page
    refused = site.post(reverse("batch_rerun", args=[cancelled.pk]), {"requests": "nope"},
                        follow=True)
    assert b"requests must be one of" in refused.content


@pytest.mark.django_db
def test_a_rerun_of_that_is_not_a_batch_id_is_not_linked(site, user, tmp_path):
    batch = make_batch(user, [{"custom_id": "a", "method": "POST",
                               "url": "/v1/chat/completions",
                               "body": {"model": "echo-test", "messages": []}}], tmp_path,
                       metadata={"rerun_of": "../../admin/"})
    page = site.get(reverse("batch_detail", args=[batch.pk]))
    assert page.status_code == 200 and 'id="rerun-of"' not in page.content.decode()
