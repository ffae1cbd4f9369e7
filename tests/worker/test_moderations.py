"""/v1/moderations through the official openai client: a batch on a worker process (the
echo model: its embeddings are hashes, so an input equal to a category's example scores
1.0 there), the file problems validation names, and the answer built from an embeddings
call."""

from __future__ import annotations

import json

import pytest

from engine.endpoints import REGISTRY
from engine.endpoints.base import ModelOptionsError, cosine, echo_vector
from engine.endpoints.moderations import DEFAULT_CATEGORIES, categories_of
from jobs.formats.prompts import prompt_bound, room_for
from jobs.formats.wire import RequestLine
from jobs.models import Price, UsageRecord
from jobs.services import quotas
from jobs.tasks import validate_batch
from tests.factories import assert_exactly_once, jsonl, upload, wait_status

MODERATIONS = "/v1/moderations"
pytestmark = pytest.mark.django_db(transaction=True)


def line(custom_id: str, text, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": MODERATIONS,
            "body": {"model": "echo-test", "input": text, **body}}


def lines_of(client, file_id) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines()]


def test_a_moderations_batch_runs_on_a_worker_process(openai_client, workers):
    violent = DEFAULT_CATEGORIES["violence"][0]
    # An example of hate that the echo model's hash embeddings do not put near violence's
    # examples as well (8 random floats each: some of them come close by chance).
    hateful = min(DEFAULT_CATEGORIES["hate"], key=lambda text: max(
        cosine(echo_vector(text), echo_vector(example))
        for example in DEFAULT_CATEGORIES["violence"]))
    lines = [line("violent", violent), line("both", [violent, hateful]),
             line("plain", "the weather is mild today")]
    Price.objects.create(model="echo-test", input_per_million=4, output_per_million=4)
    batch = openai_client.batches.create(
        input_file_id=upload(openai_client, jsonl(lines)).id, endpoint=MODERATIONS,
        completion_window="24h")
    workers.start()
    batch = wait_status(openai_client, batch.id, {"completed"})
    assert batch.endpoint == MODERATIONS and batch.request_counts.completed == 3
    out, err = lines_of(openai_client, batch.output_file_id), lines_of(
        openai_client, batch.error_file_id)
    assert_exactly_once(out, err, {x["custom_id"] for x in lines})
    bodies = {r["custom_id"]: r["response"]["body"] for r in out}
    first = bodies["violent"]
    assert first["id"].startswith("modr-") and first["model"] == "echo-test"
    [result] = first["results"]
    assert set(result["categories"]) == set(DEFAULT_CATEGORIES)
    assert result["flagged"] and result["categories"]["violence"]
    assert result["category_scores"]["violence"] == 1.0
    assert [r["categories"]["violence"] for r in bodies["both"]["results"]] == [True, False]
    assert bodies["both"]["results"][1]["categories"]["hate"]
    for body in bodies.values():  # flagged exactly where a score reaches the threshold
        for found in body["results"]:
            assert found["flagged"] == any(s >= 0.5 for s in found["category_scores"].values())
            assert all(0 <= s <= 1 for s in found["category_scores"].values())
    # Metered as embeddings are: the prompt tokens of each request's embeddings call (its
    # inputs and the category examples; the echo model's tokens are words), no output.
    examples = sum(len(text.split()) for texts in DEFAULT_CATEGORIES.values()
                   for text in texts)
    assert {cid: body["usage"]["prompt_tokens"] for cid, body in bodies.items()} == {
        cid: examples + sum(len(text.split()) for text in ([t] if isinstance(t, str) else t))
        for cid, t in ((x["custom_id"], x["body"]["input"]) for x in lines)}
    assert batch.usage.input_tokens == sum(b["usage"]["prompt_tokens"] for b in bodies.values())
    assert batch.usage.output_tokens == 0
    # The ledger charges them at the model's input price; the tokens quotas count them.
    records = UsageRecord.objects.filter(batch_id=batch.id)
    assert sum(r.input_tokens for r in records) == batch.usage.input_tokens
    assert sum(r.cost_nanos for r in records) == batch.usage.input_tokens * 2000  # $2 / M
    assert quotas.usage_for(records[0].owner)["tokens_per_day"] == batch.usage.input_tokens
    # The budget's bound counts the call the engine ran, category examples included.
    room = room_for("echo-test")
    for x in lines:
        bound = prompt_bound(RequestLine(x["custom_id"], MODERATIONS, x["body"]), room)
        assert bodies[x["custom_id"]]["usage"]["prompt_tokens"] <= bound


