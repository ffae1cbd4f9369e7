"""Anthropic's Message Batches without a server: the Messages API's params as validation
reads them (answered per request), the create body read as a stream, the usage of a
Message, and the translation of our output and error lines to Anthropic result lines."""

from __future__ import annotations

import io
import json
from datetime import UTC, datetime
from typing import Any

import pytest
from hypothesis import given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from engine.base import ModelSpec
from engine.echo import EchoEngine
from engine.endpoints import MESSAGES, anthropic_error, check_body, usage_of
from jobs.formats import anthropic
from jobs.formats.prompts import dedup_key, prompt_text
from jobs.formats.wire import (
    Code,
    LineError,
    RequestLine,
    failure_line,
    parse_line,
    response_line,
)
from jobs.lib.errors import ServiceError
from jobs.models import Batch
from jobs.policy.quality import LENGTH, flags_for
from jobs.services.message_batches import iter_requests
from jobs.templatetags.dashboard import request_text, response_text

CAP = 1000
BASE = {"model": "echo-test", "max_tokens": 10,
        "messages": [{"role": "user", "content": "hello there"}]}


def _parse(body: dict[str, Any]) -> RequestLine | LineError:
    line = {"custom_id": "r", "method": "POST", "url": MESSAGES, "body": body}
    return parse_line(json.dumps(line).encode(), max_tokens_cap=CAP)


def test_documented_params_pass() -> None:
    body = {**BASE, "system": [{"type": "text", "text": "Be brief."}], "temperature": 0.5,
            "top_p": 0.9, "top_k": 40, "stop_sequences": ["\n\n"],
            "metadata": {"user_id": "u1"}, "stream": False,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                         {"role": "assistant", "content": "Hello"},
                         {"role": "user", "content": "again"}]}
    parsed = _parse(body)
    assert isinstance(parsed, RequestLine) and parsed.refused is None


@pytest.mark.parametrize(("change", "param", "fragment"), [
    ({"max_tokens": None}, "body.max_tokens", "Missing"),
    ({"max_tokens": 0}, "body.max_tokens", "positive"),
    ({"max_tokens": CAP + 1}, "body.max_tokens", "at most"),
    ({"temperature": 1.5}, "body.temperature", "between 0 and 1"),
    ({"top_k": -1}, "body.top_k", "non-negative"),
    ({"stop_sequences": "x"}, "body.stop_sequences", "strings"),
    ({"messages": []}, "body.messages", "non-empty"),
    ({"messages": [{"role": "system", "content": "x"}]}, "body.messages[0].role", "system"),
    ({"messages": [{"role": "user", "content": [{"type": "video"}]}]},
     "body.messages[0].content[0].type", "one of"),
    ({"system": [{"type": "image"}]}, "body.system[0].type", "text"),
    ({"stream": True}, "body.stream", "Streaming"),
    ({"container": "c"}, "body.container", "not supported"),
    ({"mcp_servers": []}, "body.mcp_servers", "not supported"),
    ({"kv_transfer_params": {}}, "body.kv_transfer_params", "not a parameter"),
    ({"vllm_xargs": {}}, "body.vllm_xargs", "not a parameter"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "url", "url": "http://169.254.169.254/x.png"}}]}]},
     "body.messages[0].content[0]", "not allowed"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                 "content": [{"type": "image", "source": {
                                                     "type": "url",
                                                     "url": "http://10.0.0.1/x.png"}}]}]}]},
     "body.messages[0].content[0].content[0]", "not allowed"),
])
def test_a_bad_param_is_answered_per_request(change: dict, param: str, fragment: str) -> None:
    body = {**BASE, **change}
    body = {k: v for k, v in body.items() if v is not None}
    parsed = _parse(body)
    # The line stays in the batch (the batch does not fail); its shard answers it.
    assert isinstance(parsed, RequestLine)
    assert parsed.refused is not None
    assert parsed.refused.param == param
    assert fragment in parsed.refused.message
    assert check_body(MESSAGES, body, max_tokens_cap=CAP) == parsed.refused
    assert dedup_key(parsed) is None
    assert prompt_text(parsed) == ("", 0)


@pytest.mark.parametrize("model", [None, "", 3])
def test_a_bad_model_still_fails_the_batch(model: Any) -> None:
    body = {**BASE, "model": model} if model is not None else {
        k: v for k, v in BASE.items() if k != "model"}
    assert isinstance(_parse(body), LineError)


def test_prompt_text_of_a_messages_request() -> None:
    parsed = _parse({**BASE, "system": "Be brief.",
                     "messages": [{"role": "user", "content": [
                         {"type": "text", "text": "one"},
                         {"type": "image", "source": {"type": "base64", "data": "AAAA",
                                                      "media_type": "image/png"}}]}]})
    assert isinstance(parsed, RequestLine)
    assert prompt_text(parsed)[0] == "Be brief.\none"


