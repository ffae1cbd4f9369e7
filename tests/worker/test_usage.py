"""The usage ledger with the worker pipeline and the echo engine: a batch's cost on its page
is its output file's usage times the prices, computed from the downloaded file; what dedup
copies, JSON retries, quality flags, spot checks, cached prompt tokens, cancellation and a
price change cost."""

from __future__ import annotations

import json
from decimal import Decimal

import pytest

from jobs.models import Price, Shard, UsageRecord
from jobs.queries.spot_samples import sample
from jobs.services.pricing import format_cost
from jobs.services.spotcheck import mark
from jobs.services.stopping import cancel_batch
from tests.factories import chat_line, finalized, run_all_shards, start_shard, wait_for

pytestmark = pytest.mark.django_db(transaction=True)

PRICES = {"input": Decimal("2.5"), "cached": Decimal("1.25"), "output": Decimal("10")}


@pytest.fixture
def prices() -> Price:
    Price.objects.create(model="", input_per_million=1, output_per_million=1)
    return Price.objects.create(model="echo-test", input_per_million=PRICES["input"],
                                cached_input_per_million=PRICES["cached"],
                                output_per_million=PRICES["output"],
                                batch_discount_percent=50)


def expected_cost(bodies: list[dict]) -> Decimal:
    """The seeds' rule from response bodies: uncached input, cached input and output tokens
    at their list prices per million, half off."""
    total = Decimal(0)
    for body in bodies:
        usage = body["usage"]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        total += ((usage["prompt_tokens"] - cached) * PRICES["input"] + cached * PRICES["cached"]
                  + usage["completion_tokens"] * PRICES["output"]) / 1_000_000 / 2
    return total


def downloaded_output(client, batch) -> list[dict]:
    client.force_login(batch.owner)
    response = client.get(f"/batches/{batch.pk}/download/output")
    assert response.status_code == 200
    return [json.loads(line) for line in b"".join(response.streaming_content).splitlines()]