def test_moderation_lines_a_model_cannot_run_are_file_problems(openai_client, settings):
    """In a strict batch, as every endpoint's body problems are."""
    settings.BATCHWEB_MODELS = [*settings.BATCHWEB_MODELS, {
        "name": "chat-only", "backend": "echo", "endpoints": ["/v1/chat/completions"]}]
    lines = [line("ok", "fine"), line("model", "x", model="chat-only"),
             line("type", [1, 2]), line("empty", ""), line("field", "x", temperature=0)]
    batch = openai_client.batches.create(
        input_file_id=upload(openai_client, jsonl(lines)).id, endpoint=MODERATIONS,
        completion_window="24h", extra_body={"strict": True})
    validate_batch(batch.id)
    batch = openai_client.batches.retrieve(batch.id)
    assert batch.status == "failed"
    found = {(e.line, e.code, e.param) for e in batch.errors.data}
    assert found == {(2, "model_not_found", "body.model"), (3, "invalid_body", "body.input"),
                     (4, "invalid_body", "body.input"),
                     (5, "invalid_parameter", "body.temperature")}
    assert any("does not serve /v1/moderations" in e.message for e in batch.errors.data)


def test_the_answer_is_built_from_one_embeddings_call():
    endpoint = REGISTRY[MODERATIONS]
    options = {"moderation_categories": {"pets": ["a cat", "a dog"], "money": ["taxes"]},
               "moderation_threshold": 0.8}
    body = {"model": "m", "input": ["x", "y"]}
    sent = endpoint.engine_body(body, options=options)
    assert endpoint.serving_url == "/v1/embeddings"
    assert sent == {"model": "m", "input": ["x", "y", "a cat", "a dog", "taxes"]}
    vectors = [[1, 0], [0, 1], [0.6, 0.8], [1, 0], [-1, 0]]
    answer = {"data": [{"index": i, "embedding": v} for i, v in reversed(list(enumerate(vectors)))],
              "usage": {"prompt_tokens": 11, "total_tokens": 11}}
    answered = endpoint.from_serving(body, answer, options=options)
    results = answered["results"]
    assert results[0] == {"flagged": True, "categories": {"pets": True, "money": False},
                          "category_scores": {"pets": 1.0, "money": 0.0}}
    assert results[1] == {"flagged": True, "categories": {"pets": True, "money": False},
                          "category_scores": {"pets": 0.8, "money": 0.0}}
    # The call's prompt tokens are the request's, as an embeddings request's are.
    assert answered["usage"] == {"prompt_tokens": 11, "total_tokens": 11}
    assert endpoint.usage(answered) == (11, 0, 0)


@pytest.mark.parametrize("options", [
    {"moderation_categories": {"pets": []}},
    {"moderation_categories": ["a cat"]},
    {"moderation_categories": {"pets": ["a cat", 3]}},
    {"moderation_threshold": 2},
    {"moderation_threshold": True},
])
def test_operator_categories_that_cannot_run_are_named(options):
    with pytest.raises(ModelOptionsError, match="moderation_"):
        categories_of(options)


def test_a_model_with_bad_categories_answers_each_request_with_a_400():
    from engine import load_engine
    from engine.base import EngineRequest, ModelSpec

    engine = load_engine(ModelSpec(name="m", backend="echo", endpoints=(MODERATIONS,),
                                   options={"moderation_categories": {"pets": []}}))
    try:
        [result] = list(engine.run([EngineRequest(request_id="r", url=MODERATIONS,
                                                  body={"model": "m", "input": "x"})]))
    finally:
        engine.close()
    assert result.status_code == 400
    assert "moderation_categories" in result.body["error"]["message"]