def test_usage_of_a_message_counts_the_cache_parts() -> None:
    body = {"type": "message", "usage": {"input_tokens": 7, "output_tokens": 3,
                                         "cache_read_input_tokens": 5,
                                         "cache_creation_input_tokens": 1}}
    assert usage_of(MESSAGES, body) == (13, 3, 5)


# --- the create body, read as a stream ---


class _Trickle(io.RawIOBase):
    """A body that answers a few bytes per read, as a slow client would."""

    def __init__(self, data: bytes, step: int = 7) -> None:
        self.data, self.step, self.at = data, step, 0

    def read(self, size: int = -1, /) -> bytes:
        chunk = self.data[self.at:self.at + min(self.step, size if size > 0 else self.step)]
        self.at += len(chunk)
        return chunk


def test_requests_are_read_one_at_a_time() -> None:
    requests = [{"custom_id": f"r{i}", "params": {**BASE, "text": "é" * i}} for i in range(30)]
    data = json.dumps({"requests": requests}, indent=1).encode()
    assert list(iter_requests(io.BytesIO(data), limit=len(data))) == requests
    assert list(iter_requests(_Trickle(data), limit=len(data))) == requests


@pytest.mark.parametrize(("data", "fragment"), [
    (b'{"requests": [{"a": NaN}]}', "not valid JSON"),
    (b'{"requests": [1, 2', "not valid JSON"),
    (b'{"requests": []} x', "after the object"),
    (b'{"other": []}', "Extra inputs"),
    (b'{}', "Field required"),
    (b'\xff{}', "UTF-8"),
])
def test_a_malformed_body_is_refused(data: bytes, fragment: str) -> None:
    with pytest.raises(ServiceError) as caught:
        list(iter_requests(io.BytesIO(data), limit=1000))
    assert fragment in caught.value.message


class _Counted(io.BytesIO):
    """A body that counts what is read of it."""

    reads = 0
    read_bytes = 0

    def read(self, size: int | None = -1, /) -> bytes:
        chunk = super().read(size)
        self.reads += 1
        self.read_bytes += len(chunk)
        return chunk


def test_a_long_number_is_read_in_growing_steps() -> None:
    # Each step reads as much again as is pending and searches only the new text for the
    # number's end: a few reads for a megabyte, not one per 64 kB, each searching it all.
    number = "0." + "0" * (1 << 20) + "1"
    body = _Counted(f'{{"requests": [{number}, 2]}}'.encode())
    assert list(iter_requests(body, limit=1 << 24)) == [float(number), 2]
    assert body.reads <= 8


def test_reading_stops_once_a_value_passes_the_request_limit(settings) -> None:
    settings.BATCHWEB = {**settings.BATCHWEB, "MAX_LINE_BYTES": 64 * 1024}
    for value in ("1" * (4 << 20), '"' + "x" * (4 << 20) + '"'):
        body = _Counted(f'{{"requests": [{value}]}}'.encode())
        with pytest.raises(ServiceError) as caught:
            list(iter_requests(body, limit=1 << 24))
        assert (caught.value.status, caught.value.code) == (413, "request_too_large")
        assert body.read_bytes <= 4 * 64 * 1024, value[:3]


def test_a_body_over_the_limit_is_413() -> None:
    data = json.dumps({"requests": [{"custom_id": "a", "params": BASE}] * 50}).encode()
    with pytest.raises(ServiceError) as caught:
        list(iter_requests(io.BytesIO(data), limit=len(data) - 1))
    assert (caught.value.status, caught.value.code) == (413, "request_too_large")


# --- the translation ---


def _message() -> dict[str, Any]:
    status, body = EchoEngine(ModelSpec(name="echo-test", backend="echo")).handle(
        MESSAGES, BASE)
    assert status == 200
    return body


def _translated(raw: bytes) -> dict[str, Any]:
    line = anthropic.result_line(raw.rstrip(b"\n"))
    assert line is not None and line.endswith(b"\n")
    parsed = json.loads(line)
    # The client's own type (imported here: the SDK takes ~2 s to import).
    from anthropic.types.messages import MessageBatchIndividualResponse

    MessageBatchIndividualResponse.model_validate(parsed)
    return parsed


def test_a_success_is_succeeded_with_the_message() -> None:
    message = _message()
    line = _translated(response_line("a", 200, message))
    assert line == {"custom_id": "a", "result": {"type": "succeeded", "message": message}}
    assert message["content"] == [{"type": "text", "text": "echo: hello there"}]
    assert message["stop_reason"] == "end_turn"


