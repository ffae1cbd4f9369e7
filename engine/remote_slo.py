"""The online latency a remote server's operator promises (an SLO), and the limit of batch
requests in flight there steered by it (docs/remote-engine.md, "Online latency").

Batch requests fill what online traffic leaves of a shared `vllm serve`; each one in a
step makes that step longer, and so every online user's time to first token. The limit of
engine/remote_limits.py is steered here by what an online user sees:

- **What online users see**: a probe, one tiny streamed request at online priority (one
  output token; a few where an inter-token SLO is set) every `slo_probe_interval` seconds,
  timed from the POST to its first token. It is an online request like any other, so it
  waits for the step in progress and then shares a step with the batch's requests, as
  theirs do. One worker probes a server at a time (a Redis lock), and every worker reads
  the samples from Redis.
- **Whether any online user is there**: the server's own count of finished requests
  (vLLM's `vllm:request_success_total`) less ours (batch answers and probes). With no
  online request lately the SLO protects no one: the limit goes up to the ceiling, and
  it comes back down to where the SLO last held as soon as online requests show again.
  A server without vLLM's metrics is taken to always have online users.
- **The controller**: between the latency alone (the same percentile of probes sent with
  no batch request in flight) and the SLO, the limit grows while the measured percentile
  is in the lower half of that room, holds in the band below `slo_band` of it, and is cut
  (in proportion, at least 15%, at most half) once it crosses `slo_band`: before the SLO
  is passed, not after a 429.
- **The deadline floor**: the concurrency the server's batches need to meet their windows
  (jobs/capacity.py's plan, written to the server's state by the reconciler's pass). The
  SLO never cuts below it; the reason then says the SLO is traded for a deadline.

The 429/503/timeout cuts of remote_limits.ADJUST still apply on top.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import uuid
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from engine import remote_limits as limits
from engine.base import EngineError
from engine.endpoints import CHAT, COMPLETIONS

log = logging.getLogger(__name__)

OPTIONS: dict[str, Any] = {
    "ttft_slo_ms": None, "ttft_slo_factor": None, "ttft_slo_percentile": 90.0,
    "itl_slo_ms": None, "slo_probe_interval": 2.0, "slo_band": 0.8, "online_priority": 0,
}
# Samples kept per server, newest first (a minute at the default interval).
SAMPLES_KEPT = 30
# Decisions read the samples taken since the last change of the limit, at least this many
# for a growth (a cut needs one sample past the band).
GROW_SAMPLES = 3
# Probes sent with no batch request in flight that make the latency alone.
ALONE_KEPT = 20
ALONE_FIRST = 5
# Online requests seen within this many seconds: the SLO applies.
ONLINE_HOLD_SECONDS = 20.0
# Seconds of counts summed to tell online requests from the skew between the server's
# count and ours (requests it counted whose answer has not reached us yet), and how many
# requests in them, at least, are online traffic.
ONLINE_WINDOW_SECONDS = 5.0
ONLINE_MIN_REQUESTS = 3
# A deadline floor older than this was written by no live reconciler: ignored.
FLOOR_FRESH_SECONDS = 120.0


@dataclass(frozen=True)
class Slo:
    """The SLO of one remote server, from its model's options."""

    ttft_ms: float | None  # the time to first token to hold, or
    factor: float | None  # a multiple of the time alone
    percentile: float
    itl_ms: float | None
    interval: float
    band: float
    online_priority: int | None
    endpoint: str  # what the probe asks: chat where served, else completions


