"""The remote backend: batch requests run on an OpenAI-compatible server that already
serves the model (`vllm serve`, SGLang, ...). A worker for it loads no weights.

Options (the model's `options` in BATCHWEB_MODELS_FILE):
    base_url             the server's OpenAI base URL, e.g. http://gpu1:8000/v1 (required)
    model                the model's name on the server (default: the model's name here)
    api_key_env          the environment variable holding the server's API key (optional),
                         sent to base_url's origin only
    allow_plain_http     let the key go over http:// to a host other than loopback (default
                         false: refused at start)
    max_concurrency      the ceiling of requests in flight there, summed over every worker
                         that names the same base_url (default 64)
    initial_concurrency  where the adaptive limit starts (default 4; 1 under an SLO)
    connect_timeout      seconds (default 10); request_timeout: seconds per attempt (600)
    max_retries          retries of one request on 429, 503, a timeout or a reset (8)
    backoff_base, backoff_max   full-jitter exponential backoff, seconds (0.5, 30)
    priority             vLLM's request `priority` for batch requests (default 10: later
                         than interactive requests at 0 on a server started with
                         --scheduling-policy priority; ignored by one without it); null:
                         not sent (a server that refuses unknown fields)
    share_prefix_cache_across_owners   true: send no owner's cache salt (vLLM's
                         `cache_salt`), so one owner's `cached_tokens` can tell how another's
                         prompts begin (default false; the old `cache_salt` key is refused)
    latency_tolerance    the limit grows while a request's seconds per output token stay
                         within this factor of the lowest seen (default 2)
    metrics_url          vLLM's Prometheus endpoint (default: base_url's host + /metrics);
                         "" to not watch it
    metrics_api_key_env  the variable holding a key for metrics_url (default: the server's
                         key where metrics_url is base_url's origin, else none)
    max_response_bytes   a response body past this fails its request (default 64 MiB)
    max_in_flight        requests the worker hands in at once (default 2 x max_concurrency)
    lease_seconds        how long the slots of a worker killed mid-request stay taken
                         (default 30; a live worker renews its own every third of it)
    redis_url            set by jobs/lib/model_registry.py: the Redis holding the shared limit
    ttft_slo_ms | ttft_slo_factor, ttft_slo_percentile, itl_slo_ms, slo_probe_interval,
    slo_band, online_priority   the online latency to hold (engine/remote_slo.py); with
                         one set, the limit is steered by it instead of by latency and
                         vLLM's queue (429s, 503s, timeouts and resets still cut it)

Every request: a slot of the shared limit (engine/remote_limits.py), one POST, the slot
given back. 429 and 503 are retried after a full-jitter backoff of at least their
Retry-After (capped at backoff_max), timeouts and resets likewise; each cuts the limit. A
request still failing after max_retries ends as a failed request carrying the server's own
error. A server that cannot be reached at all is waited for (backoff capped at
backoff_max), never a failed request: the batch waits (its page says so) until the server
is back, the batch is cancelled or it expires. `abort` cancels the HTTP request, which
closes its connection; `vllm serve` then aborts the request in its engine. With an SLO the
steering may ask for the requests in flight above the limit to be aborted the same way
(`_shed`): they wait for a slot again and run later.

What a failed request's error line says is ours or the server's own JSON error, never the
server's URL nor an exception's text (they name hosts, ports and paths); those go to the
worker's log and to queue health's last error.

Threads: as engine/vllm_engine.py, one event loop in a background thread owns the HTTP
client and the Redis client; `run` (engine/base.py's `LoopEngine`) feeds it from a second
thread.
"""

from __future__ import annotations

import asyncio
import datetime
import email.utils
import ipaddress
import json
import logging
import math
import os
import random
import threading
import time
import uuid
from collections import deque
from typing import Any

import httpx
import redis.asyncio as aioredis

from engine import remote_limits as limits
from engine import remote_slo
from engine.base import (
    EngineError,
    EngineRequest,
    EngineResult,
    LoopEngine,
    ModelSpec,
)
from engine.endpoints import REGISTRY
from engine.endpoints.base import ModelOptionsError, openai_error

log = logging.getLogger(__name__)

