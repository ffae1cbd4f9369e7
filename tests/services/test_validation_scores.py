"""/v1/score and /v1/rerank lines in validation: vLLM's request shapes that pass, each
refusal named on its line, what validation reads of them (their texts for the estimate and
the content rules, dedup, usage) and the model registry's endpoints."""

from __future__ import annotations

import io
import json
from typing import Any

import pytest

from engine.endpoints import POOLING_ENDPOINTS, REGISTRY, RERANK, SCORE, check_body, usage_of
from engine.endpoints.base import Refusal
from engine.endpoints.score import SCORE_SIDES
from jobs.formats.prompts import dedup_key, estimate_tokens, prompt_text
from jobs.formats.wire import (
    Code,
    RequestLine,
    parse_line,
)

MODEL = "echo-test"
CAP = 1000
SCORE_BODY = {"model": MODEL, "queries": "A cat sits.", "documents": ["A kitten.", "Tax."]}
RERANK_BODY = {"model": MODEL, "query": "pets", "documents": ["Tax.", "A kitten."]}
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}


def _check(url: str, body: dict[str, Any], domains: tuple[str, ...] = ()) -> Refusal | None:
    return check_body(url, body, max_tokens_cap=CAP, media_domains=domains)


def _line(custom_id: str, url: str, body: dict[str, Any]) -> bytes:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url,
                       "body": body}).encode()


@pytest.mark.parametrize(("url", "body"), [
    (SCORE, SCORE_BODY),
    (SCORE, {"model": MODEL, "queries": ["a", "b"], "items": ["c", "d"]}),  # N:N
    (SCORE, {"model": MODEL, "text_1": "a", "text_2": "b"}),  # 1:1
    (SCORE, {"model": MODEL, "data_1": ["a"], "data_2": ["b", "c"], "user": "u",
             "truncate_prompt_tokens": 10, "max_tokens_per_query": 4,
             "max_tokens_per_doc": 8, "use_activation": False}),
    (SCORE, {"model": MODEL, "queries": {"content": [{"type": "text", "text": "a"}]},
             "documents": [{"content": [IMAGE]}, "plain"]}),
    (RERANK, RERANK_BODY),
    (RERANK, {**RERANK_BODY, "top_n": 1, "max_tokens_per_doc": 4}),
    (RERANK, {**RERANK_BODY, "documents": "one document"}),
    (RERANK, {**RERANK_BODY, "query": {"content": [{"type": "text", "text": "pets"}]}}),
], ids=["1:N", "N:N items", "text pair", "data pair and parameters", "content inputs",
        "rerank", "top_n", "one document", "content query"])
def test_vllms_score_and_rerank_shapes_pass(url: str, body: dict[str, Any]) -> None:
    assert _check(url, body) is None
    assert isinstance(parse_line(_line("s", url, body), max_tokens_cap=CAP), RequestLine)


@pytest.mark.parametrize("url", [SCORE, RERANK])
def test_every_documented_parameter_passes_as_null(url: str) -> None:
    sides = {name for pair in SCORE_SIDES for name in pair} | {"query", "documents"}
    base = SCORE_BODY if url == SCORE else RERANK_BODY
    body = {**{name: None for name in REGISTRY[url].fields - sides}, **base}
    assert _check(url, body) is None


