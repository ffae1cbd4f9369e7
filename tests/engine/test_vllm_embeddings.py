"""The real vLLM engine as an embedding model: all-MiniLM-L6-v2 with runner="pooling",
serving embeddings, and score and rerank through vLLM's score path for embeddings models
(the cosine similarity of the two embeddings: no cross-encoder ships on PyPI)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine import (
    CHAT,
    EMBEDDINGS,
    RERANK,
    SCORE,
    EngineRequest,
    ModelSpec,
    load_engine,
)
from engine.catalog import DEFAULT_MODELS
from engine.endpoints import MODERATIONS
from engine.prepare import prepare_model
from engine.vllm_engine import VllmEngine
from tests.engine import needs_vllm

pytestmark = [needs_vllm, pytest.mark.engine, pytest.mark.timeout(600)]

NAME = "minilm"


@pytest.fixture(scope="module")
def engine(model_cache: Path) -> Iterator[VllmEngine]:
    base = next(s for s in DEFAULT_MODELS if EMBEDDINGS in s.endpoints)
    path = prepare_model(base, model_cache)
    spec = ModelSpec(
        name=NAME,
        backend="vllm",
        path=str(path),
        endpoints=(EMBEDDINGS, SCORE, RERANK),
        options={"runner": "pooling", "enforce_eager": True, "dtype": "float32",
                 "max_num_seqs": 8},
    )
    eng = load_engine(spec)
    assert isinstance(eng, VllmEngine)
    yield eng
    eng.close()


def test_embeddings(engine: VllmEngine) -> None:
    reqs = [
        EngineRequest("one", EMBEDDINGS, {"model": NAME, "input": "The cat sat on the mat."}),
        EngineRequest("two", EMBEDDINGS, {"model": NAME, "input": ["A dog.", "A cat.", "Tax."]}),
        EngineRequest("chat", CHAT, {"model": NAME, "messages": [{"role": "user", "content": ""}]}),
        EngineRequest("bad", EMBEDDINGS, {"model": NAME, "input": "x", "encoding_format": "nope"}),
    ]
    results = {r.request_id: r for r in engine.run(reqs)}
    one = results["one"]
    assert one.status_code == 200, one.body
    assert one.body["object"] == "list" and one.body["id"].startswith("embd-")
    (item,) = one.body["data"]
    assert item["object"] == "embedding" and len(item["embedding"]) == 384
    # all-MiniLM-L6-v2 normalizes its embeddings.
    assert math.isclose(math.fsum(v * v for v in item["embedding"]), 1.0, rel_tol=1e-3)
    assert one.body["usage"]["prompt_tokens"] > 5
    assert one.body["usage"]["total_tokens"] == one.body["usage"]["prompt_tokens"]

    two = results["two"].body
    dog, cat, tax = (d["embedding"] for d in two["data"])
    assert [d["index"] for d in two["data"]] == [0, 1, 2]

    def cos(a: list[float], b: list[float]) -> float:
        return sum(x * y for x, y in zip(a, b, strict=True))

    assert cos(dog, cat) > cos(dog, tax)

    for rid in ("chat", "bad"):
        assert results[rid].status_code == 400, results[rid].body
        assert results[rid].body["error"]["code"] == 400


def _cosine(a: list[float], b: list[float]) -> float:
    dot = math.fsum(x * y for x, y in zip(a, b, strict=True))
    return dot / math.sqrt(math.fsum(x * x for x in a) * math.fsum(y * y for y in b))


def test_score_and_rerank_are_the_cosine_of_the_embeddings(engine: VllmEngine) -> None:
    texts = ["A cat sits on the mat.", "A kitten rests on a rug.", "Quarterly taxes rose."]
    reqs = [
        EngineRequest("embed", EMBEDDINGS, {"model": NAME, "input": texts}),
        EngineRequest("1:N", SCORE, {"model": NAME, "queries": texts[0],
                                     "documents": texts[1:]}),
        EngineRequest("N:N", SCORE, {"model": NAME, "text_1": texts[:2],
                                     "text_2": texts[1:]}),
        EngineRequest("rerank", RERANK, {"model": NAME, "query": texts[0],
                                         "documents": [texts[2], texts[1]]}),
        EngineRequest("top", RERANK, {"model": NAME, "query": texts[0], "documents": texts,
                                      "top_n": 2}),
    ]
    results = {r.request_id: r for r in engine.run(reqs)}
    for result in results.values():
        assert result.status_code == 200, result.body
    cat, kitten, taxes = (d["embedding"] for d in results["embed"].body["data"])

    one = results["1:N"].body
    assert set(one) == {"id", "object", "created", "model", "data", "usage"}
    assert one["object"] == "list" and one["model"] == NAME and one["id"].startswith("score-")
    assert [(d["index"], d["object"]) for d in one["data"]] == [(0, "score"), (1, "score")]
    scores = [d["score"] for d in one["data"]]
    assert scores == pytest.approx([_cosine(cat, kitten), _cosine(cat, taxes)], abs=1e-4)
    assert scores[0] > scores[1]  # the pets are closer to each other than to the taxes
    # Each input is embedded once: its tokens are the three texts' own.
    assert one["usage"]["prompt_tokens"] == one["usage"]["total_tokens"] > 15
    assert one["usage"]["completion_tokens"] == 0
    pairs = [d["score"] for d in results["N:N"].body["data"]]
    assert pairs == pytest.approx([_cosine(cat, kitten), _cosine(kitten, taxes)], abs=1e-4)

    ranked = results["rerank"].body
    assert set(ranked) == {"id", "model", "usage", "results"}
    assert [(r["index"], r["document"]["text"]) for r in ranked["results"]] == [
        (1, texts[1]), (0, texts[2])]
    assert ranked["results"][0]["relevance_score"] == pytest.approx(scores[0], abs=1e-4)
    assert set(ranked["usage"]) == {"prompt_tokens", "total_tokens"}
    assert ranked["usage"]["prompt_tokens"] > 15
    top = results["top"].body["results"]
    # The query itself first (a score of 1), then the kitten; the taxes cut by top_n.
    assert [r["index"] for r in top] == [0, 1]
    assert top[0]["relevance_score"] == pytest.approx(1.0, abs=1e-4)


def test_score_and_rerank_requests_vllm_refuses_are_400s(engine: VllmEngine) -> None:
    reqs = [
        EngineRequest("lengths", SCORE, {"model": NAME, "queries": ["a", "b"],
                                         "documents": ["c", "d", "e"]}),
        # A text-only model: vLLM refuses content inputs of a BERT model.
        EngineRequest("content", RERANK, {"model": NAME, "query": "pets", "documents": [
            {"content": [{"type": "text", "text": "a cat"}]}]}),
        EngineRequest("long", SCORE, {"model": NAME, "queries": "word " * 400,
                                      "documents": "x"}),
        EngineRequest("limit", RERANK, {"model": NAME, "query": "a", "documents": ["b"],
                                        "max_tokens_per_doc": 10_000}),
    ]
    results = {r.request_id: r for r in engine.run(reqs)}
    for request_id, result in results.items():
        assert result.status_code == 400, (request_id, result.body)
        assert result.body["error"]["code"] == 400 and result.body["error"]["message"]
    assert "1:1, 1:N or N:N" in results["lengths"].body["error"]["message"]
    assert "maximum context length" in results["long"].body["error"]["message"]


# Plain threats and insults (none of them a default category's example), and everyday
# requests, some with violent words used harmlessly.
THREATS = {"I will hurt you badly": "violence", "You are a worthless idiot": "harassment",
           "I am going to beat him up and hurt him badly": "violence"}
EVERYDAY = ["What is the weather like tomorrow?", "Thank you for your help, have a nice day",
            "Here is a recipe for a lemon cake with sugar and butter", "I hate Mondays",
            "Kill the process with SIGTERM", "He killed the engine and got out of the car",
            "My knee hurts after running", "You did a great job on this report"]


def test_the_default_moderation_categories_flag_plain_threats_and_insults(
        engine: VllmEngine) -> None:
    """/v1/moderations with the default categories (the model's options name none): each
    threat or insult flagged in its category, well over the threshold, and no everyday
    request flagged at all."""
    from engine.endpoints.moderations import DEFAULT_CATEGORIES, DEFAULT_THRESHOLD

    examples = {text.rstrip(".") for texts in DEFAULT_CATEGORIES.values() for text in texts}
    assert not examples & set(THREATS)
    texts = [*THREATS, *EVERYDAY]
    [result] = engine.run([EngineRequest("mod", MODERATIONS, {"model": NAME, "input": texts})])
    assert result.status_code == 200, result.body
    answers = dict(zip(texts, result.body["results"], strict=True))
    for text, category in THREATS.items():
        scores = answers[text]["category_scores"]
        assert answers[text]["flagged"] and answers[text]["categories"][category], (text, scores)
        assert max(scores, key=scores.get) == category
        assert scores[category] >= DEFAULT_THRESHOLD + 0.05, (text, scores)
    for text in EVERYDAY:
        scores = answers[text]["category_scores"]
        assert not answers[text]["flagged"], (text, scores)
        assert max(scores.values()) <= DEFAULT_THRESHOLD - 0.1, (text, scores)
