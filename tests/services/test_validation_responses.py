"""/v1/responses lines in validation: the bodies that pass, each refused field named on its
line, the model registry's endpoints, and what validation reads of a Responses request
(its text for the estimate and the content rules, its usage)."""

from __future__ import annotations

import io
import json
from typing import Any

import pytest

from engine.endpoints import CHAT, REGISTRY, RESPONSES, check_body, request_messages, usage_of
from engine.endpoints.base import Refusal
from jobs.formats.prompts import estimate_tokens, prompt_text
from jobs.formats.wire import (
    Code,
    RequestLine,
    parse_line,
)

MODEL = "echo-test"
CAP = 1000
BASE = {"model": MODEL, "input": "Say hello."}
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
FUNCTION = {"type": "function", "name": "get_weather", "description": "Weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


def _check(body: dict[str, Any], domains: tuple[str, ...] = ()) -> Refusal | None:
    return check_body(RESPONSES, body, max_tokens_cap=CAP, media_domains=domains)


def _line(custom_id: str, body: dict[str, Any]) -> bytes:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": RESPONSES,
                       "body": body}).encode()


@pytest.mark.parametrize("body", [
    BASE,
    {**BASE, "input": [{"role": "user", "content": "Hi"}]},
    {**BASE, "instructions": "Answer in French.", "max_output_tokens": 50, "temperature": 0,
     "top_p": 0.9, "seed": 3, "stop": ["\n"], "top_k": 5, "metadata": {"team": "a"},
     "store": False, "background": False, "user": "u1", "truncation": "auto",
     "reasoning": {"effort": "low"}, "include": ["message.output_text.logprobs"],
     "top_logprobs": 2, "safety_identifier": "x", "service_tier": "auto"},
    {**BASE, "input": [
        {"type": "message", "role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": "What is on it?"},
                                     {"type": "input_image",
                                      "image_url": "data:image/png;base64,iVBORw0KGgo="}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "A cat."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather",
         "arguments": "{\"city\": \"Paris\"}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"}]},
    {**BASE, "text": {"format": {"type": "json_schema", "name": "n", "schema": SCHEMA,
                                 "strict": True}}},
    {**BASE, "text": {"format": {"type": "json_object"}}},
    {**BASE, "text": {"format": {"type": "text"}, "verbosity": "low"}},
    {**BASE, "tools": [FUNCTION], "tool_choice": "auto", "parallel_tool_calls": False},
], ids=["string", "items", "sampling", "every item kind", "json_schema", "json_object",
        "text", "function tools"])
def test_a_good_responses_body_passes(body: dict[str, Any]) -> None:
    assert _check(body) is None
    assert isinstance(parse_line(_line("r", body), max_tokens_cap=CAP), RequestLine)


def test_every_documented_field_passes_as_null() -> None:
    body = {**{name: None for name in REGISTRY[RESPONSES].fields}, **BASE}
    assert _check(body) is None


