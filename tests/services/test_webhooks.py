"""Batch webhooks against a real HTTP receiver on 127.0.0.1: the event and its Standard
Webhooks signature (verified by the openai library), retries with backoff, attempts on
record, the address allowlist, timeouts, and delivery by a live worker."""

from __future__ import annotations

import io
import json
import time
from datetime import timedelta

import pytest
from django.utils import timezone

from jobs.lib import queues, safehttp
from jobs.models import Batch, UserSettings, WebhookDelivery, WebhookEvent
from jobs.services import webhooks
from jobs.services.batches import create_batch
from jobs.services.finalize import finalize_batch, notify_ended
from jobs.services.stopping import cancel_batch, expire_due_batches
from jobs.services.validation import run_validation
from tests.factories import (
    chat_line,
    jsonl,
    lazy_import,
    make_batch,
    make_file,
    run_batch,
    wait_for,
)

openai = lazy_import("openai")

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def hooked_user(user, receiver, loopback_allowed):
    webhooks.set_webhook_url(user=user, url=receiver.url)
    return user


def ended_batch(user, tmp_path) -> Batch:
    return run_batch(make_batch(user, [chat_line("a", "x"), chat_line("b", "y")], tmp_path))


def due_now(event_id: str) -> None:
    """Let the backoff pass without waiting for it."""
    WebhookEvent.objects.filter(pk=event_id).update(next_attempt_at=timezone.now())


def test_batch_end_enqueues_ids_only_and_the_signature_verifies(hooked_user, receiver,
                                                                tmp_path):
    batch = ended_batch(hooked_user, tmp_path)
    event = WebhookEvent.objects.get(batch_id=batch.pk)
    assert (event.type, event.status, event.owner_id) == ("batch.completed", "pending",
                                                          hooked_user.pk)
    # The finalizer only enqueued a job (ids only); nothing was sent from it.
    assert receiver.requests == []
    job = queues.queue(queues.WEBHOOK_QUEUE).fetch_job(f"{event.pk}-webhook")
    assert job.func_name == "jobs.tasks.deliver_webhook"
    assert job.args == (event.pk,) and not job.kwargs

    assert webhooks.deliver_event(event.pk) == "delivered"
    [request] = receiver.requests
    assert request["path"] == "/hooks/batch?src=bw"
    headers = {k.lower(): v for k, v in request["headers"].items()}
    assert headers["content-type"] == "application/json"
    assert headers["webhook-id"] == event.pk
    assert abs(int(headers["webhook-timestamp"]) - time.time()) < 30
    assert headers["webhook-signature"].startswith("v1,")
    body = json.loads(request["body"])
    assert body == {"id": event.pk, "object": "event", "type": "batch.completed",
                    "created_at": int(event.created_at.timestamp()), "data": {"id": batch.pk}}

    # OpenAI's own client verifies it: the same scheme as OpenAI's webhooks.
    secret = UserSettings.objects.get(user=hooked_user).webhook_secret
    client = openai.OpenAI(api_key="unused")
    unwrapped = client.webhooks.unwrap(request["body"], headers, secret=secret)
    assert unwrapped.type == "batch.completed" and unwrapped.data.id == batch.pk
    with pytest.raises(openai.InvalidWebhookSignatureError):
        client.webhooks.unwrap(request["body"].replace(b"completed", b"cancelled"), headers,
                               secret=secret)
    with pytest.raises(openai.InvalidWebhookSignatureError):
        client.webhooks.unwrap(request["body"], headers, secret=webhooks.new_webhook_secret())

    event.refresh_from_db()
    assert event.status == "delivered" and event.delivered_at and event.attempts == 1
    [delivery] = event.deliveries.all()
    assert (delivery.attempt, delivery.status_code, delivery.ok) == (1, 200, True)
    assert delivery.url == receiver.url and delivery.response_excerpt == "ok"
    # A second run of the same job finds nothing due and sends nothing.
    assert webhooks.deliver_event(event.pk) == "delivered"
    assert len(receiver.requests) == 1


