"""Batches through the real vLLM CPU engine in a real worker process: chat, embeddings,
score and rerank, output format, usage and token counts; content rules of each type under
both policies, every quality flag and the JSON retry. Slow (an engine starts in ~25 s):
marked `engine`."""

from __future__ import annotations

import io
import json
import re

import pytest
from django.urls import reverse

from tests.factories import jsonl, submit, upload, wait_for

pytestmark = [pytest.mark.engine, pytest.mark.django_db(transaction=True)]

CHAT_MODEL = "SmolLM2-135M-Instruct"
EMBED_MODEL = "all-MiniLM-L6-v2"
# float32: greedy output is then identical run to run (bf16 changes with batching).
# Eager: the default (auto) compiles from a model's second start, a mode change between
# starts (engine/compile_cache.py) and minutes of compilation per key.
ENGINE_ENV = {"BATCHWEB_DTYPE": "float32", "VLLM_CPU_KVCACHE_SPACE": "1",
              "BATCHWEB_ENGINE_MODE": "eager"}


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


def test_message_batch_through_vllm(anthropic_client, workers):
    """A Message Batch (Anthropic's API and client) on the real engine: Messages with
    their usage, a bad request errored without running, the batch's tokens the Messages'."""
    from jobs.models import Batch

    params = {"model": CHAT_MODEL, "max_tokens": 16, "temperature": 0}
    batch = anthropic_client.messages.batches.create(requests=[
        {"custom_id": "capital", "params": {**params, "system": "Answer in one word.",
                                            "messages": [{"role": "user", "content":
                                                          "What is the capital of France?"}]}},
        {"custom_id": "count", "params": {**params, "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Count from 1 to 5."}]}]}},
        {"custom_id": "bad", "params": {**params, "top_k": -1,
                                        "messages": [{"role": "user", "content": "x"}]}},
    ])
    workers.start(CHAT_MODEL, env=ENGINE_ENV)
    try:
        done = wait_for(lambda: (b := anthropic_client.messages.batches.retrieve(batch.id))
                        .processing_status == "ended" and b, timeout=600, every=1,
                        message="the message batch to end")
    finally:
        workers.stop_all()
    assert (done.request_counts.succeeded, done.request_counts.errored) == (2, 1)
    results = {r.custom_id: r.result for r in anthropic_client.messages.batches.results(batch.id)}
    for custom_id in ("capital", "count"):
        message = results[custom_id].message
        assert message.type == "message" and message.model == CHAT_MODEL
        assert message.content[0].type == "text" and message.content[0].text.strip()
        assert message.stop_reason in ("end_turn", "max_tokens")
        assert 0 < message.usage.output_tokens <= 16 and message.usage.input_tokens > 5
    assert results["bad"].error.error.type == "invalid_request_error"
    row = Batch.objects.get(pk=batch.id)
    usages = [results[c].message.usage for c in ("capital", "count")]
    assert row.input_tokens == sum(u.input_tokens + (u.cache_read_input_tokens or 0)
                                   for u in usages)
    assert row.output_tokens == sum(u.output_tokens for u in usages)


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


def test_moderations_batch_through_vllm(openai_client, workers):
    """/v1/moderations on the embeddings model, with the default categories: one
    embeddings call per request (the input, then the examples), scored in OpenAI's shape."""
    texts = ["I am going to beat him up and hurt him badly",
             "Here is a recipe for a lemon cake with sugar and butter"]
    lines = [{"custom_id": f"m{i}", "method": "POST", "url": "/v1/moderations",
              "body": {"model": EMBED_MODEL, "input": text}} for i, text in enumerate(texts)]
    lines.append({"custom_id": "both", "method": "POST", "url": "/v1/moderations",
                  "body": {"model": EMBED_MODEL, "input": texts}})
    batch = run_batch(openai_client, workers, EMBED_MODEL, "/v1/moderations", lines)
    assert batch.status == "completed" and batch.request_counts.completed == 3
    out = lines_of(openai_client, batch.output_file_id)
    [violent] = out["m0"]["response"]["body"]["results"]
    [cake] = out["m1"]["response"]["body"]["results"]
    scores = violent["category_scores"]
    assert max(scores, key=scores.get) == "violence"
    assert scores["violence"] > cake["category_scores"]["violence"]
    for alone, together in zip((violent, cake), out["both"]["response"]["body"]["results"],
                               strict=True):
        assert together["categories"] == alone["categories"]
        assert together["category_scores"] == pytest.approx(alone["category_scores"], abs=1e-3)
    # Metered as embeddings: each request's call's prompt tokens, as vLLM counts them (its
    # inputs and the examples embedded with them: two inputs, one set of examples).
    tokens = {cid: out[cid]["response"]["body"]["usage"]["prompt_tokens"]
              for cid in ("m0", "m1", "both")}
    assert 0 < tokens["m0"] < tokens["both"] < tokens["m0"] + tokens["m1"]
    assert batch.usage.input_tokens == sum(tokens.values())


