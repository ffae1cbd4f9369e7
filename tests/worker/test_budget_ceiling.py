"""A monthly budget that accepted batches cannot overrun: every request's output is bounded
by what its batch's ceiling counted (a request without max_tokens counts, and runs with,
the model's room), the ceilings of batches still running are held against the budget, an
adapter's requests are counted at the adapter's price, and an attached eval set's requests
are the owner's (ceiling, quotas, charges). The ceilings are checked against what the echo
engine really runs and the ledger really charges."""

from __future__ import annotations

import functools
import threading
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from django.db import connection

from engine.base import EngineRequest, ModelSpec
from engine.echo import EchoEngine
from engine.endpoints import CHAT, COMPLETIONS, RESPONSES, endpoint
from jobs.formats.prompts import ceiling, output_room, room_for
from jobs.formats.wire import RequestLine
from jobs.lib.errors import ServiceError
from jobs.models import Batch, EvalRun, LoraAdapter, Price, Quota, UsageRecord
from jobs.services import evals, preflight
from jobs.services.batches import create_batch
from jobs.services.budgets import reserved_nanos
from jobs.services.files import create_input_file
from jobs.services.finalize import finalize_batch
from jobs.services.validation import run_validation
from tests.factories import chat_line, finalized, in_thread, jsonl, run_all_shards
from tests.lora import write_adapter_config

pytestmark = pytest.mark.django_db(transaction=True)

# A prompt of 300 words: the echo engine answers with them, cut at the output limit.
LONG = " ".join(f"w{i}" for i in range(300))


def set_budget(user: Any, amount: str) -> None:
    Quota.objects.update_or_create(user=user, defaults={"cost_per_month": Decimal(amount)})


@pytest.fixture
def prices() -> None:
    # A token costs 0.001 of either kind, an adapter's 0.1 (no batch discount).
    Price.objects.create(model="", input_per_million=1000, output_per_million=1000,
                         batch_discount_percent=0)
    Price.objects.create(model="pricey", input_per_million=20_000,
                         output_per_million=20_000, batch_discount_percent=0)


@pytest.fixture
def adapter(tmp_path: Path) -> LoraAdapter:
    folder = tmp_path / "pricey"
    write_adapter_config(folder)
    (folder / "adapter_model.safetensors").write_bytes(b"pricey")
    return LoraAdapter.objects.create(name="pricey", base_model="echo-test", source=str(folder))


@pytest.fixture
def submit(user: Any, tmp_path: Path, settings: Any, storage: Path):
    """Create a batch of `lines` as the API does: the created batch, or the refusal."""
    settings.BATCHWEB = {**settings.BATCHWEB, "SHARD_SIZE": 4}
    count = iter(range(1000))

    def make(lines: list[dict], **extra: Any) -> Batch | ServiceError:
        path = tmp_path / f"in{next(count)}.jsonl"
        path.write_bytes(jsonl(lines))
        file = create_input_file(owner=user, path=path, filename=path.name, purpose="batch")
        try:
            return create_batch(owner=user, input_file_id=file.pk, endpoint=CHAT,
                                completion_window="24h", **extra)
        except ServiceError as refused:
            return refused
    return make


def charged(batch_ids: list[str]) -> int:
    return sum(UsageRecord.objects.filter(batch_id__in=batch_ids)
               .values_list("cost_nanos", flat=True))


# --- the rule, per request ---


def test_a_request_without_a_limit_counts_the_models_room() -> None:
    room = room_for("echo-test")
    assert (room.context, room.cap) == (2048, 32_768)
    line = RequestLine("a", CHAT, {"model": "echo-test",
                                   "messages": [{"role": "user", "content": LONG}]})
    prompt, output = ceiling(line, room)
    assert prompt >= len(LONG.encode()) // 2 and output == 2048 - prompt
    assert output_room(line, room) == output
    # What the engine is sent: the same limit, named in the endpoint's own field.
    assert endpoint(CHAT).limited(line.body, room=output)["max_completion_tokens"] == output
    # n answers count n times; a named limit counts as itself.
    assert ceiling(RequestLine("b", CHAT, {**line.body, "n": 3}), room)[1] == 3 * output
    assert ceiling(RequestLine("c", CHAT, {**line.body, "max_tokens": 7}), room)[1] == 7
    # OpenAI's completions default to 16 tokens; Responses to the room.
    plain = RequestLine("d", COMPLETIONS, {"model": "echo-test", "prompt": ["x", "y"]})
    assert ceiling(plain, room)[1] == 2 * 16
    responses = RequestLine("e", RESPONSES, {"model": "echo-test", "input": "hi"})
    limited = endpoint(RESPONSES).limited(responses.body, room=output_room(responses, room))
    prompt, output = ceiling(responses, room)
    assert limited["max_output_tokens"] == output == 2048 - prompt > 1900


