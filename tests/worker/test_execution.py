"""Batches run end to end by real `batchworker` processes (echo engine), on the real
database and Redis: results, dedup, per-request errors, cancel, expiry, kills, lost jobs,
fair share."""

from __future__ import annotations

import json
import signal
from datetime import timedelta

import pytest
from django.utils import timezone

from jobs.lib import queues
from jobs.models import Batch, Shard
from tests.factories import (
    SHAPES,
    assert_exactly_once,
    chat_line,
    jsonl,
    requests_of_shape,
    responses_line,
    shared_prefix_lines,
    submit,
    upload,
    wait_for,
    wait_status,
)

pytestmark = pytest.mark.django_db(transaction=True)


def results(client, file_id) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def every_custom_id_once(client, batch, expected: set[str]) -> tuple[list, list]:
    out = results(client, batch.output_file_id)
    err = results(client, batch.error_file_id)
    assert_exactly_once(out, err, expected)
    return out, err


def test_batch_runs_to_completion(openai_client, workers, settings):
    lines = [chat_line(f"req-{i}", f"hello number {i}", max_tokens=3 + i % 3)
             for i in range(40)]
    batch = submit(openai_client, lines, metadata={"run": "1"})
    workers.start(env={"BATCHWEB_SHARD_SIZE": "7"})
    batch = wait_status(openai_client, batch.id, {"completed"})
    assert batch.request_counts.total == 40
    assert batch.request_counts.completed == 40
    assert batch.request_counts.failed == 0
    assert batch.finalizing_at and batch.completed_at and batch.in_progress_at
    assert batch.error_file_id is None
    out, _ = every_custom_id_once(openai_client, batch, {f"req-{i}" for i in range(40)})
    first = next(r for r in out if r["custom_id"] == "req-0")
    assert first["id"].startswith("batch_req_")
    assert first["error"] is None
    assert first["response"]["status_code"] == 200
    body = first["response"]["body"]
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["content"] == "echo: hello number"
    assert body["choices"][0]["finish_reason"] == "length"
    usage_in = sum(r["response"]["body"]["usage"]["prompt_tokens"] for r in out)
    usage_out = sum(r["response"]["body"]["usage"]["completion_tokens"] for r in out)
    assert batch.usage.input_tokens == usage_in
    assert batch.usage.output_tokens == usage_out
    assert batch.usage.total_tokens == usage_in + usage_out
    assert Shard.objects.filter(batch_id=batch.id, status="done").count() == 6


def test_per_request_failure_lands_in_error_file(openai_client, workers):
    lines = [chat_line("ok", "fine"), chat_line("too-long", "word " * 3000, max_tokens=10),
             chat_line("ok2", "also fine")]
    batch = submit(openai_client, lines)
    workers.start()
    batch = wait_status(openai_client, batch.id, {"completed"})
    assert (batch.request_counts.completed, batch.request_counts.failed) == (2, 1)
    out, err = every_custom_id_once(openai_client, batch, {"ok", "ok2", "too-long"})
    assert [e["custom_id"] for e in err] == ["too-long"]
    assert err[0]["response"]["status_code"] == 400
    assert "maximum context length" in err[0]["response"]["body"]["error"]["message"]


def test_identical_deterministic_requests_are_computed_once(openai_client, workers, settings):
    same = {"temperature": 0, "max_tokens": 5}
    lines = [chat_line(f"dup-{i}", "the same question", **same) for i in range(6)]
    lines += [chat_line("seeded-a", "q", seed=7), chat_line("seeded-b", "q", seed=7)]
    lines += [chat_line("random-a", "q"), chat_line("random-b", "q")]  # sampled: both run
    batch = submit(openai_client, lines)
    workers.start(env={"BATCHWEB_SHARD_SIZE": "3"})
    batch = wait_status(openai_client, batch.id, {"completed"})
    assert Batch.objects.get(pk=batch.id).dedup_saved == 6  # 5 dups + 1 seeded copy
    out, _ = every_custom_id_once(openai_client, batch, {line["custom_id"] for line in lines})
    dup_bodies = {json.dumps(r["response"]["body"]) for r in out
                  if r["custom_id"].startswith("dup-")}
    assert len(dup_bodies) == 1  # one computation, written for all six
    assert batch.request_counts.completed == 10
    # Tokens are billed once for the computed request, not for its copies.
    computed = [r for r in out if r["custom_id"] in
                ("dup-0", "seeded-a", "random-a", "random-b")]
    assert batch.usage.input_tokens == sum(
        r["response"]["body"]["usage"]["prompt_tokens"] for r in computed)


