"""What every endpoint shares: the `Endpoint` base class, the `Refusal` of a body it will
not run, the neutral results an engine computes, and the text of a prompt.

An endpoint object is stateless: one instance per url, in the registry
(`engine/endpoints/__init__.py`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

# The `code` of a body's refusal (jobs/formats/wire.py's Code names them for the line format).
MISSING_PARAMETER = "missing_required_parameter"
INVALID_BODY = "invalid_body"
INVALID_PARAMETER = "invalid_parameter"

# vLLM's documented extra sampling parameters, fields of its ChatCompletionRequest and
# CompletionRequest (its ResponsesRequest has some of them: engine/endpoints/responses.py).
VLLM_SAMPLING_FIELDS = frozenset({
    "use_beam_search", "top_k", "min_p", "repetition_penalty", "length_penalty",
    "stop_token_ids", "include_stop_str_in_output", "ignore_eos", "min_tokens",
    "skip_special_tokens", "spaces_between_special_tokens", "truncate_prompt_tokens",
    "prompt_logprobs", "allowed_token_ids", "bad_words"})

# Body fields that cap the output tokens of a generating request, by endpoint: chat's two,
# completions' and Anthropic's max_tokens, Responses' max_output_tokens. In the order an
# engine reads them (chat's max_completion_tokens before its older max_tokens).
MAX_TOKENS_FIELDS = ("max_completion_tokens", "max_tokens", "max_output_tokens")
# Tokens a chat template adds around one message (role markers, separators) at most, for
# the templates of the models served here (SmolLM2's and Llama's add 4-6).
TEMPLATE_TOKENS = 8
# A chat template's own text once a prompt (a default system prompt when the first message
# is not one: SmolLM2's ~20 tokens, Llama 3.1's and Qwen's about as many), for a model whose
# template cannot be rendered here.
TEMPLATE_FIXED_TOKENS = 64
# What a template may add around each tool, tool call or tool result beyond their JSON
# (markers such as <tool_call>, an id, a "Tool result: " prefix vLLM's Anthropic layer writes).
TOOL_TOKENS = 16
# A template's fixed text when a request has tools (the instructions that introduce them;
# Qwen's and Hermes's are ~100-150 tokens), for a model whose template cannot be rendered here.
TOOLS_PREAMBLE_TOKENS = 512
# Content part and block types that are media: each costs what its model makes of it
# (`Room.media_tokens`), not its bytes.
MEDIA_TYPES = frozenset({"image_url", "input_audio", "file", "video_url", "audio_url", "image",
                         "input_image", "input_file"})


class Refusal(NamedTuple):
    """Why an endpoint refuses a body: the 400 it answers, naming the field. A tuple, so
    the line format's `LineError` (a Refusal that also knows its errors.data entry) and
    the endpoint's own refusal of the same body compare equal."""

    code: str
    message: str
    param: str | None = None


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def text_parts(value: Any) -> list[str]:
    """The texts of a message's `content`, a `prompt`, an `input`, an Anthropic `system` or
    a Message's `content`: a string itself; in a list, its strings and the `text` of its
    content parts (OpenAI's parts and Anthropic's text blocks alike). Token ids, images and
    anything else carry no text. The one definition of "the text of a prompt", used by
    validation (estimates, content rules), token counting, the echo engine and the
    dashboard."""
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list):
        return []
    parts = []
    for item in value:
        if isinstance(item, str):
            parts.append(item)
        elif isinstance(item, dict) and isinstance(item.get("text"), str):
            parts.append(item["text"])
    return parts


class TemplateInput(NamedTuple):
    """A chat prompt as a template renders it (`Endpoint.template_input`)."""

    messages: list[dict[str, Any]]
    tools: list[Any]


def dicts(value: Any) -> list[dict[str, Any]]:
    """The objects of a list field (a body not yet validated may hold anything there)."""
    return [item for item in value if isinstance(item, dict)] if isinstance(value, list) else []


def json_bytes(value: Any) -> int:
    """The UTF-8 bytes of `value` as a chat template's `tojson` writes it, at its widest
    (indented by 4, as Llama's templates do; others write it compact)."""
    return len(json.dumps(value, ensure_ascii=False, indent=4).encode())


