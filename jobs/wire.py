"""The OpenAI batch wire format in one place: input lines, output lines, error lines.

Input line (OpenAI "The per-line object of the batch input file"):
    {"custom_id": str, "method": "POST", "url": "/v1/chat/completions", "body": {...}}
  url: one of engine.base.ENDPOINTS (chat completions, completions, embeddings, responses,
  messages, and vLLM's score and rerank).
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

import hashlib
import json
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from engine.base import (
    CHAT,
    COMPLETIONS,
    EMBEDDINGS,
    ENDPOINTS,
    MESSAGES,
    POOLING_ENDPOINTS,
    RERANK,
    RESPONSES,
    SCORE,
    SCORE_SIDES,
    request_messages,
    score_pair,
    score_sides,
    text_parts,
)

MAX_CUSTOM_ID_CHARS = 512


class Code:
    """`code` values of errors.data entries and of error lines."""

    INVALID_JSON = "invalid_json_line"
    INVALID_ENCODING = "invalid_encoding"
    EMPTY_FILE = "empty_file"
    LINE_TOO_LONG = "line_too_long"
    TOO_MANY_REQUESTS = "too_many_requests"
    FILE_TOO_LARGE = "file_too_large"
    MISSING_PARAMETER = "missing_required_parameter"
    INVALID_CUSTOM_ID = "invalid_custom_id"
    DUPLICATE_CUSTOM_ID = "duplicate_custom_id"
    INVALID_METHOD = "invalid_method"
    INVALID_URL = "invalid_url"
    MISMATCHED_ENDPOINT = "mismatched_endpoint"
    MISMATCHED_MODEL = "mismatched_model"
    MODEL_NOT_FOUND = "model_not_found"
    INVALID_BODY = "invalid_body"
    INVALID_PARAMETER = "invalid_parameter"
    # Error lines written at run time.
    SHARD_FAILED = "shard_failed"
    BATCH_CANCELLED = "batch_cancelled"
    BATCH_EXPIRED = "batch_expired"
    # The engine aborted the request without the batch being stopped (its worker's
    # shard was taken over, or the engine was shut down under it).
    REQUEST_ABORTED = "request_aborted"
    # Read side only: a stored output or error line the dashboard cannot parse.
    UNREADABLE_LINE = "unreadable_line"


# The messages of error lines for requests that never got an HTTP response.
_UNRUN_MESSAGES = {
    Code.BATCH_CANCELLED: "The batch was cancelled before this request ran.",
    Code.BATCH_EXPIRED: "The batch expired before this request ran.",
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


@dataclass(frozen=True)
class LineError:
    code: str
    message: str
    param: str | None = None

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


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


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
    problem = check_body(url, body, max_tokens_cap=max_tokens_cap, media_domains=media_domains)
    if problem and problem.param == "body.model":
        # A file problem: the batch needs every line's model (one per batch, the queue it
        # runs on).
        return problem
    # Any other problem of the body is the request's own (validation decides whether it
    # fails the request or, for a strict batch, the batch).
    return RequestLine(custom_id=custom_id, url=url, body=body, refused=problem)


# The request fields each endpoint documents: OpenAI's request parameters of
# chat.completions, completions, embeddings and responses, plus vLLM's documented extra
# sampling parameters (fields of its ChatCompletionRequest / CompletionRequest /
# EmbeddingRequest / ResponsesRequest: for responses only those its ResponsesRequest has,
# as it would drop the others); for score and rerank, the fields of vLLM's ScoreRequest
# and RerankRequest (see _SCORING_FIELDS).
# Anything else never reaches the engine: vLLM accepts unknown and engine-internal fields
# (chat_template, kv_transfer_params, priority, vllm_xargs, prompt_embeds...) that a
# batch user must not steer. The fields engine/vllm_engine.py's _IGNORED_PARAMETERS names
# are OpenAI's, so they pass here and the engine decides about them.
_VLLM_SAMPLING_FIELDS = frozenset({
    "use_beam_search", "top_k", "min_p", "repetition_penalty", "length_penalty",
    "stop_token_ids", "include_stop_str_in_output", "ignore_eos", "min_tokens",
    "skip_special_tokens", "spaces_between_special_tokens", "truncate_prompt_tokens",
    "prompt_logprobs", "allowed_token_ids", "bad_words"})
# Score and rerank share vLLM's scoring parameters: truncation (of the whole prompt, of
# each query, of each document) and use_activation (a cross-encoder's sigmoid; an
# embeddings model's cosine does not change with it). Left out: chat_template_kwargs and
# its shorthand `instruction`, which steer the model's score template as chat_template
# does a chat (and an embeddings model ignores them), and the engine-internal request_id,
# priority, cache_salt, mm_processor_kwargs, padding and truncation_side.
_SCORING_FIELDS = frozenset({"model", "user", "truncate_prompt_tokens", "max_tokens_per_query",
                             "max_tokens_per_doc", "use_activation"})
DOCUMENTED_FIELDS: dict[str, frozenset[str]] = {
    CHAT: frozenset({
        "messages", "model", "audio", "frequency_penalty", "function_call", "functions",
        "logit_bias", "logprobs", "max_completion_tokens", "max_tokens", "metadata",
        "modalities", "n", "parallel_tool_calls", "prediction", "presence_penalty",
        "prompt_cache_key", "reasoning_effort", "response_format", "safety_identifier",
        "seed", "service_tier", "stop", "store", "stream", "stream_options", "temperature",
        "tool_choice", "tools", "top_logprobs", "top_p", "user", "verbosity",
        "web_search_options"}) | _VLLM_SAMPLING_FIELDS,
    COMPLETIONS: frozenset({
        "model", "prompt", "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs",
        "max_tokens", "n", "presence_penalty", "seed", "stop", "stream", "stream_options",
        "suffix", "temperature", "top_p", "user"}) | _VLLM_SAMPLING_FIELDS,
    EMBEDDINGS: frozenset({"input", "model", "dimensions", "encoding_format", "user",
                           "truncate_prompt_tokens"}),
    RESPONSES: frozenset({
        "input", "model", "background", "conversation", "include", "instructions",
        "max_output_tokens", "max_tool_calls", "metadata", "parallel_tool_calls",
        "previous_response_id", "prompt", "prompt_cache_key", "prompt_cache_retention",
        "reasoning", "safety_identifier", "service_tier", "store", "stream",
        "stream_options", "temperature", "text", "tool_choice", "tools", "top_logprobs",
        "top_p", "truncation", "user",
        # vLLM's sampling extras on its ResponsesRequest.
        "frequency_penalty", "presence_penalty", "logit_bias", "seed", "stop", "top_k",
        "min_p", "repetition_penalty", "stop_token_ids", "include_stop_str_in_output",
        "ignore_eos", "skip_special_tokens"}),
    # Anthropic's Messages API request parameters that vLLM's Anthropic layer honours (or,
    # as metadata and service_tier, that do not change the answer). Those it would drop or
    # cannot serve are refused by name (ANTHROPIC_UNSUPPORTED); vLLM's own extra fields
    # (kv_transfer_params, vllm_xargs, cache_salt, chat_template_kwargs...) are not
    # Anthropic's and are refused as any unknown field.
    MESSAGES: frozenset({
        "model", "messages", "max_tokens", "system", "temperature", "top_p", "top_k",
        "stop_sequences", "metadata", "stream", "tools", "tool_choice", "thinking",
        "output_config", "service_tier"}),
    SCORE: _SCORING_FIELDS | {name for pair in SCORE_SIDES for name in pair},
    RERANK: _SCORING_FIELDS | {"query", "documents", "top_n"},
}
# Documented Messages API parameters no model here can honour: a clear refusal each.
ANTHROPIC_UNSUPPORTED = frozenset({
    "container", "mcp_servers", "context_management", "inference_geo", "speed"})
ANTHROPIC_BLOCK_TYPES = frozenset({"text", "image", "tool_use", "tool_result", "thinking",
                                   "redacted_thinking"})

# Responses parameters that need state kept between requests or a background job, which a
# batch does not have: a batch's answers live in its output file only, never as stored
# responses (GET /v1/responses/{id} is not served), so each is refused, naming it, rather
# than run as if it were not set. `store` is refused only when sent as true: OpenAI's
# default is true, but a line that does not mention it asks for nothing a batch cannot do
# (its answer is in the output file), while an explicit true says the caller means to
# retrieve or continue the response later, which would then fail far from the cause.
_RESPONSES_STATEFUL = {
    "store": "Responses are not stored in a batch (its output file holds them); send "
             "store: false or leave it out.",
    "background": "Background mode is not available in a batch (a batch already runs in "
                  "the background).",
    "previous_response_id": "A batch request cannot continue a stored response (responses "
                            "are not stored); send the earlier turns in input.",
    "conversation": "A batch request cannot belong to a stored conversation; send the "
                    "earlier turns in input.",
    "prompt": "Stored prompt templates are not available here; send the prompt in input "
              "and instructions.",
}
# Input item types the engine renders into the prompt; the others reference stored items
# or the calls of built-in tools this service does not run.
RESPONSES_ITEM_TYPES = frozenset({"message", "function_call", "function_call_output",
                                  "reasoning"})
# Content part types of a Responses message, as chat's TEXT_PART_TYPES / MEDIA_PART_TYPES.
RESPONSES_TEXT_PART_TYPES = frozenset({"input_text", "output_text", "refusal"})
RESPONSES_MEDIA_PART_TYPES = frozenset({"input_image", "input_file", "input_audio"})

# Content part types of a chat message: OpenAI's, plus vLLM's video_url and audio_url.
# Other types vLLM reads (image_embeds, prompt_embeds, image_pil...) are not documented
# request content and are refused.
TEXT_PART_TYPES = frozenset({"text", "refusal"})
MEDIA_PART_TYPES = frozenset({"image_url", "input_audio", "file", "video_url", "audio_url"})


def host_listed(host: str, patterns: Sequence[str]) -> bool:
    """Whether `host` is one of `patterns`: an exact name, or ".example.com" for that name
    and its subdomains (the operator's allow-lists of webhook hosts and media domains)."""
    host = host.lower().rstrip(".")
    for pattern in patterns:
        pattern = pattern.lower().rstrip(".")
        if pattern.startswith("."):
            if host == pattern[1:] or host.endswith(pattern):
                return True
        elif host == pattern:
            return True
    return False


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


def _media_problem(part: dict[str, Any], param: str,
                   media_domains: Sequence[str]) -> LineError | None:
    """A media part may carry its data (data: URLs, base64) but point only to the domains
    the operator allows: the engine would fetch any other URL from inside its network."""
    for text in _strings(part):
        if ":" not in text:
            continue  # base64 data, a file id, a format name: no URL
        parts = urlsplit(text.strip())
        scheme = parts.scheme.lower()
        if scheme == "data":
            continue
        if scheme in ("http", "https"):
            host = parts.hostname or ""
            if host and host_listed(host, media_domains):
                continue
            return LineError(Code.INVALID_PARAMETER,
                             f"{param}: media URLs from {host or 'that address'} are not "
                             "allowed; send the media inline as a data: URL, or ask the "
                             "operator to allow the domain (BATCHWEB_MEDIA_ALLOWED_DOMAINS).",
                             param)
        if "://" in text or scheme == "file":
            return LineError(Code.INVALID_PARAMETER,
                             f"{param}: only data: URLs and http(s) URLs of allowed domains "
                             "are accepted in media parts.", param)
    return None


def _check_parts(content: list[Any], param: str, media_domains: Sequence[str], *,
                 text_types: frozenset[str] = TEXT_PART_TYPES,
                 media_types: frozenset[str] = MEDIA_PART_TYPES) -> LineError | None:
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            continue  # a plain string part: text
        where = f"{param}[{j}]"
        kind = part.get("type")
        if kind in text_types:
            continue
        if kind not in media_types:
            return LineError(Code.INVALID_PARAMETER,
                             f"{where}.type must be one of "
                             f"{', '.join(sorted(text_types | media_types))}.",
                             f"{where}.type")
        problem = _media_problem(part, where, media_domains)
        if problem:
            return problem
    return None


def _check_messages(messages: Any, media_domains: Sequence[str]) -> LineError | None:
    if not isinstance(messages, list) or not messages:
        return LineError(Code.INVALID_BODY, "body.messages must be a non-empty array.",
                         "body.messages")
    for i, message in enumerate(messages):
        param = f"body.messages[{i}]"
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            return LineError(Code.INVALID_BODY, f"{param} must be an object with a role.", param)
        content = message.get("content")
        if content is not None and not isinstance(content, str | list):
            return LineError(Code.INVALID_BODY,
                             f"{param}.content must be a string or an array of parts.",
                             f"{param}.content")
        if isinstance(content, list):
            problem = _check_parts(content, f"{param}.content", media_domains)
            if problem:
                return problem
    return None


def _check_responses(body: dict[str, Any], media_domains: Sequence[str]) -> LineError | None:
    """The rules of a Responses body: its input, the state it may not ask for, its tools
    and its text format."""
    for name, reason in _RESPONSES_STATEFUL.items():
        value = body.get(name)
        if value is None or value is False:  # not asked for (true in any spelling is)
            continue
        return LineError(Code.INVALID_PARAMETER, f"body.{name} is not supported: {reason}",
                         f"body.{name}")
    value = body.get("input")
    if not isinstance(value, str | list) or value in ("", []):
        return LineError(Code.INVALID_BODY, "body.input must be a non-empty string or array.",
                         "body.input")
    if isinstance(value, list):
        problem = _check_input_items(value, media_domains)
        if problem:
            return problem
    if body.get("instructions") is not None and not isinstance(body["instructions"], str):
        return LineError(Code.INVALID_BODY, "body.instructions must be a string.",
                         "body.instructions")
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        return LineError(Code.INVALID_BODY, "body.tools must be an array.", "body.tools")
    for i, tool in enumerate(tools or ()):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            # Built-in tools (web_search, file_search, code_interpreter, computer_use, mcp,
            # image_generation...) run on OpenAI's side; no engine here runs them.
            return LineError(Code.INVALID_PARAMETER,
                             f"body.tools[{i}]: {str(kind)[:100]} tools are not available "
                             "here; only function tools (type: function) are accepted.",
                             f"body.tools[{i}].type")
    text = body.get("text")
    if text is not None:
        if not isinstance(text, dict):
            return LineError(Code.INVALID_BODY, "body.text must be an object.", "body.text")
        fmt = text.get("format")
        if fmt is None:
            return None
        if not isinstance(fmt, dict) or fmt.get("type") not in (
                "text", "json_object", "json_schema"):
            return LineError(Code.INVALID_PARAMETER,
                             "body.text.format must be an object whose type is text, "
                             "json_object or json_schema.", "body.text.format")
        if fmt["type"] == "json_schema" and not isinstance(fmt.get("schema"), dict):
            # Without it vLLM would run the request unconstrained.
            return LineError(Code.INVALID_PARAMETER,
                             "body.text.format.schema must be a JSON Schema object.",
                             "body.text.format.schema")
    return None


def _check_input_items(items: list[Any], media_domains: Sequence[str]) -> LineError | None:
    for i, item in enumerate(items):
        param = f"body.input[{i}]"
        if not isinstance(item, dict):
            return LineError(Code.INVALID_BODY, f"{param} must be an object.", param)
        kind = item.get("type", "message" if "role" in item else None)
        if kind not in RESPONSES_ITEM_TYPES:
            return LineError(Code.INVALID_PARAMETER,
                             f"{param}.type must be one of "
                             f"{', '.join(sorted(RESPONSES_ITEM_TYPES))} (items that "
                             "reference stored items or built-in tool calls are not "
                             "available here).", f"{param}.type")
        if kind == "function_call_output":
            # Its output becomes a tool message's content: parts there are fetched as a
            # message's are (an input_image's image_url included).
            output = item.get("output")
            if isinstance(output, list):
                problem = _check_parts(output, f"{param}.output", media_domains,
                                       text_types=RESPONSES_TEXT_PART_TYPES,
                                       media_types=RESPONSES_MEDIA_PART_TYPES)
                if problem:
                    return problem
            continue
        if kind != "message":
            continue
        content = item.get("content")
        if not isinstance(item.get("role"), str) or not isinstance(content, str | list):
            return LineError(Code.INVALID_BODY,
                             f"{param} must have a role and a content string or array.",
                             param)
        if isinstance(content, list):
            problem = _check_parts(content, f"{param}.content", media_domains,
                                   text_types=RESPONSES_TEXT_PART_TYPES,
                                   media_types=RESPONSES_MEDIA_PART_TYPES)
            if problem:
                return problem
    return None


def _check_anthropic(body: dict[str, Any], media_domains: Sequence[str]) -> LineError | None:
    """The Messages API's own rules: max_tokens required, user/assistant messages whose
    content is a string or blocks of its types, a system string or text blocks, top_k and
    stop_sequences typed. Images are media parts: URLs only from allowed domains."""
    if body.get("max_tokens") is None:
        return LineError(Code.MISSING_PARAMETER, "Missing body.max_tokens.", "body.max_tokens")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return LineError(Code.INVALID_BODY, "body.messages must be a non-empty array.",
                         "body.messages")
    for i, message in enumerate(messages):
        param = f"body.messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            return LineError(Code.INVALID_BODY,
                             f"{param} must be an object with role 'user' or 'assistant' "
                             "(the system prompt is body.system).", f"{param}.role")
        problem = _check_blocks(message.get("content"), f"{param}.content", media_domains,
                                required=True)
        if problem:
            return problem
    problem = _check_blocks(body.get("system"), "body.system", media_domains, required=False,
                            types=frozenset({"text"}))
    if problem:
        return problem
    top_k = body.get("top_k")
    if top_k is not None and (not _is_int(top_k) or top_k < 0):
        return LineError(Code.INVALID_PARAMETER, "body.top_k must be a non-negative integer.",
                         "body.top_k")
    stops = body.get("stop_sequences")
    if stops is not None and (not isinstance(stops, list)
                              or not all(isinstance(s, str) for s in stops)):
        return LineError(Code.INVALID_PARAMETER, "body.stop_sequences must be an array of "
                         "strings.", "body.stop_sequences")
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        return LineError(Code.INVALID_PARAMETER, "body.metadata must be an object.",
                         "body.metadata")
    return None


