"""The endpoint registry (engine/endpoints/): one object per url, each owning its rules."""

from __future__ import annotations

from engine.endpoints import (
    ENDPOINTS,
    MESSAGES,
    POOLING_ENDPOINTS,
    REGISTRY,
    RESPONSES,
    check_body,
    show_response,
)
from engine.endpoints.base import INVALID_PARAMETER, Refusal


def test_one_object_per_url_each_complete() -> None:
    assert ENDPOINTS == ("/v1/chat/completions", "/v1/completions", "/v1/embeddings",
                         "/v1/responses", "/v1/messages", "/v1/score", "/v1/rerank",
                         "/v1/moderations")
    for url, endpoint in REGISTRY.items():
        assert endpoint.url == url
        assert {"model"} <= endpoint.fields
        assert endpoint.kind in ("chat", "generate", "embed", "score")
        assert endpoint.prompt_field in endpoint.fields, url
        assert endpoint.vllm.request.startswith("vllm."), url
        assert endpoint.pooling == (url in POOLING_ENDPOINTS)


def test_the_differences_engines_ask_for() -> None:
    # Anthropic's errors and range, Responses' store, the remote priority.
    error = {"error": {"message": "bad", "type": "BadRequestError", "param": None,
                       "code": 400}}
    assert REGISTRY[MESSAGES].error_body(400, error) == {
        "type": "error", "error": {"type": "invalid_request_error", "message": "bad"}}
    assert REGISTRY[RESPONSES].error_body(400, error) is error
    assert REGISTRY[RESPONSES].engine_body({"input": "x"}) == {"input": "x", "store": False}
    assert not REGISTRY[MESSAGES].takes_priority
    assert check_body(MESSAGES, {"model": "m", "max_tokens": 1, "temperature": 1.5,
                                 "messages": [{"role": "user", "content": "hi"}]},
                      max_tokens_cap=10) == Refusal(
        INVALID_PARAMETER, "body.temperature must be between 0 and 1.", "body.temperature")


def test_a_response_is_shown_by_the_endpoint_whose_shape_it_has() -> None:
    assert show_response({"choices": [{"message": {"content": "hi"}}]}) == "hi"
    assert show_response({"choices": [{"text": "hey"}]}) == "hey"
    assert show_response({"type": "message", "content": [{"type": "text", "text": "yo"}]}) == "yo"
    assert show_response({"data": [{"embedding": [0.1, 0.2]}]}) == (
        "embedding of 2 dimensions (1 inputs)")
    assert show_response({"error": {"message": "nope"}}) == "nope"


def test_a_chat_model_serves_messages_without_saying_so() -> None:
    from engine.endpoints import CHAT, EMBEDDINGS, MESSAGES, served

    assert served((CHAT,)) == (CHAT, MESSAGES)
    assert served((CHAT, MESSAGES)) == (CHAT, MESSAGES)
    # And every embeddings model, moderations (as its embeddings).
    assert served((EMBEDDINGS,)) == (EMBEDDINGS, "/v1/moderations")