def test_grouped_copies_of_deterministic_requests_are_computed_once(openai_client, workers):
    lines = shared_prefix_lines(40, groups=4, temperature=0)
    copies = [dict(line, custom_id=f"copy-{line['custom_id']}") for line in lines[::5]]
    batch = submit(openai_client, lines + copies)
    workers.start(env={"BATCHWEB_SHARD_SIZE": "6"})
    batch = wait_status(openai_client, batch.id, {"completed"})
    row = Batch.objects.get(pk=batch.id)
    assert row.plan["grouped"] and row.dedup_saved == len(copies)
    out, _ = every_custom_id_once(openai_client, batch,
                                  {line["custom_id"] for line in lines + copies})
    body = {r["custom_id"]: r["response"]["body"] for r in out}
    for copy in copies:
        assert body[copy["custom_id"]] == body[copy["custom_id"].removeprefix("copy-")]
    assert batch.request_counts.completed == 48


@SHAPES
def test_cancel_keeps_finished_results(openai_client, workers, settings, shape):
    lines = requests_of_shape(shape, 60, "c")
    batch = submit(openai_client, lines)
    workers.start(env={"BATCHWEB_SHARD_SIZE": "10", "BATCHWEB_ECHO_SECONDS": "0.1",
                          "BATCHWEB_ECHO_MAX_IN_FLIGHT": "4"})
    wait_for(lambda: openai_client.batches.retrieve(batch.id).request_counts.completed >= 5,
             timeout=60, message="some results")
    cancelling = openai_client.batches.cancel(batch.id)
    assert cancelling.status == "cancelling"
    batch = wait_status(openai_client, batch.id, {"cancelled"}, timeout=30)
    assert batch.cancelled_at is not None
    counts = batch.request_counts
    assert counts.completed >= 5 and counts.failed >= 1
    assert counts.completed + counts.failed == 60
    out, err = every_custom_id_once(openai_client, batch, {f"c{i}" for i in range(60)})
    assert len(out) == counts.completed
    assert all(e["error"]["code"] == "batch_cancelled" for e in err)
    assert Batch.objects.get(pk=batch.id).plan["grouped"] is (shape == "grouped")


@SHAPES
def test_expiry_keeps_partial_results(openai_client, workers, settings, shape):
    lines = requests_of_shape(shape, 60, "e")
    batch = submit(openai_client, lines)
    workers.start(env={"BATCHWEB_SHARD_SIZE": "10", "BATCHWEB_ECHO_SECONDS": "0.2",
                          "BATCHWEB_ECHO_MAX_IN_FLIGHT": "2"})
    wait_for(lambda: openai_client.batches.retrieve(batch.id).request_counts.completed >= 5,
             timeout=60, message="some results")
    # The window closes now; the workers' reconciler notices.
    Batch.objects.filter(pk=batch.id).update(expires_at=timezone.now() - timedelta(seconds=1))
    batch = wait_status(openai_client, batch.id, {"expired"}, timeout=40)
    assert batch.expired_at is not None
    out, err = every_custom_id_once(openai_client, batch, {f"e{i}" for i in range(60)})
    assert out and err
    assert all(e["error"]["code"] == "batch_expired" for e in err)
    assert Batch.objects.get(pk=batch.id).plan["grouped"] is (shape == "grouped")


@SHAPES
def test_sigkilled_worker_loses_nothing(openai_client, workers, settings, shape):
    lines = requests_of_shape(shape, 100, "k")
    batch = submit(openai_client, lines)
    # Two requests at a time, 0.2 s each: a shard takes ~2 s and the batch ~10 s. The kill
    # lands while a shard is running with progress (between shards the worker may be
    # running a control job, holding no shard, and the kill would prove nothing).
    slow = {"BATCHWEB_ECHO_SECONDS": "0.2", "BATCHWEB_ECHO_MAX_IN_FLIGHT": "2"}
    victim = workers.start(env={**slow, "BATCHWEB_SHARD_SIZE": "20"})
    wait_for(lambda: Shard.objects.filter(batch_id=batch.id, status="running",
                                          completed__gt=0).exists(),
             timeout=60, every=0.05, message="a running shard with progress")
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    # The worker that takes over need not be slow: it only has to finish what was lost.
    workers.start(env={"BATCHWEB_SHARD_SIZE": "20", "BATCHWEB_ECHO_SECONDS": "0.01"})
    batch = wait_status(openai_client, batch.id, {"completed"}, timeout=120)
    out, err = every_custom_id_once(openai_client, batch, {f"k{i}" for i in range(100)})
    assert len(out) == 100 and not err
    assert Shard.objects.filter(batch_id=batch.id, failures__gt=0).exists()
    assert Batch.objects.get(pk=batch.id).plan["grouped"] is (shape == "grouped")


