"""Property-based tests (hypothesis): the line validator never crashes and accepts exactly
the well-formed requests; a whole file's check agrees with the lines one by one; the API
answers any input with a documented response, never a 5xx."""

from __future__ import annotations

import io
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jobs.formats.wire import MAX_CUSTOM_ID_CHARS, Code, LineError, RequestLine, parse_line
from jobs.services.files import clean_filename
from jobs.services.validation import check_input
from jobs.storage.lines import iter_lines

CAP = 32_768
CODES = {v for k, v in vars(Code).items() if not k.startswith("_")}
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
EMBEDDINGS = "/v1/embeddings"
MODEL = "echo-test"

json_scalars = (st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
                | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20))
json_values = st.recursive(
    json_scalars,
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=20)

# Any text but NUL (refused: PostgreSQL cannot store it), not blank.
custom_ids = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), min_size=1,
                     max_size=60).filter(lambda s: s.strip())
messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant"]),
     "content": st.text(max_size=50)}), min_size=1, max_size=3)
chat_bodies = st.fixed_dictionaries(
    {"model": st.just(MODEL), "messages": messages},
    optional={"max_tokens": st.integers(1, CAP), "temperature": st.floats(0, 2),
              "top_p": st.floats(0.01, 1), "n": st.integers(1, 128), "seed": st.integers(),
              "stop": st.text(max_size=5)})


@st.composite
def valid_requests(draw: Any) -> dict[str, Any]:
    url = draw(st.sampled_from([CHAT, COMPLETIONS, EMBEDDINGS]))
    if url == CHAT:
        body = draw(chat_bodies)
    elif url == COMPLETIONS:
        body = {"model": MODEL, "prompt": draw(st.text(min_size=1, max_size=50)),
                "max_tokens": draw(st.integers(1, CAP))}
    else:
        body = {"model": MODEL, "input": draw(st.text(min_size=1, max_size=50)
                                              | st.lists(st.text(), min_size=1, max_size=3))}
    return {"custom_id": draw(custom_ids), "method": "POST", "url": url, "body": body}


def encode(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False).encode()


# --- parse_line ---


@given(st.binary(max_size=300))
def test_any_bytes_give_a_request_or_a_line_error(raw: bytes) -> None:
    result = parse_line(raw, max_tokens_cap=CAP)
    assert isinstance(result, RequestLine | LineError)
    if isinstance(result, LineError):
        assert result.code in CODES and result.message


@given(json_values)
def test_any_json_gives_a_request_or_a_line_error(value: Any) -> None:
    result = parse_line(encode(value), max_tokens_cap=CAP)
    if isinstance(result, LineError):
        assert result.code in CODES and result.message
        return
    # Whatever passes is a well-formed request.
    assert isinstance(value, dict)
    assert value["method"] == "POST"
    assert isinstance(result.custom_id, str) and result.custom_id.strip()
    assert len(result.custom_id) <= MAX_CUSTOM_ID_CHARS
    assert result.url in (CHAT, COMPLETIONS, EMBEDDINGS)
    assert isinstance(result.body, dict) and isinstance(result.model, str) and result.model


@given(valid_requests())
def test_valid_requests_are_accepted_as_sent(line: dict[str, Any]) -> None:
    result = parse_line(encode(line), max_tokens_cap=CAP)
    assert isinstance(result, RequestLine), result
    assert (result.custom_id, result.url, result.body) == (
        line["custom_id"], line["url"], line["body"])


BREAKS = [
    # (where, key, bad values, expected code)
    ("line", "custom_id", [None], Code.MISSING_PARAMETER),
    ("line", "custom_id", [1, 1.5, True, [], {}, "", " \t", "x" * 513], Code.INVALID_CUSTOM_ID),
    ("line", "method", [None, "GET", "post", 1], Code.INVALID_METHOD),
    ("line", "url", [None, "/v1/images", "", 1, CHAT + "/"], Code.INVALID_URL),
    ("line", "body", [None, [], "x", 1], Code.INVALID_BODY),
    ("body", "model", [None], Code.MISSING_PARAMETER),
    ("body", "model", ["", 1, []], Code.INVALID_BODY),
    ("body", "max_tokens", [0, -1, CAP + 1, 1.0, "5", True], Code.INVALID_PARAMETER),
    ("body", "stream", [True, 1], Code.INVALID_PARAMETER),
]


@given(valid_requests(), st.sampled_from(BREAKS), st.data())
def test_one_broken_field_gives_its_error(line: dict[str, Any], rule: tuple, data: Any) -> None:
    where, key, bad_values, code = rule
    value = data.draw(st.sampled_from(bad_values))
    target = line if where == "line" else line["body"]
    if value is None:
        target.pop(key, None)
    else:
        target[key] = value
    result = parse_line(encode(line), max_tokens_cap=CAP)
    # A body the endpoint refuses is the request's problem; the rest (the model included,
    # which the batch needs) the file's.
    assert isinstance(result, RequestLine) == (where == "body" and key != "model")
    problem = result.refused if isinstance(result, RequestLine) else result
    assert isinstance(problem, LineError)
    assert problem.code == code, (problem, key, value)
    assert problem.param is None or key in problem.param


