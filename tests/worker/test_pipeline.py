"""The worker pipeline in-process: a batch's shards run to completion, the JSON retry, a
/v1/responses batch through the openai client, a batch stopped while its shard runs, a
part file that cannot be written, and the engine-idle accounting reported when a worker
stops."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest

from engine.base import EngineRequest, EngineResult
from engine.prefix_limit import PromptBlocks
from jobs.models import Batch, Shard
from jobs.services.stopping import cancel_batch
from jobs.tasks import validate_batch
from jobs.worker import part_storage
from tests.factories import (
    chat_line,
    finalized,
    jsonl,
    responses_line,
    run_all_shards,
    shared_prefix_lines,
    start_shard,
    template_of,
    upload,
    wait_for,
)

# The pipeline's threads use connections of their own: the rows must be committed.
pytestmark = pytest.mark.django_db(transaction=True)


def test_a_batch_runs_to_completion_with_dedup_copies(make_batch, make_pipeline):
    lines = [chat_line(f"r{i}", f"question {i}", max_tokens=2) for i in range(9)]
    # Two identical deterministic requests: computed once, written for both custom_ids.
    lines += [chat_line("same-a", "twice asked", temperature=0),
              chat_line("same-b", "twice asked", temperature=0)]
    batch = make_batch(lines, shard_size=4)
    assert batch.dedup_saved == 1
    pipeline = make_pipeline()
    run_all_shards(pipeline, batch)
    done, out, err = finalized(batch)
    assert done.status == "completed" and err == []
    assert {r["custom_id"] for r in out} == {line["custom_id"] for line in lines}
    by_id = {r["custom_id"]: r["response"]["body"] for r in out}
    assert by_id["same-a"]["choices"] == by_id["same-b"]["choices"]
    # Usage counts the computed request once: the copy cost nothing.
    computed = [body for cid, body in by_id.items() if cid != "same-b"]
    assert done.input_tokens == sum(b["usage"]["prompt_tokens"] for b in computed)
    assert done.output_tokens == sum(b["usage"]["completion_tokens"] for b in computed)
    assert (done.completed, done.failed) == (11, 0)
    assert not pipeline.state.works


def test_json_output_that_does_not_parse_is_run_once_more(make_batch, make_pipeline):
    json_format = {"response_format": {"type": "json_object"}}
    lines = [chat_line("j0", "not json", **json_format), chat_line("j1", "no", **json_format),
             chat_line("plain", "fine")]
    batch = make_batch(lines, shard_size=10)
    pipeline = make_pipeline()
    computed: list[str] = []
    real_handle = pipeline.state.engine.handle

    def counting(url, body, adapter_path=""):
        computed.append(body["messages"][0]["content"])
        return real_handle(url, body, adapter_path)

    pipeline.state.engine.handle = counting  # type: ignore[method-assign]
    run_all_shards(pipeline, batch)
    shard = Shard.objects.get(batch=batch)
    assert shard.json_retries == 2
    assert sorted(computed) == ["fine", "no", "no", "not json", "not json"]
    done, out, _ = finalized(batch)
    # Only the final attempt is written: one line per custom_id, with its flag.
    assert sorted(r["custom_id"] for r in out) == ["j0", "j1", "plain"]
    assert shard.flag_counts.get("invalid_json") == 2



def test_prompt_tokens_served_from_the_prefix_cache_are_summed(make_batch, make_pipeline,
                                                              client):
    """The engine's `prompt_tokens_details.cached_tokens` (vLLM's, here added to the echo
    engine's answers) add up on the batch: in its OpenAI usage and its page's run report."""
    lines = [chat_line(f"p{i}", f"question {i}") for i in range(6)]
    batch = make_batch(lines, shard_size=4)
    pipeline = make_pipeline()
    real_handle = pipeline.state.engine.handle

    def with_cached_tokens(url, body, adapter_path=""):
        status, answer = real_handle(url, body, adapter_path)
        usage = answer["usage"]
        usage["prompt_tokens_details"] = {"cached_tokens": usage["prompt_tokens"] - 1}
        return status, answer

    pipeline.state.engine.handle = with_cached_tokens  # type: ignore[method-assign]
    run_all_shards(pipeline, batch)
    done, out, _ = finalized(batch)
    prompt = sum(r["response"]["body"]["usage"]["prompt_tokens"] for r in out)
    assert (done.input_tokens, done.cached_tokens) == (prompt, prompt - 6)
    usage = done.to_openai()["usage"]
    assert usage["input_tokens_details"] == {"cached_tokens": prompt - 6}
    client.force_login(batch.owner)
    page = client.get(f"/batches/{batch.pk}/").content.decode()
    assert f"{(prompt - 6) / prompt * 100:.1f}%" in page
    # How validation planned the shards, and why.
    assert "file order" in page and done.plan["reason"] in page


def test_a_responses_batch_through_the_openai_client(openai_client, make_pipeline, storage,
                                                      settings, client, user):
    """A /v1/responses batch as OpenAI's Batch API takes one: Response objects in the output
    file, a refused request in the error file, dedup, the JSON retry and quality flags on
    text.format, usage (cached tokens too) summed from the Responses usage, and the
    dashboard showing each request's messages beside its answer."""
    settings.BATCHWEB = {**settings.BATCHWEB, "SHARD_SIZE": 3}
    json_format = {"text": {"format": {"type": "json_object"}}}
    lines = [responses_line(f"r{i}", f"question {i}", max_output_tokens=2) for i in range(3)]
    lines += [responses_line("same-a", "twice asked", temperature=0, instructions="Be brief."),
              responses_line("same-b", "twice asked", temperature=0, instructions="Be brief."),
              responses_line("json", "not json", **json_format),
              responses_line("items", "", input=[{"role": "user", "content": [
                  {"type": "input_text", "text": "say it back"}]}]),
              responses_line("too-long", "word " * 3000)]
    created = openai_client.batches.create(input_file_id=upload(openai_client, jsonl(lines)).id,
                                           endpoint="/v1/responses", completion_window="24h")
    assert created.endpoint == "/v1/responses"
    validate_batch(created.id)
    batch = Batch.objects.get(pk=created.id)
    assert (batch.status, batch.dedup_saved) == ("in_progress", 1), batch.errors
    pipeline = make_pipeline()
    real_handle = pipeline.state.engine.handle

    def with_cached_tokens(url, body, adapter_path=""):
        status, answer = real_handle(url, body, adapter_path)
        if status == 200:
            usage = answer["usage"]
            usage["input_tokens_details"] = {"cached_tokens": usage["input_tokens"] - 1}
        return status, answer

    pipeline.state.engine.handle = with_cached_tokens  # type: ignore[method-assign]
    run_all_shards(pipeline, batch)
    finalized(batch)

    done = openai_client.batches.retrieve(created.id)
    assert done.status == "completed"
    assert (done.request_counts.completed, done.request_counts.failed) == (7, 1)
    out = [json.loads(x) for x in openai_client.files.content(done.output_file_id).text
           .splitlines()]
    (err,) = [json.loads(x) for x in openai_client.files.content(done.error_file_id).text
              .splitlines()]
    assert err["custom_id"] == "too-long" and err["response"]["status_code"] == 400
    assert "maximum context length" in err["response"]["body"]["error"]["message"]
    by_id = {r["custom_id"]: r["response"]["body"] for r in out}
    assert sorted(by_id) == sorted(line["custom_id"] for line in lines[:-1])
    first = by_id["r0"]
    assert first["object"] == "response" and first["id"].startswith("resp_")
    assert (first["status"], first["incomplete_details"]) == (
        "incomplete", {"reason": "max_output_tokens"})
    assert first["output"][0]["content"][0]["text"] == "echo: question"
    assert by_id["items"]["output"][0]["content"][0]["text"] == "echo: say it back"
    assert by_id["same-a"]["output"] == by_id["same-b"]["output"]
    # Usage counts each computed request once (not the copy), from input/output tokens.
    computed = [body for cid, body in by_id.items() if cid != "same-b"]
    assert done.usage.input_tokens == sum(b["usage"]["input_tokens"] for b in computed)
    assert done.usage.output_tokens == sum(b["usage"]["output_tokens"] for b in computed)
    assert done.usage.input_tokens_details.cached_tokens == sum(
        b["usage"]["input_tokens"] - 1 for b in computed)
    # The JSON request was run once more; it and the cut ones are flagged.
    shards = Shard.objects.filter(batch_id=created.id)
    assert sum(s.json_retries for s in shards) == 1
    counts: dict[str, int] = {}
    for shard in shards:
        for flag, n in shard.flag_counts.items():
            counts[flag] = counts.get(flag, 0) + n
    assert counts == {"invalid_json": 1, "length_limit": 3}
    client.force_login(user)
    page = client.get(f"/batches/{created.id}/results").content.decode()
    assert "system: Be brief.\nuser: twice asked" in page
    assert "user: say it back" in page and "echo: say it back" in page


