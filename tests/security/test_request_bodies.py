"""Only the fields an endpoint documents reach the engine, and a media part may point only to
the domains the operator allows (data: URLs always pass): the engine would otherwise fetch
whatever a batch line names, from inside the operator's network."""

from __future__ import annotations

import io
import json
from typing import Any

import pytest

from engine.endpoints import CHAT, COMPLETIONS, EMBEDDINGS, REGISTRY, check_body
from engine.endpoints.base import Refusal
from jobs.formats.wire import (
    Code,
    LineError,
    RequestLine,
    parse_line,
)

MODEL = "echo-test"
CAP = 1000
BASES = {CHAT: {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
         COMPLETIONS: {"model": MODEL, "prompt": "hi"},
         EMBEDDINGS: {"model": MODEL, "input": "hi"}}


def _line(url: str, body: dict[str, Any]) -> bytes:
    return json.dumps({"custom_id": "r", "method": "POST", "url": url, "body": body}).encode()


def _check(url: str, body: dict[str, Any], domains: tuple[str, ...] = ()) -> Refusal | None:
    return check_body(url, body, max_tokens_cap=CAP, media_domains=domains)


@pytest.mark.parametrize(("url", "name"), [
    (CHAT, "chat_template"), (CHAT, "chat_template_kwargs"), (CHAT, "kv_transfer_params"),
    (CHAT, "priority"), (CHAT, "request_id"), (CHAT, "vllm_xargs"), (CHAT, "cache_salt"),
    (CHAT, "mm_processor_kwargs"), (CHAT, "media_io_kwargs"), (CHAT, "logits_processors"),
    (CHAT, "not_a_field"), (COMPLETIONS, "prompt_embeds"), (COMPLETIONS, "messages"),
    (COMPLETIONS, "tools"), (EMBEDDINGS, "messages"), (EMBEDDINGS, "temperature"),
    (EMBEDDINGS, "mm_processor_kwargs"),
])
def test_an_undocumented_field_is_a_request_problem_naming_it(url: str, name: str) -> None:
    result = parse_line(_line(url, {**BASES[url], name: 1}), max_tokens_cap=CAP)
    assert isinstance(result, RequestLine) and result.refused is not None
    assert (result.refused.code, result.refused.param) == (Code.INVALID_PARAMETER,
                                                           f"body.{name}")
    assert name in result.refused.message


@pytest.mark.parametrize("url", [CHAT, COMPLETIONS, EMBEDDINGS])
def test_every_documented_field_passes(url: str) -> None:
    # null is accepted for every optional field by check_body's value rules.
    body = {**{name: None for name in REGISTRY[url].fields}, **BASES[url]}
    assert _check(url, body) is None
    assert isinstance(parse_line(_line(url, body), max_tokens_cap=CAP), RequestLine)


def test_openai_and_vllm_sampling_fields_are_documented() -> None:
    assert {"response_format", "tools", "tool_choice", "logprobs", "top_logprobs",
            "max_completion_tokens", "seed", "stop"} <= REGISTRY[CHAT].fields
    assert {"suffix", "echo", "best_of", "logprobs"} <= REGISTRY[COMPLETIONS].fields
    assert {"dimensions", "encoding_format"} <= REGISTRY[EMBEDDINGS].fields
    for url in (CHAT, COMPLETIONS):
        assert {"top_k", "min_p", "repetition_penalty", "min_tokens",
                "stop_token_ids"} <= REGISTRY[url].fields


def test_the_fields_the_vllm_engine_ignores_still_reach_it() -> None:
    """engine/vllm_engine.py decides about these (an endpoint's `droppable`: ignores them,
    or answers a per-request 400 when ignoring would change the answer): validation must
    not refuse them first."""
    for url, endpoint in REGISTRY.items():
        assert set(endpoint.droppable) <= endpoint.fields, url


def _image(url: str) -> dict[str, Any]:
    return {**BASES[CHAT], "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this? http://anything.example/ in text is fine"},
        {"type": "image_url", "image_url": {"url": url, "detail": "auto"}}]}]}


