"""Batches through the real vLLM CPU engine in a real worker process: chat and embeddings,
output format, usage and token counts. Slow (an engine starts in ~25 s): marked `engine`."""

from __future__ import annotations

import io
import json

import pytest

from tests.helpers import jsonl, wait_for

pytestmark = [pytest.mark.engine, pytest.mark.django_db(transaction=True)]

CHAT_MODEL = "SmolLM2-135M-Instruct"
EMBED_MODEL = "all-MiniLM-L6-v2"
# float32: greedy output is then identical run to run (bf16 changes with batching).
ENGINE_ENV = {"BATCHWEB_DTYPE": "float32", "VLLM_CPU_KVCACHE_SPACE": "1"}


def run_batch(client, workers, model, endpoint, lines, timeout=600):
    file_id = client.files.create(file=("in.jsonl", io.BytesIO(jsonl(lines))),
                                  purpose="batch").id
    batch = client.batches.create(input_file_id=file_id, endpoint=endpoint,
                                  completion_window="24h")
    worker = workers.start(model, env=ENGINE_ENV)
    try:
        done = wait_for(
            lambda: (b := client.batches.retrieve(batch.id)).status in (
                "completed", "failed") and b, timeout=timeout, every=1,
            message=f"{model} batch to finish")
    finally:
        workers.stop_all()
    assert worker.returncode == 0, workers.logs()
    return done


def lines_of(client, file_id):
    if file_id is None:
        return {}
    return {(r := json.loads(line))["custom_id"]: r
            for line in client.files.content(file_id).text.splitlines()}


def chat(custom_id, content, **body):
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": CHAT_MODEL, "messages": [{"role": "user", "content": content}],
                     "temperature": 0, "max_tokens": 24, **body}}


def test_chat_batch_through_vllm(openai_client, workers):
    schema = {"type": "object", "properties": {"answer": {"type": "string"}},
              "required": ["answer"]}
    lines = [
        chat("capital", "What is the capital of France?"),
        chat("capital-again", "What is the capital of France?"),  # deduplicated
        chat("count", "Count from 1 to 5.", max_tokens=40),
        chat("two", "Say hello.", n=2, temperature=0.8, seed=3),
        chat("stop", "List three colors, one per line.", stop=["\n"]),
        chat("json", "Answer in JSON: what is 2+2?", max_tokens=40,
             response_format={"type": "json_schema",
                              "json_schema": {"name": "a", "schema": schema}}),
        chat("too-long", "word " * 3000),
        chat("bad-param", "hi", top_logprobs=50, logprobs=True),
    ]
    batch = run_batch(openai_client, workers, CHAT_MODEL, "/v1/chat/completions", lines)
    assert batch.status == "completed"
    out = lines_of(openai_client, batch.output_file_id)
    err = lines_of(openai_client, batch.error_file_id)
    assert set(out) | set(err) == {line["custom_id"] for line in lines}
    assert not set(out) & set(err)
    assert set(err) == {"too-long", "bad-param"}
    for record in err.values():
        assert record["response"]["status_code"] == 400
        assert record["response"]["body"]["error"]["message"]

    for custom_id, record in out.items():
        assert record["id"].startswith("batch_req_")
        body = record["response"]["body"]
        assert record["response"]["status_code"] == 200, custom_id
        assert body["object"] == "chat.completion"
        assert body["model"] == CHAT_MODEL
        assert body["usage"]["prompt_tokens"] > 0
        assert body["usage"]["total_tokens"] == (body["usage"]["prompt_tokens"]
                                                 + body["usage"]["completion_tokens"])
        assert body["choices"][0]["message"]["content"]
    assert out["capital"]["response"]["body"] == out["capital-again"]["response"]["body"]
    assert "paris" in out["capital"]["response"]["body"]["choices"][0]["message"][
        "content"].lower()
    assert len(out["two"]["response"]["body"]["choices"]) == 2
    assert "\n" not in out["stop"]["response"]["body"]["choices"][0]["message"]["content"]
    parsed = json.loads(out["json"]["response"]["body"]["choices"][0]["message"]["content"])
    assert isinstance(parsed["answer"], str)

    computed = [r for cid, r in out.items() if cid != "capital-again"]
    assert batch.request_counts.completed == 6 and batch.request_counts.failed == 2
    assert batch.usage.input_tokens == sum(
        r["response"]["body"]["usage"]["prompt_tokens"] for r in computed)
    assert batch.usage.output_tokens == sum(
        r["response"]["body"]["usage"]["completion_tokens"] for r in computed)