def _check_blocks(content: Any, param: str, media_domains: Sequence[str], *, required: bool,
                  types: frozenset[str] = ANTHROPIC_BLOCK_TYPES) -> LineError | None:
    if content is None and not required:
        return None
    if isinstance(content, str):
        return None
    if not isinstance(content, list):
        return LineError(Code.INVALID_BODY, f"{param} must be a string or an array of "
                         "content blocks.", param)
    for j, block in enumerate(content):
        where = f"{param}[{j}]"
        if not isinstance(block, dict) or block.get("type") not in types:
            return LineError(Code.INVALID_PARAMETER,
                             f"{where}.type must be one of {', '.join(sorted(types))}.",
                             f"{where}.type")
        if block["type"] == "text" and not isinstance(block.get("text"), str):
            return LineError(Code.INVALID_BODY, f"{where}.text must be a string.",
                             f"{where}.text")
        if block["type"] == "image":
            problem = _media_problem(block, where, media_domains)
            if problem:
                return problem
        if block["type"] == "tool_result" and isinstance(block.get("content"), list):
            # Its blocks reach the model too (an image there is fetched like any other).
            problem = _check_blocks(block["content"], f"{where}.content", media_domains,
                                    required=False, types=frozenset({"text", "image"}))
            if problem:
                return problem
    return None


