"""TEST-ONLY backend: no model, deterministic answers shaped like vLLM's.

Never a default: a deployment gets it only by declaring `backend="echo"`. It exists so the
orchestration (sharding, retries, cancellation, output files) can be tested and benchmarked
on a million requests without loading a model.

- every answer is built by the request's endpoint (engine/endpoints/) from what was
  computed (`Generation`, `Pooled`), so the shapes are the endpoints', not this file's.
- chat: content is "echo: " + the last user message's text; completions echo the prompt;
  responses are answered as chat (over `request_messages`: instructions, then input), in
  vLLM's Response shape: one output message, status "incomplete" when cut at
  max_output_tokens (tokens capped by it as by max_tokens).
- tokens are whitespace-separated words; the output is cut at max_tokens (or
  max_completion_tokens) words, finish_reason "length", else "stop"; `n` choices.
- a request naming a LoRA adapter (`adapter_path` set) answers "echo+<adapter>:" where
  the base model answers "echo:" (completions gain it in front); refused as vLLM refuses
  it when the model's options lack enable_lora or the folder holds no adapter_config.json.
- embeddings: an 8-dim vector per input derived from sha256 of the input.
- no prefix cache (usage reports 0 cached tokens), so a request's `cache_salt` changes
  nothing here: there is no cache to share between owners.
- score and rerank: a pair's score is the cosine similarity of its two inputs' echo
  embeddings (as vLLM scores pairs on an embeddings model); rerank orders the documents by
  it and keeps `top_n`. Shaped as vLLM's ScoreResponse and RerankResponse.
- messages (Anthropic): a Message whose one text block is "echo: " + the last user
  message's text, stop_reason "max_tokens" when cut, else "end_turn"; errors in
  Anthropic's shape.
- prompt words >= options["max_model_len"] (default 2048), or an output limit over it ->
  400 like vLLM; the output is cut to what the prompt leaves (as vLLM does).
- bodies arrive validated (their endpoint's `check` runs before any engine); a body it
  still cannot read is one plain 400 (its endpoint's error shape).
- options["seconds_per_request"] (default 0) sleeps that long per request (slow shards);
  options["max_in_flight"] (default 64) bounds concurrency like the real engine.
- options["version"] (default "1"): a stand-in for the model's weights, hashed as its
  provenance's model hash. Another version answers in lower case, as new weights change
  some answers (those with capitals) and not others: what drift tests compare.
- options["sampling_defaults"] (default none): the defaults the engine applies to what a
  request leaves unset, as vLLM's generation config does; here only "max_tokens" (chat,
  completions, responses) changes an answer. Recorded in the provenance.
- options["reasoning_parser"] (vLLM's option; default none): the model reasons before it
  answers, as a reasoning model served with a parser does. A chat-kind answer (chat,
  responses, messages) first thinks "think: " + the last user message's text, then
  answers; both count as output tokens and share the output limit (the thought first), and
  the thought's words are its reasoning tokens: chat's message `reasoning` and
  `usage.completion_tokens_details.reasoning_tokens`, a Responses reasoning item and
  `usage.output_tokens_details.reasoning_tokens`, a Message's thinking block. Without the
  option, usage has no completion_tokens_details, as vLLM's without a parser.
- options["request_log"] (default none): a file to which the id of every request the engine
  computes (not the aborted ones) is appended, one per line, flushed at once, so tests count
  from the engine's own side what a worker computed twice, even across a SIGKILL.
"""

from __future__ import annotations

import hashlib
import heapq
import queue
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from engine.base import (
    ABORTED_STATUS,
    Engine,
    EngineError,
    EngineRequest,
    EngineResult,
    ModelSpec,
)
from engine.endpoints import REGISTRY
from engine.endpoints.base import EchoModel, EchoRefusal, ModelOptionsError, openai_error


