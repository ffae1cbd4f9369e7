"""Reasoning tokens: a model served with a reasoning parser (vLLM's `reasoning_parser`
option, which the echo engine reads too) answers with its reasoning apart and counts its
tokens in its usage as vLLM does; the worker carries that count into the output lines, the
batch's usage, the usage ledger (rows and daily sums) and the Usage API's extension field."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from engine.base import ModelSpec
from engine.echo import EchoEngine
from engine.endpoints import CHAT, COMPLETIONS, MESSAGES, RESPONSES, reasoning_of, usage_of
from jobs.models import Batch, UsageDay, UsageRecord
from tests.factories import chat_line, finalized, responses_line, run_all_shards

pytestmark = pytest.mark.django_db(transaction=True)

REASONING = {"reasoning_parser": "deepseek_r1"}


def echo(**options):
    return EchoEngine(ModelSpec(name="echo-test", backend="echo", options=options))


def chat(text: str, **body):
    return {"model": "echo-test", "messages": [{"role": "user", "content": text}], **body}


def test_a_chat_answer_carries_its_reasoning_and_counts_its_tokens_as_vllm():
    status, body = echo(**REASONING).handle(CHAT, chat("two words"))
    assert status == 200
    message = body["choices"][0]["message"]
    assert message["reasoning"] == "think: two words"
    assert message["content"] == "echo: two words"
    # The thought's 3 tokens are output tokens, and counted apart.
    assert body["usage"]["completion_tokens"] == 6
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 3}
    assert usage_of(CHAT, body) == (2, 6, 0) and reasoning_of(CHAT, body) == 3
    # Without a parser, as vLLM without one: no reasoning, no completion_tokens_details.
    _, plain = echo().handle(CHAT, chat("two words"))
    assert "reasoning" not in plain["choices"][0]["message"]
    assert "completion_tokens_details" not in plain["usage"]
    assert reasoning_of(CHAT, plain) == 0


def test_the_thought_shares_the_output_limit():
    _, body = echo(**REASONING).handle(CHAT, chat("one two three", max_tokens=2))
    message = body["choices"][0]
    assert message["message"]["reasoning"] == "think: one"
    assert message["message"]["content"] == "" and message["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 2
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 2}
    _, two = echo(**REASONING).handle(CHAT, chat("hi", n=2))
    assert two["usage"]["completion_tokens_details"] == {"reasoning_tokens": 4}


def test_responses_and_messages_show_reasoning_their_own_way():
    engine = echo(**REASONING)
    _, response = engine.handle(RESPONSES, {"model": "echo-test", "input": "a b"})
    reasoning, message = response["output"]
    assert reasoning["type"] == "reasoning"
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "think: a b"}]
    assert message["content"][0]["text"] == "echo: a b"
    assert response["usage"]["output_tokens"] == 6
    assert response["usage"]["output_tokens_details"] == {"reasoning_tokens": 3}
    assert reasoning_of(RESPONSES, response) == 3
    _, plain = echo().handle(RESPONSES, {"model": "echo-test", "input": "a b"})
    assert [item["type"] for item in plain["output"]] == ["message"]
    assert plain["usage"]["output_tokens_details"] == {"reasoning_tokens": 0}
    # Anthropic's usage has no reasoning count: the thinking is in output_tokens only.
    _, answer = engine.handle(MESSAGES, {**chat("a b"), "max_tokens": 16})
    assert [block["type"] for block in answer["content"]] == ["thinking", "text"]
    assert answer["content"][0]["thinking"] == "think: a b"
    assert answer["usage"]["output_tokens"] == 6 and reasoning_of(MESSAGES, answer) == 0
    # A completion runs no chat template: vLLM parses no reasoning there.
    _, completion = engine.handle(COMPLETIONS, {"model": "echo-test", "prompt": "a b"})
    assert reasoning_of(COMPLETIONS, completion) == 0


def test_reasoning_tokens_reach_the_batch_the_ledger_and_the_usage_api(
        make_batch, make_pipeline, client, api_key, openai_client):
    lines = [chat_line(f"r{i}", " ".join(["word"] * (i + 1)), max_tokens=50)
             for i in range(5)]
    batch = make_batch(lines, shard_size=2)
    run_all_shards(make_pipeline(**REASONING), batch)
    done, out, _ = finalized(batch)
    bodies = [line["response"]["body"] for line in out]
    per_line = [body["usage"]["completion_tokens_details"]["reasoning_tokens"]
                for body in bodies]
    assert sorted(per_line) == [2, 3, 4, 5, 6]  # "think:" and each request's words
    assert all(body["choices"][0]["message"]["reasoning"] for body in bodies)

    expected = sum(per_line)
    assert done.reasoning_tokens == expected
    usage = openai_client.batches.retrieve(batch.pk).usage
    assert usage.output_tokens_details.reasoning_tokens == expected
    assert usage.output_tokens == sum(body["usage"]["completion_tokens"] for body in bodies)
    records = UsageRecord.objects.filter(batch_id=batch.pk)
    assert records.count() == 3 and sum(r.reasoning_tokens for r in records) == expected
    assert sum(d.reasoning_tokens for d in UsageDay.objects.all()) == expected

    # OpenAI's usage results have no reasoning field: an extension beside theirs.
    day = datetime.now(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    page = client.get("/v1/organization/usage/completions",
                      {"start_time": int(day.timestamp())},
                      HTTP_AUTHORIZATION=f"Bearer {api_key}").json()
    (result,) = [r for bucket in page["data"] for r in bucket["results"]]
    assert result["output_reasoning_tokens"] == expected
    assert result["output_tokens"] == usage.output_tokens


def test_a_responses_batch_counts_its_reasoning_items(make_batch, make_pipeline):
    batch = make_batch([responses_line(f"r{i}", "a b c") for i in range(3)],
                       endpoint=RESPONSES)
    run_all_shards(make_pipeline(**REASONING), batch)
    done, out, _ = finalized(batch)
    assert {line["response"]["body"]["output"][0]["type"] for line in out} == {"reasoning"}
    assert done.reasoning_tokens == 3 * 4
    assert Batch.objects.get(pk=batch.pk).to_openai()["usage"]["output_tokens_details"] == {
        "reasoning_tokens": 12}