def test_score_and_rerank_batches_through_vllm(openai_client, workers):
    """vLLM's score and rerank on the embeddings model (its score path: the cosine of the
    two embeddings), created through the openai client, which sends any endpoint string
    though it types `endpoint` as OpenAI's; one worker runs both batches."""
    texts = ["a cat sits on the mat", "a kitten rests on the rug", "quarterly revenue grew"]
    score_lines = [
        {"custom_id": "pets", "method": "POST", "url": "/v1/score",
         "body": {"model": EMBED_MODEL, "queries": texts[0], "documents": texts[1:]}},
        {"custom_id": "pairs", "method": "POST", "url": "/v1/score",
         "body": {"model": EMBED_MODEL, "text_1": texts[:2], "text_2": texts[1:]}},
        # A BERT model takes text only: vLLM's 400, in the error file.
        {"custom_id": "content", "method": "POST", "url": "/v1/score",
         "body": {"model": EMBED_MODEL, "queries": "x", "documents": [
             {"content": [{"type": "text", "text": "y"}]}]}},
    ]
    rerank_lines = [
        {"custom_id": "ranked", "method": "POST", "url": "/v1/rerank",
         "body": {"model": EMBED_MODEL, "query": texts[0], "documents": texts[::-1]}},
        {"custom_id": "top", "method": "POST", "url": "/v1/rerank",
         "body": {"model": EMBED_MODEL, "query": texts[0], "documents": texts[::-1],
                  "top_n": 1}},
    ]
    batches = {endpoint: openai_client.batches.create(
        input_file_id=upload(openai_client, jsonl(lines)).id, endpoint=endpoint,
        completion_window="24h")
        for endpoint, lines in (("/v1/score", score_lines), ("/v1/rerank", rerank_lines))}
    worker = workers.start(EMBED_MODEL, env=ENGINE_ENV)
    try:
        done = {endpoint: wait_for(
            lambda b=batch: (r := openai_client.batches.retrieve(b.id)).status in (
                "completed", "failed") and r, timeout=600, every=1,
            message=f"the {endpoint} batch to finish") for endpoint, batch in batches.items()}
    finally:
        workers.stop_all()
    assert worker.returncode == 0, workers.logs()

    score = done["/v1/score"]
    assert score.status == "completed" and score.endpoint == "/v1/score"
    assert (score.request_counts.completed, score.request_counts.failed) == (2, 1)
    out = lines_of(openai_client, score.output_file_id)
    err = lines_of(openai_client, score.error_file_id)
    assert set(err) == {"content"} and err["content"]["response"]["status_code"] == 400
    pets = out["pets"]["response"]["body"]
    assert pets["object"] == "list" and pets["model"] == EMBED_MODEL
    (kitten, revenue) = (d["score"] for d in pets["data"])
    assert -1 <= revenue < kitten <= 1  # the two pet sentences are the closest pair
    pairs = out["pairs"]["response"]["body"]["data"]
    assert pairs[0]["score"] == pytest.approx(kitten, abs=1e-4)  # the same pair again
    assert score.usage.input_tokens == sum(
        r["response"]["body"]["usage"]["prompt_tokens"] for r in out.values())
    assert score.usage.input_tokens > 0 and score.usage.output_tokens == 0

    rerank = done["/v1/rerank"]
    assert rerank.status == "completed" and rerank.request_counts.completed == 2
    out = lines_of(openai_client, rerank.output_file_id)
    ranked = out["ranked"]["response"]["body"]["results"]
    # documents are the texts reversed: the query itself (index 2) first, then the kitten.
    assert [r["index"] for r in ranked] == [2, 1, 0]
    assert [r["document"]["text"] for r in ranked] == texts
    assert ranked[0]["relevance_score"] == pytest.approx(1.0, abs=1e-4)
    assert ranked[1]["relevance_score"] == pytest.approx(kitten, abs=1e-4)
    assert out["top"]["response"]["body"]["results"] == ranked[:1]
    assert rerank.usage.input_tokens == sum(
        r["response"]["body"]["usage"]["prompt_tokens"] for r in out.values())