def number_option(name: str, option: str, value: Any, *, low: float,
                  high: float = math.inf, what: str) -> float:
    """A remote model's numeric option, checked: above `low`, below `high`."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not (
            math.isfinite(value) and low < value < high):
        raise EngineError(f"model {name!r}: {option} must be {what}, not {value!r}")
    return float(value)


def parse(name: str, options: dict[str, Any], endpoints: Sequence[str]) -> Slo | None:
    """The SLO the options set, or None without one; a clear EngineError for a bad one."""
    ttft, factor = options.get("ttft_slo_ms"), options.get("ttft_slo_factor")
    itl = options.get("itl_slo_ms")
    if ttft is not None and factor is not None:
        raise EngineError(f"model {name!r}: set ttft_slo_ms or ttft_slo_factor, not both")
    if ttft is None and factor is None:
        if itl is not None:
            raise EngineError(f"model {name!r}: itl_slo_ms needs ttft_slo_ms or "
                              "ttft_slo_factor")
        return None
    endpoint = CHAT if CHAT in endpoints or not endpoints else (
        COMPLETIONS if COMPLETIONS in endpoints else "")
    if not endpoint:
        raise EngineError(f"model {name!r}: an SLO needs a model serving "
                          f"{CHAT} or {COMPLETIONS} (the probe is a one-token answer)")
    priority = options.get("online_priority", OPTIONS["online_priority"])
    if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int)):
        raise EngineError(f"model {name!r}: online_priority must be an integer or null, "
                          f"not {priority!r}")
    get = {**OPTIONS, **options}.get
    return Slo(
        ttft_ms=None if ttft is None else number_option(
            name, "ttft_slo_ms", ttft, low=0, what="milliseconds above 0"),
        factor=None if factor is None else number_option(
            name, "ttft_slo_factor", factor, low=1,
            what="a multiple above 1 of the time to first token alone"),
        percentile=number_option(name, "ttft_slo_percentile", get("ttft_slo_percentile"), low=0,
                           high=100, what="a percentile between 0 and 100 (e.g. 90)"),
        itl_ms=None if itl is None else number_option(name, "itl_slo_ms", itl, low=0,
                                                what="milliseconds above 0"),
        interval=number_option(name, "slo_probe_interval", get("slo_probe_interval"), low=0.05,
                         what="seconds above 0.05"),
        band=number_option(name, "slo_band", get("slo_band"), low=0, high=1,
                     what="a fraction between 0 and 1 of the room below the SLO"),
        online_priority=priority, endpoint=endpoint)


def percentile(values: Sequence[float], p: float) -> float:
    """Nearest rank: the smallest value with at least p% of the values at or below it."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


@dataclass(frozen=True)
class Decision:
    limit: float
    # "slo", "deadline_floor", "ceiling", "no_online_traffic", "measuring"
    reason: str


def pressure(measured: float, *, alone: float, target: float) -> float:
    """Where `measured` stands in the room between the latency alone (0) and the SLO (1)."""
    room = max(target - alone, 1e-3 * target)
    return (measured - alone) / room


def decide(*, pressure_now: float | None, latest_over: bool, samples: int, band: float,
           limit: float, ceiling: float, floor: float, binding: bool, online: bool,
           slo_limit: float | None, draining: bool = False) -> Decision:
    """The next limit. `pressure_now`: the measured percentile's place between alone and
    the SLO (None: nothing to go by yet); `latest_over`: the newest sample is past the SLO
    itself; `binding`: the limit, not the batch, bounds the requests in flight (growing an
    unused limit says nothing of what it would do); `slo_limit`: where the SLO last held;
    `draining`: more requests are in flight than the limit (a cut not yet felt: the
    requests above it still run to their end, and cutting again would overshoot)."""
    floor = min(floor, ceiling)
    if not online:
        grown = min(ceiling, max(limit * 2, limit + 1)) if binding else limit
        new = max(grown, floor)
        return Decision(new, "ceiling" if new >= ceiling else "no_online_traffic")
    if slo_limit is not None and limit > slo_limit:
        # Online users are back: straight to where the SLO held, not down in steps.
        new = max(slo_limit, floor, 1.0)
        return Decision(new, "deadline_floor" if new > slo_limit else "slo")
    if pressure_now is None:
        new = max(limit, floor)
        return Decision(new, "deadline_floor" if new > limit else "measuring")
    if (latest_over or pressure_now >= band) and draining:
        new = max(limit, floor)
        return Decision(new, "deadline_floor" if new > limit else "slo")
    if latest_over or pressure_now >= band:
        worst = max(pressure_now, band, 1.0 if latest_over else 0.0)
        cut = max(0.5, min(0.85, band / worst * 0.85))
        new = max(1.0, limit * cut)
        if new < floor:
            return Decision(max(floor, 1.0), "deadline_floor")
        return Decision(new, "slo")
    if pressure_now < band / 2 and samples >= GROW_SAMPLES and binding:
        new = min(ceiling, limit + max(1.0, 0.1 * limit))
        return Decision(max(new, floor), "ceiling" if new >= ceiling else "slo")
    new = max(limit, floor)
    if new > limit:
        return Decision(new, "deadline_floor")
    return Decision(new, "ceiling" if new >= ceiling else "slo")