# Content part types of a score or rerank input (vLLM's ScoreContentPartParam, less
# image_embeds, which is not request content); its media URLs as a chat message's.
SCORE_TEXT_PART_TYPES = frozenset({"text"})
SCORE_MEDIA_PART_TYPES = frozenset({"image_url", "video_url"})


def _check_score_inputs(value: Any, param: str, media_domains: Sequence[str], *,
                        many: bool = True) -> LineError | None:
    """One side of a score or rerank body: an input (a string, or an object whose
    `content` is an array of parts) or, when `many`, a non-empty array of them."""
    shape = ("a non-empty string, an object with a content array, or a non-empty array of "
             "them" if many else "a non-empty string or an object with a content array")
    if value in ("", []) or (isinstance(value, list) and not many):
        return LineError(Code.INVALID_BODY, f"{param} must be {shape}.", param)
    listed = isinstance(value, list)
    for j, item in enumerate(value if listed else [value]):
        where = f"{param}[{j}]" if listed else param
        if isinstance(item, str):
            continue
        if not isinstance(item, dict) or not isinstance(item.get("content"), list):
            what = "a string or an object with a content array" if listed else shape
            return LineError(Code.INVALID_BODY, f"{where} must be {what}.", where)
        problem = _check_parts(item["content"], f"{where}.content", media_domains,
                               text_types=SCORE_TEXT_PART_TYPES,
                               media_types=SCORE_MEDIA_PART_TYPES)
        if problem:
            return problem
    return None


