"""The capacity plan (jobs.capacity, written by jobs.services.deadlines): a batch's work in
engine seconds priced by what the model's requests took, its projected end on the workers
alive now, the order that gets a short window through behind a long batch, the at-risk
flag and its webhook, and the number of workers an autoscaler scales on."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from jobs import capacity, fleet, queues
from jobs.models import Batch, Shard, UsageRecord, WebhookEvent
from jobs.services import deadlines, webhooks
from jobs.services.scheduling import enqueue_next_shards
from tests.factories import chat_line, make_batch, prometheus_values

pytestmark = pytest.mark.django_db(transaction=True)

# The ledger says: an output token takes 0.01 engine seconds, a prompt token 0.001.
OUTPUT_SECONDS, PROMPT_SECONDS = 0.01, 0.001


def history(model: str = "echo-test") -> None:
    shapes = [(100, 50), (400, 10), (20, 200), (1000, 100), (50, 50)]
    for i, (prompt, output) in enumerate(shapes):
        UsageRecord.objects.create(
            owner_id=_someone().pk, batch_id=f"b{i}", shard_id=f"s{i}", model=model,
            base_model=model, endpoint="/v1/chat/completions", requests_succeeded=1,
            input_tokens=prompt, output_tokens=output,
            engine_seconds=prompt * PROMPT_SECONDS + output * OUTPUT_SECONDS)


def _someone() -> Any:
    from django.contrib.auth import get_user_model

    return get_user_model().objects.get_or_create(username="history")[0]


def workers(count: int, model: str = "echo-test") -> None:
    connection = queues.connection()
    for i in range(count):
        fleet.report_rate(connection, model, fleet.WorkerRate(
            name=f"w{i}", output_tokens_per_second=100, stamp=timezone.now().timestamp()), 5)


def running(user: Any, tmp_path: Any, settings: Any, *, requests: int, max_tokens: int,
            hours: int, priority: str = "default", shard_size: int = 10) -> Batch:
    lines = [chat_line(f"r{i}", "a short question", max_tokens=max_tokens)
             for i in range(requests)]
    batch = make_batch(user, lines, tmp_path, shard_size=shard_size, settings=settings,
                       priority=priority)
    Batch.objects.filter(pk=batch.pk).update(
        expires_at=timezone.now() + timedelta(hours=hours))
    return Batch.objects.get(pk=batch.pk)


def plan_of(model: str = "echo-test") -> capacity.ModelPlan:
    (found,) = [plan for plan in capacity.plans() if plan.model == model]
    return found


def test_the_rates_are_fitted_on_the_ledger() -> None:
    history()
    rates = capacity.model_rates("echo-test")
    assert rates.source == "ledger"
    assert rates.output_seconds == pytest.approx(OUTPUT_SECONDS)
    assert rates.prompt_seconds == pytest.approx(PROMPT_SECONDS)
    # No history and no worker: the default; a live worker's speed before the ledger's.
    assert capacity.model_rates("other").source == "default"
    rate = fleet.WorkerRate(name="w", output_tokens_per_second=50, prompt_tokens_per_second=0)
    assert capacity.model_rates("other", workers=[rate]).output_seconds == pytest.approx(0.02)


def test_workers_needed_is_0_with_nothing_and_rises_with_work(user, tmp_path, settings) -> None:
    history()
    assert capacity.plans() == []
    values = prometheus_values(_metrics())
    assert values[("batchweb_workers_needed", (("model", "echo-test"),))] == 0
    # 100 requests of 100 output tokens (~1 engine second each) due in an hour, less the
    # 20% margin: one worker does it.
    running(user, tmp_path, settings, requests=100, max_tokens=100, hours=1)
    assert plan_of().workers_needed == 1
    # 1,000 requests of 1,000 output tokens more in the same hour: ~10,100 engine seconds
    # due within 2,880: 4 workers.
    running(user, tmp_path, settings, requests=1000, max_tokens=1000, hours=1, shard_size=100)
    needed = plan_of().workers_needed
    assert needed == 4
    values = prometheus_values(_metrics())
    assert values[("batchweb_workers_needed", (("model", "echo-test"),))] == needed


def _metrics() -> str:
    from jobs.metrics import render_metrics

    return render_metrics().decode()


def test_a_short_window_behind_a_long_batch_goes_first(user, tmp_path, settings) -> None:
    """A 24h batch of ~20,000 engine seconds, then a 1h one of ~2,000: sharing one worker,
    the short one would take ~4,000 s, past its target (2,880 s): it is urgent, its shards
    go to the front of the queue; the long one still makes its window after it."""
    history()
    workers(1)
    long = running(user, tmp_path, settings, requests=2000, max_tokens=1000, hours=24,
                   shard_size=100)
    short = running(user, tmp_path, settings, requests=200, max_tokens=1000, hours=1)
    # Both have their first shards in line already, the long one's first.
    queue = queues.queue(queues.shard_queue_name("echo-test", "default"))
    assert Shard.objects.get(pk=queue.job_ids[0]).batch_id == long.pk
    assert deadlines.refresh() == 2
    long, short = Batch.objects.get(pk=long.pk), Batch.objects.get(pk=short.pk)
    assert short.urgent and not long.urgent
    assert not short.at_risk and not long.at_risk
    assert short.expected_completion_at < long.expected_completion_at < long.expires_at
    assert short.expected_completion_at < short.expires_at
    # Its waiting shards went to the front; the next one taken goes there too.
    assert [Shard.objects.get(pk=j).batch_id for j in queue.job_ids] == [short.pk] * 2 + [
        long.pk] * 2
    first = Shard.objects.get(pk=queue.job_ids[0])
    Shard.objects.filter(pk=first.pk).update(status=Shard.Status.RUNNING)
    queue.remove(first.pk)
    enqueue_next_shards(batch_id=short.pk)
    assert Shard.objects.get(pk=queue.job_ids[0]).batch_id == short.pk
    assert [Shard.objects.get(pk=j).batch_id for j in queue.job_ids[2:]] == [long.pk] * 2


def test_equal_slack_keeps_fair_share(user, tmp_path, settings) -> None:
    history()
    workers(1)
    one = running(user, tmp_path, settings, requests=50, max_tokens=100, hours=24)
    two = running(user, tmp_path, settings, requests=50, max_tokens=100, hours=24)
    deadlines.refresh()
    assert not Batch.objects.filter(pk__in=[one.pk, two.pk], urgent=True).exists()
    queue = queues.queue(queues.shard_queue_name("echo-test", "default"))
    # In line as they came: two of each, the first batch's first.
    assert [Shard.objects.get(pk=j).batch_id for j in queue.job_ids] == [one.pk] * 2 + [
        two.pk] * 2


def test_an_at_risk_batch_is_flagged_and_its_webhook_sent_once(
        user, tmp_path, settings, receiver, loopback_allowed, client) -> None:
    webhooks.set_webhook_url(user=user, url=receiver.url)
    history()
    workers(1)
    # ~1,000 engine seconds in an hour is fine; 5,000 is not, on one worker.
    late = running(user, tmp_path, settings, requests=500, max_tokens=1000, hours=1,
                   shard_size=100)
    deadlines.refresh()
    deadlines.refresh()
    late = Batch.objects.get(pk=late.pk)
    assert late.at_risk and late.expected_completion_at > late.expires_at
    events = WebhookEvent.objects.filter(batch_id=late.pk, type=deadlines.AT_RISK_EVENT)
    assert events.count() == 1
    # Shown on the API object, the page, the list and /metrics.
    api = late.to_openai()
    assert api["at_risk"] is True
    assert api["expected_completion_at"] == int(late.expected_completion_at.timestamp())
    client.force_login(user)
    assert "at risk" in client.get(f"/batches/{late.pk}/").content.decode()
    assert "at-risk" in client.get("/").content.decode()
    values = prometheus_values(_metrics())
    assert values[("batchweb_batches_at_risk", (("model", "echo-test"),))] == 1
    # Five workers more: on track again, and no second event.
    workers(6)
    deadlines.refresh()
    assert not Batch.objects.get(pk=late.pk).at_risk
    assert events.count() == 1
    assert plan_of().workers_needed == 2  # ~5,000 s within 0.8 h


def test_a_running_batch_is_projected_at_its_own_pace(user, tmp_path, settings) -> None:
    """Its pace is counted from its first answers the plan saw, not from its start (the
    first answers wait for a whole generation)."""
    batch = running(user, tmp_path, settings, requests=100, max_tokens=10, hours=24)
    Batch.objects.filter(pk=batch.pk).update(completed=5)
    deadlines.refresh()
    first = Batch.objects.get(pk=batch.pk)
    assert first.pace_answered == 5 and first.pace_at is not None
    # 20 more in the next 100 s: 75 left, 375 s to go.
    Batch.objects.filter(pk=batch.pk).update(
        completed=25, pace_at=first.pace_at - timedelta(seconds=100))
    deadlines.refresh()
    expected = Batch.objects.get(pk=batch.pk).expected_completion_at
    assert abs((expected - timezone.now()).total_seconds() - 375) < 5


def test_both_faces_show_the_projection(user, tmp_path, settings, openai_client,
                                        anthropic_client) -> None:
    history()
    workers(1)
    batch = running(user, tmp_path, settings, requests=500, max_tokens=1000, hours=1,
                    shard_size=100)
    deadlines.refresh()
    expected = int(Batch.objects.get(pk=batch.pk).expected_completion_at.timestamp())
    shown = openai_client.batches.retrieve(batch.pk)
    assert shown.model_extra["expected_completion_at"] == expected
    assert shown.model_extra["at_risk"] is True
    listed = openai_client.batches.list().data[0]
    assert listed.model_extra["at_risk"] is True
    # The Anthropic face shows its own batches with the same fields.
    message_batch = anthropic_client.messages.batches.create(requests=[
        {"custom_id": "m", "params": {"model": "echo-test", "max_tokens": 10,
                                      "messages": [{"role": "user", "content": "hi"}]}}])
    from jobs.services.validation import run_validation

    run_validation(batch_id=message_batch.id)
    deadlines.refresh()
    again = anthropic_client.messages.batches.retrieve(message_batch.id)
    assert again.model_extra["expected_completion_at"] is not None
    assert again.model_extra["at_risk"] is False