@given(valid_requests(), st.sampled_from(["NaN", "Infinity", "-Infinity"]))
def test_non_json_numbers_are_refused(line: dict[str, Any], constant: str) -> None:
    text = encode(line)[:-1] + b', "extra": ' + constant.encode() + b"}"
    result = parse_line(text, max_tokens_cap=CAP)
    assert isinstance(result, LineError) and result.code == Code.INVALID_JSON


# --- a whole file ---


@st.composite
def files(draw: Any) -> tuple[list[bytes], list[bool]]:
    """Lines of a chat batch file, each valid or broken, and which are valid on their own
    and within the batch (unique custom_id)."""
    raws: list[bytes] = []
    good: list[bool] = []
    seen: set[str] = set()
    for i in range(draw(st.integers(0, 25))):
        kind = draw(st.sampled_from(["ok", "ok", "ok", "dup", "blank", "junk", "bad"]))
        if kind == "blank":
            raws.append(draw(st.sampled_from([b"", b"  ", b"\t"])))
            good.append(False)
            continue
        cid = f"id-{i}" if kind != "dup" or not seen else draw(st.sampled_from(sorted(seen)))
        line = {"custom_id": cid, "method": "POST", "url": CHAT,
                "body": {"model": MODEL, "messages": [{"role": "user", "content": f"q{i}"}]}}
        if kind == "junk":
            raws.append(draw(st.sampled_from([b"{", b"[]", b"\xff", b"null"])))
            good.append(False)
            continue
        if kind == "bad":
            line["body"]["max_tokens"] = -1
        ok = kind != "bad" and cid not in seen
        if ok:
            seen.add(cid)
        raws.append(encode(line))
        good.append(ok)
    return raws, good


@settings(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(files(), st.sampled_from([b"\n", b"\r\n"]), st.booleans(), st.integers(1, 6))
def test_check_input_agrees_with_the_lines(django_settings_fixture: Any, file: tuple,
                                           newline: bytes, final_newline: bool,
                                           shard_size: int) -> None:
    raws, good = file
    data = newline.join(raws) + (newline if final_newline and raws else b"")
    django_settings_fixture.BATCHWEB = {**django_settings_fixture.BATCHWEB,
                                        "SHARD_SIZE": shard_size}
    # Strict: a broken body is the line's error too (not strict, see test_bad_input.py).
    report = check_input(io.BytesIO(data), endpoint=CHAT, strict=True)
    blank = [not r.strip() for r in raws]
    bad_lines = [i + 1 for i, (g, b) in enumerate(zip(good, blank, strict=True))
                 if not g and not b]
    assert report.requests == sum(good)
    if not report.requests and not bad_lines:
        assert [(e["line"], e["code"]) for e in report.errors] == [(1, Code.EMPTY_FILE)]
        return
    assert [e["line"] for e in report.errors] == bad_lines
    assert report.error_count == len(bad_lines)
    if report.ok and report.requests:
        # Shards cover every request once, in order, as whole-line byte ranges.
        assert sum(s.lines for s in report.shards) == report.requests
        assert all(s.lines <= shard_size for s in report.shards)
        ends = [0] + [s.end_byte for s in report.shards]
        for shard, previous_end in zip(report.shards, ends, strict=False):
            assert shard.start_byte >= previous_end
            assert data[shard.start_byte - 1: shard.start_byte] in (b"", b"\n")
    if not report.ok:
        assert report.shards == []


@pytest.fixture
def django_settings_fixture(settings: Any) -> Any:
    return settings


@given(st.binary(max_size=2000), st.integers(1, 50))
def test_iter_lines_covers_the_stream_exactly(data: bytes, max_line: int) -> None:
    lines = list(iter_lines(io.BytesIO(data), max_line_bytes=max_line))
    position = 0
    for number, line in enumerate(lines, start=1):
        assert line.number == number and line.start == position and line.end > line.start
        chunk = data[line.start:line.end]
        if line.content is not None:
            assert chunk.rstrip(b"\r\n").removeprefix(
                b"\xef\xbb\xbf" if number == 1 else b"") == line.content
            assert len(line.content) <= max_line + 2
        position = line.end
    assert position == len(data)
    assert len(lines) == data.count(b"\n") + (0 if data.endswith(b"\n") or not data else 1)


@given(st.text(max_size=2000))
def test_clean_filename_is_always_safe(name: str) -> None:
    cleaned = clean_filename(name)
    assert 0 < len(cleaned) <= 255
    assert "/" not in cleaned and "\\" not in cleaned
    assert cleaned.isprintable() and cleaned == cleaned.strip()


# --- the API ---

API_SETTINGS = settings(max_examples=60, deadline=None,
                        suppress_health_check=[HealthCheck.function_scoped_fixture,
                                               HealthCheck.too_slow])


@pytest.fixture
def api(db: Any, settings: Any, tmp_path: Any, django_user_model: Any) -> Any:
    from jobs.services.keys import create_api_key
    from tests.factories import Api, use_private_storage

    use_private_storage(settings, tmp_path)
    user = django_user_model.objects.create_user("prop", password="pw")
    client = Api(create_api_key(owner=user, name="p")[1])
    good = json.dumps({"custom_id": "a", "method": "POST", "url": CHAT,
                       "body": {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}})
    client.file_id = client.upload(good.encode() + b"\n").json()["id"]
    return client


def documented(response: Any, ok: tuple[int, ...] = (200,)) -> dict:
    """A 2xx we expected, or an OpenAI error object with a 4xx status: never a 5xx."""
    assert response.status_code < 500, response.content[:300]
    body = response.json()
    if response.status_code not in ok:
        assert 400 <= response.status_code < 500
        assert set(body["error"]) == {"message", "type", "param", "code"}
    return body


create_fields = st.fixed_dictionaries({}, optional={
    "input_file_id": json_values | st.just("{file}"),
    "endpoint": json_values | st.sampled_from([CHAT, COMPLETIONS, EMBEDDINGS]),
    "completion_window": json_values | st.sampled_from(["24h", "1h", "168h", "169h"]),
    "metadata": json_values, "priority": json_values | st.sampled_from(["high", "low"]),
    "output_expires_after": json_values,
})


@API_SETTINGS
@given(body=create_fields | json_values)
def test_create_batch_with_any_body_is_answered(api: Any, body: Any) -> None:
    if isinstance(body, dict) and body.get("input_file_id") == "{file}":
        body["input_file_id"] = api.file_id
    response = api.post_json("/v1/batches", body)
    result = documented(response)
    if response.status_code == 200:
        assert result["status"] == "validating" and result["input_file_id"] == api.file_id


@API_SETTINGS
@given(st.binary(max_size=400), st.text(max_size=80))
def test_upload_of_any_bytes_is_answered(api: Any, content: bytes, filename: str) -> None:
    response = api.upload(content, filename=filename or "x")
    result = documented(response)
    if response.status_code == 200:
        assert result["bytes"] == len(content)
        assert clean_filename(result["filename"]) == result["filename"]
    elif result["error"]["code"] is None:
        # A name that is nothing once sanitized: the multipart parser drops the file.
        assert result["error"]["param"] == "file"
    else:
        assert result["error"]["code"] in ("invalid_file", "line_too_long")


query_values = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]),
                       max_size=12)