def with_cached_tokens(pipeline) -> None:
    real_handle = pipeline.state.engine.handle

    def handle(url, body, adapter_path=""):
        status, answer = real_handle(url, body, adapter_path)
        usage = answer["usage"]
        usage["prompt_tokens_details"] = {"cached_tokens": usage["prompt_tokens"] // 2}
        return status, answer

    pipeline.state.engine.handle = handle  # type: ignore[method-assign]


def test_a_batchs_cost_on_its_page_is_its_output_usage_times_the_prices(
        make_batch, make_pipeline, prices, client):
    lines = [chat_line(f"r{i}", f"question number {i} " * (i + 1), max_tokens=5 + i)
             for i in range(10)]
    lines.append(chat_line("bad", "x", max_tokens=999_999_999))  # refused: costs nothing
    batch = make_batch(lines, shard_size=3)
    assert batch.cost_ceiling_nanos and batch.cost_ceiling_nanos > 0
    pipeline = make_pipeline()
    with_cached_tokens(pipeline)
    run_all_shards(pipeline, batch)
    done, _, err = finalized(batch)
    out = downloaded_output(client, done)
    assert len(out) == 10 and err
    expected = expected_cost([r["response"]["body"] for r in out])
    assert expected > 0
    records = UsageRecord.objects.filter(batch_id=batch.pk)
    assert records.count() == Shard.objects.filter(batch=batch).count()
    charged = sum(r.cost_nanos for r in records)
    # Each shard's charge is rounded once to a billionth.
    assert abs(Decimal(charged) / 10**9 - expected) <= Decimal(records.count()) / 10**9
    assert sum(r.requests_succeeded for r in records) == 10
    assert sum(r.requests_failed for r in records) == len(err)
    assert sum(r.engine_seconds for r in records) > 0
    assert {r.input_price for r in records} == {PRICES["input"] / 2}
    page = client.get(f"/batches/{batch.pk}/").content.decode()
    assert format_cost(int((expected * 10**9).to_integral_value())) in page
    assert format_cost(batch.cost_ceiling_nanos) in page

    # A new price changes nothing already charged.
    Price.objects.filter(pk=prices.pk).update(input_per_million=100, output_per_million=100)
    assert sum(r.cost_nanos for r in UsageRecord.objects.filter(batch_id=batch.pk)) == charged
    # A spot check's verdict changes nothing either: a "bad" output was still delivered.
    mark(batch=done, custom_id="r1", verdict="bad", note="wrong", user=done.owner,
         sampled={item.custom_id for item in sample(done)})
    assert sum(r.cost_nanos for r in UsageRecord.objects.filter(batch_id=batch.pk)) == charged


def test_dedup_copies_cost_nothing_and_json_retries_only_their_answer(
        make_batch, make_pipeline, prices, client):
    json_format = {"response_format": {"type": "json_object"}}
    lines = [chat_line("same-a", "twice asked", temperature=0),
             chat_line("same-b", "twice asked", temperature=0),
             chat_line("j0", "not json", **json_format)]
    batch = make_batch(lines, shard_size=10)
    assert batch.dedup_saved == 1
    pipeline = make_pipeline()
    run_all_shards(pipeline, batch)
    done, _, _ = finalized(batch)
    out = {r["custom_id"]: r["response"]["body"] for r in downloaded_output(client, done)}
    assert Shard.objects.get(batch=batch).json_retries == 1
    assert Shard.objects.get(batch=batch).flag_counts.get("invalid_json") == 1
    record = UsageRecord.objects.get(batch_id=batch.pk)
    # The copy is delivered (a success) but its tokens were computed once: not charged; the
    # JSON retry's first answer was never delivered: only the written answer is charged;
    # the flagged answer was delivered: charged.
    assert record.requests_succeeded == 3
    assert record.input_tokens == out["same-a"]["usage"]["prompt_tokens"] + \
        out["j0"]["usage"]["prompt_tokens"]
    expected = expected_cost([out["same-a"], out["j0"]])
    assert abs(Decimal(record.cost_nanos) / 10**9 - expected) <= Decimal("1e-9")


def test_a_cancelled_batch_is_charged_for_what_completed_only(make_batch, make_pipeline,
                                                              prices, client):
    lines = [chat_line(f"c{i}", f"slow {i}") for i in range(20)]
    batch = make_batch(lines, shard_size=10)
    pipeline = make_pipeline(seconds_per_request=0.3, max_in_flight=2, inbox_size=2)
    first = Shard.objects.get(batch=batch, index=0)
    start_shard(pipeline, first.pk)
    wait_for(lambda: Shard.objects.filter(pk=first.pk, completed__gt=0).exists(),
             timeout=20, message="a first result")
    cancel_batch(batch=batch)
    wait_for(lambda: Shard.objects.filter(pk=first.pk, status="done").exists(),
             timeout=20, message="the shard stopped")
    done, _, err = finalized(batch)
    assert done.status == "cancelled"
    out = downloaded_output(client, done) if done.output_file_id else []
    records = list(UsageRecord.objects.filter(batch_id=batch.pk))
    # The dropped shard never ran: no record; the stopped one is charged its results.
    assert [r.shard_id for r in records] == [first.pk]
    assert records[0].requests_succeeded == len(out)
    expected = expected_cost([r["response"]["body"] for r in out])
    assert abs(Decimal(records[0].cost_nanos) / 10**9 - expected) <= Decimal("1e-9")


def test_an_expired_batch_is_charged_once_for_what_completed(make_batch, make_pipeline,
                                                              prices, client):
    from django.utils import timezone

    from jobs.models import Batch
    from jobs.services.stopping import expire_due_batches
    from tests.factories import assert_charged_once

    lines = [chat_line(f"e{i}", f"slow {i}") for i in range(16)]
    batch = make_batch(lines, shard_size=8)
    pipeline = make_pipeline(seconds_per_request=0.3, max_in_flight=2, inbox_size=2)
    first = Shard.objects.get(batch=batch, index=0)
    start_shard(pipeline, first.pk)
    wait_for(lambda: Shard.objects.filter(pk=first.pk, completed__gt=0).exists(),
             timeout=20, message="a first result")
    Batch.objects.filter(pk=batch.pk).update(expires_at=timezone.now())
    assert expire_due_batches() == [batch.pk]
    wait_for(lambda: Shard.objects.filter(pk=first.pk, status="done").exists(),
             timeout=20, message="the shard stopped")
    done, _, err = finalized(batch)
    assert done.status == "expired" and err
    out = downloaded_output(client, done) if done.output_file_id else []
    assert 0 < len(out) < 16
    # Finalizing again (a second finalizer, the reconciler) charges nothing more.
    finalized(batch)
    assert_charged_once(batch.pk, out)
    assert UsageRecord.objects.filter(batch_id=batch.pk).count() == 1
