"""The remote backend: batch requests run on an OpenAI-compatible server that already
serves the model (`vllm serve`, SGLang, ...). A worker for it loads no weights.

Options (the model's `options` in BATCHWEB_MODELS_FILE):
    base_url             the server's OpenAI base URL, e.g. http://gpu1:8000/v1 (required)
    model                the model's name on the server (default: the model's name here)
    api_key_env          the environment variable holding the server's API key (optional)
    max_concurrency      the ceiling of requests in flight there, summed over every worker
                         that names the same base_url (default 64)
    initial_concurrency  where the adaptive limit starts (default 4)
    connect_timeout      seconds (default 10); request_timeout: seconds per attempt (600)
    max_retries          retries of one request on 429, 503, a timeout or a reset (8)
    backoff_base, backoff_max   full-jitter exponential backoff, seconds (0.5, 30)
    priority             vLLM's request `priority` for batch requests (default 10: later
                         than interactive requests at 0 on a server started with
                         --scheduling-policy priority; ignored by one without it); null:
                         not sent (a server that refuses unknown fields)
    cache_salt           send each owner's prefix cache salt (vLLM's `cache_salt`; default
                         true)
    latency_tolerance    the limit grows while a request's seconds per output token stay
                         within this factor of the lowest seen (default 2)
    metrics_url          vLLM's Prometheus endpoint (default: base_url's host + /metrics);
                         "" to not watch it
    max_in_flight        requests the worker hands in at once (default 2 x max_concurrency)
    redis_url            set by jobs/engines.py: the Redis holding the shared limit

Every request: a slot of the shared limit (engine/remote_limits.py), one POST, the slot
given back. 429 and 503 are retried after a full-jitter backoff of at least their
Retry-After, timeouts and resets likewise; each cuts the limit. A request still failing
after max_retries ends as a failed request carrying the server's own error. A server that
cannot be reached at all is waited for (backoff capped at backoff_max), never a failed
request: the batch waits (its page says so) until the server is back, the batch is
cancelled or it expires. `abort` cancels the HTTP request, which closes its connection;
`vllm serve` then aborts the request in its engine.

Threads: as engine/vllm_engine.py, one event loop in a background thread owns the HTTP
client and the Redis client; `run` (engine/base.py's `LoopEngine`) feeds it from a second
thread.
"""

from __future__ import annotations

import asyncio
import email.utils
import logging
import os
import random
import threading
import time
import uuid
from collections import deque
from collections.abc import Coroutine
from typing import Any, TypeVar

import httpx
import redis.asyncio as aioredis

from engine import remote_limits as limits
from engine.base import (
    EngineError,
    EngineRequest,
    EngineResult,
    LoopEngine,
    ModelSpec,
)
from engine.endpoints import REGISTRY
from engine.endpoints.base import openai_error

log = logging.getLogger(__name__)
T = TypeVar("T")

OPTIONS = {
    "base_url": None, "model": "", "api_key_env": "",
    "max_concurrency": limits.DEFAULT_CEILING,
    "initial_concurrency": 4, "connect_timeout": 10.0, "request_timeout": 600.0,
    "max_retries": 8, "backoff_base": 0.5, "backoff_max": 30.0, "priority": 10,
    "cache_salt": True, "latency_tolerance": 2.0, "metrics_url": None, "max_in_flight": None,
    "metrics_interval": 2.0, "redis_url": None,
}
# Answers that mean "too busy now": retried, and the limit is cut.
THROTTLED = (429, 503)
# The lowest seen latency drifts up by this factor a minute, so one lucky request does not
# hold the limit down for ever.
FLOOR_DRIFT = 1.25


def retry_after(value: str | None) -> float:
    """Seconds a Retry-After header asks for (delta-seconds or an HTTP date); 0 if none."""
    if not value:
        return 0.0
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return 0.0
    return max(0.0, when.timestamp() - time.time())