# A response body past this fails its request: a few times the largest legitimate answer
# (a long list of embeddings as JSON), and a bound on what a broken or hostile server can
# make the worker hold per request in flight.
MAX_RESPONSE_BYTES = 64 << 20
# /metrics and /models: a Prometheus page or a model list is kilobytes.
MAX_PAGE_BYTES = 8 << 20
OPTIONS = {
    "base_url": None, "model": "", "api_key_env": "", "allow_plain_http": False,
    "max_concurrency": limits.DEFAULT_CEILING,
    "initial_concurrency": 4, "connect_timeout": 10.0, "request_timeout": 600.0,
    "max_retries": 8, "backoff_base": 0.5, "backoff_max": 30.0, "priority": 10,
    "share_prefix_cache_across_owners": False, "latency_tolerance": 2.0,
    "metrics_url": None, "metrics_api_key_env": "", "max_response_bytes": MAX_RESPONSE_BYTES,
    "max_in_flight": None, "metrics_interval": 2.0, "redis_url": None,
    "lease_seconds": limits.LEASE_SECONDS,
    # The served model's context (the server's --max-model-len); else its model card's.
    "max_model_len": None,
    **remote_slo.OPTIONS,
}
# Options that were renamed: refused, with what to write instead (silently ignoring one
# could quietly undo what it asked for).
RENAMED = {
    "cache_salt": ('"cache_salt" is now "share_prefix_cache_across_owners" with the opposite '
                   'sense: "cache_salt": false is "share_prefix_cache_across_owners": true, '
                   "a trust decision (docs/security.md)"),
}
# Answers that mean "too busy now": retried, and the limit is cut.
THROTTLED = (429, 503)
# With an SLO, how often a worker looks whether the steering asked for requests in flight
# above the limit to be aborted, and for how long after it asked.
SHED_POLL_SECONDS = 0.2
SHED_SECONDS = 5.0
# The lowest seen latency drifts up by this factor a minute, so one lucky request does not
# hold the limit down for ever.
FLOOR_DRIFT = 1.25


def retry_after(value: str | None) -> float:
    """Seconds a Retry-After header asks for (delta-seconds or an HTTP date); 0 if none, in
    the past, not finite or not understood (`inf` must not park a request for ever)."""
    seconds = _retry_after_seconds(value) if value else 0.0
    return seconds if math.isfinite(seconds) and seconds > 0 else 0.0


def _retry_after_seconds(value: str) -> float:
    try:
        return float(value)
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError, OverflowError):
        return 0.0
    if when.tzinfo is None:  # "-0000": HTTP dates are GMT
        when = when.replace(tzinfo=datetime.UTC)
    return when.timestamp() - time.time()


def backoff_seconds(attempt: int, *, base: float, cap: float, asked: float = 0.0) -> float:
    """Full jitter (uniform in [0, min(cap, base * 2^attempt)]), never less than what the
    server asked for in Retry-After, up to `cap` (a server asking for a day gets retried
    after `cap`, as one that asked for nothing could be)."""
    return max(min(asked, cap), random.uniform(0.0, min(cap, base * 2 ** attempt)))


class BodyRefused(Exception):
    """A response body not read: over the bound, or encoded (the client asks for none)."""