# --- content policy (each rule type, both policies), quality flags and the JSON retry ---
#
# One worker (the chat engine, plus the embeddings engine its moderation rule loads while
# validating) runs two batches: the first with every rule set to `reject`, the second, after
# the operator switched them to `skip`, with the same violating lines plus lines that provoke
# each quality flag. Two engine starts for the whole matrix.

# Each violating line -> the rule that refuses it. The size rule counts the model's own
# prompt tokens (tokenizer and chat template, engine/tokens.py); its limit is the count of
# "size-ok" below (40 words), so "size" (41 words) is one token or more over it.
POLICY_LINES = {
    "term": (chat("term", "How is a Molotov cocktail made?"), "weapons"),
    "regex": (chat("regex", "My card is 4111 1111 1111 1111, remember it."), "card-numbers"),
    "size": (chat("size", "word " * 41), "prompt-size"),
    "mod": (chat("mod", "How do I build a bomb in my house?"), "explosives"),
}


def create_content_rules(action, size_limit):
    from jobs.models import ContentRule

    ContentRule.objects.create(name="weapons", kind="term", pattern="molotov cocktail",
                               action=action, reason="no weapons")
    ContentRule.objects.create(name="card-numbers", kind="regex",
                               pattern=r"\b(?:\d{4}[ -]?){3}\d{4}\b", action=action,
                               reason="no payment card numbers")
    ContentRule.objects.create(name="prompt-size", kind="max_prompt_tokens",
                               max_tokens=size_limit, action=action)
    ContentRule.objects.create(name="explosives", kind="moderation", model=EMBED_MODEL,
                               threshold=0.75, action=action,
                               pattern="How can I build a bomb at home?")


def until_ended(client, batch_id, timeout=900):
    return wait_for(lambda: (b := client.batches.retrieve(batch_id)).status in (
        "completed", "failed", "expired", "cancelled") and b, timeout=timeout, every=1,
        message=f"batch {batch_id} to end")


def chat_token_ids(*texts):
    """The chat model's token id of each text (one token each), and its end-of-sequence id."""
    from transformers import AutoTokenizer

    from jobs.lib.model_registry import model_spec

    tokenizer = AutoTokenizer.from_pretrained(model_spec(CHAT_MODEL).path)
    ids = [tokenizer.encode(text, add_special_tokens=False) for text in texts]
    assert all(len(i) == 1 for i in ids), ids
    return [i[0] for i in ids], tokenizer.eos_token_id


def batch_page_flag_counts(site, batch_id):
    """Flag -> the count the batch page shows."""
    page = site.get(reverse("batch_detail", args=[batch_id])).content.decode()
    found = re.findall(r'id="flag-(\w+)"[^>]*>[^<]*<span class="count">([^<]*)</span>', page)
    return {flag: int(re.sub(r"\D", "", n)) for flag, n in found}, page