def _score_pair_problem(body: dict[str, Any]) -> LineError:
    """Why a score body names no pair of SCORE_SIDES: no side at all, one side of a pair
    only, or sides of two pairs."""
    pairs = "; ".join(f"{a} and {b}" for a, b in SCORE_SIDES)
    names = {name for pair in SCORE_SIDES for name in pair}
    named = [name for name in body if name in names]
    if not named:
        return LineError(Code.MISSING_PARAMETER, "Missing the two sides to score; send one "
                         f"of these pairs: {pairs}.", "body.queries")
    partial = next((pair for pair in SCORE_SIDES if set(named) < set(pair)), None)
    if partial is not None:
        missing = next(name for name in partial if name not in named)
        return LineError(Code.MISSING_PARAMETER, f"Missing body.{missing}.", f"body.{missing}")
    return LineError(Code.INVALID_BODY, f"body.{named[0]} and body.{named[-1]} name sides of "
                     f"different pairs; send one of these pairs: {pairs}.", f"body.{named[-1]}")


def _check_scoring(url: str, body: dict[str, Any],
                   media_domains: Sequence[str]) -> LineError | None:
    """A score body's two sides, named by one pair of SCORE_SIDES, paired 1:1, 1:N or N:N;
    a rerank body's query (one input) and documents, and its top_n."""
    if url == RERANK:
        for name in ("query", "documents"):
            if body.get(name) is None:
                return LineError(Code.MISSING_PARAMETER, f"Missing body.{name}.",
                                 f"body.{name}")
        problem = (_check_score_inputs(body["query"], "body.query", media_domains, many=False)
                   or _check_score_inputs(body["documents"], "body.documents", media_domains))
        if problem:
            return problem
        top_n = body.get("top_n")
        if top_n is not None and (not _is_int(top_n) or top_n < 1):
            return LineError(Code.INVALID_PARAMETER, "body.top_n must be a positive integer "
                             "(leave it out for every document).", "body.top_n")
        return None
    pair = score_pair(body)
    if pair is None:
        return _score_pair_problem(body)
    for name in pair:
        problem = _check_score_inputs(body[name], f"body.{name}", media_domains)
        if problem:
            return problem
    (first, queries), (second, documents) = score_sides(url, body)
    if len(queries) != 1 and len(queries) != len(documents):
        return LineError(Code.INVALID_BODY,
                         f"body.{first} has {len(queries)} inputs and body.{second} "
                         f"{len(documents)}: send one {first} input (scored against each of "
                         f"body.{second}) or as many as body.{second} (scored in pairs).",
                         f"body.{second}")
    return None