async def read_bounded(response: httpx.Response, limit: int) -> bytes:
    """The body of a streamed response, read as it comes and refused once past `limit`
    bytes. Only identity bodies: a compressed body's size says nothing of what it inflates
    to (a gzip chunk inflates a thousandfold, and is inflated whole)."""
    encoding = response.headers.get("content-encoding", "").strip().lower()
    if encoding not in ("", "identity"):
        raise BodyRefused(f"a {encoding[:40]}-encoded body")
    declared = response.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BodyRefused(f"a body over {limit} bytes")
    chunks: list[bytes] = []
    size = 0
    async for chunk in response.aiter_raw():
        size += len(chunk)
        if size > limit:
            raise BodyRefused(f"a body over {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def origin(url: str) -> tuple[str, str, int]:
    """(scheme, host, port) of `url`, the port spelt out where it is the scheme's default."""
    parsed = httpx.URL(url)
    return parsed.scheme, parsed.host, parsed.port or {"http": 80, "https": 443}.get(
        parsed.scheme, 0)


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 or localhost: a key sent there never leaves this host."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_http_url(name: str, option: str, url: str) -> None:
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as e:
        raise EngineError(f"model {name!r}: {option} {url!r} is not a URL ({e})") from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise EngineError(f"model {name!r}: {option} {url!r} is not an http(s) URL")


def check_key_transport(name: str, option: str, url: str, *, allowed: bool) -> None:
    """Refuses an http:// URL off this host for a key: anyone on the path reads it (and
    then may send the server anything). `allow_plain_http` accepts that, loudly."""
    scheme, host, _ = origin(url)
    if scheme != "http" or is_loopback(host):
        return
    if not allowed:
        raise EngineError(
            f"model {name!r}: {option} {url} is plain http, and the server's API key would "
            'cross the network in clear text; use https, or set "allow_plain_http": true '
            "to accept that")
    log.warning("model %r: the API key goes over plain http to %s (allow_plain_http)",
                name, url)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


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
                 wait: float = 0.0, detail: str = "") -> None:
        self.status = status
        self.body = body
        # "answer" (the server answered), "unreachable" (no connection), "timeout", "reset"
        self.kind = kind
        self.wait = wait  # Retry-After, seconds
        # What went wrong, with the URL and the exception, for the log and queue health
        # only; "" where the body is the server's own error.
        self.detail = detail