def tool_call(call_id: Any, name: Any, arguments: Any) -> dict[str, Any]:
    """An assistant's tool call as vLLM hands it to a template: its `arguments` parsed
    from their JSON text where they are JSON (templates write them with `tojson`)."""
    if isinstance(arguments, str):
        with contextlib.suppress(ValueError, RecursionError):
            arguments = json.loads(arguments)
    return {"id": call_id or "", "type": "function",
            "function": {"name": name if isinstance(name, str) else "",
                         "arguments": arguments if arguments is not None else {}}}


def template_message(message: dict[str, Any]) -> dict[str, Any]:
    """One OpenAI chat message as a template receives it: its text parts joined with
    newlines (as vLLM joins them for a text model), its tool calls (`tool_call`), and a
    tool result's `tool_call_id` and `name`."""
    shown: dict[str, Any] = {"role": str(message.get("role", "user")),
                             "content": "\n".join(text_parts(message.get("content")))}
    calls = message.get("tool_calls")
    if isinstance(calls, list) and calls:
        shown["tool_calls"] = [
            tool_call(c.get("id"), (c.get("function") or {}).get("name"),
                      (c.get("function") or {}).get("arguments"))
            for c in calls if isinstance(c, dict)]
    for key in ("tool_call_id", "name"):
        if isinstance(message.get(key), str):
            shown[key] = message[key]
    return shown


def count_media(value: Any) -> int:
    """Media parts in a content value, nested ones included (an Anthropic tool result's)."""
    if isinstance(value, list):
        return sum(count_media(item) for item in value)
    if isinstance(value, dict):
        if value.get("type") in MEDIA_TYPES:
            return 1
        return count_media(value.get("content"))
    return 0


def openai_error(status: int, message: str, param: str | None = None, *,
                 kind: str = "BadRequestError") -> dict[str, Any]:
    """An OpenAI error body as vLLM's serving layer writes it."""
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def openai_usage(body: dict[str, Any]) -> tuple[int, int, int]:
    """(prompt, completion, cached prompt) tokens of OpenAI's `usage`; cached ones are its
    `prompt_tokens_details.cached_tokens` (served from the prefix cache)."""
    usage = body.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    return (int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0),
            int(details.get("cached_tokens") or 0))


def show_messages(messages: list[Any]) -> str:
    """Messages for the dashboard: "role: text", one a line."""
    lines = []
    for message in messages:
        if not isinstance(message, dict):
            continue
        content = message.get("content")
        if isinstance(content, list):
            content = " ".join(text_parts(content))
        lines.append(f"{message.get('role', '?')}: {content}")
    return "\n".join(lines)


@dataclass(frozen=True)
class Generation:
    """What a generating request came to, whatever engine computed it; its endpoint builds
    the wire response (`Endpoint.respond`)."""

    model: str
    text: str
    # Cut at the output-token cap (else it stopped by itself).
    cut: bool
    prompt_tokens: int
    # Output tokens of one choice (its reasoning included).
    output_tokens: int
    n: int = 1
    # What a model served with a reasoning parser thought before answering, and its
    # tokens (of output_tokens), per choice; None: no reasoning parser, so its usage has no
    # reasoning count at all (as vLLM's).
    reasoning: str | None = None
    reasoning_tokens: int = 0


@dataclass(frozen=True)
class Pooled:
    """What a pooling request came to: one embedding per input, or one score per pair
    with the documents scored (rerank shows them)."""

    model: str
    prompt_tokens: int
    embeddings: list[list[float]] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    documents: list[Any] = field(default_factory=list)


@dataclass(frozen=True)
class EchoModel:
    """The test-only echo engine's model (engine/echo.py), as an endpoint's `echo` answers
    for it: no weights, words for tokens."""

    name: str
    # Its context, in words.
    max_model_len: int
    # What its answers start with: "echo:", or "echo+<adapter>:" for an adapter's request.
    lead: str = "echo:"
    adapter: bool = False
    # Another version of its "weights" answers in lower case.
    lower: bool = False
    # It thinks before it answers, as a model served with a reasoning parser.
    reasons: bool = False
    # The output limit it applies to a request naming none (its generation config's).
    default_max_tokens: int | None = None
    # The model's options (what an endpoint reads of them: moderation's categories).
    options: Mapping[str, Any] = field(default_factory=dict)


class ModelOptionsError(ValueError):
    """A model's options that an endpoint cannot run with (its answer is a 400 naming
    them, for every request of that endpoint, until the operator fixes them)."""