def test_redis_flushed_mid_batch_is_recovered(openai_client, workers, settings):
    lines = [chat_line(f"f{i}", f"q {i}") for i in range(80)]
    batch = submit(openai_client, lines)
    workers.start(env={"BATCHWEB_SHARD_SIZE": "10", "BATCHWEB_ECHO_SECONDS": "0.02"})
    wait_for(lambda: Shard.objects.filter(batch_id=batch.id, status="done").exists(),
             timeout=60, message="a finished shard")
    queues.connection().flushdb()
    batch = wait_status(openai_client, batch.id, {"completed"}, timeout=90)
    every_custom_id_once(openai_client, batch, {f"f{i}" for i in range(80)})


@SHAPES
def test_small_batch_is_not_stuck_behind_a_big_one(openai_client, other_client, workers,
                                                    settings, shape):
    settings.BATCHWEB = {**settings.BATCHWEB, "SHARD_SIZE": 10}  # validated in this process
    big = submit(openai_client, requests_of_shape(shape, 300, "b"))
    from jobs.tasks import validate_batch

    validate_batch(big.id)
    assert Batch.objects.get(pk=big.id).plan["grouped"] is (shape == "grouped")
    small = submit(other_client, [chat_line(f"s{i}", "q") for i in range(5)])
    validate_batch(small.id)
    workers.start(env={"BATCHWEB_SHARD_SIZE": "10", "BATCHWEB_ECHO_SECONDS": "0.02"})
    wait_status(other_client, small.id, {"completed"}, timeout=120)
    small_done = Shard.objects.get(batch_id=small.id).finished_at
    big_before = Shard.objects.filter(batch_id=big.id, finished_at__lt=small_done).count()
    # FIFO would have run all 30 of the big batch's shards first; interleaving lets the
    # small one in after the big one's few shards already in the queue.
    assert big_before <= 3, big_before
    wait_status(openai_client, big.id, {"completed"}, timeout=180)


def test_quality_flags_and_json_retry(openai_client, workers):
    lines = [
        chat_line("plain", "a normal question"),
        chat_line("cut", "one two three four five", max_tokens=3),
        chat_line("loop", "na " * 30),
        chat_line("json", "give me json", response_format={"type": "json_object"}),
    ]
    batch = submit(openai_client, lines)
    workers.start()
    batch = wait_status(openai_client, batch.id, {"completed"})
    out, _ = every_custom_id_once(openai_client, batch, {line["custom_id"] for line in lines})
    shard = Shard.objects.get(batch_id=batch.id)
    assert shard.flag_counts == {"length_limit": 1, "repetition": 1, "invalid_json": 1}
    # The JSON request ran twice (the retry with a new seed); only one line was written.
    assert shard.json_retries == 1
    assert sum(1 for r in out if r["custom_id"] == "json") == 1
    from django.core.files.storage import default_storage

    with default_storage.open(shard.flags_part) as part:
        flagged = {json.loads(line)["custom_id"]: json.loads(line)["flags"] for line in part}
    assert flagged == {"cut": ["length_limit"], "loop": ["repetition"],
                       "json": ["invalid_json"]}


