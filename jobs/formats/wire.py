"""The OpenAI batch wire format in one place: input lines, output lines, error lines.

Input line (OpenAI "The per-line object of the batch input file"):
    {"custom_id": str, "method": "POST", "url": "/v1/chat/completions", "body": {...}}
  url: one of engine.endpoints.ENDPOINTS (chat completions, completions, embeddings,
  responses, messages, and vLLM's score and rerank), whose endpoint checks the body.
  custom_id: "A developer-provided per-request id that will be used to match outputs to
  inputs. Must be unique for each request in a batch."
Output line ("The per-line object of the batch output and error files"):
    {"id": "batch_req_...", "custom_id": str,
     "response": {"status_code": int, "request_id": str, "body": {...}} | null,
     "error": {"code": str, "message": str} | null}
  error: "For requests that failed with a non-HTTP error, this will contain more
  information on the cause of the failure."
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engine.endpoints import ENDPOINTS, REGISTRY
from engine.endpoints import base as refusals
from engine.endpoints.base import Refusal

MAX_CUSTOM_ID_CHARS = 512


class Code:
    """`code` values of errors.data entries and of error lines."""

    INVALID_JSON = "invalid_json_line"
    INVALID_ENCODING = "invalid_encoding"
    EMPTY_FILE = "empty_file"
    LINE_TOO_LONG = "line_too_long"
    TOO_MANY_REQUESTS = "too_many_requests"
    FILE_TOO_LARGE = "file_too_large"
    MISSING_PARAMETER = refusals.MISSING_PARAMETER
    INVALID_CUSTOM_ID = "invalid_custom_id"
    DUPLICATE_CUSTOM_ID = "duplicate_custom_id"
    INVALID_METHOD = "invalid_method"
    INVALID_URL = "invalid_url"
    MISMATCHED_ENDPOINT = "mismatched_endpoint"
    MISMATCHED_MODEL = "mismatched_model"
    MODEL_NOT_FOUND = "model_not_found"
    # A body's refusal (engine.endpoints: the endpoint's own rules).
    INVALID_BODY = refusals.INVALID_BODY
    INVALID_PARAMETER = refusals.INVALID_PARAMETER
    # Error lines written at run time.
    SHARD_FAILED = "shard_failed"
    BATCH_CANCELLED = "batch_cancelled"
    BATCH_EXPIRED = "batch_expired"
    # The batch's input, read in place from its owner's bucket, was replaced after it was
    # registered: the batch stops and fails rather than run on other data.
    INPUT_CHANGED = "input_changed"
    # The engine aborted the request without the batch being stopped (its worker's
    # shard was taken over, or the engine was shut down under it).
    REQUEST_ABORTED = "request_aborted"
    # Read side only: a stored output or error line the dashboard cannot parse.
    UNREADABLE_LINE = "unreadable_line"


# The messages of error lines for requests that never got an HTTP response.
_UNRUN_MESSAGES = {
    Code.BATCH_CANCELLED: "The batch was cancelled before this request ran.",
    Code.BATCH_EXPIRED: "The batch expired before this request ran.",
    Code.INPUT_CHANGED: "The batch's input file changed in its bucket before this request "
                        "ran.",
    Code.REQUEST_ABORTED: "The request was aborted before it finished.",
}


def unrun_message(code: str, reason: str = "") -> str:
    """The message of an error line for a request that was not run, by its code; codes
    without a fixed message (shard_failed) carry the reason the shard gave."""
    return _UNRUN_MESSAGES.get(code) or f"The request could not be run: {reason or 'unknown'}"


# What an error message quotes of a value the user sent (a model name, a custom_id): a
# 6 MB model name must not make a 6 MB message on every line of a batch's errors.
QUOTE_CHARS = 100
# No message of an `errors.data` item is longer, whatever it quotes.
MAX_MESSAGE_CHARS = 1000


def quoted(value: str) -> str:
    """`value` in single quotes for an error message, cut to QUOTE_CHARS."""
    return f"'{value}'" if len(value) <= QUOTE_CHARS else f"'{value[:QUOTE_CHARS]}…'"


class LineError(Refusal):
    """A problem of one line: a file problem, or the request problem of a body its
    endpoint refuses (a `Refusal`, the same fields)."""

    __slots__ = ()

    def entry(self, line: int) -> dict[str, Any]:
        """One `errors.data` item of the Batch object. Messages quote what the line sent (a
        model name): NUL is escaped, as PostgreSQL cannot store it in JSON text, and the
        message is cut, so `errors` stays small however large the lines were."""
        message = self.message[:MAX_MESSAGE_CHARS].replace("\x00", "\\u0000")
        return {"code": self.code, "line": line, "param": self.param, "message": message}


@dataclass(frozen=True)
class RequestLine:
    custom_id: str
    url: str
    body: dict[str, Any]
    # The problem of a body the endpoint refuses: a request problem, answered per request
    # (as OpenAI's and Anthropic's batches answer it) unless the batch is strict. The line
    # runs nowhere; its shard writes `refused_line` as its error line.
    refused: LineError | None = None

    @property
    def model(self) -> str:
        return self.body["model"]


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


# One decoder for every line: json.loads with an option builds a new one per call.
_STRICT_DECODER = json.JSONDecoder(parse_constant=_reject_constant)


def loads_strict(text: str | bytes) -> Any:
    """json.loads without Python's extensions: NaN, Infinity and -Infinity are refused (no
    other JSON parser reads them back, and they would end up in the output files)."""
    if isinstance(text, bytes | bytearray):
        text = text.decode(json.detect_encoding(text), "surrogatepass")  # as json.loads
    if text.startswith("\ufeff"):
        raise json.JSONDecodeError("Unexpected UTF-8 BOM (decode using utf-8-sig)", text, 0)
    return _STRICT_DECODER.decode(text)


def raw_decode_strict(text: str, pos: int = 0) -> tuple[Any, int]:
    """One JSON value of `text` from `pos` (as `loads_strict`, NaN and Infinity refused)
    and where it ends: for bodies read a value at a time."""
    return _STRICT_DECODER.raw_decode(text, pos)


def _is_unicode(value: Any) -> bool:
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def custom_id_of(raw: bytes | None) -> str | None:
    """The custom_id of an input line, None when it is not an object with a string one."""
    try:
        obj = json.loads(raw or b"")
    except (ValueError, RecursionError):
        return None
    custom_id = obj.get("custom_id") if isinstance(obj, dict) else None
    return custom_id if isinstance(custom_id, str) else None


def parse_line(raw: bytes, *, max_tokens_cap: int,
               media_domains: Sequence[str] = ()) -> RequestLine | LineError:
    """Check one input line on its own (uniqueness and the batch's endpoint/model are the
    caller's). `raw` has its line ending stripped."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return LineError(Code.INVALID_ENCODING, f"Line is not valid UTF-8 ({exc.reason}).")
    try:
        obj = loads_strict(text)
    except (ValueError, RecursionError) as exc:
        return LineError(Code.INVALID_JSON, f"Line is not valid JSON: {str(exc)[:200]}")
    if not isinstance(obj, dict):
        return LineError(Code.INVALID_JSON, "Each line must be a JSON object.")
    if ("\\ud" in text or "\\uD" in text) and not _is_unicode(obj):
        # An unpaired surrogate escape such as "\ud800" is valid JSON but not Unicode text:
        # it could not be stored, tokenized or written back as UTF-8.
        return LineError(Code.INVALID_ENCODING,
                         "Line has an unpaired surrogate escape (\\ud800-\\udfff), which is "
                         "not valid Unicode.")

    custom_id = obj.get("custom_id")
    if custom_id is None:
        return LineError(Code.MISSING_PARAMETER, "Missing custom_id.", "custom_id")
    if not isinstance(custom_id, str) or not custom_id.strip():
        return LineError(Code.INVALID_CUSTOM_ID, "custom_id must be a non-empty string.",
                         "custom_id")
    if "\x00" in custom_id:
        # custom_ids are stored (dedup copies, spot checks) and PostgreSQL text has no NUL.
        return LineError(Code.INVALID_CUSTOM_ID, "custom_id must not contain NUL characters.",
                         "custom_id")
    if len(custom_id) > MAX_CUSTOM_ID_CHARS:
        return LineError(Code.INVALID_CUSTOM_ID,
                         f"custom_id is longer than {MAX_CUSTOM_ID_CHARS} characters.",
                         "custom_id")
    method = obj.get("method")
    if method != "POST":
        return LineError(Code.INVALID_METHOD, "method must be POST.", "method")
    url = obj.get("url")
    if url not in ENDPOINTS:
        return LineError(Code.INVALID_URL,
                         f"url must be one of {', '.join(ENDPOINTS)}.", "url")
    body = obj.get("body")
    if not isinstance(body, dict):
        return LineError(Code.INVALID_BODY, "body must be a JSON object.", "body")
    refusal = REGISTRY[url].check(body, max_tokens_cap=max_tokens_cap,
                                  media_domains=media_domains)
    problem = LineError(*refusal) if refusal else None
    if problem and problem.param == "body.model":
        # A file problem: the batch needs every line's model (one per batch, the queue it
        # runs on).
        return problem
    # Any other problem of the body is the request's own (validation decides whether it
    # fails the request or, for a strict batch, the batch).
    return RequestLine(custom_id=custom_id, url=url, body=body, refused=problem)


def new_request_id() -> str:
    # An identifier, not a secret: 96 bits from the process's Mersenne Twister (seeded from
    # the OS, and again in every forked child), not a system call (os.urandom) for every
    # line a worker writes.
    return f"batch_req_{random.getrandbits(96):024x}"


def response_line(custom_id: str, status_code: int, body: dict[str, Any]) -> bytes:
    """An output or error file line carrying the HTTP response of one request."""
    line = {
        "id": new_request_id(),
        "custom_id": custom_id,
        "response": {"status_code": status_code, "request_id": body.get("id") or
                     f"req_{random.getrandbits(96):024x}", "body": body},
        "error": None,
    }
    return json.dumps(line, ensure_ascii=False).encode() + b"\n"


def refused_line(custom_id: str, *, code: str, message: str, param: str | None) -> bytes:
    """An error file line for a request problem: the 400 the endpoint answers a body it
    refuses, in OpenAI's shape (`response.body.error`), never run."""
    return response_line(custom_id, 400, {"error": {
        "message": message, "type": "invalid_request_error", "param": param or None,
        "code": code}})


def failure_line(custom_id: str, code: str, message: str) -> bytes:
    """An error file line for a request that never got an HTTP response."""
    line = {
        "id": new_request_id(),
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code, "message": message},
    }
    return json.dumps(line, ensure_ascii=False).encode() + b"\n"