def test_each_ending_has_its_event_type(hooked_user, tmp_path):
    cancelled = make_batch(hooked_user, [chat_line("a", "x")], tmp_path)
    cancel_batch(batch=cancelled)
    finalize_batch(batch_id=cancelled.pk)
    expired = make_batch(hooked_user, [chat_line("a", "x")], tmp_path)
    Batch.objects.filter(pk=expired.pk).update(expires_at=timezone.now() - timedelta(1))

    expire_due_batches()
    finalize_batch(batch_id=expired.pk)
    bad = make_file(hooked_user, [{"custom_id": "x", "method": "GET", "url": "/nope",
                                   "body": {}}], tmp_path)
    failed = create_batch(owner=hooked_user, input_file_id=bad.pk,
                          endpoint="/v1/chat/completions", completion_window="24h")
    run_validation(batch_id=failed.pk)
    types = dict(WebhookEvent.objects.values_list("batch_id", "type"))
    assert types == {cancelled.pk: "batch.cancelled", expired.pk: "batch.expired",
                     failed.pk: "batch.failed"}
    # Finalizing again (a repeated job) records no second event.
    finalize_batch(batch_id=cancelled.pk)
    notify_ended(cancelled.pk)
    assert WebhookEvent.objects.filter(batch_id=cancelled.pk).count() == 1


def test_no_webhook_no_event(user, tmp_path, loopback_allowed):
    ended_batch(user, tmp_path)
    assert not WebhookEvent.objects.exists()


def test_retries_with_exponential_backoff_until_delivered(hooked_user, receiver, tmp_path):
    receiver.script = [500, 503]
    event = WebhookEvent.objects.get(batch_id=ended_batch(hooked_user, tmp_path).pk)

    before = timezone.now()
    assert webhooks.deliver_event(event.pk) == "pending"
    event.refresh_from_db()
    first_wait = event.next_attempt_at - before
    assert timedelta(seconds=9) < first_wait <= timedelta(seconds=11)  # base 10 s
    assert event.last_error == "HTTP 500"
    # Not due yet: a duplicate job (or an impatient reconciler) sends nothing.
    assert webhooks.deliver_event(event.pk) == "pending"
    assert len(receiver.requests) == 1
    assert webhooks.enqueue_due() == 0

    due_now(event.pk)
    assert webhooks.enqueue_due() == 1  # the reconciler's pass enqueues the retry
    before = timezone.now()
    assert webhooks.deliver_event(event.pk) == "pending"
    event.refresh_from_db()
    assert timedelta(seconds=19) < event.next_attempt_at - before <= timedelta(seconds=21)

    due_now(event.pk)
    assert webhooks.deliver_event(event.pk) == "delivered"
    attempts = list(WebhookDelivery.objects.filter(event=event).values_list(
        "attempt", "status_code", "ok"))
    assert attempts == [(1, 500, False), (2, 503, False), (3, 200, True)]
    # Every attempt carried the same event id, and a fresh timestamp and signature.
    assert {r["headers"]["webhook-id"] for r in receiver.requests} == {event.pk}
    assert len({r["body"] for r in receiver.requests}) == 1


def test_gives_up_after_max_attempts_and_admin_can_retry(hooked_user, receiver, tmp_path,
                                                         loopback_allowed):
    loopback_allowed.BATCHWEB = {**loopback_allowed.BATCHWEB, "WEBHOOK_MAX_ATTEMPTS": 2}
    receiver.script = [500, 500, 500]
    event = WebhookEvent.objects.get(batch_id=ended_batch(hooked_user, tmp_path).pk)
    assert webhooks.deliver_event(event.pk) == "pending"
    due_now(event.pk)
    assert webhooks.deliver_event(event.pk) == "failed"
    event.refresh_from_db()
    assert event.next_attempt_at is None and event.attempts == 2
    due_now(event.pk)
    assert webhooks.deliver_event(event.pk) == "failed"  # failed events are not retried
    assert len(receiver.requests) == 2
    # An operator's retry gives one more attempt.
    assert webhooks.retry_now(events=WebhookEvent.objects.filter(pk=event.pk)) == 1
    assert webhooks.deliver_event(event.pk) == "failed"  # the script's third 500
    receiver.script = []
    webhooks.retry_now(events=WebhookEvent.objects.filter(pk=event.pk))
    assert webhooks.deliver_event(event.pk) == "delivered"
    assert event.deliveries.count() == 4


def test_redirects_are_not_followed(hooked_user, receiver, tmp_path):
    receiver.script = [302]
    event = WebhookEvent.objects.get(batch_id=ended_batch(hooked_user, tmp_path).pk)
    assert webhooks.deliver_event(event.pk) == "pending"
    assert len(receiver.requests) == 1
    assert event.deliveries.get().status_code == 302


