"""The one narrow interface between the batch service and an inference engine.

Nothing in `engine/` imports Django: the worker hands plain requests in and gets plain
results out. A request is one line of a batch input file, already validated; a result is
the OpenAI response body the output (or error) file will carry for it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from engine.prefix_limit import PromptBlocks

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
EMBEDDINGS = "/v1/embeddings"
RESPONSES = "/v1/responses"
# Anthropic's Messages API (a Message Batch's requests): vLLM's Anthropic serving layer,
# which renders the request through the chat one, so every model serving CHAT serves it.
MESSAGES = "/v1/messages"
# vLLM's score and rerank APIs: a score request pairs the inputs of its two sides (1:1, 1:N
# or N:N) and answers one score per pair; a rerank request orders documents by their
# relevance to one query. A pooling model serves them: a cross-encoder scores each pair,
# an embeddings model (the default here) the cosine similarity of the two embeddings.
SCORE = "/v1/score"
RERANK = "/v1/rerank"
ENDPOINTS = (CHAT, COMPLETIONS, EMBEDDINGS, RESPONSES, MESSAGES, SCORE, RERANK)
# The endpoints of pooling models: no output tokens and no sampling (the same request gets
# the same answer), no generated text to check, retry or prefix-group.
POOLING_ENDPOINTS = (EMBEDDINGS, SCORE, RERANK)
# The names vLLM's ScoreRequest accepts for a score request's two sides, one pair a body.
SCORE_SIDES = (("queries", "documents"), ("queries", "items"), ("text_1", "text_2"),
               ("data_1", "data_2"))

# Anthropic's error types by HTTP status (its documented "HTTP errors"); any other status
# is the nearest of them: another 4xx an invalid request, another 5xx an API error.
ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    """An Anthropic error object: {"type": "error", "error": {"type", "message"}}, the body
    of the API's refusals and of an `errored` batch result alike."""
    kind = ANTHROPIC_ERROR_TYPES.get(status) or (
        "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def text_parts(value: Any) -> list[str]:
    """The texts of a message's `content`, a `prompt`, an `input`, an Anthropic `system` or
    a Message's `content`: a string itself; in a list, its strings and the `text` of its
    content parts (OpenAI's parts and Anthropic's text blocks alike). Token ids, images and anything
    else carry no text. The one definition of "the text of a prompt", used by validation
    (estimates, content rules), token counting, the echo engine and the dashboard."""
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


def request_messages(url: str, body: dict[str, Any]) -> list[Any]:
    """The chat messages a chat, Responses or Messages request puts through the model's
    chat template, each a dict with `role` and `content` (whose texts are `text_parts`); [] for
    other endpoints. A chat body's are its `messages` themselves (the list, not a copy:
    validation calls this for every line; a body not yet validated may hold other items
    there). A Responses body's are built as vLLM builds them: `instructions` as a system
    message, a string `input` as one user message, else its items with a role (messages),
    and each function_call_output as a tool message carrying its output; function calls
    and reasoning items carry no prompt text. A Messages body's are its `system` and
    `messages`. The one definition of "the messages of a
    prompt", beside `text_parts`, used by validation, token counting, prefix keys, the
    echo engine and the dashboard alike."""
    if url == CHAT:
        messages = body.get("messages")
        return messages if isinstance(messages, list) else []
    if url == MESSAGES:
        # Its `system` first, as one system message: vLLM's Anthropic layer renders it so,
        # its text blocks joined as they are.
        system = body.get("system")
        head = [{"role": "system", "content": "".join(text_parts(system))}] if system else []
        messages = body.get("messages")
        return head + (messages if isinstance(messages, list) else [])
    if url != RESPONSES:
        return []
    found: list[Any] = []
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:
        found.append({"role": "system", "content": instructions})
    value = body.get("input")
    if isinstance(value, str):
        found.append({"role": "user", "content": value})
    elif isinstance(value, list):
        for item in value:
            if not isinstance(item, dict):
                continue
            if isinstance(item.get("role"), str):
                found.append({"role": item["role"], "content": item.get("content")})
            elif item.get("type") in ("function_call_output", "custom_tool_call_output"):
                found.append({"role": "tool", "content": item.get("output")})
    return found


def score_pair(body: dict[str, Any]) -> tuple[str, str] | None:
    """The pair of SCORE_SIDES a score body names its sides with; None when it names none,
    one side only, or sides of two pairs."""
    named = {name for pair in SCORE_SIDES for name in pair if name in body}
    return next((pair for pair in SCORE_SIDES if named == set(pair)), None)


def score_sides(url: str, body: dict[str, Any]) -> list[tuple[str, list[Any]]]:
    """The two sides a score or rerank body pairs, each as (field name, inputs): a rerank's
    query and documents, a score's sides by the names it uses (`score_pair`). A single
    input is a list of one. Each input is given as its content, a string or a list of
    content parts (vLLM's `{"content": [...]}` inputs), whose texts are `text_parts`.
    [] for other endpoints and for a score body without one pair. The one definition of
    "the inputs of a score request", used by validation, token counting, the echo engine
    and the dashboard alike."""
    names = ("query", "documents") if url == RERANK else (
        score_pair(body) if url == SCORE else None)
    if names is None:
        return []
    sides = []
    for name in names:
        value = body.get(name)
        inputs = value if isinstance(value, list) else [value]
        sides.append((name, [item.get("content") if isinstance(item, dict) else item
                             for item in inputs]))
    return sides


# The status an aborted request's EngineResult carries (nginx's "client closed request");
# callers look at `aborted` first.
ABORTED_STATUS = 499


class EngineError(Exception):
    """The engine itself failed (could not start, crashed): the whole shard is retried.

    A single bad request is never an EngineError; it is an `EngineResult` with a 4xx status.
    """


@dataclass(frozen=True)
class EngineRequest:
    # Unique among the requests in flight in this engine; the worker uses "<shard>:<line>".
    request_id: str
    # One of ENDPOINTS.
    url: str
    # The request body exactly as the batch line carries it (model name already checked).
    body: dict[str, Any]
    # When `body["model"]` names a LoRA adapter of this engine's model: the adapter's local
    # folder (a PEFT adapter_config.json and its weights). The engine loads it on first
    # use and keeps it under that name; empty for the base model's own requests.
    adapter_path: str = ""
    # Requests share prefix cache entries only with requests of the same salt (vLLM's
    # cache_salt): the worker gives each owner's requests their own, so a cache hit, which
    # every answer reports in its usage, tells nothing of another user's prompts. At most
    # 128 characters, none of '@', '/', '\\' or NUL (vLLM's rule); empty: no salt.
    cache_salt: str = ""
    # Requests with the same nonzero `prefix` (and salt) share a long prompt prefix (a
    # group of a grouped shard, jobs.prefix): the engine has the first one compute it
    # before the others start, so they all find it in its prefix cache.
    prefix: int = 0


@dataclass(frozen=True)
class EngineResult:
    request_id: str
    # 200 with an OpenAI response object (chat.completion, text_completion, an embeddings
    # list or a Responses `response`, each with `usage`; vLLM's score list or rerank
    # results for SCORE and RERANK), or 4xx with an OpenAI error
    # body {"error": {...}}; for MESSAGES an Anthropic Message (with its `usage`) or an
    # `anthropic_error` body.
    status_code: int
    body: dict[str, Any] = field(default_factory=dict)
    # True when the request was aborted through `Engine.abort` before it finished; `body`
    # is then empty and the caller decides what to write for it.
    aborted: bool = False
    # The full blocks of its prompt the prefix cache could serve another request (None
    # where the engine has no prefix cache): what the limit of caching is counted from.
    prompt_blocks: PromptBlocks | None = None


@dataclass(frozen=True)
class ModelSpec:
    """One model a deployment serves, as declared in settings.BATCHWEB_MODELS."""

    # The name users put in the `model` field of a request.
    name: str
    # "vllm" (GPU and CPU alike: the installed vLLM build decides the device), "remote"
    # (an OpenAI-compatible server that serves it: engine/remote.py) or "echo" (test-only,
    # no model).
    backend: str
    # A local Hugging Face style folder; empty for the echo backend.
    path: str = ""
    # The endpoints this model serves.
    endpoints: tuple[str, ...] = (CHAT, COMPLETIONS)
    # Passed to the engine (dtype, max_model_len, max_num_seqs, tensor_parallel_size, ...).
    options: dict[str, Any] = field(default_factory=dict)
    # Where `prepare_model` gets the weights from when `path` does not exist yet.
    source: str = ""


class Engine(ABC):
    """Continuous batching behind a pull-based stream.

    `run` pulls requests lazily from the iterable it is given (which may block while the
    caller has nothing to hand in), keeps at most `max_in_flight` of them inside the engine,
    and yields each result as soon as it finishes, in completion order. It returns after the
    iterable is exhausted and every pulled request has produced a result. Memory stays flat
    however many requests pass through.
    """

    max_in_flight: int
    # Tokens of KV cache, hence the most prompt prefix the engine can keep for reuse; 0 for
    # an engine without a prefix cache. Validation plans grouped shards for a cache of
    # BATCHWEB_PREFIX_CACHE_TOKENS: workers log theirs so the two can be matched.
    prefix_cache_tokens: int = 0

    @property
    def batch_size(self) -> int:
        """How many requests the engine computes at once (vLLM's max_num_seqs). A worker
        holding this many takes no more work, so idle workers get the next shards."""
        return self.max_in_flight

    @abstractmethod
    def run(self, requests: Iterable[EngineRequest]) -> Iterator[EngineResult]: ...

    @abstractmethod
    def abort(self, request_ids: Iterable[str]) -> None:
        """Stop these requests if they are in flight; each still yields one result, aborted."""

    def provenance(self) -> dict[str, Any]:
        """What this engine is (engine.provenance.Provenance as JSON: the model's files and
        their hash, the engine and its version, dtype, parallelism, the sampling defaults it
        applies), recorded on every shard it runs; {} when the engine cannot say."""
        return {}

    def close(self) -> None:  # noqa: B027 (optional hook, not abstract)
        """Release the model and any engine process."""