@pytest.mark.parametrize(("url", "body", "param", "fragment"), [
    # The two sides of a score request: one pair of vLLM's names, both there.
    (SCORE, {"model": MODEL}, "body.queries", "queries and documents; queries and items"),
    (SCORE, {"model": MODEL, "queries": "a"}, "body.documents", "Missing body.documents"),
    (SCORE, {"model": MODEL, "text_2": ["b"]}, "body.text_1", "Missing body.text_1"),
    (SCORE, {"model": MODEL, "text_1": "a", "documents": ["b"]}, "body.documents",
     "different pairs"),
    (SCORE, {**SCORE_BODY, "items": ["c"]}, "body.items", "different pairs"),
    # Empty or malformed sides, and lengths vLLM cannot pair.
    (SCORE, {**SCORE_BODY, "documents": []}, "body.documents", "non-empty"),
    (SCORE, {**SCORE_BODY, "queries": ""}, "body.queries", "non-empty"),
    (SCORE, {**SCORE_BODY, "queries": None}, "body.queries", "non-empty string"),
    (SCORE, {**SCORE_BODY, "documents": ["a", 3]}, "body.documents[1]", "a string or an object"),
    (SCORE, {**SCORE_BODY, "documents": {"text": "a"}}, "body.documents", "content array"),
    (SCORE, {"model": MODEL, "queries": ["a", "b"], "documents": ["c", "d", "e"]},
     "body.documents", "body.queries has 2 inputs and body.documents 3"),
    # Content parts: text and media, media URLs only from allowed domains.
    (SCORE, {**SCORE_BODY, "documents": [{"content": [{"type": "image_embeds"}]}]},
     "body.documents[0].content[0].type", "image_url, text, video_url"),
    (SCORE, {**SCORE_BODY, "documents": [{"content": [
        {"type": "image_url", "image_url": {"url": "http://169.254.169.254/x.png"}}]}]},
     "body.documents[0].content[0]", "BATCHWEB_MEDIA_ALLOWED_DOMAINS"),
    # A rerank request: one query, non-empty documents, a positive top_n.
    (RERANK, {"model": MODEL, "documents": ["a"]}, "body.query", "Missing body.query"),
    (RERANK, {"model": MODEL, "query": "a"}, "body.documents", "Missing body.documents"),
    (RERANK, {**RERANK_BODY, "query": ["a", "b"]}, "body.query", "non-empty string or"),
    (RERANK, {**RERANK_BODY, "query": ""}, "body.query", "non-empty string"),
    (RERANK, {**RERANK_BODY, "documents": []}, "body.documents", "non-empty"),
    (RERANK, {**RERANK_BODY, "top_n": 0}, "body.top_n", "positive integer"),
    (RERANK, {**RERANK_BODY, "top_n": "2"}, "body.top_n", "positive integer"),
    (RERANK, {**RERANK_BODY, "top_n": True}, "body.top_n", "positive integer"),
    # Fields that are not the endpoint's, or that steer the engine.
    (RERANK, {**RERANK_BODY, "queries": ["b"]}, "body.queries", "not a parameter of /v1/rerank"),
    (SCORE, {**SCORE_BODY, "top_n": 1}, "body.top_n", "not a parameter of /v1/score"),
    (SCORE, {**SCORE_BODY, "instruction": "x"}, "body.instruction", "not a parameter"),
    (SCORE, {**SCORE_BODY, "chat_template_kwargs": {}}, "body.chat_template_kwargs",
     "not a parameter"),
    (RERANK, {**RERANK_BODY, "priority": -10}, "body.priority", "not a parameter"),
    (RERANK, {**RERANK_BODY, "request_id": "mine"}, "body.request_id", "not a parameter"),
    (SCORE, {**SCORE_BODY, "cache_salt": "s"}, "body.cache_salt", "not a parameter"),
    (SCORE, {**SCORE_BODY, "mm_processor_kwargs": {}}, "body.mm_processor_kwargs",
     "not a parameter"),
    (SCORE, {**SCORE_BODY, "input": "x"}, "body.input", "not a parameter"),
    (RERANK, {**RERANK_BODY, "stream": True}, "body.stream", "not a parameter"),
])
def test_a_bad_score_or_rerank_body_is_a_line_error_naming_the_field(
        url: str, body: dict[str, Any], param: str, fragment: str) -> None:
    problem = _check(url, body)
    assert problem is not None, body
    assert problem.param == param, problem
    assert problem.code in (Code.INVALID_PARAMETER, Code.INVALID_BODY, Code.MISSING_PARAMETER)
    assert fragment in problem.message, problem.message


def test_media_of_allowed_domains_pass() -> None:
    body = {**SCORE_BODY, "documents": [{"content": [
        {"type": "image_url", "image_url": {"url": "https://images.example.com/cat.png"}}]}]}
    assert _check(SCORE, body, ("images.example.com",)) is None


