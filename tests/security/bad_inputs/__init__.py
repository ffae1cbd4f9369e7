"""The malformed-input corpus: every case with the documented answer it must get.

- FILE_CASES: uploads POST /v1/files refuses at once (400 or 413), storing nothing.
- LENIENT_CASES: irregular files the service documents as accepted (CRLF, BOM, no final
  newline, blank lines, hostile filenames), with what they must become.
- LINE_CASES: valid JSONL whose lines break the request rules: the file is stored, and the
  batch ends `failed` with exactly these errors.data entries (line, code), and no shard.
- BATCH_CASES, LIST_CASES, UPLOAD_CREATE_CASES: requests the API refuses (400/404/413).
- UPLOAD_FLOW_CASES (in test_bad_input.py, they need parts first): the Uploads API refusing
  parts and completions.

Run by tests/security/test_bad_input.py; `len(ALL_CASES)` is the number the note reports.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass, field
from typing import Any

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
EMBEDDINGS = "/v1/embeddings"
SCORE = "/v1/score"
RERANK = "/v1/rerank"
MODEL = "echo-test"
DROP = object()  # an override that removes the key


def request(cid: str = "r", **overrides: Any) -> dict[str, Any]:
    """A valid chat request line; `body__x=...` overrides a body field, DROP removes."""
    line: dict[str, Any] = {
        "custom_id": cid, "method": "POST", "url": CHAT,
        "body": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                 "max_tokens": 5}}
    for key, value in overrides.items():
        target, name = (line["body"], key[6:]) if key.startswith("body__") else (line, key)
        if value is DROP:
            target.pop(name, None)
        else:
            target[name] = value
    return line


def raw(obj: Any) -> bytes:
    return json.dumps(obj).encode()


def jsonl(*lines: Any) -> bytes:
    return b"".join((x if isinstance(x, bytes) else raw(x)) + b"\n" for x in lines)


GOOD = jsonl(request("a"), request("b"))


def deep(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


# --- files refused at upload ---


@dataclass(frozen=True)
class FileCase:
    name: str
    content: bytes
    status: int = 400
    code: str | None = "invalid_file"
    param: str | None = "file"
    fragment: str = ""
    filename: str = "in.jsonl"
    purpose: Any = "batch"
    fields: dict[str, Any] = field(default_factory=dict)
    limits: dict[str, int] = field(default_factory=dict)  # settings.BATCHWEB overrides


FILE_CASES = [
    FileCase("empty file", b"", fragment="no requests"),
    FileCase("only blank lines", b"\n\n   \n\t\n", fragment="no requests"),
    FileCase("only CRLF blank lines", b"\r\n\r\n", fragment="no requests"),
    FileCase("invalid UTF-8", jsonl(request("a")) + b'{"custom_id": "\xff\xfe"}\n',
             fragment="Line 2 is not UTF-8 text."),
    FileCase("UTF-16 with BOM", "\ufeff".encode("utf-16") + raw(request()).decode()
             .encode("utf-16-le"), fragment="not UTF-8"),
    FileCase("a JSON array of requests", raw([request("a"), request("b")]) + b"\n",
             fragment="Line 1 is not a JSON object"),
    FileCase("a JSON string line", jsonl(request("a"), "just text"),
             fragment="Line 2 is not a JSON object"),
    FileCase("a JSON number line", jsonl(request("a")) + b"42\n",
             fragment="Line 2 is not a JSON object"),
    FileCase("null line", b"null\n", fragment="Line 1 is not a JSON object"),
    FileCase("invalid JSON", jsonl(request("a")) + b'{"custom_id": "b",\n',
             fragment="Line 2 is not valid JSON"),
    FileCase("single quotes", b"{'custom_id': 'a'}\n", fragment="Line 1 is not valid JSON"),
    FileCase("trailing garbage", raw(request("a")) + b" xyz\n",
             fragment="Line 1 is not valid JSON"),
    FileCase("pretty-printed JSON over lines", json.dumps(request("a"), indent=2).encode(),
             fragment="Line 1 is not valid JSON"),
    FileCase("NaN is not JSON", b'{"custom_id": NaN}\n', fragment="Line 1 is not valid JSON"),
    FileCase("deeply nested JSON", deep(200_000) + b"\n", fragment="Line 1 is not valid JSON"),
    FileCase("deeply nested body", b'{"custom_id": "a", "body": ' + deep(100_000) + b"}\n",
             fragment="Line 1 is not valid JSON"),
    FileCase("gzip file", gzip.compress(GOOD), fragment="not UTF-8"),
    FileCase("binary file (PNG)", b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 8,
             fragment="not UTF-8"),
    FileCase("NUL bytes", b"\x00" * 64 + b"\n", fragment="Line 1 is not valid JSON"),
    FileCase("a 10 MB line", b'{"custom_id": "a", "pad": "' + b"x" * (10 * 1024 * 1024)
             + b'"}\n', code="line_too_long", fragment="Line 1 is longer than"),
    FileCase("more lines than allowed", jsonl(*[request(f"r{i}") for i in range(11)]),
             code="too_many_requests", fragment="at most 10",
             limits={"MAX_REQUESTS_PER_BATCH": 10}),
    FileCase("file over the size limit", GOOD * 50, status=413, code="file_too_large",
             limits={"MAX_FILE_BYTES": 1000}),
    FileCase("bad purpose", GOOD, code=None, param="purpose", purpose="fine-tune"),
    FileCase("purpose batch_output", GOOD, code=None, param="purpose", purpose="batch_output"),
    FileCase("missing purpose", GOOD, code=None, param="purpose", purpose=None),
    FileCase("bad expires_after anchor", GOOD, code=None, param="expires_after.anchor",
             fields={"expires_after[anchor]": "last_access", "expires_after[seconds]": "3600"}),
    FileCase("expires_after too short", GOOD, code=None, param="expires_after.seconds",
             fields={"expires_after[anchor]": "created_at", "expires_after[seconds]": "60"}),
    FileCase("expires_after not a number", GOOD, code=None, param="expires_after.seconds",
             fields={"expires_after[anchor]": "created_at", "expires_after[seconds]": "soon"}),
    FileCase("expires_after not JSON", GOOD, code=None, param="expires_after",
             fields={"expires_after": "{oops"}),
    # A real client sends the whole name in the part's headers, over Django's 1 kB limit
    # for them: refused with a clear error rather than a 500.
    FileCase("1,000-character filename", GOOD, code=None, filename="a" * 995 + ".json",
             fragment="multipart body could not be read"),
]


# --- irregular but documented as accepted ---


@dataclass(frozen=True)
class LenientCase:
    name: str
    content: bytes
    requests: int  # request lines counted (File.line_count and the batch's total)
    filename: str = "in.jsonl"
    shown_name: str | None = "in.jsonl"  # the cleaned name; None: only check it is safe


LENIENT_CASES = [
    LenientCase("CRLF line endings", jsonl(request("a"), request("b")).replace(b"\n", b"\r\n"),
                2),
    LenientCase("UTF-8 BOM", b"\xef\xbb\xbf" + jsonl(request("a"), request("b")), 2),
    LenientCase("no final newline", jsonl(request("a"), request("b"))[:-1], 2),
    LenientCase("blank lines between", b"\n" + jsonl(request("a")) + b"\n  \n" +
                jsonl(request("b")), 2),
    LenientCase("path traversal filename", GOOD, 2, filename="../../../etc/passwd",
                shown_name="passwd"),
    LenientCase("windows path filename", GOOD, 2, filename="..\\..\\boot.ini",
                shown_name="boot.ini"),
    LenientCase("300-character filename", GOOD, 2, filename="a" * 295 + ".json",
                shown_name="a" * 250 + ".json"),  # Django keeps 255 characters
    LenientCase("control characters in filename", GOOD, 2, filename="in\x07\x1b[31m\x7f.jsonl",
                shown_name=None),
    LenientCase("script tag filename", GOOD, 2, filename="<script>alert(1)</script>.jsonl",
                shown_name=None),
]


# --- lines that break the request rules: the batch fails validation ---


@dataclass(frozen=True)
class LineCase:
    name: str
    content: bytes
    errors: list[tuple[int, str]]  # errors.data as (line, code), in order
    endpoint: str = CHAT


def _bad(name: str, *overrides_list: dict[str, Any], code: str) -> LineCase:
    """A valid first line, then one line per overrides dict, each expected to fail."""
    lines = [request("ok")] + [request(f"bad{i}", **o) for i, o in enumerate(overrides_list)]
    return LineCase(name, jsonl(*lines), [(i + 2, code) for i in range(len(overrides_list))])


LINE_CASES = [
    _bad("missing custom_id", {"custom_id": DROP}, code="missing_required_parameter"),
    _bad("null custom_id", {"custom_id": None}, code="missing_required_parameter"),
    _bad("non-string custom_id", {"custom_id": 7}, {"custom_id": ["a"]}, {"custom_id": True},
         code="invalid_custom_id"),
    _bad("empty custom_id", {"custom_id": ""}, {"custom_id": "   "}, code="invalid_custom_id"),
    _bad("10 kB custom_id", {"custom_id": "x" * 10_000}, code="invalid_custom_id"),
    _bad("NUL in custom_id", {"custom_id": "a\x00b"}, code="invalid_custom_id"),
    LineCase("duplicate custom_ids", jsonl(request("a"), request("b"), request("a"),
                                           request("b")),
             [(3, "duplicate_custom_id"), (4, "duplicate_custom_id")]),
    _bad("wrong method", {"method": "GET"}, {"method": "post"}, {"method": DROP},
         code="invalid_method"),
    _bad("unknown url", {"url": "/v1/images/generations"}, {"url": "v1/chat/completions"},
         {"url": DROP}, {"url": 3}, code="invalid_url"),
    _bad("mixed urls", {"url": COMPLETIONS, "body": {"model": MODEL, "prompt": "x"}},
         code="mismatched_endpoint"),
    _bad("unknown model", {"body__model": "gpt-9"}, code="model_not_found"),
    _bad("NUL in model name", {"body__model": "echo\x00test"}, code="model_not_found"),
    LineCase("model that does not serve the endpoint",
             jsonl({"custom_id": "e", "method": "POST", "url": EMBEDDINGS,
                    "body": {"model": "SmolLM2-135M-Instruct", "input": "x"}}),
             [(1, "model_not_found")], endpoint=EMBEDDINGS),
    _bad("missing model", {"body__model": DROP}, code="missing_required_parameter"),
    _bad("non-string model", {"body__model": 5}, {"body__model": ""}, code="invalid_body"),
    _bad("body not an object", {"body": [1]}, {"body": "text"}, {"body": None},
         {"body": DROP}, code="invalid_body"),
    _bad("messages malformed", {"body__messages": DROP}, {"body__messages": []},
         {"body__messages": "hi"}, {"body__messages": ["hi"]}, {"body__messages": [{}]},
         {"body__messages": [{"role": 1, "content": "x"}]},
         {"body__messages": [{"role": "user", "content": 5}]}, code="invalid_body"),
    LineCase("empty prompt", jsonl({"custom_id": "p", "method": "POST", "url": COMPLETIONS,
                                    "body": {"model": MODEL, "prompt": ""}}),
             [(1, "invalid_body")], endpoint=COMPLETIONS),
    LineCase("empty embeddings input",
             jsonl({"custom_id": "e", "method": "POST", "url": EMBEDDINGS,
                    "body": {"model": MODEL, "input": []}}),
             [(1, "invalid_body")], endpoint=EMBEDDINGS),
    LineCase("score sides that cannot be paired",
             jsonl({"custom_id": "s", "method": "POST", "url": SCORE,
                    "body": {"model": MODEL, "queries": ["a", "b"], "documents": ["c"]}},
                   {"custom_id": "t", "method": "POST", "url": SCORE,
                    "body": {"model": MODEL, "queries": "a", "documents": []}},
                   {"custom_id": "u", "method": "POST", "url": SCORE,
                    "body": {"model": MODEL, "text_1": "a", "documents": ["c"]}}),
             [(1, "invalid_body"), (2, "invalid_body"), (3, "invalid_body")], endpoint=SCORE),
    LineCase("rerank without its query or with a bad top_n",
             jsonl({"custom_id": "r", "method": "POST", "url": RERANK,
                    "body": {"model": MODEL, "documents": ["c"]}},
                   {"custom_id": "q", "method": "POST", "url": RERANK,
                    "body": {"model": MODEL, "query": "a", "documents": ["c"], "top_n": 0}}),
             [(1, "missing_required_parameter"), (2, "invalid_parameter")], endpoint=RERANK),
    _bad("negative or zero max_tokens", {"body__max_tokens": -5}, {"body__max_tokens": 0},
         code="invalid_parameter"),
    _bad("huge max_tokens", {"body__max_tokens": 10**12}, {"body__max_completion_tokens": 10**6},
         code="invalid_parameter"),
    _bad("non-integer max_tokens", {"body__max_tokens": 1.5}, {"body__max_tokens": "10"},
         {"body__max_tokens": True}, code="invalid_parameter"),
    _bad("bad n", {"body__n": 0}, {"body__n": 1000}, code="invalid_parameter"),
    _bad("bad temperature", {"body__temperature": 3}, {"body__temperature": -1},
         {"body__temperature": "hot"}, code="invalid_parameter"),
    _bad("bad top_p", {"body__top_p": 0}, {"body__top_p": 1.5}, code="invalid_parameter"),
    _bad("streaming", {"body__stream": True}, code="invalid_parameter"),
    _bad("undocumented body fields", {"body__chat_template": "{{ 7 * 7 }}"},
         {"body__kv_transfer_params": {"do_remote_decode": True}}, {"body__priority": -100},
         {"body__vllm_xargs": {"a": 1}}, {"body__temperatur": 0}, code="invalid_parameter"),
    LineCase("undocumented fields of other endpoints",
             jsonl({"custom_id": "c", "method": "POST", "url": COMPLETIONS,
                    "body": {"model": MODEL, "prompt": "x", "prompt_embeds": "AAAA"}}),
             [(1, "invalid_parameter")], endpoint=COMPLETIONS),
    _bad("media URL of a domain not allowed",
         {"body__messages": [{"role": "user", "content": [
             {"type": "text", "text": "what is this?"},
             {"type": "image_url", "image_url": {"url": "http://169.254.169.254/latest/x"}}]}]},
         {"body__messages": [{"role": "user", "content": [
             {"type": "video_url", "video_url": {"url": "https://example.com/v.mp4"}}]}]},
         {"body__messages": [{"role": "user", "content": [
             {"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]}]},
         {"body__messages": [{"role": "user", "content": [
             {"type": "image_embeds", "image_embeds": "AAAA"}]}]},
         code="invalid_parameter"),
    LineCase("errors counted by physical line", b"\n" + jsonl(request("a")) + b"\n" +
             jsonl(request("a")), [(4, "duplicate_custom_id")]),
    LineCase("line too long inside the limit file", jsonl(request("a")) +
             b'{"custom_id": "' + b"y" * 3000 + b'"}\n',
             [(2, "line_too_long")]),  # MAX_LINE_BYTES lowered to 2,000 for this case
]
LINE_LIMITS = {"line too long inside the limit file": {"MAX_LINE_BYTES": 2000}}


# --- API requests refused ---


@dataclass(frozen=True)
class ApiCase:
    name: str
    method: str
    path: str  # "{file}" is replaced by a good input file's id, "{other}" by another user's
    body: Any = None  # JSON (dict/list/str) or raw bytes with content_type
    content_type: str = "application/json"
    status: int = 400
    param: str | None = None
    code: str | None = None


def create(**fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"input_file_id": "{file}", "endpoint": CHAT,
                            "completion_window": "24h"}
    for key, value in fields.items():
        if value is DROP:
            body.pop(key)
        else:
            body[key] = value
    return body


BATCH_CASES = [
    ApiCase("unknown endpoint", "POST", "/v1/batches", create(endpoint="/v1/images"),
            param="endpoint"),
    ApiCase("missing endpoint", "POST", "/v1/batches", create(endpoint=DROP), param="endpoint"),
    *[ApiCase(f"completion_window {w!r}", "POST", "/v1/batches", create(completion_window=w),
              param="completion_window")
      for w in ("24", "24H", "1d", "169h", "0h", "", None, 24, "-1h", "1e3h", "24h\n")],
    ApiCase("metadata not an object", "POST", "/v1/batches", create(metadata=["a"]),
            param="metadata"),
    ApiCase("metadata with 17 pairs", "POST", "/v1/batches",
            create(metadata={f"k{i}": "v" for i in range(17)}), param="metadata"),
    ApiCase("metadata key of 65 characters", "POST", "/v1/batches",
            create(metadata={"k" * 65: "v"}), param="metadata"),
    ApiCase("metadata value of 513 characters", "POST", "/v1/batches",
            create(metadata={"k": "v" * 513}), param="metadata.k"),
    ApiCase("metadata value not a string", "POST", "/v1/batches",
            create(metadata={"k": 1}), param="metadata.k"),
    ApiCase("metadata value with NUL", "POST", "/v1/batches",
            create(metadata={"k": "a\x00"}), param="metadata.k"),
    ApiCase("metadata key with NUL", "POST", "/v1/batches",
            create(metadata={"k\x00": "a"}), param="metadata"),
    ApiCase("input_file_id with NUL", "POST", "/v1/batches", create(input_file_id="file-\x00"),
            status=404, code="not_found"),
    ApiCase("bad priority", "POST", "/v1/batches", create(priority="urgent"), param="priority"),
    ApiCase("bad output_expires_after", "POST", "/v1/batches",
            create(output_expires_after={"anchor": "created_at", "seconds": 5}),
            param="expires_after.seconds"),
    ApiCase("missing input_file_id", "POST", "/v1/batches", create(input_file_id=DROP),
            param="input_file_id"),
    ApiCase("input_file_id not a string", "POST", "/v1/batches", create(input_file_id=12),
            param="input_file_id"),
    ApiCase("unknown input file", "POST", "/v1/batches", create(input_file_id="file-nope"),
            status=404, code="not_found"),
    ApiCase("another user's input file", "POST", "/v1/batches", create(input_file_id="{other}"),
            status=404, code="not_found"),
    ApiCase("body not JSON", "POST", "/v1/batches", b"{nope"),
    ApiCase("body a JSON array", "POST", "/v1/batches", b"[1, 2]"),
    ApiCase("form-encoded body", "POST", "/v1/batches", b"endpoint=x",
            content_type="application/x-www-form-urlencoded"),
    ApiCase("multipart body", "POST", "/v1/batches", b"--x--",
            content_type="multipart/form-data; boundary=x"),
    ApiCase("deeply nested JSON body", "POST", "/v1/batches", deep(100_000)),
    ApiCase("PUT on batches", "PUT", "/v1/batches", {}, status=405),
    ApiCase("cancel an unknown batch", "POST", "/v1/batches/batch_nope/cancel", {},
            status=404, code="not_found"),
    # JSON is how an object is named in place (`source`): one without it is refused so.
    ApiCase("files upload as JSON", "POST", "/v1/files", {"file": "x", "purpose": "batch"},
            param="source"),
    ApiCase("files upload as text", "POST", "/v1/files", b"hello", content_type="text/plain",
            param="file"),
    ApiCase("files upload without a file field", "POST", "/v1/files", b"--x--\r\n",
            content_type="multipart/form-data; boundary=x", param="file"),
]

LIST_CASES = [
    ApiCase(f"GET {path}?{query}", "GET", f"{path}?{query}", param=param)
    for path, query, param in [
        ("/v1/batches", "limit=0", "limit"), ("/v1/batches", "limit=101", "limit"),
        ("/v1/batches", "limit=-1", "limit"), ("/v1/batches", "limit=1.5", "limit"),
        ("/v1/batches", "limit=%00", "limit"), ("/v1/batches", "after=batch_nope", "after"),
        ("/v1/batches", "after={other}", "after"), ("/v1/batches", "after=%00", "after"),
        ("/v1/files", "limit=0", "limit"), ("/v1/files", "limit=10001", "limit"),
        ("/v1/files", "order=sideways", "order"), ("/v1/files", "purpose=fine-tune", "purpose"),
        ("/v1/files", "after=file-nope", "after"), ("/v1/files", "after=file-%00", "after"),
    ]
]

UPLOAD_CREATE_CASES = [
    ApiCase(name, "POST", "/v1/uploads", {**{"filename": "a.jsonl", "purpose": "batch",
                                            "bytes": 100, "mime_type": "application/jsonl"},
                                         **fields}, status=status, param=param)
    for name, fields, status, param in [
        ("upload bytes zero", {"bytes": 0}, 400, "bytes"),
        ("upload bytes negative", {"bytes": -1}, 400, "bytes"),
        ("upload bytes a string", {"bytes": "100"}, 400, "bytes"),
        ("upload bytes a boolean", {"bytes": True}, 400, "bytes"),
        ("upload bytes over the limit", {"bytes": 10**15}, 413, "bytes"),
        ("upload bad purpose", {"purpose": "vision"}, 400, "purpose"),
        ("upload bad mime_type", {"mime_type": "image/png"}, 400, "mime_type"),
        ("upload missing filename", {"filename": None}, 400, "filename"),
        ("upload blank filename", {"filename": "  "}, 400, "filename"),
    ]
]

API_CASES = BATCH_CASES + LIST_CASES + UPLOAD_CREATE_CASES

# The Uploads API flows of test_bad_input.py (parts out of order, wrong total, wrong md5,
# completing twice, ...): named here so they count in the corpus.
UPLOAD_FLOW_CASES = [
    "empty part", "part over the part limit", "parts over the declared bytes",
    "complete with no part_ids", "complete with part_ids not a list",
    "complete with a part twice", "complete with an unknown part",
    "complete with another upload's part", "complete with the wrong total",
    "complete with the wrong md5", "complete with md5 not a string",
    "parts out of order make invalid JSONL", "complete twice", "part after completion",
    "complete after cancel", "cancel twice", "complete as form data",
]

ALL_CASES = ([c.name for c in FILE_CASES] + [c.name for c in LENIENT_CASES]
             + [c.name for c in LINE_CASES] + [c.name for c in API_CASES] + UPLOAD_FLOW_CASES)