@API_SETTINGS
@given(st.sampled_from(["/v1/files", "/v1/batches"]),
       st.dictionaries(st.sampled_from(["limit", "after", "order", "purpose"]), query_values))
def test_lists_with_any_query_are_answered(api: Any, path: str, query: dict) -> None:
    response = api.client.get(path, query, **api.headers)
    result = documented(response)
    if response.status_code == 200:
        assert result["object"] == "list"


@API_SETTINGS
@given(st.sampled_from(["files/{}", "files/{}/content", "batches/{}", "batches/{}/cancel",
                        "uploads/{}/cancel", "uploads/{}/complete", "uploads/{}/parts"]),
       st.text(alphabet=st.characters(codec="utf-8", exclude_characters="/?#",
                                      exclude_categories=["Cs", "Cc"]) | st.just("\x00"),
               min_size=1, max_size=60))
def test_any_object_id_is_answered(api: Any, template: str, object_id: str) -> None:
    from urllib.parse import quote

    path = "/v1/" + template.format(quote(object_id, safe=""))
    method = "post" if template.endswith(("cancel", "complete", "parts")) else "get"
    response = api.get(path) if method == "get" else api.post_json(path, {})
    if response.status_code == 404 and not response["Content-Type"].startswith(
            "application/json"):
        return  # Django's own 404 for a path the URLconf does not match ("." or "..")
    documented(response)
    if object_id != api.file_id:
        assert response.status_code in (400, 404), response.content[:200]


def test_unpaired_surrogate_escape_is_a_line_error() -> None:
    # Valid JSON, not Unicode: found by the property test above (custom_id "\ud800").
    line = {"custom_id": "x", "method": "POST", "url": COMPLETIONS,
            "body": {"model": MODEL, "prompt": "p"}}
    lone = json.dumps({**line, "custom_id": "\ud800"}).encode()
    paired = json.dumps({**line, "custom_id": "\U0001f600"}).encode()  # "\ud83d\ude00"
    error = parse_line(lone, max_tokens_cap=100)
    assert isinstance(error, LineError) and error.code == "invalid_encoding"
    assert parse_line(paired, max_tokens_cap=100).custom_id == "\U0001f600"