def test_the_sides_and_texts_of_score_and_rerank_requests() -> None:
    body = {"model": MODEL, "text_1": "Cats?",
            "text_2": ["Yes.", {"content": [{"type": "text", "text": "No."}, IMAGE]}]}
    assert REGISTRY[SCORE].sides(body) == [
        ("text_1", ["Cats?"]), ("text_2", ["Yes.", [{"type": "text", "text": "No."}, IMAGE]])]
    assert REGISTRY[RERANK].sides(RERANK_BODY) == [("query", ["pets"]),
                                                ("documents", ["Tax.", "A kitten."])]
    assert REGISTRY[SCORE].sides({"model": MODEL}) == []
    line = RequestLine("s", SCORE, body)
    text, chars = prompt_text(line)
    assert text == "Cats?\nYes.\nNo."
    assert chars == len("Cats?Yes.No.")
    # No output tokens: a pooling model generates none.
    assert estimate_tokens(line, chars) == max(1, chars // 4)
    assert prompt_text(RequestLine("r", RERANK, RERANK_BODY)) == ("pets\nTax.\nA kitten.",
                                                                  len("petsTax.A kitten."))


def test_score_and_rerank_requests_are_deduplicated_as_embeddings() -> None:
    assert set(POOLING_ENDPOINTS) == {"/v1/embeddings", SCORE, RERANK, "/v1/moderations"}
    for url, body in ((SCORE, SCORE_BODY), (RERANK, RERANK_BODY)):
        # No sampling: the same body always gets the same answer.
        key = dedup_key(RequestLine("a", url, body))
        assert key is not None and key == dedup_key(RequestLine("b", url, dict(body)))
    assert dedup_key(RequestLine("a", SCORE, SCORE_BODY)) != dedup_key(
        RequestLine("a", SCORE, {**SCORE_BODY, "documents": ["Tax."]}))


def test_usage_of_score_and_rerank_responses() -> None:
    # As vLLM writes them: the score list's usage is UsageInfo, rerank's has no completions.
    score = {"id": "score-1", "object": "list", "data": [], "usage": {
        "prompt_tokens": 17, "total_tokens": 17, "completion_tokens": 0,
        "prompt_tokens_details": None, "completion_tokens_details": None}}
    assert usage_of(SCORE, score) == (17, 0, 0)
    assert usage_of(RERANK, {"id": "score-2", "results": [],
                     "usage": {"prompt_tokens": 19, "total_tokens": 19}}) == (19, 0, 0)


@pytest.mark.django_db
def test_the_default_embeddings_model_serves_score_and_rerank(settings: Any) -> None:
    from batchweb.settings import DEFAULT_MODELS
    from engine.catalog import DEFAULT_MODELS as PREPARED
    from jobs.lib.model_registry import model_spec
    from jobs.services.validation import check_input

    embeddings = next(m for m in DEFAULT_MODELS if m["name"] == "all-MiniLM-L6-v2")
    assert {SCORE, RERANK} <= set(embeddings["endpoints"])
    assert {SCORE, RERANK} <= set(next(s for s in PREPARED
                                       if s.name == "all-MiniLM-L6-v2").endpoints)
    echo = model_spec("echo-test")
    assert echo is not None and set(echo.endpoints) == set(REGISTRY)
    settings.BATCHWEB_MODELS = [
        {"name": "embed-only", "backend": "echo", "endpoints": ["/v1/embeddings"]},
        {"name": MODEL, "backend": "echo", "endpoints": [SCORE, RERANK]}]
    content = b"\n".join([_line("a", SCORE, {**SCORE_BODY, "model": "embed-only"}),
                          _line("b", SCORE, {**SCORE_BODY, "documents": []})]) + b"\n"
    report = check_input(io.BytesIO(content), endpoint=SCORE, strict=True)
    assert [(e["line"], e["code"], e["param"]) for e in report.errors] == [
        (1, Code.MODEL_NOT_FOUND, "body.model"), (2, Code.INVALID_BODY, "body.documents")]
    assert "does not serve /v1/score" in report.errors[0]["message"]
    report = check_input(io.BytesIO(content), endpoint=SCORE)
    assert [(e["line"], e["code"]) for e in report.errors] == [(1, Code.MODEL_NOT_FOUND)]
    assert [(e["line"], e["code"]) for e in report.refused_lines] == [(2, Code.INVALID_BODY)]
    good = b"\n".join([_line("a", RERANK, RERANK_BODY),
                       _line("b", RERANK, {**RERANK_BODY, "query": "taxes"})]) + b"\n"
    report = check_input(io.BytesIO(good), endpoint=RERANK)
    assert report.ok and report.requests == 2 and report.model == MODEL
    assert report.output_tokens_ceiling == 0
