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

from engine.endpoints import CHAT, COMPLETIONS
from engine.prefix_limit import PromptBlocks

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
    # One of engine.endpoints.ENDPOINTS.
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
    # 200 with the endpoint's response object (chat.completion, text_completion, an
    # embeddings list or a Responses `response`, each with `usage`; vLLM's score list or
    # rerank results; an Anthropic Message), or 4xx with its error body (OpenAI's
    # {"error": {...}}, or Anthropic's: `Endpoint.error_body`).
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