@pytest.mark.parametrize(("raw", "result"), [
    (failure_line("a", Code.BATCH_CANCELLED, "x"), {"type": "canceled"}),
    (failure_line("a", Code.BATCH_EXPIRED, "x"), {"type": "expired"}),
    (failure_line("a", Code.SHARD_FAILED, "engine died"),
     {"type": "errored", "error": anthropic_error(500, "engine died")}),
    (failure_line("a", Code.INVALID_PARAMETER, "body.top_k must be..."),
     {"type": "errored", "error": anthropic_error(400, "body.top_k must be...")}),
    (response_line("a", 400, anthropic_error(400, "too long")),
     {"type": "errored", "error": {"type": "error", "error": {
         "type": "invalid_request_error", "message": "too long"}}}),
    # An OpenAI-shaped error body (vLLM's for an exception) becomes Anthropic's.
    (response_line("a", 500, {"error": {"message": "boom", "type": "InternalServerError",
                                        "param": None, "code": 500}}),
     {"type": "errored", "error": anthropic_error(500, "boom")}),
])
def test_error_lines_translate(raw: bytes, result: dict[str, Any]) -> None:
    assert _translated(raw) == {"custom_id": "a", "result": result}


def test_an_unreadable_line_is_skipped() -> None:
    assert anthropic.result_line(b"not json") is None


def _batch(**fields: Any) -> Batch:
    now = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
    return Batch(id="msgbatch_x", api=Batch.Api.ANTHROPIC, endpoint=MESSAGES, total=5,
                 created_at=now, expires_at=now.replace(day=2), **fields)


@pytest.mark.parametrize(("status", "processing"), [
    ("validating", "in_progress"), ("in_progress", "in_progress"),
    ("finalizing", "in_progress"), ("cancelling", "canceling"), ("completed", "ended"),
    ("failed", "ended"), ("expired", "ended"), ("cancelled", "ended")])
def test_processing_status(status: str, processing: str) -> None:
    assert anthropic.PROCESSING_STATUS[Batch.Status(status)] == processing


def test_a_running_batch_counts_every_request_processing() -> None:
    from anthropic.types.messages import MessageBatch

    shown = anthropic.message_batch(_batch(status="in_progress", completed=3, failed=1),
                                    base_url="http://h:1/")
    MessageBatch.model_validate(shown)
    assert shown["request_counts"] == {"processing": 5, "succeeded": 0, "errored": 0,
                                       "canceled": 0, "expired": 0}
    assert shown["results_url"] is None and shown["ended_at"] is None
    assert shown["created_at"] == "2026-12-01T12:00:00Z"
    assert shown["expires_at"] == "2026-12-02T12:00:00Z"


def test_an_ended_batch_counts_by_outcome() -> None:
    from anthropic.types.messages import MessageBatch

    ended = datetime(2026, 12, 1, 13, 0, tzinfo=UTC)
    shown = anthropic.message_batch(
        _batch(status="completed", completed=4, failed=1, completed_at=ended),
        base_url="http://h:1/")
    MessageBatch.model_validate(shown)
    assert shown["request_counts"] == {"processing": 0, "succeeded": 4, "errored": 1,
                                       "canceled": 0, "expired": 0}
    assert shown["ended_at"] == "2026-12-01T13:00:00Z"
    assert shown["results_url"] == "http://h:1/v1/messages/batches/msgbatch_x/results"
    failed = anthropic.request_counts(_batch(status="failed"))
    assert failed["errored"] == 5


def test_dashboard_previews_and_flags_read_messages() -> None:
    line = {"custom_id": "a", "url": MESSAGES,
            "body": {**BASE, "system": "Be brief.",
                     "messages": [{"role": "user", "content": [{"type": "text",
                                                                "text": "hi"}]}]}}
    assert request_text(line) == "system: Be brief.\nuser: hi"
    message = _message()
    assert response_text(message) == "echo: hello there"
    assert response_text(anthropic_error(400, "too long")) == "too long"
    cut = {**message, "stop_reason": "max_tokens"}
    assert flags_for(MESSAGES, BASE, cut) == [LENGTH]


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(), lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=20)


@hypothesis_settings(max_examples=200, deadline=None)
@given(st.lists(_json, max_size=6), st.sampled_from([None, 0, 2]), st.integers(1, 40),
       st.booleans())
def test_the_stream_reads_what_json_reads(items, indent, step, ascii_only) -> None:
    data = json.dumps({"requests": items}, indent=indent, ensure_ascii=ascii_only).encode()
    assert list(iter_requests(_Trickle(data, step), limit=len(data))) == items


@pytest.mark.parametrize(("message", "param", "named", "named_param"), [
    ("body.temperature must be between 0 and 1.", "body.temperature",
     "params.temperature must be between 0 and 1.", "params.temperature"),
    ("body.messages[0] must be an object with role 'user' or 'assistant' (the system "
     "prompt is body.system).", "body.messages[0].role",
     "params.messages[0] must be an object with role 'user' or 'assistant' (the system "
     "prompt is params.system).", "params.messages[0].role"),
    # What the user sent is quoted as sent; other words are not field paths.
    ("The model 'body.x' is not served here; nobody.y", "body.model",
     "The model 'body.x' is not served here; nobody.y", "params.model"),
    ("Missing custom_id.", "custom_id", "Missing custom_id.", "custom_id"),
])
def test_a_message_batch_request_problem_names_its_params(message, param, named,
                                                          named_param):
    assert anthropic.params_named(LineError("invalid_parameter", message, param)) == \
        LineError("invalid_parameter", named, named_param)