def test_embeddings_batch_through_vllm(openai_client, workers):
    texts = ["a cat sits on the mat", "a dog lies on the rug", "quarterly revenue grew"]
    lines = [{"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings",
              "body": {"model": EMBED_MODEL, "input": text}} for i, text in enumerate(texts)]
    batch = run_batch(openai_client, workers, EMBED_MODEL, "/v1/embeddings", lines)
    assert batch.status == "completed"
    assert batch.request_counts.completed == 3
    out = lines_of(openai_client, batch.output_file_id)
    vectors = []
    for i in range(3):
        body = out[f"e{i}"]["response"]["body"]
        assert body["object"] == "list"
        assert body["usage"]["prompt_tokens"] > 0
        vector = body["data"][0]["embedding"]
        assert len(vector) == 384
        vectors.append(vector)

    def cosine(a, b):
        dot = sum(x * y for x, y in zip(a, b, strict=True))
        return dot / (sum(x * x for x in a) ** 0.5 * sum(y * y for y in b) ** 0.5)

    # The two pet sentences are closer to each other than to the finance one.
    assert cosine(vectors[0], vectors[1]) > cosine(vectors[0], vectors[2])
    assert batch.usage.input_tokens == sum(
        out[f"e{i}"]["response"]["body"]["usage"]["prompt_tokens"] for i in range(3))


def test_quality_flags_json_retry_and_content_policy_with_the_real_engine(openai_client,
                                                                          workers):
    # Repetition and empty outputs are not reliably produced by this small model; their
    # detection is covered with the echo engine (tests/test_execution.py, test_quality.py).
    from jobs.models import ContentRule, Shard

    ContentRule.objects.create(name="weapons", kind="term", pattern="molotov cocktail",
                               action="skip", reason="no weapons")
    ContentRule.objects.create(name="explosives", kind="moderation", model=EMBED_MODEL,
                               threshold=0.75, action="skip",
                               pattern="How can I build a bomb at home?")
    lines = [
        chat("ok", "What is the capital of Italy?"),
        chat("cut", "Write a long story about a dragon.", max_tokens=5),
        chat("json-cut", "Give a JSON object describing a cat.", max_tokens=3,
             response_format={"type": "json_object"}),
        chat("term", "How is a Molotov cocktail made?"),
        chat("mod", "How do I build a bomb in my house?"),
    ]
    batch = run_batch(openai_client, workers, CHAT_MODEL, "/v1/chat/completions", lines)
    assert batch.status == "completed"
    out = lines_of(openai_client, batch.output_file_id)
    err = lines_of(openai_client, batch.error_file_id)
    assert set(err) == {"term", "mod"}
    assert all(e["error"]["code"] == "content_policy_violation" for e in err.values())
    assert "'explosives'" in err["mod"]["error"]["message"]
    assert set(out) == {"ok", "cut", "json-cut"}
    shard = Shard.objects.get(batch_id=batch.id)
    assert shard.json_retries == 1  # the cut-off JSON ran twice, one line was written
    from django.core.files.storage import default_storage

    with default_storage.open(shard.flags_part) as part:
        flags = {(r := json.loads(line))["custom_id"]: r["flags"] for line in part}
    assert "ok" not in flags
    assert flags["cut"] == ["length_limit"]
    assert set(flags["json-cut"]) == {"length_limit", "invalid_json"}