# KEYS: state. ARGV: the limit read, the new limit, reason, ceiling, now (the prober's
# clock, which its samples carry). Written only if no one changed the limit meanwhile (a
# 429's cut since is kept).
STEER = """
local ceiling = tonumber(ARGV[4])
local limit = math.min(tonumber(redis.call('HGET', KEYS[1], 'limit') or ceiling), ceiling)
if math.abs(limit - tonumber(ARGV[1])) > 1e-6 then
  return tostring(limit)
end
redis.call('HSET', KEYS[1], 'limit', ARGV[2], 'reason', ARGV[3], 'steered_at', ARGV[5])
return ARGV[2]
"""


def keys(base_url: str) -> tuple[str, str, str]:
    """(probe lock, samples, samples alone) keys of the server at `base_url`."""
    prefix = f"{limits.KEY_PREFIX}{limits.server_id(base_url)}"
    return f"{prefix}:prober", f"{prefix}:probes", f"{prefix}:alone"


def vllm_successes(text: str, model: str) -> float | None:
    """vLLM's count of requests finished for `model` (every finish reason summed); None
    when the text has none."""
    found = False
    total = 0.0
    for line in text.splitlines():
        if not line.startswith("vllm:request_success_total"):
            continue
        if 'model_name="' in line and f'model_name="{model}"' not in line:
            continue
        try:
            total += float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
        found = True
    return total if found else None


@dataclass(frozen=True)
class Sample:
    at: float
    ttft_ms: float
    itl_ms: float | None
    ours: int  # batch requests of every worker in flight when it was sent

    def encode(self) -> str:
        return json.dumps([round(self.at, 3), round(self.ttft_ms, 2), self.itl_ms, self.ours])

    @classmethod
    def decode(cls, raw: bytes | str) -> Sample | None:
        try:
            at, ttft, itl, ours = json.loads(raw)
            return cls(float(at), float(ttft), None if itl is None else float(itl), int(ours))
        except (ValueError, TypeError):
            return None


