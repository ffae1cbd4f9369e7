"""The capacity plan (jobs.capacity.plan, written by jobs.services.deadlines): a batch's work in
engine seconds priced by what the model's requests took, its projected end on the workers
alive now, the order that gets a short window through behind a long batch, the at-risk
flag and its webhook, and the number of workers an autoscaler scales on."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from jobs.capacity import fleet
from jobs.capacity import plan as capacity
from jobs.lib import queues
from jobs.models import (
    WAITS_FOR_START,
    WAITS_FOR_WORKER,
    Batch,
    Shard,
    UsageRecord,
    WebhookEvent,
    target_seconds,
)
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
    from jobs.http.metrics import render_metrics

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


def test_deadline_order_puts_one_batch_first_at_a_time(user, tmp_path, settings) -> None:
    """Sharing one worker three ways, a 24h batch of ~30,000 engine seconds would be late
    (~90,000 s > 69,120), and so would a 1h one of ~2,000 (~6,000 > 2,880): the batches due
    no later than the 24h one run earliest deadline first, the 1h one, then the 2h one
    (~1,000, fine sharing but due sooner), then the 24h one. Only the first is urgent: two
    at the front would take turns there, and the 24h one's shards would keep the others
    behind them."""
    history()
    workers(1)
    big = running(user, tmp_path, settings, requests=3000, max_tokens=1000, hours=24,
                  shard_size=100)
    one = running(user, tmp_path, settings, requests=200, max_tokens=1000, hours=1,
                  shard_size=100)
    two = running(user, tmp_path, settings, requests=100, max_tokens=1000, hours=2,
                  shard_size=100)
    deadlines.refresh()
    big, one, two = (Batch.objects.get(pk=b.pk) for b in (big, one, two))
    assert one.urgent and not two.urgent and not big.urgent
    assert one.expected_completion_at < two.expected_completion_at < big.expected_completion_at
    assert not (one.at_risk or two.at_risk or big.at_risk)
    # The first one done, the next in deadline order goes first.
    Batch.objects.filter(pk=one.pk).update(status=Batch.Status.COMPLETED)
    deadlines.refresh()
    assert Batch.objects.get(pk=two.pk).urgent is False  # sharing two ways meets both now
    Batch.objects.filter(pk=big.pk).update(expires_at=timezone.now() + timedelta(hours=10))
    deadlines.refresh()
    assert [Batch.objects.get(pk=b.pk).urgent for b in (two, big)] == [True, False]


def test_the_comparison_switch_turns_the_order_off(user, tmp_path, settings,
                                                  monkeypatch) -> None:
    """BATCHWEB_DEADLINE_ORDER=0 (bench/simulation.py's order before deadlines): the same
    plan and projection, but the short batch is not put first."""
    monkeypatch.setenv("BATCHWEB_DEADLINE_ORDER", "0")
    history()
    workers(1)
    long = running(user, tmp_path, settings, requests=2000, max_tokens=1000, hours=24,
                   shard_size=100)
    short = running(user, tmp_path, settings, requests=200, max_tokens=1000, hours=1)
    deadlines.refresh()
    assert not Batch.objects.filter(pk__in=[long.pk, short.pk], urgent=True).exists()
    assert Batch.objects.get(pk=short.pk).expected_completion_at is not None
    queue = queues.queue(queues.shard_queue_name("echo-test", "default"))
    assert [Shard.objects.get(pk=j).batch_id for j in queue.job_ids] == [long.pk] * 2 + [
        short.pk] * 2
    # Turned back on, the next pass puts it first.
    monkeypatch.setenv("BATCHWEB_DEADLINE_ORDER", "1")
    deadlines.refresh()
    assert Batch.objects.get(pk=short.pk).urgent
    assert Shard.objects.get(pk=queue.job_ids[0]).batch_id == short.pk


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
    workers(1)
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


def test_a_young_batch_counts_the_requests_its_engines_hold(user, tmp_path, settings) -> None:
    """At 10% done its answers are still the first wave's (4 a second since the plan first
    saw some); the requests it started, answered or held by a worker, say the engines' pace
    (700 in the 100 s since its first shard was claimed: 7 a second). Weighed by the share
    answered: 0.9 x 7 + 0.1 x 4 = 6.7 a second, 1,800 left, 269 s to go."""
    batch = running(user, tmp_path, settings, requests=2000, max_tokens=10, hours=24,
                    shard_size=100)
    now = timezone.now()
    shards = list(Shard.objects.filter(batch=batch).order_by("index"))
    for shard in shards[:2]:  # answered
        Shard.objects.filter(pk=shard.pk).update(
            status=Shard.Status.DONE, completed=100, started_at=now - timedelta(seconds=100),
            finished_at=now - timedelta(seconds=20))
    for shard in shards[2:7]:  # claimed, in an engine, nothing answered yet
        Shard.objects.filter(pk=shard.pk).update(
            status=Shard.Status.RUNNING, started_at=now - timedelta(seconds=60))
    Batch.objects.filter(pk=batch.pk).update(
        completed=200, pace_at=now - timedelta(seconds=40), pace_answered=40)
    alive = [fleet.WorkerRate(name="w0", output_tokens_per_second=100)]
    (item,) = capacity.plan_model("echo-test", [Batch.objects.get(pk=batch.pk)],
                                  workers=alive, now=now).batches
    assert (item.finish - now).total_seconds() == pytest.approx(1800 / 6.7, abs=0.5)
    # Answered at the same pace with nothing in flight, it is its answers' pace alone.
    Shard.objects.filter(batch=batch, status=Shard.Status.RUNNING).update(
        status=Shard.Status.QUEUED, started_at=None)
    Batch.objects.filter(pk=batch.pk).update(completed=200, pace_answered=40)
    for shard in shards[:2]:
        Shard.objects.filter(pk=shard.pk).update(started_at=now - timedelta(seconds=50))
    (item,) = capacity.plan_model("echo-test", [Batch.objects.get(pk=batch.pk)],
                                  workers=alive, now=now).batches
    assert (item.finish - now).total_seconds() == pytest.approx(1800 / 4, abs=0.5)


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


def test_a_batch_no_worker_serves_waits_for_one_on_both_faces(
        user, tmp_path, settings, openai_client, anthropic_client) -> None:
    """No worker of its model: the batch waits for the one the capacity signal asks for,
    and is projected after that worker's cold start; read later, with no pass since, its end
    has moved on by as long (never a moment already past), on both faces."""
    history()
    fleet.report_cold_start(queues.connection(), "echo-test", 40.0)
    batch = running(user, tmp_path, settings, requests=100, max_tokens=100, hours=24)
    deadlines.refresh()
    row = Batch.objects.get(pk=batch.pk)
    assert row.waits_for == "worker" and not row.at_risk
    # 100 requests of 100 output tokens at 0.01 s each, after 40 s of cold start.
    planned = (row.expected_completion_at - row.planned_at).total_seconds()
    assert planned == pytest.approx(40 + 100, abs=1.5)
    assert plan_of().workers_needed == 1 and plan_of().startup == capacity.Startup(40.0)
    first = openai_client.batches.retrieve(batch.pk).model_extra
    assert first["waits_for"] == "worker" and first["at_risk"] is False
    import time

    time.sleep(2.2)  # no pass meanwhile: the row is as the plan left it
    again = openai_client.batches.retrieve(batch.pk).model_extra
    now = timezone.now().timestamp()
    assert again["expected_completion_at"] >= now + 130
    assert again["expected_completion_at"] >= first["expected_completion_at"] + 2
    listed = openai_client.batches.list().data[0].model_extra
    assert listed["expected_completion_at"] >= now and listed["waits_for"] == "worker"
    # A pass while it still waits as long leaves its row, and every poll's answer, as it was.
    assert deadlines.refresh() == 0
    assert Batch.objects.get(pk=batch.pk).progress_version == row.progress_version
    # The Anthropic face's own batch says the same.
    message_batch = anthropic_client.messages.batches.create(requests=[
        {"custom_id": "m", "params": {"model": "echo-test", "max_tokens": 10,
                                      "messages": [{"role": "user", "content": "hi"}]}}])
    from jobs.services.validation import run_validation

    run_validation(batch_id=message_batch.id)
    deadlines.refresh()
    shown = anthropic_client.messages.batches.retrieve(message_batch.id).model_extra
    assert shown["waits_for"] == "worker" and shown["at_risk"] is False
    assert shown["expected_completion_at"] >= timezone.now().timestamp() + 40
    # A worker comes: the next pass plans on it, and nothing waits any more.
    workers(1)
    deadlines.refresh()
    assert not Batch.objects.filter(pk__in=[batch.pk, message_batch.id]).exclude(
        waits_for="").exists()
    assert openai_client.batches.retrieve(batch.pk).model_extra["waits_for"] is None


def test_a_worker_loading_its_engine_leaves_what_is_left_of_its_start(
        user, tmp_path, settings) -> None:
    """A worker of the model began loading its engine 60 s ago and the last one took
    100 s: the batch waits for the 40 s left, then its work (100 requests of 100 output
    tokens at 0.01 s: 100 s). Once that worker is ready and reports itself, nothing waits."""

    history()
    connection = queues.connection()
    starting = fleet.STARTING_KEY.format(model="echo-test")
    fleet.report_cold_start(connection, "echo-test", 100.0)
    batch = running(user, tmp_path, settings, requests=100, max_tokens=100, hours=24)
    fleet.report_starting(connection, "echo-test", "w0")
    connection.hset(starting, "w0", f"{timezone.now().timestamp() - 60:.0f}")
    deadlines.refresh()
    row = Batch.objects.get(pk=batch.pk)
    assert row.waits_for == WAITS_FOR_START
    assert (row.expected_completion_at - row.planned_at).total_seconds() == pytest.approx(
        40 + 100, abs=2)
    assert plan_of().startup.starting_for == pytest.approx(60, abs=2)
    assert row.to_openai()["waits_for"] == "start"
    # One that began long ago died loading, and is forgotten: it waits for a worker again.
    connection.hset(starting, "w0", f"{timezone.now().timestamp() - 3600:.0f}")
    deadlines.refresh()
    assert Batch.objects.get(pk=batch.pk).waits_for == WAITS_FOR_WORKER
    # Ready: no longer starting; alive, it runs the batch.
    fleet.report_starting(connection, "echo-test", "w0")
    fleet.report_cold_start(connection, "echo-test", 95.0, name="w0")
    assert connection.hlen(starting) == 0
    workers(1)
    deadlines.refresh()
    assert Batch.objects.get(pk=batch.pk).projection().waits_for == ""


def test_a_batch_that_cannot_make_its_window_without_a_worker_is_at_risk(
        user, tmp_path, settings) -> None:
    """Its window's target is 48 min away (an hour less the margin): with a cold start of
    40 min and 10 min of work, even a worker starting now is late. And one that would make
    it becomes at risk as it waits, without a pass: its end moves on with the clock, its
    target (the window's end less 20% of the time left) more slowly."""
    history()
    fleet.report_cold_start(queues.connection(), "echo-test", 2400.0)
    late = running(user, tmp_path, settings, requests=600, max_tokens=100, hours=1)
    deadlines.refresh()
    assert Batch.objects.get(pk=late.pk).at_risk
    assert Batch.objects.get(pk=late.pk).to_openai()["at_risk"] is True
    fleet.report_cold_start(queues.connection(), "echo-test", 60.0)
    deadlines.refresh()
    row = Batch.objects.get(pk=late.pk)
    assert not row.at_risk and not row.projection().at_risk
    # ~11 min of work after a 1 min cold start: 50 min later it would end ~61 min after
    # the plan, past the target then (~58 min) and the window itself.
    later = row.planned_at + timedelta(minutes=50)
    read = row.projection(later)
    assert read.at_risk and read.end is not None and read.end > later
    assert read.end - later == row.expected_completion_at - row.planned_at


WORKER_COUNTS = st.sampled_from([0, 0, 1, 3])


@hypothesis_settings(max_examples=60, deadline=None,
                     suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(workers_alive=WORKER_COUNTS, worker_speed=st.sampled_from([0.0, 5.0, 100.0]),
       cold_start=st.one_of(st.none(), st.floats(0, 3600)),
       window=st.floats(-120, 86400), done=st.floats(0, 1),
       pace=st.one_of(st.none(), st.floats(0, 3600)), stale=st.floats(0, 200_000),
       starting=st.one_of(st.none(), st.floats(0, 7200)), ledger=st.booleans())
def test_a_projection_is_never_a_moment_already_past(
        user, tmp_path, settings, workers_alive, worker_speed, cold_start, window, done, pace,
        stale, starting, ledger) -> None:
    """Whatever the plan's inputs (no workers, workers that measured nothing yet, a cold
    start reported or not, a worker loading its engine for a while or for longer than the
    last one took, a window nearly over or already past, a batch that ran some, a plan read
    long after it was written), a running batch's projected end, read at any moment, is
    that moment or later; it says it waits for a worker exactly while none runs its model,
    and it is at risk whenever that end is past its target."""

    connection = queues.connection()
    connection.delete(fleet.RATES_KEY.format(model="echo-test"),
                      fleet.COLD_START_KEY.format(model="echo-test"),
                      fleet.STARTING_KEY.format(model="echo-test"))
    UsageRecord.objects.all().delete()
    if ledger:
        history()
    for i in range(workers_alive):
        fleet.report_rate(connection, "echo-test", fleet.WorkerRate(
            name=f"w{i}", output_tokens_per_second=worker_speed,
            stamp=timezone.now().timestamp()), 5)
    if cold_start is not None:
        fleet.report_cold_start(connection, "echo-test", cold_start)
    if starting is not None:
        connection.hset(fleet.STARTING_KEY.format(model="echo-test"), "loading",
                        f"{timezone.now().timestamp() - starting:.0f}")
    batch = Batch.objects.filter(owner=user).first() or running(
        user, tmp_path, settings, requests=50, max_tokens=50, hours=24)
    now = timezone.now()
    answered = int(done * batch.total)
    Batch.objects.filter(pk=batch.pk).update(
        status=Batch.Status.IN_PROGRESS, completed=answered,
        output_tokens=answered * 20, expires_at=now + timedelta(seconds=window),
        pace_at=None if pace is None else now - timedelta(seconds=pace), pace_answered=0,
        expected_completion_at=None, planned_at=None, waits_for="", at_risk=False)
    deadlines.refresh(now=now)
    row = Batch.objects.get(pk=batch.pk)
    for moment in (now, now + timedelta(seconds=stale / 1000), now + timedelta(seconds=stale)):
        read = row.projection(moment)
        if answered >= row.total:
            continue  # nothing left: the finalization, not the plan, ends it
        assert read.end is not None and read.end >= moment
        assert read.epoch is not None and read.epoch >= moment.timestamp()
        assert read.waits_for in (
            {""} if workers_alive else {WAITS_FOR_WORKER, WAITS_FOR_START})
        if not workers_alive and starting is None:
            assert read.waits_for == WAITS_FOR_WORKER
        target = target_seconds(row.expires_at, moment)
        if (read.end - moment).total_seconds() > target:
            assert read.at_risk
