"""Anthropic's Message Batches API through the official `anthropic` client, unchanged,
against a live server: the whole flow on real workers (echo engine), cancel, expiry, a bad
request, another user's batch, a body over the limit, paging, delete, auth."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import pytest
import requests
from django.utils import timezone

from jobs.lib import heavy
from jobs.models import Batch, File
from jobs.services.finalize import finalize_batch
from jobs.services.stopping import expire_due_batches
from jobs.tasks import validate_batch
from tests.factories import chat_line, lazy_import, submit, wait_for

anthropic = lazy_import("anthropic")
openai = lazy_import("openai")

pytestmark = pytest.mark.django_db(transaction=True)

MODEL = "echo-test"


def params(text: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 16,
            "messages": [{"role": "user", "content": text}], **extra}


def create(client: Any, n: int, prefix: str = "r") -> Any:
    return client.messages.batches.create(requests=[
        {"custom_id": f"{prefix}{i}", "params": params(f"question number {i}")}
        for i in range(n)])


def wait_ended(client: Any, batch_id: str, timeout: float = 60) -> Any:
    return wait_for(lambda: (b := client.messages.batches.retrieve(batch_id))
                    .processing_status == "ended" and b, timeout=timeout,
                    message=f"{batch_id} to end")


def results_of(client: Any, batch_id: str) -> dict[str, Any]:
    found = {r.custom_id: r.result for r in client.messages.batches.results(batch_id)}
    return found


def test_the_whole_flow(anthropic_client, workers):
    batch = anthropic_client.messages.batches.create(requests=[
        {"custom_id": "ok-1", "params": params("hello there", system="Be brief.")},
        {"custom_id": "ok-2", "params": params("one two three four", max_tokens=3,
                                              temperature=0, stop_sequences=["x"])},
        {"custom_id": "bad-param", "params": params("x", top_k=-1)},
        {"custom_id": "unsupported", "params": params("x", mcp_servers=[])},
        {"custom_id": "too-long", "params": params("word " * 3000)},
        {"custom_id": "too-hot", "params": params("x", temperature=9)},
    ])
    assert batch.id.startswith("msgbatch_")
    assert batch.type == "message_batch"
    assert batch.processing_status == "in_progress"
    assert batch.request_counts.processing == 6
    assert batch.results_url is None and batch.ended_at is None
    assert abs(batch.expires_at - batch.created_at - timedelta(hours=24)) < timedelta(seconds=1)
    workers.start()
    batch = wait_ended(anthropic_client, batch.id)
    counts = batch.request_counts
    assert (counts.processing, counts.succeeded, counts.errored, counts.canceled,
            counts.expired) == (0, 2, 4, 0, 0)
    assert batch.ended_at is not None and batch.results_url.endswith(f"{batch.id}/results")

    results = results_of(anthropic_client, batch.id)
    assert set(results) == {"ok-1", "ok-2", "bad-param", "unsupported", "too-long",
                            "too-hot"}
    message = results["ok-1"].message
    assert results["ok-1"].type == "succeeded"
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].text == "echo: hello there"
    assert message.stop_reason == "end_turn"
    assert message.usage.input_tokens == 4 and message.usage.output_tokens == 3
    assert results["ok-2"].message.stop_reason == "max_tokens"
    for custom_id, fragment in (("bad-param", "params.top_k"),
                                ("unsupported", "params.mcp_servers"),
                                ("too-long", "maximum context length"),
                                ("too-hot", "params.temperature must be between 0 and 1")):
        result = results[custom_id]
        assert result.type == "errored"
        assert result.error.type == "error"
        assert result.error.error.type == "invalid_request_error"
        # The request's fields as its user wrote them: params, not the batch line's body.
        assert fragment in result.error.error.message
        assert "body." not in result.error.error.message
    # The usage of the batch is the Messages' own.
    row = Batch.objects.get(pk=batch.id)
    assert row.input_tokens == sum(r.message.usage.input_tokens
                                   for r in results.values() if r.type == "succeeded")

    listed = anthropic_client.messages.batches.list()
    assert [b.id for b in listed.data] == [batch.id]
    deleted = anthropic_client.messages.batches.delete(batch.id)
    assert (deleted.id, deleted.type) == (batch.id, "message_batch_deleted")
    with pytest.raises(anthropic.NotFoundError) as caught:
        anthropic_client.messages.batches.retrieve(batch.id)
    assert caught.value.body["error"]["type"] == "not_found_error"
    assert not File.objects.filter(pk=row.input_file_id).exists()


def test_cancel_on_workers_keeps_finished_results(anthropic_client, workers):
    batch = create(anthropic_client, 40, "c")
    workers.start(env={"BATCHWEB_SHARD_SIZE": "10", "BATCHWEB_ECHO_SECONDS": "0.1",
                       "BATCHWEB_ECHO_MAX_IN_FLIGHT": "4"})
    wait_for(lambda: Batch.objects.get(pk=batch.id).completed >= 5, timeout=60,
             message="some results")
    canceling = anthropic_client.messages.batches.cancel(batch.id)
    assert canceling.processing_status in ("canceling", "ended")
    assert canceling.cancel_initiated_at is not None
    batch = wait_ended(anthropic_client, batch.id, timeout=30)
    counts = batch.request_counts
    assert counts.succeeded >= 5 and counts.canceled >= 1 and counts.errored == 0
    assert counts.succeeded + counts.canceled == 40
    results = results_of(anthropic_client, batch.id)
    assert set(results) == {f"c{i}" for i in range(40)}
    kinds = [r.type for r in results.values()]
    assert (kinds.count("succeeded"), kinds.count("canceled")) == (counts.succeeded,
                                                                   counts.canceled)
    # Ended: cancelling again is Anthropic's invalid request (a 400, never a 409).
    with pytest.raises(anthropic.BadRequestError):
        anthropic_client.messages.batches.cancel(batch.id)


def test_expiry_on_workers(anthropic_client, workers):
    batch = create(anthropic_client, 40, "e")
    workers.start(env={"BATCHWEB_SHARD_SIZE": "10", "BATCHWEB_ECHO_SECONDS": "0.2",
                       "BATCHWEB_ECHO_MAX_IN_FLIGHT": "2"})
    wait_for(lambda: Batch.objects.get(pk=batch.id).completed >= 3, timeout=60,
             message="some results")
    Batch.objects.filter(pk=batch.id).update(expires_at=timezone.now() - timedelta(seconds=1))
    batch = wait_ended(anthropic_client, batch.id, timeout=40)
    counts = batch.request_counts
    assert counts.expired >= 1 and counts.succeeded >= 3
    assert counts.succeeded + counts.expired == 40
    kinds = [r.type for r in results_of(anthropic_client, batch.id).values()]
    assert set(kinds) == {"succeeded", "expired"} and len(kinds) == 40


# --- in-process: validation and finalization run here, no worker ---


def test_cancel_before_running(anthropic_client):
    batch = create(anthropic_client, 3)
    validate_batch(batch.id)
    canceling = anthropic_client.messages.batches.cancel(batch.id)
    assert canceling.processing_status == "canceling"
    with pytest.raises(anthropic.BadRequestError) as caught:  # only ended batches go
        anthropic_client.messages.batches.delete(batch.id)
    assert "cancel" in caught.value.body["error"]["message"]
    finalize_batch(batch_id=batch.id)
    batch = anthropic_client.messages.batches.retrieve(batch.id)
    assert batch.processing_status == "ended"
    assert batch.request_counts.canceled == 3 and batch.request_counts.processing == 0
    assert {r.result.type for r in anthropic_client.messages.batches.results(batch.id)} == {
        "canceled"}


def test_a_stopped_batchs_counts_are_counted_under_the_users_guard(anthropic_client):
    batch = create(anthropic_client, 3)
    validate_batch(batch.id)
    anthropic_client.messages.batches.cancel(batch.id)
    finalize_batch(batch_id=batch.id)
    owner = Batch.objects.get(pk=batch.id).owner_id
    once = anthropic_client.with_options(max_retries=0)
    # While another heavy computation of the same user runs, counting waits its turn.
    with heavy.one_per_user(owner):
        for call in (lambda: once.messages.batches.retrieve(batch.id),
                     lambda: once.messages.batches.list()):
            with pytest.raises(anthropic.RateLimitError) as caught:
                call()
            assert caught.value.body["error"]["type"] == "rate_limit_error"
    assert once.messages.batches.retrieve(batch.id).request_counts.canceled == 3
    # Counted once, the counts are a cache read: no guard to wait for.
    with heavy.one_per_user(owner):
        assert once.messages.batches.list().data[0].request_counts.canceled == 3


def test_expired_before_running(anthropic_client):
    batch = create(anthropic_client, 2)
    validate_batch(batch.id)
    Batch.objects.filter(pk=batch.id).update(expires_at=timezone.now() - timedelta(seconds=1))
    assert expire_due_batches() == [batch.id]
    finalize_batch(batch_id=batch.id)
    batch = anthropic_client.messages.batches.retrieve(batch.id)
    assert batch.request_counts.expired == 2
    assert [r.result.type for r in anthropic_client.messages.batches.results(batch.id)] == [
        "expired", "expired"]


def test_results_before_the_end_are_refused(anthropic_client, live_server, api_key):
    batch = create(anthropic_client, 1)
    with pytest.raises(anthropic.AnthropicError):  # the client itself: no results_url yet
        list(anthropic_client.messages.batches.results(batch.id))
    response = requests.get(f"{live_server.url}/v1/messages/batches/{batch.id}/results",
                            headers={"x-api-key": api_key})
    assert response.status_code == 400
    assert "once it has ended" in response.json()["error"]["message"]


@pytest.mark.parametrize(("requests_", "fragment"), [
    ([], "at least one"),
    ([{"custom_id": "a"}], "exactly custom_id and params"),
    ([{"custom_id": "a b", "params": params("x")}], "custom_id"),
    ([{"custom_id": "a" * 65, "params": params("x")}], "custom_id"),
    ([{"custom_id": "a", "params": "x"}], "params"),
    ([{"custom_id": "a", "params": params("x")}, {"custom_id": "a", "params": params("y")}],
     "unique"),
])
def test_a_bad_request_envelope_is_400(anthropic_client, requests_, fragment):
    with pytest.raises(anthropic.BadRequestError) as caught:
        anthropic_client.messages.batches.create(requests=requests_)
    body = caught.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert fragment in body["error"]["message"]
    assert not Batch.objects.exists() and not File.objects.exists()


def test_a_model_not_served_ends_every_request_errored(anthropic_client):
    batch = anthropic_client.messages.batches.create(requests=[
        {"custom_id": "a", "params": params("x")},
        {"custom_id": "b", "params": params("y", model="claude-nope")},
        {"custom_id": "c", "params": {"max_tokens": 16,
                                      "messages": [{"role": "user", "content": "z"}]}}])
    validate_batch(batch.id)
    batch = anthropic_client.messages.batches.retrieve(batch.id)
    assert batch.processing_status == "ended" and batch.request_counts.errored == 3
    results = results_of(anthropic_client, batch.id)
    assert "claude-nope" in results["b"].error.error.message
    # Validation's problems name the request's params, as its user wrote them.
    assert results["c"].error.error.message == "Missing params.model."
    assert [(e["line"], e["param"]) for e in Batch.objects.get(pk=batch.id).errors] == [
        (2, "params.model"), (3, "params.model")]
    assert "not run" in results["a"].error.error.message.lower()


def test_another_users_batch_is_404(anthropic_client, other_anthropic_client, openai_client,
                                    live_server, api_key, other_key):
    batch = create(anthropic_client, 1)
    calls = [other_anthropic_client.messages.batches.retrieve,
             other_anthropic_client.messages.batches.cancel,
             other_anthropic_client.messages.batches.delete]
    for call in calls:
        with pytest.raises(anthropic.NotFoundError) as caught:
            call(batch.id)
        assert caught.value.body["error"]["type"] == "not_found_error"
    assert other_anthropic_client.messages.batches.list().data == []
    response = requests.get(f"{live_server.url}/v1/messages/batches/{batch.id}/results",
                            headers={"x-api-key": other_key})
    assert response.status_code == 404
    # An OpenAI batch is no Message Batch, and a Message Batch is no OpenAI batch: each API
    # lists and finds only its own.
    openai_batch = submit(openai_client, [chat_line("a", "x")])
    with pytest.raises(anthropic.NotFoundError):
        anthropic_client.messages.batches.retrieve(openai_batch.id)
    assert [b.id for b in anthropic_client.messages.batches.list()] == [batch.id]
    assert [b.id for b in openai_client.batches.list()] == [openai_batch.id]
    assert [b.id for b in openai_client.batches.list(extra_query={"status": "validating"})] \
        == [openai_batch.id]
    for openai_call in (openai_client.batches.retrieve, openai_client.batches.cancel):
        with pytest.raises(openai.NotFoundError):
            openai_call(batch.id)
    response = requests.get(f"{live_server.url}/v1/batches/{batch.id}/results",
                            headers={"Authorization": f"Bearer {api_key}"})
    assert response.status_code == 404
    assert Batch.objects.get(pk=batch.id).status == "validating"


def test_a_body_over_the_size_limit_is_413(anthropic_client, settings):
    settings.BATCHWEB = {**settings.BATCHWEB, "MESSAGE_BATCH_MAX_BYTES": 4096}
    with pytest.raises(anthropic.APIStatusError) as caught:
        create(anthropic_client, 100)
    assert caught.value.status_code == 413
    assert caught.value.body == {"type": "error", "error": {
        "type": "request_too_large", "message": "The request body is larger than 4096 bytes."}}
    assert not Batch.objects.exists() and not File.objects.exists()


def test_a_body_over_the_request_limit_is_refused_before_its_end(live_server, api_key,
                                                                  settings):
    settings.BATCHWEB = {**settings.BATCHWEB, "MESSAGE_BATCH_MAX_REQUESTS": 3}
    requests_ = [{"custom_id": f"r{i}", "params": params("x")} for i in range(4)]
    # What follows the request over the limit is not JSON: the refusal comes before it is
    # read, so millions of tiny requests are never parsed (nor their custom_ids held).
    body = json.dumps({"requests": requests_})[:-2] + ", {not json" + " " * 100_000
    response = requests.post(f"{live_server.url}/v1/messages/batches", data=body.encode(),
                             headers={"x-api-key": api_key, "anthropic-version": "2023-06-01",
                                      "content-type": "application/json"})
    assert response.status_code == 400
    assert response.json() == {"type": "error", "error": {
        "type": "invalid_request_error",
        "message": "requests: a batch takes at most 3 requests."}}
    assert not Batch.objects.exists() and not File.objects.exists()


def test_a_message_batch_has_anthropics_request_limit_not_openais(anthropic_client,
                                                                   openai_client, settings):
    settings.BATCHWEB = {**settings.BATCHWEB, "MAX_REQUESTS_PER_BATCH": 3,
                         "MESSAGE_BATCH_MAX_REQUESTS": 5}
    # At create and again at validation, the Message Batch is held to its own limit.
    batch = create(anthropic_client, 4)
    validate_batch(batch.id)
    assert Batch.objects.get(pk=batch.id).status == Batch.Status.IN_PROGRESS
    with pytest.raises(anthropic.BadRequestError) as caught:
        create(anthropic_client, 6)
    assert "at most 5 requests" in caught.value.body["error"]["message"]
    # An OpenAI batch of the same size is held to OpenAI's.
    with pytest.raises(openai.BadRequestError) as refused:
        submit(openai_client, [chat_line(f"o{i}", "x") for i in range(4)])
    assert "at most 3" in refused.value.body["message"]


def test_a_message_batch_body_may_exceed_openais_file_limit(anthropic_client, settings):
    settings.BATCHWEB = {**settings.BATCHWEB, "MAX_FILE_BYTES": 1000}
    batch = create(anthropic_client, 20)  # ~2.5 kB of body: within Anthropic's 256 MB
    assert File.objects.get(pk=Batch.objects.get(pk=batch.id).input_file_id).bytes > 1000


def _cleanup_after(days: float) -> Any:
    from jobs.services.cleanup import run_cleanup

    return run_cleanup(now=timezone.now() + timedelta(days=days))


def test_results_are_archived_29_days_after_the_batch_ended(anthropic_client, live_server,
                                                            api_key):
    batch = create(anthropic_client, 3)
    validate_batch(batch.id)
    anthropic_client.messages.batches.cancel(batch.id)
    finalize_batch(batch_id=batch.id)
    row = Batch.objects.get(pk=batch.id)
    error_file = File.objects.get(pk=row.error_file_id)
    # Kept Anthropic's 29 days from the end.
    assert abs(error_file.expires_at - row.cancelled_at - timedelta(days=29)) < \
        timedelta(seconds=5)
    assert _cleanup_after(28).archived_batches == 0
    assert anthropic_client.messages.batches.retrieve(batch.id).archived_at is None
    assert len(results_of(anthropic_client, batch.id)) == 3

    assert _cleanup_after(29.01).archived_batches == 1
    assert not File.objects.filter(pk=error_file.pk).exists()
    archived = anthropic_client.messages.batches.retrieve(batch.id)
    assert archived.archived_at is not None and archived.processing_status == "ended"
    # Its counts outlive the error file they were counted from.
    assert archived.request_counts.canceled == 3 and archived.request_counts.errored == 0
    with pytest.raises(anthropic.NotFoundError) as caught:
        list(anthropic_client.messages.batches.results(batch.id))
    assert caught.value.body["type"] == "error"
    assert caught.value.body["error"]["type"] == "not_found_error"
    assert "no longer available" in caught.value.body["error"]["message"]
    # Listed the same way; deleted as any ended batch.
    assert anthropic_client.messages.batches.list().data[0].archived_at == archived.archived_at
    anthropic_client.messages.batches.delete(batch.id)
    assert not Batch.objects.filter(pk=batch.id).exists()


def test_a_batch_that_failed_validation_is_archived_with_its_input(anthropic_client):
    batch = anthropic_client.messages.batches.create(requests=[
        {"custom_id": "a", "params": params("x", model="claude-nope")}])
    validate_batch(batch.id)
    assert len(results_of(anthropic_client, batch.id)) == 1  # answered from its input
    assert _cleanup_after(31).archived_batches == 1
    archived = anthropic_client.messages.batches.retrieve(batch.id)
    assert archived.archived_at is not None and archived.request_counts.errored == 1
    with pytest.raises(anthropic.NotFoundError):
        list(anthropic_client.messages.batches.results(batch.id))


def test_results_kept_until_deleted_when_the_operator_says_so(anthropic_client, settings):
    settings.BATCHWEB = {**settings.BATCHWEB, "MESSAGE_BATCH_RESULTS_DAYS": 0}
    batch = create(anthropic_client, 1)
    validate_batch(batch.id)
    anthropic_client.messages.batches.cancel(batch.id)
    finalize_batch(batch_id=batch.id)
    assert File.objects.get(pk=Batch.objects.get(pk=batch.id).error_file_id).expires_at is None
    assert _cleanup_after(365).archived_batches == 0
    assert len(results_of(anthropic_client, batch.id)) == 1


def test_list_pages_with_anthropic_cursors(anthropic_client):
    ids = [create(anthropic_client, 1).id for _ in range(5)]
    newest_first = ids[::-1]
    page = anthropic_client.messages.batches.list(limit=2)
    assert [b.id for b in page.data] == newest_first[:2]
    assert page.has_more and page.first_id == newest_first[0] and page.last_id == newest_first[1]
    # The client follows after_id = last_id to the end.
    assert [b.id for b in anthropic_client.messages.batches.list(limit=2)] == newest_first
    after = anthropic_client.messages.batches.list(after_id=newest_first[1], limit=10)
    assert [b.id for b in after.data] == newest_first[2:] and not after.has_more
    before = anthropic_client.messages.batches.list(before_id=newest_first[3], limit=2)
    assert [b.id for b in before.data] == newest_first[1:3] and before.has_more
    with pytest.raises(anthropic.BadRequestError):
        anthropic_client.messages.batches.list(limit=1001)
    with pytest.raises(anthropic.BadRequestError):
        anthropic_client.messages.batches.list(after_id="msgbatch_nope")


def test_auth_by_x_api_key(live_server, api_key):
    url = f"{live_server.url}/v1/messages/batches"
    for headers in ({}, {"x-api-key": "sk-bw-wrong"}, {"Authorization": "Bearer sk-bw-no"}):
        response = requests.get(url, headers={"anthropic-version": "2023-06-01", **headers})
        assert response.status_code == 401
        assert response.json()["error"]["type"] == "authentication_error"
        assert response.json()["type"] == "error"
    response = requests.get(url, headers={"x-api-key": api_key})  # no anthropic-version
    assert response.status_code == 200
    # The client sends its key as a Bearer token (anthropic 2.x): the same key works so.
    assert requests.get(url, headers={"Authorization": f"Bearer {api_key}"}).status_code == 200
    assert json.loads(response.content) == {"data": [], "has_more": False, "first_id": None,
                                            "last_id": None}