class RemoteEngine(LoopEngine):
    thread_prefix = "remote"

    def __init__(self, spec: ModelSpec) -> None:
        renamed = sorted(set(spec.options) & set(RENAMED))
        if renamed:
            raise EngineError(f"model {spec.name!r}: {RENAMED[renamed[0]]}")
        unknown = sorted(set(spec.options) - set(OPTIONS))
        if unknown:
            raise EngineError(f"unknown remote option(s) {unknown} for model {spec.name!r}")
        options = {**OPTIONS, **spec.options}
        if not options["base_url"]:
            raise EngineError(f"model {spec.name!r}: a remote model needs options.base_url")
        if not options["redis_url"]:
            raise EngineError(f"model {spec.name!r}: no redis_url for the shared limit")
        self.spec = spec
        self.slo = remote_slo.parse(spec.name, spec.options, spec.endpoints)
        self.base_url = str(options["base_url"]).rstrip("/")
        self.model = options["model"] or spec.name
        check_http_url(spec.name, "base_url", self.base_url)
        self.metrics_url = self._metrics_url(options["metrics_url"])
        self._auth, self._metrics_auth = self._keys(options)
        self.ceiling = max(1, int(options["max_concurrency"]))
        # Under an SLO the limit starts at one request where the operator names no start:
        # a start above where the SLO holds would spend the SLO's budget (which allows
        # the controller's trials) on its way down.
        initial = options["initial_concurrency"] if self.slo is None or \
            "initial_concurrency" in spec.options else 1
        self.initial = max(1, min(self.ceiling, int(initial)))
        self.max_retries = int(options["max_retries"])
        self.backoff_base = float(options["backoff_base"])
        self.backoff_max = float(options["backoff_max"])
        self.priority = options["priority"]
        # The model's context, as the registry or the server's model card says.
        self.max_model_len: int | None = options["max_model_len"] or None
        self.send_cache_salt = not options["share_prefix_cache_across_owners"]
        if not self.send_cache_salt:
            log.warning("model %r: owners share the server's prefix cache "
                        "(share_prefix_cache_across_owners): cached_tokens can tell one "
                        "owner how another's prompts begin", spec.name)
        self.tolerance = float(options["latency_tolerance"])
        self.max_response_bytes = int(options["max_response_bytes"])
        self.metrics_interval = float(options["metrics_interval"])
        self.max_in_flight = int(options["max_in_flight"] or 2 * self.ceiling)
        # Renewed every third of it: much under a few seconds, a renewal delayed by a busy
        # Redis or event loop would hand a live request's slot to another worker.
        self.lease_ms = int(1000 * remote_slo.number_option(
            spec.name, "lease_seconds", options["lease_seconds"], low=1,
            what="seconds above 1"))
        self._timeout = httpx.Timeout(float(options["request_timeout"]),
                                      connect=float(options["connect_timeout"]))
        self._redis_url = str(options["redis_url"])
        self._leases_key, self._state_key = limits.keys(self.base_url)
        self._tasks: dict[str, asyncio.Task[tuple[int, dict[str, Any]]]] = {}
        self._aborted: set[str] = set()
        self._held: set[str] = set()
        # The attempt in flight on each lease held: what _shed aborts.
        self._posts: dict[str, asyncio.Future[_Attempt]] = {}
        self._waiters: deque[asyncio.Future[str]] = deque()
        self._floor = float("inf")
        self._floor_at = time.monotonic()
        # Seconds per output token of one request, smoothed: the deadline floor's measure
        # of what one slot yields (jobs/capacity/plan.py).
        self._token_seconds = 0.0
        self._token_seconds_at = 0.0
        self._noted: dict[str, float] = {}
        self._logged: dict[str, float] = {}  # time.monotonic() of the last log line, by kind
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

    def _metrics_url(self, configured: str | None) -> str:
        if configured is None:
            root = self.base_url[:-3] if self.base_url.endswith("/v1") else self.base_url
            return root + "/metrics"
        if configured:
            check_http_url(self.spec.name, "metrics_url", configured)
        return str(configured)

    def _keys(self, options: dict[str, Any]) -> tuple[dict[str, str], dict[str, str]]:
        """The Authorization headers for base_url and for metrics_url. The server's key
        goes to base_url's origin only: a metrics_url elsewhere (a Prometheus proxy, a
        sidecar) gets its own key from metrics_api_key_env, or none. Redirects are not
        followed (httpx's default), so no answer can send the key on elsewhere either."""
        key = self._env_key(options["api_key_env"])
        metrics_key = self._env_key(options["metrics_api_key_env"])
        if not options["metrics_api_key_env"] and self.metrics_url and \
                origin(self.metrics_url) == origin(self.base_url):
            metrics_key = key
        allowed = bool(options["allow_plain_http"])
        if key:
            check_key_transport(self.spec.name, "base_url", self.base_url, allowed=allowed)
        if metrics_key and self.metrics_url:
            check_key_transport(self.spec.name, "metrics_url", self.metrics_url,
                                allowed=allowed)
        return bearer(key), bearer(metrics_key)

    def _env_key(self, variable: str) -> str:
        if not variable:
            return ""
        key = os.environ.get(variable, "")
        if not key:
            raise EngineError(f"model {self.spec.name!r}: environment variable {variable} "
                              "is not set")
        return key

    # -- start / stop -------------------------------------------------------------------

    async def _start(self) -> None:
        # Identity bodies only: their size on the wire is what the worker holds
        # (read_bounded). Keys go per request (_keys), never as the client's default.
        self._http = httpx.AsyncClient(
            timeout=self._timeout, headers={"Accept-Encoding": "identity"},
            limits=httpx.Limits(max_connections=self.ceiling + 4,
                                max_keepalive_connections=self.ceiling + 4))
        self._redis = aioredis.from_url(self._redis_url)
        await self._redis.ping()
        self._acquire = self._redis.register_script(limits.ACQUIRE)
        self._renew = self._redis.register_script(limits.RENEW)
        self._adjust = self._redis.register_script(limits.ADJUST)
        self._steer = self._redis.register_script(remote_slo.STEER)
        await self._redis.hset(self._state_key, mapping={"base_url": self.base_url})
        self._wanted = asyncio.Event()
        self._steering = remote_slo.Steering(slo=self.slo, engine=self) if self.slo else None
        self._background = [self._loop.create_task(self._grant()),
                            self._loop.create_task(self._keep_leases())]
        if self._steering is not None:
            # The SLO steers the limit; vLLM's queue is no longer the signal.
            self._background += [self._loop.create_task(self._steering.run()),
                                 self._loop.create_task(self._shed())]
        elif self.metrics_url:
            self._background.append(self._loop.create_task(self._watch_metrics()))
        await self._check_model()

    async def _check_model(self) -> None:
        """Refuse to start against a server that answers but does not serve the model; a
        server that cannot be reached yet is only logged (its requests wait for it)."""
        try:
            status, raw = await self._get(self.base_url + "/models", self._auth,
                                          timeout=httpx.Timeout(10.0))
        except (httpx.HTTPError, BodyRefused) as e:
            log.warning("remote %s not reachable yet (%s): requests wait for it",
                        self.base_url, e)
            return
        if status != 200:
            log.warning("remote %s/models answered %d", self.base_url, status)
            return
        try:
            cards = [m for m in json.loads(raw).get("data", []) if isinstance(m, dict)]
        except (ValueError, AttributeError, RecursionError):
            return
        served = [m.get("id") for m in cards]
        if served and self.model not in served:
            raise EngineError(f"{self.base_url} serves {served[:20]}, not {self.model!r}")
        # vLLM's model card says its context: the output limit named for a request that
        # names none stays within it (where the registry does not give max_model_len, its
        # room is the service's cap, which the server would refuse).
        context = next((m.get("max_model_len") for m in cards if m.get("id") == self.model),
                       None)
        if isinstance(context, int) and context > 0:
            self.max_model_len = context

    async def _get(self, url: str, headers: dict[str, str], *,
                   timeout: httpx.Timeout) -> tuple[int, bytes]:
        """A page of the server (its model list, its metrics): the status, and the body
        when it is 200, read up to MAX_PAGE_BYTES."""
        async with self._http.stream("GET", url, headers=headers, timeout=timeout) as response:
            if response.status_code != 200:
                return response.status_code, b""
            return 200, await read_bounded(response, MAX_PAGE_BYTES)

    async def _shutdown(self) -> None:
        pending = {*self._tasks.values(), *getattr(self, "_background", [])}
        deadline = time.monotonic() + 10
        while pending and time.monotonic() < deadline:
            # Cancelled again until they end: redis-py and httpx may turn a cancellation
            # into an error of their own (a closed connection), which a loop that goes on
            # after errors swallows.
            for task in pending:
                task.cancel()
            _, pending = await asyncio.wait(pending, timeout=0.1)
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
        if self._steering is not None:
            # The time alone is measured before the first batch request goes.
            await self._steering.ready.wait()
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
                        args=[lease, self.lease_ms, self.initial, self.ceiling])
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
            await asyncio.sleep(self.lease_ms / 3000)
            if self._held:
                try:
                    await self._renew(keys=[self._leases_key],
                                      args=[self.lease_ms, *self._held])
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

    async def _shed(self) -> None:
        """With an SLO: where the steering asked within SHED_SECONDS (online users back
        after a lull, or even one batch request breaking the SLO), this worker's share of
        the requests in flight above the limit is aborted, newest first (the least work
        lost); each goes back to wait for a slot and runs again, not counted as a retry.
        vLLM aborts a request whose connection closes, so online users wait for no more
        than the step in progress."""
        while True:
            await asyncio.sleep(SHED_POLL_SECONDS)
            mine = [p for p in self._posts.values() if not p.done()]
            if not mine:
                continue
            try:
                pipe = self._redis.pipeline()
                pipe.hmget(self._state_key, "limit", "shed_at")
                pipe.zcard(self._leases_key)
                (limit, shed_at), in_flight = await pipe.execute()
            except Exception:
                continue
            if time.time() - float(shed_at or 0) > SHED_SECONDS:
                continue
            going = [p for p in mine if p.cancelled() or (
                isinstance(p, asyncio.Task) and p.cancelling())]
            live = [p for p in mine if p not in going]
            excess = int(in_flight) - len(going) - math.floor(float(limit or self.ceiling))
            count = min(len(live), math.ceil(excess * len(mine) / max(1, int(in_flight))))
            for post in live[len(live) - count:] if count > 0 else []:
                post.cancel()
            if count > 0:
                log.info("remote %s: %d batch request(s) aborted to run later: the SLO's "
                         "limit is %s", self.base_url, count, limit.decode() if limit else "")
                await self._note(count="shed")

    async def _watch_metrics(self) -> None:
        """Where the server is vLLM: cut the limit while its queue holds requests and not
        all of its requests are ours (others, interactive ones first, are waiting or
        would be). A server without vLLM's metrics is asked again every minute."""
        while True:
            await asyncio.sleep(self.metrics_interval)
            if not self._held:
                continue
            try:
                found = await self._read_metrics()
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

    async def _read_metrics(self) -> tuple[float, float] | None:
        """vLLM's queue from metrics_url; None where it is not there (or too big a page:
        logged, and asked again a minute later like any page that is not vLLM's)."""
        try:
            status, raw = await self._get(self.metrics_url, self._metrics_auth,
                                          timeout=httpx.Timeout(5.0))
        except BodyRefused as e:
            log.warning("remote %s: %s refused (%s)", self.base_url, self.metrics_url, e)
            return None
        if status != 200:
            return None
        return vllm_queue(raw.decode("utf-8", "replace"), self.model)

    # -- one request --------------------------------------------------------------------

    def _body(self, req: EngineRequest) -> dict[str, Any]:
        endpoint = REGISTRY[req.url]
        body = {**req.body, "model": self.model}
        if self.priority is not None and endpoint.takes_priority:
            body["priority"] = self.priority
        if self.send_cache_salt and req.cache_salt:
            body["cache_salt"] = req.cache_salt
        # The output limit the budget counted, named; as in process (what a batch cannot
        # ask for set: the server keeps nothing of it).
        return endpoint.limited(endpoint.engine_body(body, options=self.spec.options),
                                room=req.output_room,
                                context=self.max_model_len)

    def _error(self, url: str, status: int, message: str) -> tuple[int, dict[str, Any]]:
        return status, REGISTRY[url].error_body(status, openai_error(
            status, message, kind="BadRequestError" if status < 500 else "ServerError"))

    async def _serve(self, req: EngineRequest) -> tuple[int, dict[str, Any]]:
        if req.body.get("stream"):
            return self._error(req.url, 400, "stream is not supported in batch requests")
        if req.adapter_path:
            return self._error(req.url, 400, f"model {self.spec.name!r} runs on a remote "
                               "server and loads no LoRA adapters")
        try:
            body = self._body(req)
        except ModelOptionsError as e:
            return self._error(req.url, 400, str(e))
        route = REGISTRY[req.url].serving_url
        url = self.base_url + (route[3:] if route.startswith("/v1/") else route)
        retries = 0
        waits = 0
        while True:
            lease = await self._take_slot()
            started, sent_at = time.monotonic(), time.time()
            post = asyncio.ensure_future(self._post(url, req.url, body))
            self._posts[lease] = post
            try:
                attempt: _Attempt | None = await post
                if self._steering is not None and attempt is not None and \
                        attempt.kind == "answer" and attempt.status == 200:
                    # Its time to first token comes out of the server's histogram (what
                    # is left there is online users'), recorded before its lease goes.
                    await self._steering.answered(attempt.body, sent_at=sent_at)
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise  # the request itself is aborted
                attempt = None  # shed (_shed): run again when a slot is free
            finally:
                self._posts.pop(lease, None)
                await self._give_slot(lease)
            if attempt is None:
                continue
            elapsed = time.monotonic() - started
            if attempt.kind == "unreachable":
                # Waited for, without a limit: the server is down or not there yet.
                if self._first_in(60.0, "unreachable_logged"):
                    log.warning("remote request %s waits: %s", req.request_id, attempt.detail)
                await self._note(count="backoffs", unreachable_at=time.time(),
                                 last_error=attempt.detail)
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
                    await self._note(count="errors", last_error=_last_error(attempt))
                return self._result(req, attempt)
            await self._change_limit("cut")
            if retries >= self.max_retries:
                await self._note(count="errors", busy_at=time.time(),
                                 last_error=_last_error(attempt))
                return self._result(req, attempt)
            log.debug("remote request %s retried: %s", req.request_id, _last_error(attempt))
            await self._note(count="backoffs", busy_at=time.time(),
                             last_error=_last_error(attempt))
            await asyncio.sleep(backoff_seconds(retries, base=self.backoff_base,
                                                cap=self.backoff_max, asked=attempt.wait))
            retries += 1

    def _result(self, req: EngineRequest, attempt: _Attempt) -> tuple[int, dict[str, Any]]:
        """The request's result (its endpoint's answer, built from the serving route's);
        what went wrong, where its error line cannot say, is logged here."""
        if attempt.detail:
            log.warning("remote request %s failed: %s", req.request_id, attempt.detail)
        if attempt.status == 200:
            try:
                return 200, REGISTRY[req.url].from_serving(req.body, attempt.body,
                                                           options=self.spec.options)
            except (KeyError, TypeError, ValueError, StopIteration) as e:
                log.warning("remote request %s: answer not readable: %r", req.request_id, e)
                return self._error(req.url, 502, "the model's server answered a body this "
                                   "endpoint cannot read")
        return attempt.status, attempt.body

    def _first_in(self, seconds: float, what: str) -> bool:
        """Whether `what` happened last more than `seconds` ago (and now it has)."""
        now = time.monotonic()
        if now - self._logged.get(what, -seconds) < seconds:
            return False
        self._logged[what] = now
        return True

    def _no_answer(self, endpoint: str, status: int, kind: str, public: str, detail: str,
                   wait: float = 0.0) -> _Attempt:
        """An attempt without an answer to pass on: the error line gets `public`, in words
        that name nothing of the server (its URL, hosts, ports, paths); the log and queue
        health get `detail`."""
        status, body = self._error(endpoint, status, public)
        return _Attempt(status, body, kind, wait=wait, detail=f"{self.base_url}: {detail}")

    async def _post(self, url: str, endpoint: str, body: dict[str, Any]) -> _Attempt:
        try:
            async with self._http.stream("POST", url, json=body,
                                         headers=self._auth) as response:
                raw = await read_bounded(response, self.max_response_bytes)
        except (httpx.ConnectError, httpx.ConnectTimeout) as e:
            return self._no_answer(endpoint, 503, "unreachable",
                                   "the model's server cannot be reached", f"unreachable: {e!r}")
        except httpx.TimeoutException as e:
            return self._no_answer(endpoint, 504, "timeout",
                                   "the model's server did not answer in time",
                                   f"timed out: {e!r}")
        except httpx.TransportError as e:  # reset, closed mid-answer, protocol error
            return self._no_answer(endpoint, 502, "reset", "the model's server closed the "
                                   "connection before answering", f"closed the connection: {e!r}")
        except BodyRefused as e:
            return self._no_answer(endpoint, 502, "answer",
                                   f"the model's server answered with {e}: not read",
                                   f"answered with {e}: not read")
        return self._answer(endpoint, response, raw)

    def _answer(self, endpoint: str, response: httpx.Response, raw: bytes) -> _Attempt:
        """The server's answer as the request's result: its JSON as it wrote it, or, where
        it is not an OpenAI answer or error (a proxy's HTML page, say), our error."""
        wait = retry_after(response.headers.get("retry-after"))
        try:
            parsed = json.loads(raw)
        except (ValueError, RecursionError):
            parsed = None
        status = response.status_code
        if isinstance(parsed, dict) and (status == 200 or "error" in parsed):
            return _Attempt(status, parsed, wait=wait)
        return self._no_answer(endpoint, 502 if status == 200 else status, "answer",
                               f"the model's server answered {status} without an OpenAI "
                               "answer or error", f"answered {status}: {raw[:500]!r}",
                               wait=wait)

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
        await self._keep_token_seconds(per_token, now)
        if self._steering is None and per_token <= self._floor * self.tolerance:
            await self._change_limit("grow")

    async def _keep_token_seconds(self, per_token: float, now: float) -> None:
        """A request's seconds per output token, smoothed, in the server's state at most
        once a second: what the reconciler turns a deadline into slots with."""
        self._token_seconds = per_token if not self._token_seconds else (
            0.9 * self._token_seconds + 0.1 * per_token)
        if now - self._token_seconds_at < 1.0:
            return
        self._token_seconds_at = now
        try:
            await self._redis.hset(self._state_key, "token_seconds",
                                   f"{self._token_seconds:.6f}")
        except Exception as e:
            log.warning("remote %s: state not recorded (%s)", self.base_url, e)

    def _outcome(self, request_id: str, task: asyncio.Task[Any]) -> EngineResult:
        error = task.exception()
        if error is not None:  # a bug here, not the server's answer: this request fails
            log.error("remote request %s failed", request_id, exc_info=error)
            return EngineResult(request_id, 500, {"error": {
                "message": "the remote engine failed on this request (the worker's log "
                "says why)", "type": "InternalServerError", "param": None, "code": 500}})
        status, body = task.result()
        return EngineResult(request_id, status, body)


def _last_error(attempt: _Attempt) -> str:
    """What queue health shows of an attempt: our detail, or the server's own error."""
    return attempt.detail[:500] or _message(attempt.body)


def _message(body: dict[str, Any]) -> str:
    error = body.get("error")
    if isinstance(error, dict):
        return str(error.get("message", ""))[:500]
    return str(error or body)[:500]
