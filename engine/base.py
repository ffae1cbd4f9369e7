"""The one narrow interface between the batch service and an inference engine.

Nothing in `engine/` imports Django: the worker hands plain requests in and gets plain
results out. A request is one line of a batch input file, already validated; a result is
the OpenAI response body the output (or error) file will carry for it.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from abc import ABC, abstractmethod
from collections.abc import Coroutine, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from engine.endpoints import CHAT, COMPLETIONS
from engine.prefix_limit import PromptBlocks

log = logging.getLogger(__name__)
T = TypeVar("T")

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
    # group of a grouped shard, jobs.formats.prefix_keys): the engine has the first one compute it
    # before the others start, so they all find it in its prefix cache.
    prefix: int = 0
    # The most output tokens of one answer when the body names no limit: what the budget
    # counted for it (the model's context less its prompt, at most the service's cap). The
    # engine sends it as the endpoint's limit field, or its model's own default limit when
    # lower (`Endpoint.limited`); 0: the engine's own default.
    output_room: int = 0


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


@dataclass(frozen=True)
class Exhausted:
    """The feeder's last word: how many requests it handed to the engine in this run."""

    count: int


@dataclass(frozen=True)
class Failed:
    """The run fails with `error` (the caller's iterable raised, or the engine died)."""

    error: BaseException


class LoopEngine(Engine):
    """An engine whose requests are tasks on an asyncio event loop it owns in a background
    thread (vLLM in process, the remote server's HTTP client). The worker is not asyncio
    based: `run` feeds the loop from a second thread (the input iterable may block, and
    must never block the loop) and hands results back through a queue. A subclass starts
    the loop and gives one request's coroutine (`_serve`) and what its ended task comes to
    (`_outcome`)."""

    spec: ModelSpec
    # Names the threads of this engine ("vllm": vllm-feed-<model>).
    thread_prefix: str
    _loop: asyncio.AbstractEventLoop
    _tasks: dict[str, asyncio.Task[Any]]
    # Requests cancelled through `abort` (their tasks may end otherwise than cancelled).
    _aborted: set[str]
    _closed: bool
    _thread: threading.Thread
    # How long `close` waits for the loop's thread once its shutdown has run.
    close_timeout: float = 30

    @abstractmethod
    def _serve(self, req: EngineRequest) -> Coroutine[Any, Any, Any]:
        """One request, on the loop."""

    @abstractmethod
    def _outcome(self, request_id: str, task: asyncio.Task[Any]) -> EngineResult | Failed:
        """What a request's task that ended by itself (not aborted) comes to; `Failed`
        fails the whole run."""

    @abstractmethod
    async def _shutdown(self) -> None:
        """Ends the requests on the loop and releases what the engine holds, on the loop."""

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Runs `coro` on the engine's loop from another thread and waits for it."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def close(self) -> None:
        """Shuts the engine down (`_shutdown`), then stops its loop and thread. Once only:
        a failed shutdown is logged, and the loop stops all the same."""
        if self._closed:
            return
        self._closed = True
        if self._loop.is_running():
            try:
                self._call(self._shutdown())
            except Exception:
                log.exception("%s engine %s: shutdown", self.thread_prefix, self.spec.name)
            finally:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join(timeout=self.close_timeout)
        if not self._loop.is_running():
            self._loop.close()

    def run(self, requests: Iterable[EngineRequest]) -> Iterator[EngineResult]:
        if self._closed:
            raise EngineError("engine is closed")
        results: queue.SimpleQueue[EngineResult | Exhausted | Failed] = queue.SimpleQueue()
        # A slot is taken before a request is pulled and given back when its result is
        # yielded: at most max_in_flight requests are inside the engine or waiting to be
        # consumed, so memory stays flat whatever the input size.
        slots = threading.Semaphore(self.max_in_flight)
        stop = threading.Event()
        mine: set[str] = set()  # request ids of this run not yet yielded

        def feed() -> None:
            count = 0
            try:
                source = iter(requests)
                while True:
                    slots.acquire()
                    if stop.is_set():
                        return
                    try:
                        req = next(source)
                    except StopIteration:
                        break
                    if stop.is_set():
                        return
                    count += 1
                    mine.add(req.request_id)
                    self._loop.call_soon_threadsafe(self._submit, req, results)
            except BaseException as e:  # the caller's iterable failed: re-raised in run()
                results.put(Failed(e))
                return
            results.put(Exhausted(count))

        feeder = threading.Thread(target=feed, name=f"{self.thread_prefix}-feed-{self.spec.name}",
                                  daemon=True)
        feeder.start()
        expected: int | None = None
        done = 0
        try:
            while expected is None or done < expected:
                item = results.get()
                if isinstance(item, Exhausted):
                    expected = item.count
                elif isinstance(item, Failed):
                    raise item.error
                else:
                    done += 1
                    mine.discard(item.request_id)
                    yield item
                    # Given back once the caller took the result (it asks for the next one),
                    # so pulled-but-not-consumed requests never exceed max_in_flight.
                    slots.release()
        finally:
            # Normal end, or the caller stopped early / an error: free the feeder and make
            # sure nothing of this run keeps the engine busy.
            stop.set()
            slots.release()
            if mine:
                self.abort(list(mine))

    def _submit(self, req: EngineRequest, results: queue.SimpleQueue[Any]) -> None:
        """On the loop: start one request."""
        task = self._loop.create_task(self._serve(req))
        self._tasks[req.request_id] = task
        task.add_done_callback(lambda t: self._finish(req.request_id, t, results))

    def _finish(self, request_id: str, task: asyncio.Task[Any],
                results: queue.SimpleQueue[Any]) -> None:
        """On the loop: a request's task ended; hand its result to the consumer."""
        self._tasks.pop(request_id, None)
        aborted = request_id in self._aborted
        self._aborted.discard(request_id)
        if aborted or task.cancelled():
            results.put(EngineResult(request_id, ABORTED_STATUS, aborted=True))
        else:
            results.put(self._outcome(request_id, task))

    def abort(self, request_ids: Iterable[str]) -> None:
        ids = list(request_ids)
        if ids and not self._closed:
            self._loop.call_soon_threadsafe(self._cancel, ids)

    def _cancel(self, ids: list[str]) -> None:
        """On the loop. Cancelling the task stops the request where it runs (vLLM aborts
        it in its engine; the remote server, when its HTTP connection closes). vLLM's
        serving layer turns the cancellation into a "Client disconnected" error body, so
        the ids cancelled here are remembered as aborted."""
        for request_id in ids:
            task = self._tasks.get(request_id)
            if task is not None and not task.done():
                self._aborted.add(request_id)
                task.cancel()