@dataclass(frozen=True)
class ResultLine:
    """An output or error file line, read back (the dashboard's browsing, spot checks)."""

    custom_id: str | None
    status_code: int | None
    # error.code for a request that got no response, http_<status> for an HTTP error,
    # None for a success.
    code: str | None
    message: str
    body: Any


def read_result_line(content: bytes) -> ResultLine:
    """Parse one line written by `response_line` or `failure_line`; anything else (a line
    changed by hand, cut short) is an `unreadable_line`, never an exception."""
    unreadable = ResultLine(None, None, Code.UNREADABLE_LINE, "", None)
    try:
        obj = json.loads(content)
    except (ValueError, RecursionError):
        return unreadable
    if not isinstance(obj, dict):
        return unreadable
    custom_id = obj.get("custom_id") if isinstance(obj.get("custom_id"), str) else None
    error = obj.get("error")
    response = obj.get("response")
    if isinstance(error, dict):
        return ResultLine(custom_id, None, str(error.get("code") or "error"),
                          str(error.get("message") or ""), None)
    if not isinstance(response, dict):
        return ResultLine(custom_id, None, Code.UNREADABLE_LINE, "", None)
    status = response.get("status_code")
    body = response.get("body")
    if isinstance(status, int) and status >= 400:
        message = ""
        if isinstance(body, dict) and isinstance(body.get("error"), dict):
            message = str(body["error"].get("message") or "")
        return ResultLine(custom_id, status, f"http_{status}", message, body)
    return ResultLine(custom_id, status if isinstance(status, int) else None, None, "", body)