@pytest.mark.parametrize("url", [
    "http://169.254.169.254/latest/meta-data/", "https://example.com/cat.png",
    "http://localhost:8000/admin", "HTTPS://Example.COM/cat.png", "file:///etc/passwd",
    "ftp://example.com/x.png", "https://images.example.com.evil.test/cat.png",
])
def test_a_media_url_is_refused_unless_its_domain_is_allowed(url: str) -> None:
    problem = _check(CHAT, _image(url))
    assert problem is not None and problem.code == Code.INVALID_PARAMETER
    assert problem.param == "body.messages[0].content[1]"
    # Allowing another domain changes nothing.
    assert _check(CHAT, _image(url), ("images.example.com",)) is not None


def test_an_allowed_domain_and_data_urls_pass() -> None:
    assert _check(CHAT, _image("data:image/png;base64,iVBORw0KGgo=")) is None
    assert _check(CHAT, _image("https://images.example.com/cat.png"),
                  ("images.example.com",)) is None
    assert _check(CHAT, _image("https://images.example.com/cat.png"), ("example.com",))
    assert _check(CHAT, _image("https://a.b.example.com/cat.png"), (".example.com",)) is None


@pytest.mark.parametrize("part", [
    {"type": "video_url", "video_url": {"url": "https://example.com/v.mp4"}},
    {"type": "audio_url", "audio_url": {"url": "https://example.com/a.wav"}},
    {"type": "file", "file": {"file_data": "https://example.com/doc.pdf"}},
    {"type": "input_audio", "input_audio": {"data": "http://example.com/a.wav",
                                            "format": "wav"}},
])
def test_every_media_part_is_checked(part: dict[str, Any]) -> None:
    body = {**BASES[CHAT], "messages": [{"role": "user", "content": [part]}]}
    problem = _check(CHAT, body)
    assert problem is not None and problem.code == Code.INVALID_PARAMETER
    assert _check(CHAT, body, ("example.com",)) is None


def test_inline_media_passes() -> None:
    parts = [{"type": "input_audio", "input_audio": {"data": "UklGRiQAAABXQVZF",
                                                     "format": "wav"}},
             {"type": "file", "file": {"file_data": "data:application/pdf;base64,JVBERi0=",
                                       "filename": "a.pdf"}},
             {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}]
    body = {**BASES[CHAT], "messages": [{"role": "user", "content": parts}]}
    assert _check(CHAT, body) is None


@pytest.mark.parametrize("kind", ["image_embeds", "prompt_embeds", "image_pil", None, 7])
def test_undocumented_content_part_types_are_refused(kind: Any) -> None:
    body = {**BASES[CHAT], "messages": [{"role": "user", "content": [
        {"type": kind, "image_embeds": "AAAA"}]}]}
    problem = _check(CHAT, body)
    assert problem is not None
    assert (problem.code, problem.param) == (Code.INVALID_PARAMETER,
                                             "body.messages[0].content[0].type")


@pytest.mark.django_db
def test_validation_reads_the_allowed_domains_from_settings(settings: Any) -> None:
    from jobs.services.validation import check_input

    content = (_line(CHAT, _image("https://images.example.com/cat.png")) + b"\n")
    report = check_input(io.BytesIO(content), endpoint=None)
    assert report.ok and report.refused == 1
    assert [(e["line"], e["code"]) for e in report.refused_lines] == [
        (1, Code.INVALID_PARAMETER)]
    assert "BATCHWEB_MEDIA_ALLOWED_DOMAINS" in report.refused_lines[0]["message"]
    settings.BATCHWEB = {**settings.BATCHWEB, "MEDIA_ALLOWED_DOMAINS": ["images.example.com"]}
    report = check_input(io.BytesIO(content), endpoint=None)
    assert report.ok and report.refused == 0


@pytest.mark.django_db
def test_errors_quote_at_most_a_hundred_characters_of_a_value() -> None:
    """A 100 kB model name makes a short errors.data message, not a copy of the name on
    every line of a batch's errors."""
    from jobs.services.validation import check_input

    name = "m" * 100_000
    content = b"\n".join(_line(CHAT, {**BASES[CHAT], "model": name + str(i)})
                         for i in range(3)) + b"\n"
    report = check_input(io.BytesIO(content), endpoint=None)
    assert [e["code"] for e in report.errors] == [Code.MODEL_NOT_FOUND] * 3
    for entry in report.errors:
        assert len(entry["message"]) < 200 and "m" * 100 + "…" in entry["message"]
    long = LineError(Code.INVALID_PARAMETER, "x" * 10_000, "body.x").entry(1)
    assert len(long["message"]) == 1000