class EchoRefusal(Exception):
    """What the echo model answers instead of a result: (status, OpenAI error body)."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.body = openai_error(status, message, param)


def context_refusal(tokens: int, limit: int) -> EchoRefusal:
    """The one echo refusal that depends on the model, not the body: vLLM's own wording."""
    return EchoRefusal(400, f"This model's maximum context length is {limit} tokens. However, "
                       f"you requested {tokens} tokens. Please reduce the length of the input.",
                       "input_tokens")


def echo_vector(text: str) -> list[float]:
    """An input's echo embedding: 8 floats in [-1, 1) from the 32 bytes of its sha256,
    deterministic and input-specific."""
    digest = hashlib.sha256(text.encode()).digest()
    return [(v / 32768.0) for v in struct.unpack("<16h", digest)[:8]]


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    norms = math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))
    return dot / norms if norms else 0.0


@dataclass(frozen=True)
class VllmServing:
    """How vLLM's in-process serving layer answers an endpoint (engine/vllm_engine.py):
    the serving object's name on vLLM's app state, its request model (module.Name, imported
    only by the worker that runs vLLM), the method called (None: the object itself is
    called, as the pooling ones are) and how a pydantic answer is dumped to JSON, as vLLM's
    own route writes it."""

    state: str
    request: str
    method: str | None = None
    dump: dict[str, Any] = field(default_factory=dict)