def backoff_seconds(attempt: int, *, base: float, cap: float, asked: float = 0.0) -> float:
    """Full jitter (uniform in [0, min(cap, base * 2^attempt)]), never less than what the
    server asked for in Retry-After."""
    return max(asked, random.uniform(0.0, min(cap, base * 2 ** attempt)))


def vllm_queue(text: str, model: str) -> tuple[float, float] | None:
    """(running, waiting) from vLLM's Prometheus text for `model` (every engine of it
    summed); None when the text is not vLLM's."""
    found = False
    running = waiting = 0.0
    for line in text.splitlines():
        if not line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting")):
            continue
        name, _, rest = line.partition("{")
        labels, _, value = rest.rpartition("}") if rest else ("", "", line.split()[-1])
        name = name.split()[0]
        if 'model_name="' in labels and f'model_name="{model}"' not in labels:
            continue
        try:
            number = float(value.split()[0])
        except (IndexError, ValueError):
            continue
        found = True
        if name == "vllm:num_requests_running":
            running += number
        elif name == "vllm:num_requests_waiting":
            waiting += number
    return (running, waiting) if found else None


class _Attempt:
    """How one attempt at a request ended."""

    def __init__(self, status: int, body: dict[str, Any], kind: str = "answer",
                 wait: float = 0.0) -> None:
        self.status = status
        self.body = body
        # "answer" (the server answered), "unreachable" (no connection), "timeout", "reset"
        self.kind = kind
        self.wait = wait  # Retry-After, seconds