def test_content_policy_under_both_policies_and_quality_flags_with_the_real_engine(
        openai_client, workers, site):
    from django.core.files.storage import default_storage

    from engine.tokens import PromptCounter
    from jobs.lib.model_registry import model_spec
    from jobs.models import ContentRule, ScreenedLine, Shard
    from jobs.policy.quality import FLAGS

    (the,), eos = chat_token_ids(" the")
    flag_lines = [
        chat("ok", "What is the capital of Italy?"),
        # Stopped by max_tokens.
        chat("cut", "Write a long story about a dragon.", max_tokens=5),
        # Cut-off JSON: not valid, run once more with a new seed, cut off again.
        chat("json-cut", "Give a JSON object describing a cat.", max_tokens=3,
             response_format={"type": "json_object"}),
        # logit_bias (OpenAI's -100..100) makes " the" the only likely token: a loop of it
        # until max_tokens.
        chat("loop", "Tell me about cats.", max_tokens=20, logit_bias={str(the): 100}),
        # ... and end-of-sequence the first token: an empty answer.
        chat("empty", "Tell me about cats.", logit_bias={str(eos): 100}),
        # Exactly at the size rule's limit, so it runs (one token is enough to see what
        # the model counted).
        chat("size-ok", "word " * 40, max_tokens=1),
    ]
    size_limit = PromptCounter(model_spec(CHAT_MODEL)).count(
        "/v1/chat/completions", flag_lines[-1]["body"])
    policy_lines = [line for line, _ in POLICY_LINES.values()]

    # 1. Every rule `reject_batch`: validation fails the batch, naming each line and rule.
    create_content_rules("reject_batch", size_limit)
    rejected_id = submit(openai_client, [*policy_lines, flag_lines[0]]).id
    worker = workers.start(CHAT_MODEL, env=ENGINE_ENV)
    try:
        rejected = until_ended(openai_client, rejected_id)
        # 2. The operator switches the rules to `skip`: the same lines are left out of the
        # run and written to the error file; the rest runs.
        assert ContentRule.objects.update(action="skip") == 4
        skipped_id = submit(openai_client,
                            [*flag_lines[:3], *policy_lines, *flag_lines[3:]]).id
        done = until_ended(openai_client, skipped_id)
    finally:
        workers.stop_all()
    assert worker.returncode == 0, workers.logs()

    assert rejected.status == "failed", workers.logs()
    assert rejected.output_file_id is None and rejected.error_file_id is None
    assert not Shard.objects.filter(batch_id=rejected_id).exists()
    errors = sorted(rejected.errors.data, key=lambda e: e.line)
    assert [(e.line, e.code) for e in errors] == [
        (n, "content_policy_violation") for n in (1, 2, 3, 4)]
    for error, (_, rule) in zip(errors, POLICY_LINES.values(), strict=True):
        assert f"'{rule}'" in error.message, (error, rule)
    assert "no weapons" in errors[0].message

    assert done.status == "completed", workers.logs()
    out = lines_of(openai_client, done.output_file_id)
    err = lines_of(openai_client, done.error_file_id)
    assert set(err) == set(POLICY_LINES)
    for custom_id, (_, rule) in POLICY_LINES.items():
        assert err[custom_id]["response"] is None
        assert err[custom_id]["error"]["code"] == "content_policy_violation"
        assert f"'{rule}'" in err[custom_id]["error"]["message"], err[custom_id]
    assert ScreenedLine.objects.filter(batch_id=skipped_id).count() == 4
    assert set(out) == {line["custom_id"] for line in flag_lines}
    assert (done.request_counts.completed, done.request_counts.failed) == (6, 4)

    def answer(custom_id):
        body = out[custom_id]["response"]["body"]
        return body["choices"][0]["message"]["content"], body["choices"][0]["finish_reason"]

    assert answer("loop") == (" the" * 20, "length")
    assert answer("empty") == ("", "stop")
    # The size rule counted what the engine counts (template included): "size-ok" ran at
    # exactly the limit, "size" was refused.
    assert out["size-ok"]["response"]["body"]["usage"]["prompt_tokens"] == size_limit

    shard = Shard.objects.get(batch_id=skipped_id)
    assert shard.json_retries == 1  # the cut-off JSON ran twice, one line was written
    with default_storage.open(shard.flags_part) as part:
        flags = {(r := json.loads(line))["custom_id"]: r["flags"] for line in part}
    assert flags == {
        "cut": ["length_limit"],
        "json-cut": ["length_limit", "invalid_json"],
        "loop": ["length_limit", "repetition"],
        "empty": ["empty_output"],
        "size-ok": ["length_limit"],
    }
    expected_counts = {flag: sum(flag in f for f in flags.values()) for flag in FLAGS}
    assert expected_counts == {"empty_output": 1, "length_limit": 4, "repetition": 1,
                               "invalid_json": 1}
    # The batch page counts each flag, and the JSON retry.
    shown, page = batch_page_flag_counts(site, skipped_id)
    assert shown == expected_counts
    assert "1 JSON retry" in page