def check_body(url: str, body: dict[str, Any], *, max_tokens_cap: int,
               media_domains: Sequence[str] = ()) -> LineError | None:
    """The request-body rules we can check without the model; the engine checks the rest
    and answers a per-request 400 for what it cannot honour."""
    model = body.get("model")
    if model is None:
        return LineError(Code.MISSING_PARAMETER, "Missing body.model.", "body.model")
    if not isinstance(model, str) or not model:
        return LineError(Code.INVALID_BODY, "body.model must be a non-empty string.",
                         "body.model")
    documented = DOCUMENTED_FIELDS.get(url, frozenset())
    for name in body:
        if url == MESSAGES and name in ANTHROPIC_UNSUPPORTED:
            return LineError(Code.INVALID_PARAMETER,
                             f"body.{name} is not supported by this service's models.",
                             f"body.{name}")
        if name not in documented:
            return LineError(Code.INVALID_PARAMETER,
                             f"body.{name[:100]} is not a parameter of {url}; only the "
                             "endpoint's documented parameters are accepted.",
                             f"body.{name[:100]}")
    if body.get("stream"):
        return LineError(Code.INVALID_PARAMETER, "Streaming is not supported in a batch.",
                         "body.stream")
    if url == CHAT:
        problem = _check_messages(body.get("messages"), media_domains)
        if problem:
            return problem
    elif url == MESSAGES:
        problem = _check_anthropic(body, media_domains)
        if problem:
            return problem
    elif url == COMPLETIONS:
        prompt = body.get("prompt")
        if not isinstance(prompt, str | list) or prompt in ("", []):
            return LineError(Code.INVALID_BODY, "body.prompt must be a non-empty string or array.",
                             "body.prompt")
    elif url == EMBEDDINGS:
        value = body.get("input")
        if not isinstance(value, str | list) or value in ("", []):
            return LineError(Code.INVALID_BODY, "body.input must be a non-empty string or array.",
                             "body.input")
    elif url == RESPONSES:
        problem = _check_responses(body, media_domains)
        if problem:
            return problem
    elif url in (SCORE, RERANK):
        problem = _check_scoring(url, body, media_domains)
        if problem:
            return problem
    for name in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        value = body.get(name)
        if value is None:
            continue
        if not _is_int(value) or value < 1:
            return LineError(Code.INVALID_PARAMETER, f"body.{name} must be a positive integer.",
                             f"body.{name}")
        if value > max_tokens_cap:
            return LineError(Code.INVALID_PARAMETER,
                             f"body.{name} must be at most {max_tokens_cap}.", f"body.{name}")
    n = body.get("n")
    if n is not None and (not _is_int(n) or not 1 <= n <= 128):
        return LineError(Code.INVALID_PARAMETER, "body.n must be an integer from 1 to 128.",
                         "body.n")
    temperature = body.get("temperature")
    highest = 1 if url == MESSAGES else 2  # Anthropic's range is 0 to 1
    if temperature is not None and (not _is_number(temperature)
                                    or not 0 <= temperature <= highest):
        return LineError(Code.INVALID_PARAMETER,
                         f"body.temperature must be between 0 and {highest}.",
                         "body.temperature")
    top_p = body.get("top_p")
    if top_p is not None and (not _is_number(top_p) or not 0 < top_p <= 1):
        return LineError(Code.INVALID_PARAMETER, "body.top_p must be in (0, 1].", "body.top_p")
    return None


