"""TEST-ONLY backend: no model, deterministic answers shaped like vLLM's.

Never a default: a deployment gets it only by declaring `backend="echo"`. It exists so the
orchestration (sharding, retries, cancellation, output files) can be tested and benchmarked
on a million requests without loading a model.

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
- prompt words + max_tokens > options["max_model_len"] (default 2048) -> 400 like vLLM.
- bodies arrive validated (jobs.wire.check_body runs before any engine); a body it still
  cannot read is one plain 400.
- options["seconds_per_request"] (default 0) sleeps that long per request (slow shards);
  options["max_in_flight"] (default 64) bounds concurrency like the real engine.
- options["version"] (default "1"): a stand-in for the model's weights, hashed as its
  provenance's model hash. Another version answers in lower case, as new weights change
  some answers (those with capitals) and not others: what drift tests compare.
- options["sampling_defaults"] (default none): the defaults the engine applies to what a
  request leaves unset, as vLLM's generation config does; here only "max_tokens" (chat,
  completions, responses) changes an answer. Recorded in the provenance.
- options["request_log"] (default none): a file to which the id of every request the engine
  computes (not the aborted ones) is appended, one per line, flushed at once, so tests count
  from the engine's own side what a worker computed twice, even across a SIGKILL.
"""

from __future__ import annotations

import hashlib
import heapq
import math
import queue
import struct
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from engine.base import (
    ABORTED_STATUS,
    CHAT,
    COMPLETIONS,
    EMBEDDINGS,
    MESSAGES,
    RERANK,
    RESPONSES,
    SCORE,
    Engine,
    EngineError,
    EngineRequest,
    EngineResult,
    ModelSpec,
    anthropic_error,
    request_messages,
    score_sides,
    text_parts,
)


def _error(message: str, param: str | None = None) -> tuple[int, dict[str, Any]]:
    return 400, {"error": {"message": message, "type": "BadRequestError", "param": param,
                           "code": 400}}


def _context_error(tokens: int, limit: int) -> tuple[int, dict[str, Any]]:
    # The one refusal that depends on the model, not the body: vLLM's own wording.
    return _error(f"This model's maximum context length is {limit} tokens. However, you "
                  f"requested {tokens} tokens. Please reduce the length of the input.",
                  "input_tokens")


def _vector(text: str) -> list[float]:
    """An input's echo embedding: 8 floats in [-1, 1) from the 32 bytes of its sha256,
    deterministic and input-specific."""
    digest = hashlib.sha256(text.encode()).digest()
    return [(v / 32768.0) for v in struct.unpack("<16h", digest)[:8]]


def _cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    norms = math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))
    return dot / norms if norms else 0.0


def _response_object(body: dict[str, Any], text: str, finish: str, prompt_tokens: int,
                     output_tokens: int, model: str) -> dict[str, Any]:
    """A Responses `response` as vLLM's serving layer writes it (the fields readers use)."""
    content: list[dict[str, Any]] = [{"type": "output_text", "text": text, "annotations": [],
                                      "logprobs": None}]
    return {
        "id": f"resp_{uuid.uuid4().hex}", "object": "response", "created_at": int(time.time()),
        "model": body.get("model") or model, "status": "completed" if finish == "stop"
        else "incomplete", "incomplete_details": None if finish == "stop"
        else {"reason": "max_output_tokens"}, "instructions": body.get("instructions"),
        "metadata": body.get("metadata"), "background": False,
        "max_output_tokens": body.get("max_output_tokens"), "previous_response_id": None,
        "temperature": body.get("temperature", 1.0), "top_p": body.get("top_p", 1.0),
        "text": body.get("text"), "tools": body.get("tools") or [],
        "tool_choice": body.get("tool_choice", "auto"), "parallel_tool_calls": True,
        "truncation": body.get("truncation", "disabled"), "service_tier": "auto",
        "user": body.get("user"),
        "output": [{"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant",
                    "status": "completed", "content": content if text else []}],
        "usage": {"input_tokens": prompt_tokens, "output_tokens": output_tokens,
                  "total_tokens": prompt_tokens + output_tokens,
                  "input_tokens_details": {"cached_tokens": 0},
                  "output_tokens_details": {"reasoning_tokens": 0}},
    }