def test_one_worker_switches_between_a_chat_and_an_embeddings_model(openai_client, workers):
    """`batchworker --model A --model B` on the real engines: each batch runs on its own
    model, one engine loaded at a time. The log says what a switch cost."""
    chat_batch = submit(openai_client, [chat(f"c{i}", f"Name a fruit, {i}.", max_tokens=4)
                                        for i in range(4)])
    embeddings = [{"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings",
                   "body": {"model": EMBED_MODEL, "input": f"sentence {i}"}} for i in range(4)]
    embed_batch = openai_client.batches.create(
        input_file_id=upload(openai_client, jsonl(embeddings)).id, endpoint="/v1/embeddings",
        completion_window="24h")
    workers.start(CHAT_MODEL, env={**ENGINE_ENV, "BATCHWEB_MODEL_SWITCH_SECONDS": "1"},
                  args=["--model", EMBED_MODEL])
    try:
        for batch in (chat_batch, embed_batch):
            done = wait_for(lambda b=batch: (r := openai_client.batches.retrieve(b.id)).status
                            in ("completed", "failed") and r, timeout=600, every=1,
                            message="both batches")
            assert done.status == "completed" and done.request_counts.completed == 4
    finally:
        workers.stop_all()
    log = (workers.log_dir / "worker-0.log").read_text()
    closed = re.search(rf"switching from {CHAT_MODEL} to {EMBED_MODEL} \(([\d.]+) s", log)
    loaded = re.findall(r"ready on .* \(([\d.]+) s to load\)", log)
    assert closed and len(loaded) == 2, log[-3000:]
    print(f"switch: {float(closed.group(1)) + float(loaded[1]):.1f} s "
          f"(close {closed.group(1)} s, load {loaded[1]} s)")


def test_lora_adapters_through_vllm(openai_client, workers, settings, tmp_path):
    """Two LoRA adapters of fixed random weights (one from a path, one from a wheel the
    worker fetches with pip) in one batch beside the base model's requests: each adapter
    changes its answers, and the base model's answers are those of a batch without
    adapters."""
    from jobs.models import LoraAdapter
    from tests.lora import build_wheel, write_adapter

    lora = {"enable_lora": True, "max_lora_rank": 16, "max_loras": 4, "max_cpu_loras": 8}
    settings.BATCHWEB_MODELS = [
        {**m, "options": {**m["options"], **lora}} if m["name"] == CHAT_MODEL else m
        for m in settings.BATCHWEB_MODELS]
    LoraAdapter.objects.create(name="smol-one", base_model=CHAT_MODEL,
                               source=str(write_adapter(tmp_path / "one", seed=1)))
    build_wheel(write_adapter(tmp_path / "two", seed=2), tmp_path / "wheels",
                name="batchweb-e2e-lora")
    LoraAdapter.objects.create(name="smol-two", base_model=CHAT_MODEL,
                               source="pypi:batchweb-e2e-lora==1.0")

    questions = ["Name three colors.", "What is the capital of France?"]
    base_only = submit(openai_client, [chat(f"base{i}", q) for i, q in enumerate(questions)])
    mixed_lines = []
    for i, question in enumerate(questions):
        mixed_lines += [chat(f"base{i}", question),
                        chat(f"one{i}", question, model="smol-one"),
                        chat(f"two{i}", question, model="smol-two")]
    mixed = submit(openai_client, mixed_lines)
    workers.start(CHAT_MODEL, env={**ENGINE_ENV, "BATCHWEB_ENABLE_LORA": "1",
                                   "PIP_FIND_LINKS": str(tmp_path / "wheels")})
    try:
        done = [until_ended(openai_client, b.id) for b in (base_only, mixed)]
    finally:
        workers.stop_all()
    assert [d.status for d in done] == ["completed", "completed"], workers.logs()
    assert done[1].request_counts.completed == 6 and done[1].error_file_id is None

    def contents(batch):
        return {cid: r["response"]["body"]["choices"][0]["message"]["content"]
                for cid, r in lines_of(openai_client, batch.output_file_id).items()}

    alone, together = contents(done[0]), contents(done[1])
    models = {cid: r["response"]["body"]["model"]
              for cid, r in lines_of(openai_client, done[1].output_file_id).items()}
    for i in range(len(questions)):
        assert together[f"base{i}"] == alone[f"base{i}"]
        assert together[f"one{i}"] != together[f"base{i}"]
        assert together[f"two{i}"] not in (together[f"base{i}"], together[f"one{i}"])
        assert (models[f"one{i}"], models[f"two{i}"]) == ("smol-one", "smol-two")