def test_a_cancelled_batch_stops_its_running_shard(make_batch, make_pipeline):
    lines = [chat_line(f"c{i}", f"slow {i}") for i in range(20)]
    batch = make_batch(lines, shard_size=20)
    # A small inbox: most lines are still waiting to be handed in when the batch stops.
    pipeline = make_pipeline(seconds_per_request=0.5, max_in_flight=2, inbox_size=2)
    shard = Shard.objects.get(batch=batch)
    start_shard(pipeline, shard.pk)
    wait_for(lambda: Shard.objects.filter(pk=shard.pk, completed__gt=0).exists(),
             timeout=20, message="a first result")
    cancel_batch(batch=batch)
    # The heartbeat sees the stop code and aborts the requests in flight.
    wait_for(lambda: Shard.objects.filter(pk=shard.pk, status="done").exists(),
             timeout=20, message="the shard stopped")
    done, out, err = finalized(batch)
    assert done.status == "cancelled"
    assert len(out) + len(err) == 20
    assert out and err
    assert {e["error"]["code"] for e in err} <= {"batch_cancelled", "request_aborted"}
    assert any(e["error"]["code"] == "batch_cancelled" for e in err)


def test_a_part_that_cannot_be_stored_fails_only_that_attempt(
        make_batch, make_pipeline, monkeypatch):
    lines = [chat_line(f"w{i}", f"disk {i}") for i in range(6)]
    batch = make_batch(lines, shard_size=3)
    first, second = Shard.objects.filter(batch=batch).order_by("index")
    storage = part_storage.backend()
    real_concatenate = storage.concatenate
    failed: list[str] = []

    def disk_full_once(target, sources):
        if first.pk in target and not failed:
            failed.append(target)
            raise OSError(28, "No space left on device")
        return real_concatenate(target, sources)

    monkeypatch.setattr(storage, "concatenate", disk_full_once)
    monkeypatch.setattr(part_storage, "backend", lambda: storage)
    pipeline = make_pipeline()
    pipeline.intake.run_shard(first.pk)
    pipeline.intake.run_shard(second.pk)
    wait_for(lambda: Shard.objects.filter(pk=second.pk, status="done").exists(),
             timeout=20, message="the other shard done")
    first.refresh_from_db()
    assert (first.status, first.failures, first.attempt) == ("queued", 1, 1)
    assert "No space left on device" in first.last_error
    assert pipeline.state.broken is None and not pipeline.state.works
    # Its retry runs on the same engine and completes the batch.
    Shard.objects.filter(pk=first.pk).update(not_before=None)
    pipeline.intake.run_shard(first.pk)
    wait_for(lambda: Shard.objects.filter(pk=first.pk, status="done").exists(),
             timeout=20, message="the retry done")
    done, out, err = finalized(batch)
    assert done.status == "completed" and err == []
    assert sorted(r["custom_id"] for r in out) == sorted(f"w{i}" for i in range(6))


