"""The JSON retry (`jobs.worker.retry`): which results are run once more, and the request of
that second run (a new seed, the first run's adapter folder, cache salt and output room)."""

from __future__ import annotations

from engine.base import EngineResult, ModelSpec
from engine.echo import EchoEngine
from jobs.formats.wire import RequestLine
from jobs.worker.retry import is_retry, needs_json_retry, reseeded, retry_request

URL = "/v1/chat/completions"
JSON_OBJECT = {"type": "json_object"}


def chat(text: str, **body: object) -> RequestLine:
    return RequestLine(custom_id="c", url=URL, body={
        "model": "echo-test", "messages": [{"role": "user", "content": text}], **body})


def echoed(line: RequestLine) -> EngineResult:
    engine = EchoEngine(ModelSpec(name="echo-test", backend="echo", options={}))
    status, body = engine.handle(line.url, line.body)
    return EngineResult(request_id="s:1:0", status_code=status, body=body)


def with_content(result: EngineResult, content: str) -> EngineResult:
    """The engine's answer, its text replaced (the echo engine never answers in JSON)."""
    choice = {**result.body["choices"][0]}
    choice["message"] = {**choice["message"], "content": content}
    return EngineResult(request_id=result.request_id, status_code=200,
                        body={**result.body, "choices": [choice]})


def test_an_answer_that_is_not_the_json_asked_for_is_run_again():
    line = chat("not json", response_format=JSON_OBJECT)
    result = echoed(line)
    assert needs_json_retry(line, result)
    assert not needs_json_retry(line, with_content(result, '{"a": 1}'))
    # A JSON value that is not an object is not what json_object asked for.
    assert needs_json_retry(line, with_content(result, "[1, 2]"))


def test_a_schema_the_answer_does_not_match_is_run_again():
    schema = {"type": "json_schema", "json_schema": {"name": "n", "schema": {
        "type": "object", "required": ["a"], "properties": {"a": {"type": "integer"}}}}}
    line = chat("x", response_format=schema)
    result = echoed(line)
    assert not needs_json_retry(line, with_content(result, '{"a": 1}'))
    assert needs_json_retry(line, with_content(result, '{"a": "one"}'))


def test_no_retry_without_a_json_format_or_for_a_failed_request():
    plain = chat("not json")
    assert not needs_json_retry(plain, echoed(plain))
    line = chat("not json", response_format=JSON_OBJECT)
    failed = EngineResult(request_id="s:1:0", status_code=400, body={"error": {}})
    assert not needs_json_retry(line, failed)


def test_the_second_run_has_a_new_seed_and_the_first_runs_settings():
    line = chat("x", response_format=JSON_OBJECT, seed=41)
    retry = retry_request("s:1:0", line, "/models/lora-a", cache_salt="salt",
                          output_room=99)
    assert retry.request_id == "s:1:0r" and is_retry(retry.request_id)
    assert not is_retry("s:1:0")
    assert retry.body == {**line.body, "seed": 42} and line.body["seed"] == 41
    assert (retry.url, retry.adapter_path, retry.cache_salt, retry.output_room) == (
        URL, "/models/lora-a", "salt", 99)


def test_a_request_without_an_integer_seed_gets_seed_1():
    assert reseeded({"model": "m"}) == {"model": "m", "seed": 1}
    assert reseeded({"seed": None})["seed"] == 1


def test_a_responses_request_asks_for_json_in_its_text_format():
    line = RequestLine(custom_id="c", url="/v1/responses", body={
        "model": "echo-test", "input": "not json", "text": {"format": {"type": "json_object"}}})
    assert needs_json_retry(line, echoed(line))
    plain = RequestLine(custom_id="c", url="/v1/responses",
                        body={"model": "echo-test", "input": "not json"})
    assert not needs_json_retry(plain, echoed(plain))