def test_a_slow_receiver_times_out(hooked_user, receiver, tmp_path, loopback_allowed):
    loopback_allowed.BATCHWEB = {**loopback_allowed.BATCHWEB, "WEBHOOK_TIMEOUT_SECONDS": 0.5}
    receiver.delay = 2
    event = WebhookEvent.objects.get(batch_id=ended_batch(hooked_user, tmp_path).pk)
    started = time.monotonic()
    assert webhooks.deliver_event(event.pk) == "pending"
    assert time.monotonic() - started < 1.5
    delivery = event.deliveries.get()
    assert delivery.status_code is None and "timed out" in delivery.error.lower()


def test_addresses_outside_the_allowlist_are_never_called(user, receiver, tmp_path,
                                                          settings):
    # The default allows nothing, loopback included.
    assert settings.BATCHWEB["WEBHOOK_ALLOWED_NETWORKS"] == []
    with pytest.raises(safehttp.NotAllowed, match="not allowed"):
        webhooks.set_webhook_url(user=user, url=receiver.url)
    # "public" does not include loopback or private ranges.
    settings.BATCHWEB = {**settings.BATCHWEB, "WEBHOOK_ALLOWED_NETWORKS": ["public",
                                                                          "10.0.0.0/8"]}
    for url in (receiver.url, "http://[::1]:9/", "http://192.168.1.1/",
                "http://169.254.169.254/latest/meta-data"):
        with pytest.raises(safehttp.NotAllowed):
            safehttp.check_url(url)
    assert safehttp.check_url("http://10.1.2.3:8080/x").addresses == ["10.1.2.3"]
    for url in ("ftp://127.0.0.1/", "http://user:pw@127.0.0.1/", "not a url"):
        with pytest.raises(safehttp.NotAllowed):
            safehttp.check_url(url)

    # A URL stored before the operator narrowed the list is refused at send time.
    UserSettings.objects.update_or_create(user=user, defaults={"webhook_url": receiver.url})
    event = WebhookEvent.objects.get(batch_id=ended_batch(user, tmp_path).pk)
    assert webhooks.deliver_event(event.pk) == "failed"  # for good: retrying cannot help
    assert receiver.requests == []
    assert "not allowed" in event.deliveries.get().error


def test_allowed_host_names(user, receiver, settings):
    settings.BATCHWEB = {**settings.BATCHWEB, "WEBHOOK_ALLOWED_HOSTS": [".localhost"],
                         "WEBHOOK_ALLOWED_NETWORKS": []}
    port = receiver.server.server_port
    # A listed name vouches for the name, not for a loopback or private address behind it.
    with pytest.raises(safehttp.NotAllowed):
        safehttp.check_url(f"http://localhost:{port}/x")
    settings.BATCHWEB = {**settings.BATCHWEB, "WEBHOOK_ALLOWED_HOSTS": [".localhost"],
                         "WEBHOOK_ALLOWED_NETWORKS": ["127.0.0.0/8", "::1/128"]}
    target = safehttp.check_url(f"http://localhost:{port}/x")
    assert "127.0.0.1" in target.addresses
    # Whatever order the resolver gives (::1 first, maybe), the loopback receiver is reached.
    outcome = safehttp.post(f"http://localhost:{port}/x", body=b"{}", headers={})
    assert outcome.ok, outcome.error
    settings.BATCHWEB = {**settings.BATCHWEB, "WEBHOOK_ALLOWED_HOSTS": [".localhost"],
                         "WEBHOOK_ALLOWED_NETWORKS": []}
    with pytest.raises(safehttp.NotAllowed):
        safehttp.check_url(f"http://127.0.0.1:{port}/x")  # the name was allowed, not the IP


def test_delivered_by_a_live_worker(openai_client, hooked_user, receiver, workers):
    file_id = openai_client.files.create(
        file=("in.jsonl", io.BytesIO(jsonl([chat_line("a", "hello")]))), purpose="batch").id
    batch = openai_client.batches.create(input_file_id=file_id,
                                         endpoint="/v1/chat/completions",
                                         completion_window="24h")
    workers.start(env={"BATCHWEB_WEBHOOK_ALLOWED_NETWORKS": "127.0.0.1/32"})
    wait_for(lambda: receiver.requests, timeout=90, message="the webhook")
    body = json.loads(receiver.requests[0]["body"])
    assert body["type"] == "batch.completed" and body["data"]["id"] == batch.id
    wait_for(lambda: WebhookEvent.objects.filter(status="delivered").exists(), timeout=30,
             message="the delivery to be recorded")
    assert openai_client.batches.retrieve(batch.id).status == "completed"