class RemoteEngine(LoopEngine):
    thread_prefix = "remote"

    def __init__(self, spec: ModelSpec) -> None:
        unknown = sorted(set(spec.options) - set(OPTIONS))
        if unknown:
            raise EngineError(f"unknown remote option(s) {unknown} for model {spec.name!r}")
        options = {**OPTIONS, **spec.options}
        if not options["base_url"]:
            raise EngineError(f"model {spec.name!r}: a remote model needs options.base_url")
        if not options["redis_url"]:
            raise EngineError(f"model {spec.name!r}: no redis_url for the shared limit")
        self.spec = spec
        self.base_url = str(options["base_url"]).rstrip("/")
        self.model = options["model"] or spec.name
        key_env = options["api_key_env"]
        self._api_key = os.environ.get(key_env, "") if key_env else ""
        if key_env and not self._api_key:
            raise EngineError(f"model {spec.name!r}: environment variable {key_env} is not set")
        self.ceiling = max(1, int(options["max_concurrency"]))
        self.initial = max(1, min(self.ceiling, int(options["initial_concurrency"])))
        self.max_retries = int(options["max_retries"])
        self.backoff_base = float(options["backoff_base"])
        self.backoff_max = float(options["backoff_max"])
        self.priority = options["priority"]
        self.send_cache_salt = bool(options["cache_salt"])
        self.tolerance = float(options["latency_tolerance"])
        metrics_url = options["metrics_url"]
        if metrics_url is None:
            root = self.base_url[:-3] if self.base_url.endswith("/v1") else self.base_url
            metrics_url = root + "/metrics"
        self.metrics_url = metrics_url
        self.metrics_interval = float(options["metrics_interval"])
        self.max_in_flight = int(options["max_in_flight"] or 2 * self.ceiling)
        self._timeout = httpx.Timeout(float(options["request_timeout"]),
                                      connect=float(options["connect_timeout"]))
        self._redis_url = str(options["redis_url"])
        self._leases_key, self._state_key = limits.keys(self.base_url)
        self._tasks: dict[str, asyncio.Task[tuple[int, dict[str, Any]]]] = {}
        self._aborted: set[str] = set()
        self._held: set[str] = set()
        self._waiters: deque[asyncio.Future[str]] = deque()
        self._floor = float("inf")
        self._floor_at = time.monotonic()
        self._noted: dict[str, float] = {}
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever,
                                        name=f"remote-loop-{spec.name}", daemon=True)
        self._thread.start()
        try:
            self._call(self._start())
        except Exception as e:
            self.close()
            raise EngineError(f"remote engine for {spec.name!r} failed to start: {e}") from e

    @property
    def batch_size(self) -> int:
        return self.ceiling

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    # -- start / stop -------------------------------------------------------------------

    async def _start(self) -> None:
        headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
        self._http = httpx.AsyncClient(
            timeout=self._timeout, headers=headers,
            limits=httpx.Limits(max_connections=self.ceiling + 4,
                                max_keepalive_connections=self.ceiling + 4))
        self._redis = aioredis.from_url(self._redis_url)
        await self._redis.ping()
        self._acquire = self._redis.register_script(limits.ACQUIRE)
        self._renew = self._redis.register_script(limits.RENEW)
        self._adjust = self._redis.register_script(limits.ADJUST)
        await self._redis.hset(self._state_key, mapping={"base_url": self.base_url})
        self._wanted = asyncio.Event()
        self._background = [self._loop.create_task(self._grant()),
                            self._loop.create_task(self._keep_leases())]
        if self.metrics_url:
            self._background.append(self._loop.create_task(self._watch_metrics()))
        await self._check_model()

    async def _check_model(self) -> None:
        """Refuse to start against a server that answers but does not serve the model; a
        server that cannot be reached yet is only logged (its requests wait for it)."""
        try:
            response = await self._http.get(self.base_url + "/models",
                                            timeout=httpx.Timeout(10.0))
        except httpx.HTTPError as e:
            log.warning("remote %s not reachable yet (%s): requests wait for it",
                        self.base_url, e)
            return
        if response.status_code != 200:
            log.warning("remote %s/models answered %d", self.base_url, response.status_code)
            return
        try:
            served = [m.get("id") for m in response.json().get("data", [])]
        except (ValueError, AttributeError):
            return
        if served and self.model not in served:
            raise EngineError(f"{self.base_url} serves {served}, not {self.model!r}")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._loop.is_running():
            try:
                self._call(self._shutdown())
            except Exception:
                log.exception("remote engine %s: shutdown", self.spec.name)
            finally:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join(timeout=30)
        if not self._loop.is_running():
            self._loop.close()

    async def _shutdown(self) -> None:
        tasks = [*self._tasks.values(), *getattr(self, "_background", [])]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=10)
        if getattr(self, "_redis", None) is not None:
            try:
                if self._held:
                    await self._redis.zrem(self._leases_key, *self._held)
            finally:
                await self._redis.aclose()  # type: ignore[attr-defined]  # stubs predate it
        if getattr(self, "_http", None) is not None:
            await self._http.aclose()

    # -- the shared limit ---------------------------------------------------------------

    async def _take_slot(self) -> str:
        future: asyncio.Future[str] = self._loop.create_future()
        self._waiters.append(future)
        self._wanted.set()
        return await future

    async def _give_slot(self, lease: str) -> None:
        self._held.discard(lease)
        try:
            await self._redis.zrem(self._leases_key, lease)
        except Exception:  # Redis gone: the lease expires by itself
            log.warning("remote %s: lease %s not given back", self.base_url, lease)

    async def _grant(self) -> None:
        """Hands slots to the waiting requests in order, one lease at a time; polls while
        every slot is taken (a lease given back by another worker wakes no one here)."""
        pause = 0.01
        while True:
            await self._wanted.wait()
            while self._waiters:
                future = self._waiters[0]
                if future.done():
                    self._waiters.popleft()
                    continue
                lease = uuid.uuid4().hex
                try:
                    got = await self._acquire(
                        keys=[self._leases_key, self._state_key],
                        args=[lease, limits.LEASE_SECONDS * 1000, self.initial, self.ceiling])
                except Exception as e:
                    log.warning("remote %s: Redis unavailable for the limit (%s)",
                                self.base_url, e)
                    await asyncio.sleep(1.0)
                    continue
                if got:
                    pause = 0.01
                    self._waiters.popleft()
                    if future.done():  # aborted meanwhile
                        await self._redis.zrem(self._leases_key, lease)
                    else:
                        self._held.add(lease)
                        future.set_result(lease)
                    continue
                await asyncio.sleep(pause)
                pause = min(0.2, pause * 2)
            self._wanted.clear()

    async def _keep_leases(self) -> None:
        while True:
            await asyncio.sleep(limits.LEASE_SECONDS / 3)
            if self._held:
                try:
                    await self._renew(keys=[self._leases_key],
                                      args=[limits.LEASE_SECONDS * 1000, *self._held])
                except Exception as e:
                    log.warning("remote %s: leases not renewed (%s)", self.base_url, e)

    async def _change_limit(self, how: str) -> None:
        try:
            await self._adjust(keys=[self._state_key],
                               args=[how, self.ceiling, limits.COOLDOWN_SECONDS * 1000,
                                     limits.BETA])
        except Exception as e:
            log.warning("remote %s: limit not adjusted (%s)", self.base_url, e)

    async def _note(self, *, count: str = "", **fields: Any) -> None:
        """Counts one backoff or error and stamps the server's condition for the pages.
        A timestamp is written at most once a second per engine (one per request would
        be a Redis write per request for nothing)."""
        now = time.time()
        stamps = {k: v for k, v in fields.items()
                  if not k.endswith("_at") or now - self._noted.get(k, 0) >= 1.0}
        for k in stamps:
            if k.endswith("_at"):
                self._noted[k] = now
        try:
            pipe = self._redis.pipeline()
            if count:
                pipe.hincrby(self._state_key, count, 1)
            if stamps:
                pipe.hset(self._state_key, mapping={k: str(v) for k, v in stamps.items()})
            await pipe.execute()
        except Exception as e:
            log.warning("remote %s: state not recorded (%s)", self.base_url, e)

    async def _watch_metrics(self) -> None:
        """Where the server is vLLM: cut the limit while its queue holds requests and not
        all of its requests are ours (others, interactive ones first, are waiting or
        would be). A server without vLLM's metrics is asked again every minute."""
        while True:
            await asyncio.sleep(self.metrics_interval)
            if not self._held:
                continue
            try:
                response = await self._http.get(self.metrics_url, timeout=httpx.Timeout(5.0))
                found = vllm_queue(response.text, self.model) if response.status_code == 200 \
                    else None
                if found is None:
                    await asyncio.sleep(60)
                    continue
                ours = await self._redis.zcard(self._leases_key)
            except Exception:
                continue
            running, waiting = found
            if waiting > 0 and running + waiting > ours:
                await self._change_limit("cut")
                await self._note(busy_at=time.time())

    # -- one request --------------------------------------------------------------------

    def _body(self, req: EngineRequest) -> dict[str, Any]:
        endpoint = REGISTRY[req.url]
        body = {**req.body, "model": self.model}
        if self.priority is not None and endpoint.takes_priority:
            body["priority"] = self.priority
        if self.send_cache_salt and req.cache_salt:
            body["cache_salt"] = req.cache_salt
        # As in process (what a batch cannot ask for set: the server keeps nothing of it).
        return endpoint.engine_body(body)

    def _error(self, url: str, status: int, message: str) -> tuple[int, dict[str, Any]]:
        return status, REGISTRY[url].error_body(status, openai_error(
            status, message, kind="BadRequestError" if status < 500 else "ServerError"))

    async def _serve(self, req: EngineRequest) -> tuple[int, dict[str, Any]]:
        if req.body.get("stream"):
            return self._error(req.url, 400, "stream is not supported in batch requests")
        if req.adapter_path:
            return self._error(req.url, 400, f"model {self.spec.name!r} runs on a remote "
                               "server and loads no LoRA adapters")
        body = self._body(req)
        url = self.base_url + (req.url[3:] if req.url.startswith("/v1/") else req.url)
        retries = 0
        waits = 0
        while True:
            lease = await self._take_slot()
            started = time.monotonic()
            try:
                attempt = await self._post(url, req.url, body)
            finally:
                await self._give_slot(lease)
            elapsed = time.monotonic() - started
            if attempt.kind == "unreachable":
                # Waited for, without a limit: the server is down or not there yet.
                await self._note(count="backoffs", unreachable_at=time.time(),
                                 last_error=attempt.body["error"]["message"])
                waits += 1
                await asyncio.sleep(backoff_seconds(min(waits, 10), base=self.backoff_base,
                                                    cap=self.backoff_max))
                continue
            await self._note(reached_at=time.time())
            throttled = attempt.kind != "answer" or attempt.status in THROTTLED
            if not throttled:
                if attempt.status == 200:
                    await self._learn(elapsed, attempt.body)
                    if isinstance(req.body.get("model"), str) and "model" in attempt.body:
                        attempt.body["model"] = req.body["model"]
                elif attempt.status >= 500:
                    await self._note(count="errors", last_error=_message(attempt.body))
                return attempt.status, attempt.body
            await self._change_limit("cut")
            if retries >= self.max_retries:
                await self._note(count="errors", busy_at=time.time(),
                                 last_error=_message(attempt.body))
                return attempt.status, attempt.body
            await self._note(count="backoffs", busy_at=time.time(),
                             last_error=_message(attempt.body))
            await asyncio.sleep(backoff_seconds(retries, base=self.backoff_base,
                                                cap=self.backoff_max, asked=attempt.wait))
            retries += 1

    async def _post(self, url: str, endpoint: str, body: dict[str, Any]) -> _Attempt:
        try:
            response = await self._http.post(url, json=body)
        except (httpx.ConnectError, httpx.ConnectTimeout) as e:
            status, error = self._error(endpoint, 503, f"{self.base_url} unreachable: {e!r}")
            return _Attempt(status, error, "unreachable")
        except httpx.TimeoutException as e:
            status, error = self._error(endpoint, 504, f"{self.base_url} timed out: {e!r}")
            return _Attempt(status, error, "timeout")
        except httpx.TransportError as e:  # reset, closed mid-answer, protocol error
            status, error = self._error(endpoint, 502, f"{self.base_url} closed the "
                                        f"connection: {e!r}")
            return _Attempt(status, error, "reset")
        try:
            parsed = response.json()
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict) or (response.status_code != 200 and
                                            "error" not in parsed):
            text = response.text[:500]
            status, parsed = self._error(endpoint, 502 if response.status_code == 200 else
                                         response.status_code,
                                         f"{self.base_url} answered {response.status_code}: "
                                         f"{text}")
            return _Attempt(status, parsed, wait=retry_after(response.headers.get(
                "retry-after")))
        return _Attempt(response.status_code, parsed,
                        wait=retry_after(response.headers.get("retry-after")))

    async def _learn(self, elapsed: float, body: dict[str, Any]) -> None:
        """AIMD's increase: one more slot per limit's worth of requests whose seconds per
        output token stay within `tolerance` of the lowest seen."""
        usage = body.get("usage") or {}
        tokens = usage.get("completion_tokens") or usage.get("output_tokens") or 1
        per_token = elapsed / max(1, int(tokens))
        now = time.monotonic()
        if now - self._floor_at > 60:
            self._floor *= FLOOR_DRIFT
            self._floor_at = now
        self._floor = min(self._floor, per_token)
        if per_token <= self._floor * self.tolerance:
            await self._change_limit("grow")

    def _outcome(self, request_id: str, task: asyncio.Task[Any]) -> EngineResult:
        error = task.exception()
        if error is not None:  # a bug here, not the server's answer: this request fails
            log.error("remote request %s failed", request_id, exc_info=error)
            return EngineResult(request_id, 500, {"error": {
                "message": f"remote engine error: {error!r}", "type": "InternalServerError",
                "param": None, "code": 500}})
        status, body = task.result()
        return EngineResult(request_id, status, body)


def _message(body: dict[str, Any]) -> str:
    error = body.get("error")
    if isinstance(error, dict):
        return str(error.get("message", ""))[:500]
    return str(error or body)[:500]