class EchoEngine(Engine):
    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec
        opts = spec.options
        self.max_model_len = int(opts.get("max_model_len", 2048))
        self.seconds_per_request = float(opts.get("seconds_per_request", 0))
        self.max_in_flight = int(opts.get("max_in_flight", 64))
        self.version = str(opts.get("version", "1"))
        self.sampling_defaults = dict(opts.get("sampling_defaults") or {})
        self.reasons = bool(opts.get("reasoning_parser"))
        log_path = opts.get("request_log") or ""
        self._request_log = open(log_path, "a", buffering=1) if log_path else None  # noqa: SIM115
        self._lock = threading.Lock()
        self._in_flight: set[str] = set()
        self._aborted: set[str] = set()
        # Wakes the clocks of running streams: a request was added, aborted, or the stream
        # stopped. `_aborts` counts the aborts, so a clock rescans its requests only then.
        self._clock = threading.Condition()
        self._aborts = 0
        self._closed = False

    # -- one request --------------------------------------------------------------------

    def handle(self, url: str, body: dict[str, Any],
               adapter_path: str = "") -> tuple[int, dict[str, Any]]:
        """(status, body) for one request body, shaped as vLLM's. Bodies reach an engine
        validated (its endpoint's `check`, for every engine alike), so the only checks here
        are the model's: what it serves, its context length and its adapters."""
        endpoint = REGISTRY.get(url)
        if endpoint is None:
            return 400, openai_error(400, f"model {self.spec.name!r} does not serve {url}",
                                     "url")
        lead = "echo:"
        if adapter_path:
            problem = self._adapter_problem(body.get("model"), adapter_path)
            if problem is not None:
                status, refused = problem
                return status, endpoint.error_body(status, openai_error(
                    status, refused, "model",
                    kind="BadRequestError" if status == 400 else "NotFoundError"))
            lead = f"echo+{body.get('model')}:"
        model = EchoModel(
            name=self.spec.name, max_model_len=self.max_model_len, lead=lead,
            adapter=bool(adapter_path), lower=self.version != "1", reasons=self.reasons,
            default_max_tokens=self.sampling_defaults.get("max_tokens"),
            options=self.spec.options)
        try:
            return 200, endpoint.echo(body, model)
        except EchoRefusal as refusal:
            return refusal.status, endpoint.error_body(refusal.status, refusal.body)
        except ModelOptionsError as e:
            return 400, endpoint.error_body(400, openai_error(400, str(e), "model"))
        except (KeyError, TypeError, AttributeError, ValueError):
            return 400, endpoint.error_body(400, openai_error(
                400, "The echo engine cannot answer this request body."))

    # -- the stream ---------------------------------------------------------------------

    def run(self, requests: Iterable[EngineRequest]) -> Iterator[EngineResult]:
        if self._closed:
            raise EngineError("engine is closed")
        if self.seconds_per_request <= 0:
            yield from self._run_inline(requests)
        else:
            yield from self._run_threaded(requests)

    def _run_inline(self, requests: Iterable[EngineRequest]) -> Iterator[EngineResult]:
        # The benchmark path: each request is answered as it is pulled, so none is ever in
        # flight while the caller runs (abort has nothing to stop) and the bound is 1.
        for req in requests:
            yield self._compute(req)

    def _run_threaded(self, requests: Iterable[EngineRequest]) -> Iterator[EngineResult]:
        # Slow requests: up to max_in_flight of them wait concurrently, like a batch would.
        # One clock thread holds them all (a heap of deadlines) and sleeps until the next
        # deadline or an abort, so a waiting request costs no CPU however many there are.
        results: queue.SimpleQueue[EngineResult | BaseException | None] = queue.SimpleQueue()
        slots = threading.Semaphore(self.max_in_flight)
        stop = threading.Event()
        timers: list[tuple[float, int, EngineRequest]] = []
        count = 0

        def feed() -> None:
            nonlocal count
            try:
                source = iter(requests)
                while True:
                    slots.acquire()  # before pulling: never hold more than the bound
                    if stop.is_set():
                        return
                    req = next(source, None)
                    if req is None:
                        break
                    with self._clock:
                        with self._lock:
                            self._in_flight.add(req.request_id)
                        heapq.heappush(timers, (time.monotonic() + self.seconds_per_request,
                                                count, req))
                        count += 1
                        self._clock.notify_all()
            except BaseException as e:
                results.put(e)
                return
            results.put(None)

        def clock() -> None:
            aborts_seen = -1
            with self._clock:
                while not stop.is_set():
                    now = time.monotonic()
                    due = []
                    while timers and timers[0][0] <= now:
                        due.append(heapq.heappop(timers)[2])
                    if aborts_seen != self._aborts:  # aborted requests end at once
                        aborts_seen = self._aborts
                        with self._lock:
                            aborted_ids = self._aborted & {t[2].request_id for t in timers}
                        if aborted_ids:
                            due += [t[2] for t in timers if t[2].request_id in aborted_ids]
                            timers[:] = [t for t in timers
                                         if t[2].request_id not in aborted_ids]
                            heapq.heapify(timers)
                    for req in due:
                        with self._lock:
                            self._in_flight.discard(req.request_id)
                            aborted = req.request_id in self._aborted
                            self._aborted.discard(req.request_id)
                        results.put(EngineResult(req.request_id, ABORTED_STATUS, aborted=True)
                                    if aborted else self._compute(req))
                    self._clock.wait(timers[0][0] - time.monotonic() if timers else None)

        feeder = threading.Thread(target=feed, daemon=True)
        ticker = threading.Thread(target=clock, daemon=True)
        feeder.start()
        ticker.start()
        fed_all = False
        done = 0
        try:
            while not fed_all or done < count:
                item = results.get()
                if item is None:
                    fed_all = True
                elif isinstance(item, BaseException):
                    raise item
                else:
                    done += 1
                    yield item
                    # After the caller took it: pulled-but-not-consumed never exceeds the bound.
                    slots.release()
        finally:
            stop.set()
            slots.release()
            with self._clock:
                self._clock.notify_all()

    def _compute(self, req: EngineRequest) -> EngineResult:
        endpoint = REGISTRY.get(req.url)
        # As the in-process engine: the output limit the budget counted, named.
        request = endpoint.limited(req.body, room=req.output_room,
                                   default=self.sampling_defaults.get("max_tokens"),
                                   context=self.max_model_len) \
            if endpoint is not None else req.body
        status, body = self.handle(req.url, request, req.adapter_path)
        with self._lock:
            if self._request_log is not None and not self._request_log.closed:
                self._request_log.write(req.request_id + "\n")
        return EngineResult(req.request_id, status, body)

    def _adapter_problem(self, name: Any, path: str) -> tuple[int, str] | None:
        """As vLLM refuses an adapter: the model must load adapters (enable_lora), and the
        folder must hold a PEFT adapter."""
        if not self.spec.options.get("enable_lora"):
            return 400, (f"model {self.spec.name!r} does not load LoRA adapters (its options "
                         "do not set enable_lora)")
        if not (Path(path) / "adapter_config.json").is_file():
            return 404, f"Loading lora {name} failed: No adapter found for {path}"
        return None

    def provenance(self) -> dict[str, Any]:
        from engine.provenance import Provenance

        return Provenance(
            model=self.spec.name, model_source=self.spec.source or "echo",
            model_sha256=hashlib.sha256(f"echo:{self.version}".encode()).hexdigest(),
            engine="echo", engine_version=self.version,
            dtype=str(self.spec.options.get("dtype") or "none"),
            parallelism={"tensor_parallel_size": 1, "pipeline_parallel_size": 1},
            sampling_defaults=self.sampling_defaults).as_json()

    def abort(self, request_ids: Iterable[str]) -> None:
        with self._lock:
            for request_id in request_ids:
                if request_id in self._in_flight:
                    self._aborted.add(request_id)
        with self._clock:
            self._aborts += 1
            self._clock.notify_all()

    def close(self) -> None:
        self._closed = True
        with self._lock:
            if self._request_log is not None:
                self._request_log.close()