class Endpoint:
    """One endpoint: what is particular to it, from its body's rules to the dashboard's
    view of its answer. Subclasses set the class attributes and override what differs."""

    url: str
    # The body fields it documents; anything else never reaches an engine.
    fields: frozenset[str]
    # Documented fields no model here can honour: refused by name.
    unsupported: frozenset[str] = frozenset()
    max_temperature = 2
    # The kind of call an engine makes: "chat" (messages through the chat template),
    # "generate" (a plain prompt), "embed" or "score".
    kind: str
    # A pooling model's endpoint: no output tokens and no sampling (the same request gets
    # the same answer), no generated text to check, retry or prefix-group.
    pooling = False
    # Whether validation groups its requests by prompt prefix (jobs/formats/prefix_keys.py).
    prefix_grouped = False
    # The body field an engine cannot answer without.
    prompt_field: str
    # OpenAI parameters that change the answer and that vLLM's request model may lack
    # (it would drop them silently: engine/vllm_engine.py refuses them instead).
    droppable: tuple[str, ...] = ()
    # Whether vLLM's request model takes a `priority` (the remote engine sends one).
    takes_priority = True
    # The url of another endpoint through whose serving layer this one runs: a model that
    # serves that one serves this one too, without every models file having to say so.
    served_through: str | None = None
    vllm: VllmServing

    # -- the body -----------------------------------------------------------------------

    def check(self, body: dict[str, Any], *, max_tokens_cap: int,
              media_domains: Sequence[str] = ()) -> Refusal | None:
        """The request-body rules we can check without the model; the engine checks the
        rest and answers a per-request 400 for what it cannot honour."""
        model = body.get("model")
        if model is None:
            return Refusal(MISSING_PARAMETER, "Missing body.model.", "body.model")
        if not isinstance(model, str) or not model:
            return Refusal(INVALID_BODY, "body.model must be a non-empty string.", "body.model")
        for name in body:
            if name in self.unsupported:
                return Refusal(INVALID_PARAMETER,
                               f"body.{name} is not supported by this service's models.",
                               f"body.{name}")
            if name not in self.fields:
                return Refusal(INVALID_PARAMETER,
                               f"body.{name[:100]} is not a parameter of {self.url}; only the "
                               "endpoint's documented parameters are accepted.",
                               f"body.{name[:100]}")
        if body.get("stream"):
            return Refusal(INVALID_PARAMETER, "Streaming is not supported in a batch.",
                           "body.stream")
        problem = self.check_own(body, media_domains)
        if problem:
            return problem
        for name in MAX_TOKENS_FIELDS:
            value = body.get(name)
            if value is None:
                continue
            if not is_int(value) or value < 1:
                return Refusal(INVALID_PARAMETER, f"body.{name} must be a positive integer.",
                               f"body.{name}")
            if value > max_tokens_cap:
                return Refusal(INVALID_PARAMETER,
                               f"body.{name} must be at most {max_tokens_cap}.", f"body.{name}")
        n = body.get("n")
        if n is not None and (not is_int(n) or not 1 <= n <= 128):
            return Refusal(INVALID_PARAMETER, "body.n must be an integer from 1 to 128.",
                           "body.n")
        temperature = body.get("temperature")
        highest = self.max_temperature
        if temperature is not None and (not is_number(temperature)
                                        or not 0 <= temperature <= highest):
            return Refusal(INVALID_PARAMETER,
                           f"body.temperature must be between 0 and {highest}.",
                           "body.temperature")
        top_p = body.get("top_p")
        if top_p is not None and (not is_number(top_p) or not 0 < top_p <= 1):
            return Refusal(INVALID_PARAMETER, "body.top_p must be in (0, 1].", "body.top_p")
        return None

    def check_own(self, body: dict[str, Any], media_domains: Sequence[str]) -> Refusal | None:
        """The endpoint's own rules: its prompt or inputs (run after the shared ones on
        fields and streaming, before those on sampling)."""
        raise NotImplementedError

    # -- the prompt ---------------------------------------------------------------------

    def messages(self, body: dict[str, Any]) -> list[Any]:
        """The messages a "chat" kind puts through the model's chat template, each a dict
        with `role` and `content` (whose texts are `text_parts`); [] for other kinds. The
        one definition of "the messages of a prompt", used by validation, token counting,
        prefix keys, the echo engine and the dashboard alike."""
        return []

    def sides(self, body: dict[str, Any]) -> list[tuple[str, list[Any]]]:
        """The two sides a "score" kind pairs, each as (field name, inputs); [] for other
        kinds, and for a body without its two. The one definition of "the inputs of a
        score request", used by validation, token counting, the echo engine and the
        dashboard alike."""
        return []

    def prompts(self, body: dict[str, Any]) -> list[Any]:
        """The prompts of the other kinds, as a tokenizer counts them: each a string or a
        list of token ids."""
        return []

    def prompt_values(self, body: dict[str, Any]) -> list[Any]:
        """The values whose `text_parts` are the prompt's text."""
        return [message.get("content") for message in self.messages(body)]

    def prompt_text(self, body: dict[str, Any]) -> tuple[str, int]:
        """(text, characters) of what a request sends to the model: the texts of its
        `prompt_values` joined with "\\n", and the characters the token estimate counts
        (the texts' own, and 4 for each token id or token array)."""
        values = self.prompt_values(body)
        parts = [part for value in values for part in text_parts(value)]
        # Token ids (in a completions prompt or an embeddings input) have no text.
        token_ids = sum(1 for value in values if isinstance(value, list)
                        for item in value if not isinstance(item, str | dict))
        return "\n".join(parts), sum(map(len, parts)) + 4 * token_ids

    def template_input(self, body: dict[str, Any]) -> TemplateInput:
        """The prompt as a chat template receives it from vLLM, for the "chat" kind: its
        messages in OpenAI's chat shape (`template_message`) and its function tools in
        chat's shape. Used only to bound the prompt's tokens (`prompt_bound`, and
        `engine.tokens.PromptCounter.prompt_bound` with the model's own template).
        Endpoints whose prompt has tools, tool calls or tool results say how they map."""
        return TemplateInput([template_message(m) for m in self.messages(body)
                              if isinstance(m, dict)], [])

    def media(self, body: dict[str, Any]) -> int:
        """How many media parts (images, audio, files) the prompt holds, nested ones
        included: each costs what its model makes of it, not its bytes."""
        return sum(count_media(value) for value in self.prompt_values(body))

    def prompt_bound(self, body: dict[str, Any]) -> int:
        """An upper bound of the request's prompt tokens, media aside, for a model whose
        tokenizer is not at hand: a tokenizer never makes more tokens of a text than its
        UTF-8 bytes (byte-level BPE, SentencePiece with byte fallback, WordPiece), so one
        token per byte of every text the template renders (message texts, and the JSON of
        tools and tool calls as `tojson` writes it, indented), plus TEMPLATE_TOKENS a
        message or input, TEMPLATE_FIXED_TOKENS for a chat template's own text, and
        TOOL_TOKENS a tool or call and TOOLS_PREAMBLE_TOKENS for its text about tools.
        Loose (English runs ~4 bytes a token): a model with a tokenizer is bounded by it
        instead (`engine.tokens`)."""
        if self.kind == "chat":
            shown = self.template_input(body)
            size = TEMPLATE_FIXED_TOKENS + sum(len(m["content"].encode()) + TEMPLATE_TOKENS
                                               for m in shown.messages)
            calls = [m["tool_calls"] for m in shown.messages if m.get("tool_calls")]
            size += sum(json_bytes(c) + TOOL_TOKENS * len(c) for c in calls)
            if shown.tools:
                size += (json_bytes(shown.tools) + TOOL_TOKENS * len(shown.tools)
                         + TOOLS_PREAMBLE_TOKENS)
            return max(1, size)
        values = self.prompt_values(body)
        size = 0
        for value in values:
            size += sum(len(text.encode()) for text in text_parts(value))
            if isinstance(value, list):  # token ids, or token arrays
                size += sum(len(item) if isinstance(item, list) else 1 for item in value
                            if not isinstance(item, str | dict))
        return max(1, size + TEMPLATE_TOKENS * max(len(values), 1))

    # The body field the output-token limit is sent in when a request names none.
    limit_field = "max_tokens"
    # The limit the API itself gives a request that names none (OpenAI's completions:
    # 16); None: the model's room, its context less the prompt, at most the service's cap.
    default_limit: int | None = None

    def named_limit(self, body: dict[str, Any]) -> int | None:
        """The output-token limit the body names, if any."""
        return next((body[name] for name in MAX_TOKENS_FIELDS if body.get(name) is not None),
                    None)

    def answers(self, body: dict[str, Any]) -> int:
        """How many answers the request generates (each up to its output limit)."""
        n = body.get("n")
        return n if isinstance(n, int) and n > 1 else 1

    def output_limit(self, body: dict[str, Any], *, room: int) -> int:
        """The most output tokens of one answer: the body's own limit, else the API's
        default, else `room` (the model's context less the prompt's bound, at most the
        service's cap). A request without a limit runs with this one named, so the engine
        never generates more than the budget counted (engine_body)."""
        named = self.named_limit(body)
        if named is not None:
            return named
        return self.default_limit if self.default_limit is not None else room

    def output_ceiling(self, body: dict[str, Any], *, room: int) -> int:
        """The most output tokens the request may generate, all answers together."""
        return self.output_limit(body, room=room) * self.answers(body)

    def limited(self, body: dict[str, Any], *, room: int, default: int | None = None,
                context: int | None = None) -> dict[str, Any]:
        """A body that names no output limit, with the one the budget counted for it named
        (`output_limit` of `room`), lowered to the model's own `default` (its generation
        config's, which an engine applies to a request naming none) and to its whole
        `context` (vLLM refuses a limit past it: where the registry does not say the
        model's max_model_len, the room is the service's cap): what an engine sends on,
        so that no request generates more than the budget counted. A limit the body
        names is the user's, sent as it is; `room` 0: the body as it is."""
        if not room or self.named_limit(body) is not None:
            return body
        limit = min(value for value in (self.output_limit(body, room=room), default, context)
                    if value)
        return {**body, self.limit_field: limit}

    def deterministic(self, body: dict[str, Any]) -> bool:
        """Whether the answer is fully determined by the body (greedy sampling, or a fixed
        seed): identical requests are then computed once."""
        return body.get("temperature", 1) == 0 or body.get("seed") is not None

    # The url whose serving layer an engine calls for this endpoint (a remote server's
    # route; in process, `vllm` names the serving object): its own, unless it runs as
    # another endpoint's call and builds its answer from that one's (`from_serving`).
    @property
    def serving_url(self) -> str:
        return self.url

    def engine_body(self, body: dict[str, Any], *,
                    options: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The body as an engine sends it on (what a batch cannot ask for, set); `options`
        are the model's."""
        return body

    def from_serving(self, body: dict[str, Any], answer: dict[str, Any], *,
                     options: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The endpoint's wire response from the serving layer's successful `answer` to
        `engine_body(body)`: the answer itself, unless the endpoint runs as another's
        call."""
        return answer

    def calls_functions(self, body: dict[str, Any]) -> bool:
        """Whether the body offers function tools that vLLM answers as calls only with a
        tool call parser (and would otherwise answer as plain text)."""
        return False

    # -- the answer ---------------------------------------------------------------------

    def respond(self, body: dict[str, Any], result: Any) -> dict[str, Any]:
        """The wire response of a `Generation` or `Pooled` result, shaped as vLLM's."""
        raise NotImplementedError

    def error_body(self, status: int, openai: dict[str, Any]) -> dict[str, Any]:
        """The error body of this endpoint's API from an OpenAI error body."""
        return openai

    def json_format(self, body: dict[str, Any]) -> Any:
        """Where the body asks for its output's format (chat's `response_format`), else
        None."""
        return None

    def output_texts(self, body: dict[str, Any]) -> list[tuple[str, str | None]]:
        """(text, finish_reason) of each answer of a response body; "length" is the stop
        at the output-token cap. [] where nothing is generated."""
        return []

    def usage(self, body: dict[str, Any]) -> tuple[int, int, int]:
        """(prompt, completion, cached prompt) tokens of a response body's usage."""
        return openai_usage(body)

    def reasoning_tokens(self, body: dict[str, Any]) -> int:
        """Of a response body's completion tokens, those spent reasoning, as its engine's
        reasoning parser counted them: OpenAI's
        `usage.completion_tokens_details.reasoning_tokens` (0 where there is none)."""
        details = (body.get("usage") or {}).get("completion_tokens_details") or {}
        return int(details.get("reasoning_tokens") or 0)

    # -- the dashboard ------------------------------------------------------------------

    def show_request(self, body: dict[str, Any]) -> str:
        """The human part of a request body: here a `messages` list as chat messages, else
        its prompt or input (also what a body this endpoint cannot read shows)."""
        messages = body.get("messages")
        if isinstance(messages, list):
            return show_messages(messages)
        for key in ("prompt", "input"):
            if key in body:
                value = body[key]
                return value if isinstance(value, str) else json.dumps(value,
                                                                       ensure_ascii=False)
        return ""

    def show_response(self, body: dict[str, Any]) -> str | None:
        """The human part of a response body, None when the body is not this endpoint's
        answer."""
        return None

    # -- the echo model (engine/echo.py, test-only) --------------------------------------

    def echo(self, body: dict[str, Any], model: EchoModel) -> dict[str, Any]:
        """The echo model's answer to a generating request: its words, cut at the output
        limit (finish "length") and at what the prompt leaves of the context. Raises
        EchoRefusal for what the model refuses, KeyError and the like for a body it cannot
        read."""
        if not body.get(self.prompt_field):  # a body without its prompt
            raise KeyError(self.prompt_field)
        prompt_tokens, words, thought = self.echo_words(body, model)
        max_tokens = self.named_limit(body) or model.default_max_tokens
        if model.lower:
            words = [word.lower() for word in words]
        if prompt_tokens >= model.max_model_len or (max_tokens or 0) > model.max_model_len:
            raise context_refusal(prompt_tokens + (max_tokens or 0), model.max_model_len)
        max_tokens = min(max_tokens or model.max_model_len, model.max_model_len - prompt_tokens)
        # The thought comes first and takes its share of the limit, as a reasoning model's
        # does: a limit it reaches leaves no answer.
        thinking = (thought or [])[:max_tokens]
        answer = words[:max_tokens - len(thinking)]
        return self.respond(body, Generation(
            model=body.get("model") or model.name, text=" ".join(answer),
            cut=len(thought or []) + len(words) > max_tokens,
            prompt_tokens=prompt_tokens, output_tokens=len(thinking) + len(answer),
            n=body.get("n") or 1,
            reasoning=" ".join(thinking) if thought is not None else None,
            reasoning_tokens=len(thinking)))

    def echo_words(self, body: dict[str, Any],
                   model: EchoModel) -> tuple[int, list[str], list[str] | None]:
        """(prompt tokens, answer words, thought words or None: no reasoning) of a request
        on the echo model; here the chat kind's: it answers the last user message, after
        the model's lead."""
        messages = self.messages(body)
        prompt_tokens = sum(len(" ".join(text_parts(m.get("content"))).split())
                            for m in messages)
        last_user = next((" ".join(text_parts(m.get("content")))
                          for m in reversed(messages) if m.get("role") == "user"), "")
        thought = ["think:", *last_user.split()] if model.reasons else None
        return prompt_tokens, [model.lead, *last_user.split()], thought


class Pooling(Endpoint):
    """An endpoint of pooling models: nothing generated, the same body the same answer."""

    pooling = True

    def output_ceiling(self, body: dict[str, Any], *, room: int) -> int:
        return 0

    def limited(self, body: dict[str, Any], *, room: int, default: int | None = None,
                context: int | None = None) -> dict[str, Any]:
        return body

    def deterministic(self, body: dict[str, Any]) -> bool:
        return True