@pytest.mark.parametrize(("extra", "param", "fragment"), [
    # Stored state and background runs a batch does not have.
    ({"store": True}, "body.store", "not stored"),
    ({"store": "true"}, "body.store", "not stored"),
    ({"background": True}, "body.background", "Background mode"),
    ({"previous_response_id": "resp_123"}, "body.previous_response_id", "stored response"),
    ({"conversation": "conv_123"}, "body.conversation", "conversation"),
    ({"conversation": {"id": "conv_123"}}, "body.conversation", "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, "body.prompt", "prompt templates"),
    ({"stream": True}, "body.stream", "Streaming"),
    # Tools that run on OpenAI's side.
    ({"tools": [{"type": "web_search"}]}, "body.tools[0].type", "web_search"),
    ({"tools": [{"type": "web_search_preview"}]}, "body.tools[0].type", "web_search_preview"),
    ({"tools": [FUNCTION, {"type": "file_search", "vector_store_ids": ["vs_1"]}]},
     "body.tools[1].type", "file_search"),
    ({"tools": [{"type": "code_interpreter", "container": {"type": "auto"}}]},
     "body.tools[0].type", "code_interpreter"),
    ({"tools": [{"type": "computer_use_preview", "display_width": 1024,
                 "display_height": 768, "environment": "browser"}]},
     "body.tools[0].type", "computer_use_preview"),
    ({"tools": [{"type": "mcp", "server_label": "x", "server_url": "https://x.test"}]},
     "body.tools[0].type", "mcp"),
    ({"tools": "get_weather"}, "body.tools", "array"),
    # Input that references what is stored elsewhere, or is no input.
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "body.input[0].type",
     "stored items"),
    ({"input": [{"type": "web_search_call", "id": "ws_1", "status": "completed"}]},
     "body.input[0].type", "built-in tool"),
    ({"input": ""}, "body.input", "non-empty"),
    ({"input": []}, "body.input", "non-empty"),
    ({"input": 5}, "body.input", "non-empty"),
    ({"input": ["hi"]}, "body.input[0]", "object"),
    ({"input": [{"role": "user"}]}, "body.input[0]", "content"),
    ({"input": [{"role": "user", "content": [{"type": "input_video", "url": "x"}]}]},
     "body.input[0].content[0].type", "input_text"),
    ({"instructions": ["be brief"]}, "body.instructions", "string"),
    # Formats vLLM would not honour.
    ({"text": {"format": {"type": "json_schema", "name": "n"}}}, "body.text.format.schema",
     "JSON Schema"),
    ({"text": {"format": {"type": "regex"}}}, "body.text.format", "json_schema"),
    ({"text": "json"}, "body.text", "object"),
    # Fields of chat, not of responses.
    ({"messages": [{"role": "user", "content": "hi"}]}, "body.messages", "not a parameter"),
    ({"response_format": {"type": "json_object"}}, "body.response_format", "not a parameter"),
    ({"max_tokens": 5}, "body.max_tokens", "not a parameter"),
    ({"n": 2}, "body.n", "not a parameter"),
    ({"request_id": "resp_mine"}, "body.request_id", "not a parameter"),
    ({"vllm_xargs": {}}, "body.vllm_xargs", "not a parameter"),
    ({"min_tokens": 3}, "body.min_tokens", "not a parameter"),
    # Values.
    ({"max_output_tokens": 0}, "body.max_output_tokens", "positive"),
    ({"max_output_tokens": CAP + 1}, "body.max_output_tokens", "at most"),
    ({"temperature": 3}, "body.temperature", "between"),
])
def test_a_refused_field_is_a_line_error_naming_it(extra: dict[str, Any], param: str,
                                                   fragment: str) -> None:
    problem = _check({**BASE, **extra})
    assert problem is not None, extra
    assert problem.param == param, problem
    assert problem.code in (Code.INVALID_PARAMETER, Code.INVALID_BODY)
    assert fragment in problem.message, problem.message


