"""TEST-ONLY backend: no model, deterministic answers shaped like vLLM's.

Never a default: a deployment gets it only by declaring `backend="echo"`. It exists so the
orchestration (sharding, retries, cancellation, output files) can be tested and benchmarked
on a million requests without loading a model.

- chat: content is "echo: " + the last user message's text; completions echo the prompt.
- tokens are whitespace-separated words; the output is cut at max_tokens (or
  max_completion_tokens) words, finish_reason "length", else "stop"; `n` choices.
- embeddings: an 8-dim vector per input derived from sha256 of the input.
- prompt words + max_tokens > options["max_model_len"] (default 2048) -> 400 like vLLM.
- options["seconds_per_request"] (default 0) sleeps that long per request (slow shards);
  options["max_in_flight"] (default 64) bounds concurrency like the real engine.
- options["request_log"] (default none): a file to which the id of every request the engine
  computes (not the aborted ones) is appended, one per line, flushed at once, so tests count
  from the engine's own side what a worker computed twice, even across a SIGKILL.
"""

from __future__ import annotations

import hashlib
import queue
import struct
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from typing import Any

from engine.base import (
    CHAT,
    COMPLETIONS,
    EMBEDDINGS,
    Engine,
    EngineError,
    EngineRequest,
    EngineResult,
    ModelSpec,
)

ABORTED_STATUS = 499  # same as engine.vllm_engine.ABORTED_STATUS


def _error(message: str, param: str | None = None, code: int = 400) -> tuple[int, dict[str, Any]]:
    return code, {
        "error": {"message": message, "type": "BadRequestError", "param": param, "code": code}
    }