def test_a_responses_batch_runs_on_a_worker_process(openai_client, workers):
    lines = [responses_line(f"q{i}", f"hello number {i}", max_output_tokens=2 + i % 2,
                            instructions="Be brief.") for i in range(10)]
    lines.append(responses_line("too-long", "word " * 3000))
    batch = openai_client.batches.create(
        input_file_id=upload(openai_client, jsonl(lines)).id, endpoint="/v1/responses",
        completion_window="24h")
    workers.start(env={"BATCHWEB_SHARD_SIZE": "4"})
    batch = wait_status(openai_client, batch.id, {"completed"})
    assert batch.endpoint == "/v1/responses"
    out, err = every_custom_id_once(openai_client, batch,
                                    {line["custom_id"] for line in lines})
    assert [e["custom_id"] for e in err] == ["too-long"]
    assert err[0]["response"]["status_code"] == 400
    body = next(r["response"]["body"] for r in out if r["custom_id"] == "q1")
    assert body["object"] == "response" and body["status"] == "incomplete"
    assert body["output"][0]["content"][0]["text"] == "echo: hello number"
    assert batch.usage.input_tokens == sum(r["response"]["body"]["usage"]["input_tokens"]
                                           for r in out)
    assert batch.usage.output_tokens == sum(r["response"]["body"]["usage"]["output_tokens"]
                                            for r in out)


@pytest.mark.parametrize("endpoint", ["/v1/score", "/v1/rerank"])
def test_score_and_rerank_batches_run_on_a_worker_process(openai_client, workers, endpoint):
    """The openai client's batches.create types `endpoint` as a Literal of OpenAI's
    endpoints but sends any string: vLLM's score and rerank batches are created with it."""
    def line(custom_id: str, query: str, **body) -> dict:
        shape = ({"queries": query, "documents": ["a kitten", "taxes rose"]}
                 if endpoint == "/v1/score" else {"query": query,
                                                  "documents": ["taxes rose", "a kitten"]})
        return {"custom_id": custom_id, "method": "POST", "url": endpoint,
                "body": {"model": "echo-test", **shape, **body}}

    lines = [line(f"q{i}", f"a cat number {i}") for i in range(6)]
    lines += [line("again", "a cat number 0"),  # deterministic: computed once
              line("too-long", "word " * 3000)]
    batch = openai_client.batches.create(
        input_file_id=upload(openai_client, jsonl(lines)).id, endpoint=endpoint,
        completion_window="24h")
    workers.start(env={"BATCHWEB_SHARD_SIZE": "3"})
    batch = wait_status(openai_client, batch.id, {"completed"})
    assert batch.endpoint == endpoint and batch.model == "echo-test"
    out, err = every_custom_id_once(openai_client, batch,
                                    {line["custom_id"] for line in lines})
    assert [e["custom_id"] for e in err] == ["too-long"]
    assert "maximum context length" in err[0]["response"]["body"]["error"]["message"]
    bodies = {r["custom_id"]: r["response"]["body"] for r in out}
    if endpoint == "/v1/score":
        assert [d["object"] for d in bodies["q1"]["data"]] == ["score", "score"]
    else:
        assert {r["document"]["text"] for r in bodies["q1"]["results"]} == {
            "a kitten", "taxes rose"}
    assert bodies["again"] == bodies["q0"]
    assert Batch.objects.get(pk=batch.id).dedup_saved == 1
    computed = [body for custom_id, body in bodies.items() if custom_id != "again"]
    assert batch.usage.input_tokens == sum(b["usage"]["prompt_tokens"] for b in computed)
    assert batch.usage.output_tokens == 0


def test_a_worker_with_a_full_batch_leaves_shards_to_an_idle_one(openai_client, workers,
                                                                   settings):
    # Each echo engine computes 4 requests at a time (0.1 s each) and a shard is 8 requests,
    # so one shard fills a worker's batch: it takes its next shard only once that batch has
    # room, and never holds more than 2 shards at once (without the rule it held up to 8,
    # its inbox's worth). The idle worker gets the rest.
    slow = {"BATCHWEB_ECHO_SECONDS": "0.1", "BATCHWEB_ECHO_MAX_IN_FLIGHT": "4",
            "BATCHWEB_SHARD_SIZE": "8"}
    workers.start(env=slow)
    workers.start(env=slow)
    wait_for(lambda: workers.logs().count("ready on") == 2, message="two ready workers")
    batch = submit(openai_client, [chat_line(f"w{i}", f"q {i}") for i in range(96)])
    batch = wait_status(openai_client, batch.id, {"completed"}, timeout=120)
    every_custom_id_once(openai_client, batch, {f"w{i}" for i in range(96)})
    shards = list(Shard.objects.filter(batch_id=batch.id).values_list(
        "worker", "started_at", "finished_at"))
    assert len({worker for worker, _, _ in shards}) == 2
    held_at_once = max(
        sum(1 for other, start, end in shards if other == worker and start <= moment < end)
        for worker, moment, _ in shards)
    assert held_at_once <= 2, held_at_once