class EchoEngine(Engine):
    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec
        opts = spec.options
        self.max_model_len = int(opts.get("max_model_len", 2048))
        self.seconds_per_request = float(opts.get("seconds_per_request", 0))
        self.max_in_flight = int(opts.get("max_in_flight", 64))
        self.version = str(opts.get("version", "1"))
        self.sampling_defaults = dict(opts.get("sampling_defaults") or {})
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
        validated (jobs.wire.check_body, for every engine alike), so the only checks here
        are the model's: what it serves, its context length and its adapters."""
        lead = "echo:"
        if adapter_path:
            problem = self._adapter_problem(body.get("model"), adapter_path)
            if problem is not None:
                status, refused = problem
                if url == MESSAGES:
                    return status, anthropic_error(status, refused)
                return status, {"error": {"message": refused, "type": (
                    "BadRequestError" if status == 400 else "NotFoundError"),
                    "param": "model", "code": status}}
            lead = f"echo+{body.get('model')}:"
        try:
            if url == EMBEDDINGS:
                return self._embeddings(body)
            if url in (SCORE, RERANK):
                return self._scores(url, body)
            if url == MESSAGES:
                return self._messages(body, lead)
            if url in (CHAT, RESPONSES):
                # A body without its messages (input) is one it cannot read.
                if not body.get("messages" if url == CHAT else "input"):
                    raise KeyError(url)
                messages = request_messages(url, body)
                prompt_tokens = sum(len(" ".join(text_parts(m.get("content"))).split())
                                    for m in messages)
                last_user = next((" ".join(text_parts(m.get("content")))
                                  for m in reversed(messages) if m.get("role") == "user"), "")
                words = [lead, *last_user.split()]
            elif url == COMPLETIONS:
                words = " ".join(text_parts(body["prompt"])).split()
                if adapter_path:
                    words.insert(0, lead)
                prompt_tokens = len(words)
            else:
                return _error(f"model {self.spec.name!r} does not serve {url}", "url")
        except (KeyError, TypeError, AttributeError, ValueError):
            refusal = "The echo engine cannot answer this request body."
            return (400, anthropic_error(400, refusal)) if url == MESSAGES else _error(refusal)
        max_tokens = (body.get("max_completion_tokens") or body.get("max_tokens")
                      or body.get("max_output_tokens")
                      or self.sampling_defaults.get("max_tokens"))
        if self.version != "1":
            words = [word.lower() for word in words]
        n = body.get("n") or 1
        if prompt_tokens + (max_tokens or 0) > self.max_model_len:
            return _context_error(prompt_tokens + (max_tokens or 0), self.max_model_len)
        finish = "length" if max_tokens is not None and len(words) > max_tokens else "stop"
        text = " ".join(words[:max_tokens])
        completion_tokens = len(words[:max_tokens]) * n
        common = {"created": int(time.time()), "model": body.get("model") or self.spec.name,
                  "usage": {"prompt_tokens": prompt_tokens,
                            "total_tokens": prompt_tokens + completion_tokens,
                            "completion_tokens": completion_tokens,
                            "prompt_tokens_details": None}}
        if url == RESPONSES:
            return 200, _response_object(body, text, finish, prompt_tokens,
                                         completion_tokens, self.spec.name)
        if url == CHAT:
            message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None,
                                       "tool_calls": []}
            return 200, {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
                         **common, "choices": [
                             {"index": i, "message": message, "logprobs": None,
                              "finish_reason": finish, "stop_reason": None}
                             for i in range(n)]}
        return 200, {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", **common,
                     "choices": [{"index": i, "text": text, "logprobs": None,
                                  "finish_reason": finish, "stop_reason": None}
                                 for i in range(n)]}

    def _messages(self, body: dict[str, Any], lead: str) -> tuple[int, dict[str, Any]]:
        """An Anthropic Message, as vLLM's Anthropic layer answers (its `usage` without the
        cache fields: this engine has no prefix cache)."""
        messages = body["messages"]
        texts = [body.get("system"), *(m.get("content") for m in messages)]
        prompt_tokens = sum(len(" ".join(text_parts(t)).split()) for t in texts)
        last_user = next((" ".join(text_parts(m.get("content")))
                          for m in reversed(messages) if m.get("role") == "user"), "")
        words = [lead, *last_user.split()]
        if self.version != "1":
            words = [word.lower() for word in words]
        max_tokens = body["max_tokens"]
        if prompt_tokens + max_tokens > self.max_model_len:
            status, error = _context_error(prompt_tokens + max_tokens, self.max_model_len)
            return status, anthropic_error(status, error["error"]["message"])
        cut = len(words) > max_tokens
        return 200, {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant",
                     "content": [{"type": "text", "text": " ".join(words[:max_tokens])}],
                     "model": body.get("model") or self.spec.name,
                     "stop_reason": "max_tokens" if cut else "end_turn", "stop_sequence": None,
                     "usage": {"input_tokens": prompt_tokens,
                               "output_tokens": len(words[:max_tokens])}}

    def _embeddings(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        inputs = body["input"]
        if isinstance(inputs, str):
            inputs = [inputs]
        data = []
        prompt_tokens = 0
        for i, text in enumerate(inputs):
            tokens = len(text.split())
            if tokens > self.max_model_len:
                return _context_error(tokens, self.max_model_len)
            prompt_tokens += tokens
            data.append({"index": i, "object": "embedding", "embedding": _vector(text)})
        return 200, {
            "id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
            "model": body.get("model") or self.spec.name, "data": data,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens,
                      "completion_tokens": 0, "prompt_tokens_details": None},
        }

    def _scores(self, url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """A score list (one score per pair, a single first input paired with each second
        one) or rerank results (the documents by relevance, the first `top_n`). Each input
        counts its words once, as vLLM embeds each input once."""
        (_, first), (_, second) = score_sides(url, body)
        texts = [" ".join(text_parts(content)) for content in first + second]
        for text in texts:
            if len(text.split()) > self.max_model_len:
                return _context_error(len(text.split()), self.max_model_len)
        prompt_tokens = sum(len(text.split()) for text in texts)
        queries, documents = texts[:len(first)], texts[len(first):]
        if len(queries) == 1:  # 1:N, as vLLM pairs them (else N:N)
            queries *= len(documents)
        scores = [_cosine(_vector(q), _vector(d))
                  for q, d in zip(queries, documents, strict=True)]
        model = body.get("model") or self.spec.name
        request_id = f"score-{uuid.uuid4().hex}"
        if url == SCORE:
            return 200, {
                "id": request_id, "object": "list", "created": int(time.time()),
                "model": model, "data": [{"index": i, "object": "score", "score": score}
                                         for i, score in enumerate(scores)],
                "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens,
                          "completion_tokens": 0, "prompt_tokens_details": None,
                          "completion_tokens_details": None}}
        # The most relevant first (ties in document order, as vLLM's stable sort).
        ranked = sorted(range(len(scores)), key=lambda i: -scores[i])
        results = [{"index": i, "document": {"text": second[i], "multi_modal": None}
                    if isinstance(second[i], str) else {"text": None, "multi_modal": second[i]},
                    "relevance_score": scores[i]}
                   for i in ranked[:body.get("top_n") or len(ranked)]]
        return 200, {"id": request_id, "model": model, "results": results,
                     "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}

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
        status, body = self.handle(req.url, req.body, req.adapter_path)
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