class Steering:
    """The SLO's half of a remote engine, on its event loop: probes while it holds the
    server's probe lock, keeps the latency alone, and steers the shared limit. `ready` is
    set once a time alone is known where the SLO is a multiple of it (or could not be
    measured): the engine grants no slot before, so the first probes see no batch."""

    def __init__(self, *, slo: Slo, engine: Any) -> None:
        self.slo = slo
        self.engine = engine  # the RemoteEngine: its HTTP and Redis clients, keys, auth
        self.lock_key, self.samples_key, self.alone_key = keys(engine.base_url)
        self.me = uuid.uuid4().hex
        self.ready = asyncio.Event()
        self._counts: deque[float] = deque(
            maxlen=max(2, math.ceil(ONLINE_WINDOW_SECONDS / slo.interval)))
        self._last: tuple[float, float] | None = None  # (server's successes, ours)
        self._online_at = -math.inf
        self._metrics_ok = True
        self._target_ms: float | None = None  # the SLO in ms, once known

    # -- the probe ------------------------------------------------------------------

    def _probe_body(self) -> dict[str, Any]:
        tokens = 4 if self.slo.itl_ms is not None else 1
        body: dict[str, Any] = {"model": self.engine.model, "max_tokens": tokens,
                                "temperature": 0, "stream": True}
        if self.slo.endpoint == CHAT:
            body["messages"] = [{"role": "user", "content": "Hi"}]
        else:
            body["prompt"] = "Hi"
        if self.slo.online_priority is not None:
            body["priority"] = self.slo.online_priority
        return body

    async def probe(self) -> tuple[float, float | None] | None:
        """(time to first token, mean inter-token gap) in ms of one probe; None when the
        server could not be reached or refused it. A probe that times out is a sample of
        its timeout: online users waited at least that long. Once the SLO is known a
        probe waits at most twice it: past the SLO is all a decision needs to know, and a
        probe waited out would hold the next decision back as long as the server is slow."""
        url = self.engine.base_url + self.slo.endpoint[3:]
        timeout = max(0.5, 2 * self._target_ms / 1000) if self._target_ms else 10.0
        started = time.monotonic()
        stamps: list[float] = []
        try:
            async with self.engine._http.stream(
                    "POST", url, json=self._probe_body(), headers=self.engine._auth,
                    timeout=httpx.Timeout(timeout, connect=5.0)) as response:
                if response.status_code != 200:
                    # Without samples the limit holds where it is ("measuring"): say why.
                    if self.engine._first_in(60.0, "probe_refused"):
                        log.warning("remote %s: the SLO probe was answered %d; the limit "
                                    "holds until probes pass", self.engine.base_url,
                                    response.status_code)
                    return None
                async for line in response.aiter_lines():
                    if line.startswith("data: {") and '"choices"' in line:
                        stamps.append(time.monotonic())
        except httpx.TimeoutException:
            if stamps:  # the first token came: the gaps after it were too long
                return (stamps[0] - started) * 1000, (time.monotonic() - stamps[-1]) * 1000
            return (time.monotonic() - started) * 1000, None
        except httpx.HTTPError:
            return None
        if not stamps:
            return None
        itl = ((stamps[-1] - stamps[0]) / (len(stamps) - 1) * 1000
               if len(stamps) > 1 else None)
        return (stamps[0] - started) * 1000, itl

    # -- the loop -------------------------------------------------------------------

    async def run(self) -> None:
        redis = self.engine._redis
        try:
            await self._first_alone(redis)
        finally:
            self.ready.set()
        while True:
            await asyncio.sleep(self.slo.interval)
            try:
                if await self._lead(redis):
                    await self._tick(redis)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # Redis or the server gone: the next tick tries again
                log.warning("remote %s: SLO tick failed (%s)", self.engine.base_url, e)

    async def _lead(self, redis: Any) -> bool:
        """Whether this engine is the server's prober (taking the lock when free)."""
        ttl = int(self.slo.interval * 3000)
        if await redis.set(self.lock_key, self.me, nx=True, px=ttl):
            return True
        holder = await redis.get(self.lock_key)
        if holder is not None and holder.decode() == self.me:
            await redis.pexpire(self.lock_key, ttl)
            return True
        return False

    async def _first_alone(self, redis: Any) -> None:
        """Where no time alone is known: a few probes before the first batch request (one
        after another), so the SLO has its room below it (and a multiple its base)."""
        if await redis.llen(self.alone_key) >= ALONE_FIRST:
            return
        for _ in range(ALONE_FIRST * 2):
            if await redis.zcard(self.engine._leases_key) > 0:
                return  # another worker's batch is running: alone is not to be had now
            got = await self.probe()
            if got is not None:
                await self._keep(redis, Sample(time.time(), got[0], got[1], 0))
                if await redis.llen(self.alone_key) >= ALONE_FIRST:
                    return

    async def _keep(self, redis: Any, sample: Sample) -> None:
        pipe = redis.pipeline()
        pipe.lpush(self.samples_key, sample.encode())
        pipe.ltrim(self.samples_key, 0, SAMPLES_KEPT - 1)
        if sample.ours == 0:
            pipe.lpush(self.alone_key, sample.encode())
            pipe.ltrim(self.alone_key, 0, ALONE_KEPT - 1)
        pipe.hincrby(self.engine._state_key, "probes", 1)
        await pipe.execute()

    async def _online(self, redis: Any) -> bool:
        """Whether online requests finished lately: the server's count less ours."""
        if not self.engine.metrics_url or not self._metrics_ok:
            return True
        try:
            status, raw = await self.engine._get(self.engine.metrics_url,
                                                 self.engine._metrics_auth,
                                                 timeout=httpx.Timeout(5.0))
        except Exception:
            return True
        served = vllm_successes(raw.decode("utf-8", "replace"), self.engine.model) \
            if status == 200 else None
        if served is None:
            self._metrics_ok = status == 200 and self._last is not None
            return True
        fields = await redis.hmget(self.engine._state_key, "answered", "probes")
        ours = sum(float(v or 0) for v in fields)
        if self._last is not None:
            self._counts.append((served - self._last[0]) - (ours - self._last[1]))
        self._last = (served, ours)
        now = time.monotonic()
        if len(self._counts) < (self._counts.maxlen or 0):
            return True  # a first window not read yet: taken as online
        if sum(self._counts) >= ONLINE_MIN_REQUESTS:
            self._online_at = now
        return now - self._online_at < ONLINE_HOLD_SECONDS

    async def _tick(self, redis: Any) -> None:
        state_key = self.engine._state_key
        ours = int(await redis.zcard(self.engine._leases_key))
        got = await self.probe()
        if got is not None:
            await self._keep(redis, Sample(time.time(), got[0], got[1], ours))
        online = await self._online(redis)
        pipe = redis.pipeline()
        pipe.lrange(self.samples_key, 0, -1)
        pipe.lrange(self.alone_key, 0, -1)
        pipe.hmget(state_key, "limit", "steered_at", "floor", "floor_at", "slo_limit")
        pipe.zcard(self.engine._leases_key)
        raw_samples, raw_alone, fields, in_flight = await pipe.execute()
        samples = [s for s in map(Sample.decode, raw_samples) if s is not None]
        alone = [s for s in map(Sample.decode, raw_alone) if s is not None]
        ceiling = float(self.engine.ceiling)
        limit = min(float(fields[0] or self.engine.initial), ceiling)
        steered_at = float(fields[1] or 0)
        floor = float(fields[2] or 0) if time.time() - float(fields[3] or 0) \
            < FLOOR_FRESH_SECONDS else 0.0
        # Where the SLO last held with online users there; where it never held, the
        # limit a server not yet seen starts at.
        slo_limit = float(fields[4]) if fields[4] else float(self.engine.initial)
        recent = [s for s in samples if s.at > steered_at and s.ours > 0]
        p = self.slo.percentile
        alone_ttft = percentile([s.ttft_ms for s in alone], p) if alone else None
        target = self.slo.ttft_ms
        if target is None and self.slo.factor is not None and alone_ttft:
            target = self.slo.factor * alone_ttft
        self._target_ms = target
        measured = percentile([s.ttft_ms for s in recent], p) if recent else None
        itl = percentile([s.itl_ms for s in recent if s.itl_ms is not None], p) \
            if any(s.itl_ms is not None for s in recent) else None
        now_pressure: float | None = None
        latest_over = False
        if target is not None and measured is not None:
            now_pressure = pressure(measured, alone=min(alone_ttft or 0, target), target=target)
            latest_over = recent[0].ttft_ms > target
            if self.slo.itl_ms is not None and itl is not None:
                alone_itl = [s.itl_ms for s in alone if s.itl_ms is not None]
                base = min(percentile(alone_itl, p), self.slo.itl_ms) if alone_itl else 0.0
                now_pressure = max(now_pressure, pressure(itl, alone=base,
                                                          target=self.slo.itl_ms))
                latest_over = latest_over or (recent[0].itl_ms or 0) > self.slo.itl_ms
        decision = decide(pressure_now=now_pressure, latest_over=latest_over,
                          samples=len(recent), band=self.slo.band, limit=limit,
                          ceiling=ceiling, floor=floor,
                          binding=int(in_flight) + 1 >= int(limit), online=online,
                          slo_limit=slo_limit, draining=int(in_flight) > max(1, int(limit)))
        shown = {"slo_percentile": p, "online": int(online), "floor_now": floor,
                 "slo_ms": "" if target is None else round(target, 1),
                 "online_ms": "" if measured is None else round(measured, 1),
                 "alone_ms": "" if alone_ttft is None else round(alone_ttft, 1),
                 "itl_slo_ms": self.slo.itl_ms or "",
                 "online_itl_ms": "" if itl is None else round(itl, 1),
                 "slo_seen_at": round(time.time(), 3)}
        if online and decision.reason != "measuring":
            # Where the SLO holds now: where the limit comes back to when online users
            # return after a quiet spell.
            shown["slo_limit"] = round(decision.limit, 3)
        await redis.hset(state_key, mapping={k: str(v) for k, v in shown.items()})
        if abs(decision.limit - limit) > 1e-6:
            await self.engine._steer(keys=[state_key], args=[
                repr(limit), repr(decision.limit), decision.reason, ceiling,
                repr(time.time())])
        else:
            await redis.hset(state_key, "reason", decision.reason)
