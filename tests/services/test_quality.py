"""Quality flags on outputs (pure functions; the pipeline's use is tested end to end)."""

from __future__ import annotations

import pytest

from jobs.policy.quality import flags_for, is_repetitive, json_problem

CHAT = "/v1/chat/completions"


def chat_response(*texts: str, finish: str = "stop") -> dict:
    return {"choices": [{"message": {"content": t}, "finish_reason": finish} for t in texts]}


@pytest.mark.parametrize("text, expected", [
    ("The capital of France is Paris.", False),
    ("I think " + "the cat sat on the mat. " * 5, True),
    ("na " * 20, True),
    ("hahahahahahaha", True),
    ("Wow!!!!", False),
    ("a b c d e f g h i j k l m n o p", False),
    ("", False),
])
def test_repetition(text, expected):
    assert is_repetitive(text) is expected


def test_flags():
    assert flags_for(CHAT, {}, chat_response("fine")) == []
    assert flags_for(CHAT, {}, chat_response("  ")) == ["empty_output"]
    assert flags_for(CHAT, {}, chat_response("cut", finish="length")) == ["length_limit"]
    assert flags_for(CHAT, {}, chat_response("fine", "yes " * 30)) == ["repetition"]
    as_json = {"response_format": {"type": "json_object"}}
    assert flags_for(CHAT, as_json, chat_response('{"a": 1}')) == []
    assert flags_for(CHAT, as_json, chat_response("{oops")) == ["invalid_json"]
    assert flags_for("/v1/completions", {}, {"choices": [{"text": "", "finish_reason": "stop"}]}
                     ) == ["empty_output"]
    assert flags_for("/v1/embeddings", {}, {"data": []}) == []


def test_json_schema_problems():
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}}
    assert json_problem('{"n": 3}', fmt) is None
    assert "schema" in json_problem('{"n": "three"}', fmt)
    assert "not valid JSON" in json_problem("n=3", fmt)
    assert json_problem("[1]", {"type": "json_object"}) == "not a JSON object"


RESPONSES = "/v1/responses"


def response_object(text: str, *, cut: bool = False) -> dict:
    return {"object": "response", "status": "incomplete" if cut else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "output": [{"type": "reasoning", "id": "rs_1", "summary": [],
                        "content": [{"type": "reasoning_text", "text": "thinking"}]},
                       {"type": "message", "role": "assistant", "content": [
                           {"type": "output_text", "text": text, "annotations": []}]}]}


def test_flags_of_a_response_object():
    assert flags_for(RESPONSES, {}, response_object("fine")) == []
    assert flags_for(RESPONSES, {}, response_object(" ")) == ["empty_output"]
    assert flags_for(RESPONSES, {}, {"object": "response", "output": []}) == ["empty_output"]
    assert flags_for(RESPONSES, {}, response_object("cut", cut=True)) == ["length_limit"]
    assert flags_for(RESPONSES, {}, response_object("yes " * 30)) == ["repetition"]
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    as_schema = {"text": {"format": {"type": "json_schema", "name": "n", "schema": schema}}}
    assert flags_for(RESPONSES, as_schema, response_object('{"n": 1}')) == []
    assert flags_for(RESPONSES, as_schema, response_object('{"n": "one"}')) == ["invalid_json"]
    as_object = {"text": {"format": {"type": "json_object"}}}
    assert flags_for(RESPONSES, as_object, response_object("{oops")) == ["invalid_json"]
    # A chat-style response_format means nothing to a Responses request.
    assert flags_for(RESPONSES, {"response_format": {"type": "json_object"}},
                     response_object("{oops")) == []