def dedup_key(line: RequestLine) -> bytes | None:
    """A digest of the request when its result is fully determined by its content
    (a pooling endpoint, greedy sampling, or a fixed seed); None when two runs may rightly
    differ."""
    body = line.body
    if line.refused is not None:
        return None  # answered without running: nothing to share
    if (line.url not in POOLING_ENDPOINTS and body.get("temperature", 1) != 0
            and body.get("seed") is None):
        return None
    canonical = json.dumps([line.url, body], sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(canonical.encode(), digest_size=16).digest()


def prompt_text(line: RequestLine) -> tuple[str, int]:
    """(text, characters) of what a request sends to the model: the texts of its messages'
    contents (or of its prompt, or of its inputs, or of a score or rerank request's two
    sides) joined with "\n", and the characters the
    token estimate counts (the texts' own, and 4 for each token id or token array).

    Validation computes it once per line, for the estimate and for the content rules."""
    body = line.body
    if line.refused is not None:
        return "", 0  # it never runs: nothing to estimate or screen
    if line.url == CHAT:
        messages = body["messages"]
        try:  # the common case, every content a string
            text = "\n".join([message["content"] for message in messages])
            return text, len(text) - len(messages) + 1
        except (KeyError, TypeError):
            values = [message.get("content") for message in messages]
    elif line.url in (RESPONSES, MESSAGES):
        values = [message.get("content") for message in request_messages(line.url, body)]
    elif line.url in (SCORE, RERANK):
        values = [content for _, inputs in score_sides(line.url, body) for content in inputs]
    else:
        values = [body.get("prompt") if line.url == COMPLETIONS else body.get("input")]
    parts = [part for value in values for part in text_parts(value)]
    # Token ids (in a completions prompt or an embeddings input) have no text.
    token_ids = sum(1 for value in values if isinstance(value, list)
                    for item in value if not isinstance(item, str | dict))
    return "\n".join(parts), sum(map(len, parts)) + 4 * token_ids


def estimate_tokens(line: RequestLine, chars: int | None = None) -> tuple[int, int]:
    """(input tokens, output-token ceiling) estimated without a tokenizer: ~4 characters a
    token, which is close for English with BPE tokenizers. `chars` is `prompt_text`'s
    count, when the caller has it."""
    if chars is None:
        chars = prompt_text(line)[1]
    body = line.body
    ceiling = 0
    if line.refused is not None:
        return 1, 0
    if line.url not in POOLING_ENDPOINTS:  # a pooling model generates no tokens
        ceiling = (body.get("max_completion_tokens") or body.get("max_tokens")
                   or body.get("max_output_tokens") or 0)
        ceiling *= body.get("n") or 1
    return max(1, chars // 4), ceiling


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


def usage_of(body: dict[str, Any]) -> tuple[int, int, int]:
    """(prompt, completion, cached prompt) tokens of a response body's usage; cached ones
    are OpenAI's `prompt_tokens_details.cached_tokens` (served from the prefix cache). A
    Responses `response` names them input_tokens, output_tokens and
    `input_tokens_details.cached_tokens`. An Anthropic Message counts its prompt in three
    parts: `input_tokens` (not from the cache), `cache_read_input_tokens` (from it) and
    `cache_creation_input_tokens`."""
    usage = body.get("usage") or {}
    if body.get("type") == "message":
        cached = int(usage.get("cache_read_input_tokens") or 0)
        prompt = (int(usage.get("input_tokens") or 0) + cached
                  + int(usage.get("cache_creation_input_tokens") or 0))
        return prompt, int(usage.get("output_tokens") or 0), cached
    if "input_tokens" in usage:
        details = usage.get("input_tokens_details") or {}
        return (int(usage.get("input_tokens") or 0), int(usage.get("output_tokens") or 0),
                int(details.get("cached_tokens") or 0))
    details = usage.get("prompt_tokens_details") or {}
    return (int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0),
            int(details.get("cached_tokens") or 0))