def test_the_stop_log_line_reports_a_non_negative_window(make_pipeline, caplog):
    pipeline = make_pipeline()
    pipeline.state.idle.request_started()  # handed in, never finished
    with caplog.at_level(logging.INFO, logger="jobs.worker.pipeline"):
        pipeline.close()
    line = next(r.getMessage() for r in caplog.records if "engine idle" in r.getMessage())
    assert "-" not in line, line
    assert "0.00% of 0.0s" in line


def test_a_grouped_shard_hands_each_prefix_group_in_under_one_key(make_batch, make_pipeline,
                                                                  client):
    """A grouped shard's requests reach the engine in run order, each prefix group's next
    to each other under one key of its own (the vLLM engine has the first compute the
    shared prefix before the rest start); and the limit of prefix caching, counted from the
    prompt blocks the engine reports, adds up per shard on the batch and its page."""
    lines = shared_prefix_lines(24, groups=4)
    batch = make_batch(lines, shard_size=9)
    # Planned for the cache the test settings give (BATCHWEB_PREFIX_CACHE_TOKENS).
    assert batch.plan["grouped"] and batch.plan["cache_tokens"] == 400
    pipeline = make_pipeline()
    seen: list[EngineRequest] = []
    compute = pipeline.state.engine._compute

    def with_prompt_blocks(request: EngineRequest) -> EngineResult:
        # As a prefix cache of 16-token blocks would: the group's system prompt is one
        # shared block, the item one of its own.
        seen.append(request)
        return dataclasses.replace(compute(request), prompt_blocks=PromptBlocks(
            16, (request.prefix, hash(request.request_id))))

    pipeline.state.engine._compute = with_prompt_blocks  # type: ignore[method-assign]
    run_all_shards(pipeline, batch)
    done, out, _ = finalized(batch)
    assert done.completed == 24
    template = {f"g{i}": template_of(i, 4) for i in range(24)}
    line_of = {n + 1: line["custom_id"] for n, line in enumerate(lines)}
    runs: dict[str, list[tuple[int, str]]] = {}  # shard -> (key, custom_id) in run order
    for request in seen:
        shard, _, line = request.request_id.rsplit(":", 2)
        runs.setdefault(shard, []).append((request.prefix, line_of[int(line)]))
    keys: dict[int, int] = {}
    cacheable = 0
    for run in runs.values():
        assert all(key for key, _ in run)
        for key, custom_id in run:
            assert keys.setdefault(key, template[custom_id]) == template[custom_id]
        # A group's requests are neighbours: each key is one stretch of the run.
        stretches = [key for n, (key, _) in enumerate(run) if n == 0 or run[n - 1][0] != key]
        assert len(stretches) == len(set(stretches))
        cacheable += 16 * (len(run) - len(stretches))
    assert len(keys) == 4
    assert done.cacheable_tokens == cacheable > 0
    client.force_login(batch.owner)
    page = client.get(f"/batches/{batch.pk}/").content.decode()
    assert f'id="cache-limit">{cacheable}' in page


def test_a_shard_in_file_order_hands_its_requests_in_without_a_key(make_batch, make_pipeline):
    batch = make_batch([chat_line(f"r{i}", f"question {i}") for i in range(5)])
    assert not batch.plan["grouped"]
    pipeline = make_pipeline()
    seen: list[EngineRequest] = []
    compute = pipeline.state.engine._compute

    def recording(request: EngineRequest) -> EngineResult:
        seen.append(request)
        return compute(request)

    pipeline.state.engine._compute = recording  # type: ignore[method-assign]
    run_all_shards(pipeline, batch)
    assert len(seen) == 5 and not any(request.prefix for request in seen)
    # Without prompt blocks (the echo engine has no prefix cache) nothing is cacheable.
    assert finalized(batch)[0].cacheable_tokens == 0