def _text(content: Any) -> str:
    """A message's text: a string, or the text parts of a content-part list."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(
            p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"
        )
    return ""


class EchoEngine(Engine):
    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec
        opts = spec.options
        self.max_model_len = int(opts.get("max_model_len", 2048))
        self.seconds_per_request = float(opts.get("seconds_per_request", 0))
        self.max_in_flight = int(opts.get("max_in_flight", 64))
        self._lock = threading.Lock()
        self._in_flight: set[str] = set()
        self._aborted: set[str] = set()
        self._abort_event = threading.Event()  # wakes sleeping requests on abort
        self._closed = False
        log_path = opts.get("request_log") or ""
        self._request_log = open(log_path, "a", buffering=1) if log_path else None  # noqa: SIM115

    # -- one request --------------------------------------------------------------------

    def handle(self, url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """(status, body) for one request body, as vLLM would shape it."""
        if body.get("stream"):
            return _error("stream is not supported in batch requests", "stream")
        if url == EMBEDDINGS:
            return self._embeddings(body)
        if url not in (CHAT, COMPLETIONS):
            return _error(f"model {self.spec.name!r} does not serve {url}", "url")

        max_tokens = body.get("max_completion_tokens")
        if max_tokens is None:
            max_tokens = body.get("max_tokens")
        n = body.get("n", 1)
        if n is None:
            n = 1
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            return _error(f"n must be at least 1, got {n}.", "n")
        if max_tokens is not None and (
            not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1
        ):
            return _error(f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens")

        if url == CHAT:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                return _error("messages must be a non-empty list", "messages")
            prompt_tokens = sum(
                len(_text(m.get("content")).split()) for m in messages if isinstance(m, dict)
            )
            last_user = next(
                (
                    _text(m.get("content"))
                    for m in reversed(messages)
                    if isinstance(m, dict) and m.get("role") == "user"
                ),
                "",
            )
            words = ["echo:", *last_user.split()]
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list):  # one prompt per batch line; a list is joined
                prompt = " ".join(str(p) for p in prompt)
            if not isinstance(prompt, str):
                return _error("prompt must be a string", "prompt")
            words = prompt.split()
            prompt_tokens = len(words)

        if prompt_tokens + (max_tokens or 0) > self.max_model_len:
            return _error(
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, you requested {prompt_tokens + (max_tokens or 0)} tokens "
                f"({prompt_tokens} in the messages, {max_tokens or 0} in the completion). "
                "Please reduce the length of the messages or completion.",
                "input_tokens",
            )

        if max_tokens is not None and len(words) > max_tokens:
            words, finish = words[:max_tokens], "length"
        else:
            finish = "stop"
        text = " ".join(words)
        completion_tokens = len(words) * n
        usage = {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens,
            "prompt_tokens_details": None,
        }
        model = body.get("model") or self.spec.name
        created = int(time.time())
        if url == CHAT:
            choices: list[dict[str, Any]] = [
                {
                    "index": i,
                    "message": {"role": "assistant", "content": text, "refusal": None,
                                "tool_calls": []},
                    "logprobs": None,
                    "finish_reason": finish,
                    "stop_reason": None,
                }
                for i in range(n)
            ]
            return 200, {
                "id": f"chatcmpl-{uuid.uuid4().hex}",
                "object": "chat.completion",
                "created": created,
                "model": model,
                "choices": choices,
                "usage": usage,
            }
        choices = [
            {"index": i, "text": text, "logprobs": None, "finish_reason": finish,
             "stop_reason": None}
            for i in range(n)
        ]
        return 200, {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": choices,
            "usage": usage,
        }

    def _embeddings(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        inputs = body.get("input")
        if isinstance(inputs, str):
            inputs = [inputs]
        if not isinstance(inputs, list) or not inputs or not all(
            isinstance(x, str) for x in inputs
        ):
            return _error("input must be a string or a non-empty list of strings", "input")
        data = []
        prompt_tokens = 0
        for i, text in enumerate(inputs):
            tokens = len(text.split())
            if tokens > self.max_model_len:
                return _error(
                    f"This model's maximum context length is {self.max_model_len} tokens. "
                    f"However, you requested {tokens} tokens in the input for embedding "
                    "generation. Please reduce the length of the input.",
                    "input_tokens",
                )
            prompt_tokens += tokens
            # 8 floats in [-1, 1) from the 32 bytes of sha256: deterministic, input-specific.
            digest = hashlib.sha256(text.encode()).digest()
            vector = [(v / 32768.0) for v in struct.unpack("<16h", digest)[:8]]
            data.append({"index": i, "object": "embedding", "embedding": vector})
        return 200, {
            "id": f"embd-{uuid.uuid4().hex}",
            "object": "list",
            "created": int(time.time()),
            "model": body.get("model") or self.spec.name,
            "data": data,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens,
                      "completion_tokens": 0, "prompt_tokens_details": None},
        }

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
        # Slow requests: up to max_in_flight of them sleep concurrently, like a batch would.
        results: queue.SimpleQueue[EngineResult | BaseException | None] = queue.SimpleQueue()
        slots = threading.Semaphore(self.max_in_flight)
        stop = threading.Event()
        count = 0

        def serve(req: EngineRequest) -> None:
            deadline = time.monotonic() + self.seconds_per_request
            while not self._is_aborted(req.request_id) and not stop.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._abort_event.wait(min(left, 0.05))
            with self._lock:
                self._in_flight.discard(req.request_id)
                aborted = req.request_id in self._aborted or stop.is_set()
                self._aborted.discard(req.request_id)
            if aborted:
                results.put(EngineResult(req.request_id, ABORTED_STATUS, aborted=True))
            else:
                results.put(self._compute(req))

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
                    with self._lock:
                        self._in_flight.add(req.request_id)
                    count += 1
                    threading.Thread(target=serve, args=(req,), daemon=True).start()
            except BaseException as e:
                results.put(e)
                return
            results.put(None)

        feeder = threading.Thread(target=feed, daemon=True)
        feeder.start()
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

    def _compute(self, req: EngineRequest) -> EngineResult:
        status, body = self.handle(req.url, req.body)
        with self._lock:
            if self._request_log is not None and not self._request_log.closed:
                self._request_log.write(req.request_id + "\n")
        return EngineResult(req.request_id, status, body)

    def _is_aborted(self, request_id: str) -> bool:
        return request_id in self._aborted

    def abort(self, request_ids: Iterable[str]) -> None:
        with self._lock:
            for request_id in request_ids:
                if request_id in self._in_flight:
                    self._aborted.add(request_id)
        self._abort_event.set()
        self._abort_event.clear()

    def close(self) -> None:
        self._closed = True
        with self._lock:
            if self._request_log is not None:
                self._request_log.close()