def test_cjk_and_emoji_are_not_undercounted() -> None:
    room = room_for("echo-test")
    text = "東京の天気は晴れです🙂" * 20
    line = RequestLine("j", CHAT, {"model": "echo-test", "max_tokens": 1,
                                   "messages": [{"role": "user", "content": text}]})
    # A quarter of the characters would be 60; half the UTF-8 bytes is 330.
    assert ceiling(line, room)[0] >= len(text.encode()) // 2 > len(text) // 4 * 5


def test_the_engine_runs_a_request_without_a_limit_within_what_was_counted(
        make_pipeline, submit, user, prices) -> None:
    batch = submit([chat_line("long", LONG)])
    run_validation(batch_id=batch.pk)
    batch = Batch.objects.get(pk=batch.pk)
    # Counted: the prompt's bound and the room it leaves, at 0.001 a token.
    assert batch.cost_ceiling_nanos == 2048 * 1_000_000
    # An engine that honours its request's room alone (the echo engine's context is far
    # larger here): the answer stops at the room, as counted.
    pipeline = make_pipeline(max_model_len=100_000)
    run_all_shards(pipeline, batch)
    done, out, _ = finalized(batch)
    usage = out[0]["response"]["body"]["usage"]
    assert usage["completion_tokens"] == 301  # "echo:" and the 300 words: all of it
    assert charged([batch.pk]) <= batch.cost_ceiling_nanos
    # The same engine handed a request without its room generates past it.
    engine = EchoEngine(ModelSpec(name="echo-test", backend="echo",
                                  options={"max_model_len": 100_000}))
    body = {"model": "echo-test", "messages": [{"role": "user", "content": LONG * 10}]}
    unbounded, bounded = engine.run([EngineRequest("x", CHAT, body),
                                     EngineRequest("y", CHAT, body, output_room=100)])
    results = {r.request_id: r for r in (unbounded, bounded)}
    assert results["x"].body["usage"]["completion_tokens"] > 2048
    assert results["y"].body["usage"]["completion_tokens"] == 100


def test_batches_still_running_hold_their_ceilings(submit, user, prices) -> None:
    """Three batches of 0.8 against a budget of 2: the third is refused until the first
    has ended and been charged what it used."""
    set_budget(user, "2")
    lines = [chat_line("r", "hi", max_tokens=725)]  # and 74 input tokens at most
    first, second = submit(lines), submit(lines)
    assert isinstance(first, Batch) and isinstance(second, Batch)
    assert first.cost_ceiling_nanos and 0.79e9 < first.cost_ceiling_nanos < 0.81e9
    third = submit(lines)
    assert isinstance(third, ServiceError) and third.status == 429
    assert third.code == "cost_per_month_exceeded" and "held by your batches" in third.message
    assert reserved_nanos(user) == first.cost_ceiling_nanos + second.cost_ceiling_nanos
    # The first ends, charged 0.1: only that is counted from now on.
    Batch.objects.filter(pk=first.pk).update(status=Batch.Status.COMPLETED)
    UsageRecord.objects.create(owner=user, batch_id=first.pk, shard_id="s1",
                               model="echo-test", base_model="echo-test", endpoint=CHAT,
                               cost_nanos=100_000_000)
    assert isinstance(submit(lines), Batch)


@pytest.mark.skipif(connection.vendor != "postgresql",
                    reason="SQLite runs one writing transaction at a time anyway")
def test_concurrent_creates_of_one_owner_cannot_share_the_room(
        user, prices, tmp_path, storage) -> None:
    set_budget(user, "1")
    files = []
    for i in range(4):
        path = tmp_path / f"race{i}.jsonl"
        path.write_bytes(jsonl([chat_line("r", "hi", max_tokens=700)]))
        files.append(create_input_file(owner=user, path=path, filename=path.name,
                                       purpose="batch"))
        preflight.check_file(files[-1], endpoint=CHAT)  # cached: the creates race in the check
    results: list[Any] = []
    barrier = threading.Barrier(len(files))

    def create(file_id: str) -> None:
        barrier.wait()
        try:
            results.append(create_batch(owner=user, input_file_id=file_id, endpoint=CHAT,
                                        completion_window="24h"))
        except ServiceError as refused:
            results.append(refused)

    threads = [in_thread(functools.partial(create, f.pk)) for f in files]
    for thread in threads:
        thread.join()
    assert len(results) == 4
    assert [r.code for r in results if isinstance(r, ServiceError)] == [
        "cost_per_month_exceeded"] * 3


def test_an_adapters_requests_are_counted_at_its_price(submit, user, prices, adapter) -> None:
    set_budget(user, "1")
    # 10 output tokens and a short prompt (74 tokens at most for a model without a tokenizer:
    # 2 bytes, 8 for the message, 64 for a template's own text): ~0.08 at the base price,
    # ~1.7 at the adapter's.
    refused = submit([chat_line("a", "hi", model="pricey", max_tokens=10)])
    assert isinstance(refused, ServiceError) and refused.code == "cost_per_month_exceeded"
    accepted = submit([chat_line("b", "hi", max_tokens=10)])
    assert isinstance(accepted, Batch) and accepted.cost_ceiling_nanos < 0.1e9