def test_media_of_a_responses_message_is_checked_as_chat_media() -> None:
    body = {**BASE, "input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "http://169.254.169.254/latest/meta-data/"}]}]}
    problem = _check(body)
    assert problem is not None and problem.param == "body.input[0].content[0]"
    assert "BATCHWEB_MEDIA_ALLOWED_DOMAINS" in problem.message
    allowed = {**BASE, "input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "https://images.example.com/cat.png"}]}]}
    assert _check(allowed, ("images.example.com",)) is None


def test_media_of_a_function_call_output_is_checked_as_a_messages() -> None:
    # The output becomes a tool message: an input_image there is fetched as anywhere else.
    def output(*parts: dict[str, Any]) -> dict[str, Any]:
        return {**BASE, "input": [
            {"role": "user", "content": "Look."},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": list(parts)}]}

    metadata = {"type": "input_image", "image_url": "http://169.254.169.254/latest/meta-data/"}
    problem = _check(output({"type": "input_text", "text": "here"}, metadata))
    assert problem is not None and problem.param == "body.input[2].output[1]"
    assert "BATCHWEB_MEDIA_ALLOWED_DOMAINS" in problem.message
    problem = _check(output({"type": "input_file", "file_url": "file:///etc/passwd"}))
    assert problem is not None and problem.param == "body.input[2].output[0]"
    problem = _check(output({"type": "image_url", "image_url": {"url": "http://10.0.0.1/"}}))
    assert problem is not None and problem.param == "body.input[2].output[0].type"
    allowed = {"type": "input_image", "image_url": "https://images.example.com/cat.png"}
    assert _check(output(allowed), ("images.example.com",)) is None
    inline = {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo="}
    assert _check(output({"type": "input_text", "text": "ok"}, inline)) is None


def test_the_messages_and_text_of_a_responses_prompt() -> None:
    body = {**BASE, "instructions": "Be brief.", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "reasoning", "id": "rs_1", "summary": []}]}
    assert [m["role"] for m in request_messages(RESPONSES, body)] == ["system", "user", "tool"]
    line = RequestLine("r", RESPONSES, {**body, "max_output_tokens": 7})
    text, chars = prompt_text(line)
    assert text == "Be brief.\nWeather?\nsunny"
    assert chars == len("Be brief.Weather?sunny")
    assert estimate_tokens(line, chars) == chars // 4
    assert prompt_text(RequestLine("s", RESPONSES, BASE)) == ("Say hello.", 10)


def test_usage_of_a_response_object() -> None:
    body = {"object": "response", "usage": {
        "input_tokens": 30, "output_tokens": 7, "total_tokens": 37,
        "input_tokens_details": {"cached_tokens": 16},
        "output_tokens_details": {"reasoning_tokens": 0}}}
    assert usage_of(RESPONSES, body) == (30, 7, 16)
    assert usage_of(RESPONSES, {"usage": {"input_tokens": 3, "output_tokens": 1,
                               "input_tokens_details": None}}) == (3, 1, 0)
    # The chat shape still reads as before.
    assert usage_of(CHAT, {"usage": {"prompt_tokens": 5, "completion_tokens": 2,
                               "prompt_tokens_details": {"cached_tokens": 1}}}) == (5, 2, 1)


@pytest.mark.django_db
def test_a_model_that_does_not_serve_responses_is_refused_per_line(settings: Any) -> None:
    from jobs.services.validation import check_input

    settings.BATCHWEB_MODELS = [
        {"name": "chat-only", "backend": "echo", "endpoints": ["/v1/chat/completions"]},
        {"name": MODEL, "backend": "echo", "endpoints": [RESPONSES]}]
    content = b"\n".join([_line("a", {**BASE, "model": "chat-only"}),
                          _line("b", {**BASE, "store": True})]) + b"\n"
    report = check_input(io.BytesIO(content), endpoint=RESPONSES, strict=True)
    assert [(e["line"], e["code"], e["param"]) for e in report.errors] == [
        (1, Code.MODEL_NOT_FOUND, "body.model"), (2, Code.INVALID_PARAMETER, "body.store")]
    assert "does not serve /v1/responses" in report.errors[0]["message"]
    # Not strict: the model is the file's problem, the body line 2's request's own.
    report = check_input(io.BytesIO(content), endpoint=RESPONSES)
    assert [(e["line"], e["code"]) for e in report.errors] == [(1, Code.MODEL_NOT_FOUND)]
    assert [(e["line"], e["custom_id"], e["code"], e["param"]) for e in report.refused_lines
            ] == [(2, "b", Code.INVALID_PARAMETER, "body.store")]
    good = b"\n".join([_line("a", BASE), _line("b", {**BASE, "input": "again"})]) + b"\n"
    report = check_input(io.BytesIO(good), endpoint=RESPONSES)
    assert report.ok and report.requests == 2 and report.model == MODEL