@pytest.fixture
def eval_set(tmp_path: Path, storage: Path) -> Any:
    items = [{"custom_id": f"e{i}", "body": {"messages": [{"role": "user", "content": LONG}]},
              "expected": "x"} for i in range(3)]
    path = tmp_path / "set.jsonl"
    path.write_bytes(jsonl(items))
    return evals.create_eval_set(name="long", path=path, rule="exact")


def test_an_attached_eval_set_is_the_owners(submit, user, prices, eval_set) -> None:
    # Its three requests name no limit: 3 x 2048 tokens, 6.144 at 0.001.
    set_budget(user, "6")
    lines = [chat_line("r", "hi", max_tokens=5)]
    refused = submit(lines, eval_set="long")
    assert isinstance(refused, ServiceError) and refused.code == "cost_per_month_exceeded"
    set_budget(user, "7")
    batch = submit(lines, eval_set="long")
    assert isinstance(batch, Batch) and batch.cost_ceiling_nanos > 6.144e9
    # Quotas: its requests count in the batch's, and its run as an active batch.
    Quota.objects.filter(user=user).update(max_requests_per_batch=3)
    too_many = submit(lines, eval_set="long")
    assert isinstance(too_many, ServiceError)
    assert "4 requests (with 3 of its eval set)" in too_many.message
    Quota.objects.filter(user=user).update(max_requests_per_batch=None, max_active_batches=2)
    Batch.objects.filter(pk=batch.pk).update(status=Batch.Status.CANCELLED)
    assert isinstance(submit(lines), Batch)
    busy = submit(lines, eval_set="long")
    assert isinstance(busy, ServiceError) and busy.code == "max_active_batches_exceeded"


def test_what_one_budget_accepts_is_never_charged_past_it(
        make_pipeline, submit, user, prices, adapter, eval_set) -> None:
    """One budget, everything a user might send: a batch without max_tokens, three batches
    back to back, an adapter's batch, a batch with an eval set. What is accepted runs to
    the end on the echo engine, whose answers are as long as the limits allow; the ledger
    then holds at most the budget, and each batch at most its ceiling."""
    budget = Decimal("12")
    set_budget(user, str(budget))
    tries = {
        # Its set's three requests name no limit: 3 x 2048 tokens, 6.144 at 0.001.
        "eval set": submit([chat_line("e", "hi", max_tokens=5)], eval_set="long"),
        "no limit": submit([chat_line("n", LONG)]),  # 2.048
        "adapter": submit([chat_line("a", "hi", model="pricey", max_tokens=5)]),  # 1.58
        **{f"back to back {i}": submit([chat_line(f"b{i}", "hi", max_tokens=1500)])
           for i in range(3)},  # 1.574 each
    }
    accepted = {name: b for name, b in tries.items() if isinstance(b, Batch)}
    refused = {name: e for name, e in tries.items() if isinstance(e, ServiceError)}
    assert sorted(accepted) == ["adapter", "back to back 0", "eval set", "no limit"]
    assert {e.code for e in refused.values()} == {"cost_per_month_exceeded"}
    assert sum(b.cost_ceiling_nanos for b in accepted.values()) <= budget * 10**9

    pipeline = make_pipeline(enable_lora=True)
    for batch in accepted.values():
        run_validation(batch_id=batch.pk)
        run_all_shards(pipeline, Batch.objects.get(pk=batch.pk))
        assert finalized(batch)[2] == []  # every request ran
    for run in EvalRun.objects.filter(batch__in=accepted.values()):
        run_validation(batch_id=run.run_batch_id)
        run_all_shards(pipeline, Batch.objects.get(pk=run.run_batch_id))
        finalize_batch(batch_id=run.run_batch_id)
    total = UsageRecord.objects.filter(owner=user)
    assert total.exists() and sum(r.cost_nanos for r in total) <= budget * 10**9
    for batch in accepted.values():
        ran = [batch.pk, *EvalRun.objects.filter(batch=batch).values_list("run_batch_id",
                                                                          flat=True)]
        done = Batch.objects.get(pk=batch.pk)
        assert 0 < charged(ran) <= done.cost_ceiling_nanos, (done.status, done.failed, ran)


def test_the_budgets_read_of_a_file_runs_under_the_per_user_guard(submit, user,
                                                                 prices) -> None:
    """Another heavy read of the same user (a preflight, a count) meanwhile: the create
    answers 429 at once rather than read the file beside it."""
    from jobs.lib import heavy

    set_budget(user, "10")
    with heavy.one_per_user(user.pk):
        busy = submit([chat_line("r", "hi", max_tokens=5)])
    assert isinstance(busy, ServiceError) and busy.status == 429
    assert busy.code == "rate_limit_exceeded"
    assert isinstance(submit([chat_line("r", "hi", max_tokens=5)]), Batch)
