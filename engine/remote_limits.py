"""How many requests may be in flight on one remote server, shared by every worker.

A remote server (engine/remote.py) is shared: several batchworkers, on several hosts, may
point at the same base URL. Their requests in flight are bounded together by a semaphore
held in Redis, and the bound itself moves (AIMD) with what the server answers.

- The semaphore is a sorted set of leases, each scored by when it expires (Redis' own
  clock). A holder renews its leases while their requests run; a killed worker stops
  renewing, so its slots come back after LEASE_SECONDS without anyone cleaning up.
- The limit is a float in the server's state hash, grown per request whose latency stays
  near the floor: +1 each until the first cut (TCP's slow start: a batch reaches a big
  server's capacity in a few rounds, not thousands of requests), then +1/limit each (one
  slot per round of the limit, as TCP's congestion avoidance) from the threshold the last
  cut left. x BETA on a 429, a 503, a timeout, a reset, or vLLM's own queue holding
  requests not ours; never above the ceiling nor below 1 (the SLO alone pauses it at
  0), and cut at most once per
  COOLDOWN_SECONDS (a burst of 429s is one signal, not ten halvings).
- The same hash counts backoffs and errors and remembers when the server was last busy or
  unreachable, for queue health, /metrics and the batch page (`server_state`).
- With an SLO (engine/remote_slo.py) the limit is steered by the online latency measured
  there instead of growing per request; the cuts above still apply. The hash then also
  holds the SLO, the latency measured, the deadline floor (`set_floor`, written by the
  reconciler's pass) and why the limit is where it is; "paused" (0) where even one
  batch request in flight breaks the SLO while online users are there.

Keys: batchweb:remote:<server id>:leases and :state; the server id is a digest of the base
URL, so every worker that names the same URL shares them.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Any

KEY_PREFIX = "batchweb:remote:"
# A remote model's `max_concurrency` when its options do not say.
DEFAULT_CEILING = 64
LEASE_SECONDS = 30
BETA = 0.5
COOLDOWN_SECONDS = 2.0
# How long after a throttle or a connection failure the server still shows as busy or
# unreachable.
RECENT_SECONDS = 30

# Why a server's limit is where it is (ServerState.reason).
REASONS = ("throttled", "slo", "paused", "deadline_floor", "ceiling", "no_online_traffic",
           "measuring", "adaptive")

# KEYS: leases, state. ARGV: lease id, lease ms, initial limit, ceiling.
# 1 and the lease taken when in flight < the limit, else 0 (a limit of 0: paused).
ACQUIRE = """
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local limit = tonumber(redis.call('HGET', KEYS[2], 'limit'))
if limit == nil then
  limit = tonumber(ARGV[3])
  redis.call('HSET', KEYS[2], 'limit', ARGV[3])
end
limit = math.min(limit, tonumber(ARGV[4]))
if redis.call('ZCARD', KEYS[1]) < math.floor(limit) then
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
  redis.call('PEXPIRE', KEYS[1], 2 * tonumber(ARGV[2]))
  return 1
end
return 0
"""

# KEYS: leases. ARGV: lease ms, lease ids... Every lease pushed to now + lease ms (put
# back if Redis lost it: its request is still running and must be counted).
RENEW = """
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
for i = 2, #ARGV do
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[1]), ARGV[i])
end
redis.call('PEXPIRE', KEYS[1], 2 * tonumber(ARGV[1]))
return #ARGV - 1
"""

# KEYS: state. ARGV: "grow" | "cut", ceiling, cooldown ms, beta. The new limit.
ADJUST = """
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local ceiling = tonumber(ARGV[2])
local limit = math.min(tonumber(redis.call('HGET', KEYS[1], 'limit') or ceiling), ceiling)
if ARGV[1] == 'grow' then
  local threshold = tonumber(redis.call('HGET', KEYS[1], 'threshold') or ceiling)
  if limit < threshold then
    limit = math.min(ceiling, threshold, limit + 1)
  else
    limit = math.min(ceiling, limit + 1 / math.max(1, limit))
  end
else
  local last = tonumber(redis.call('HGET', KEYS[1], 'cut_at') or 0)
  if now - last < tonumber(ARGV[3]) then
    return tostring(limit)
  end
  limit = math.max(math.min(1, limit), limit * tonumber(ARGV[4]))
  redis.call('HSET', KEYS[1], 'cut_at', now, 'threshold', tostring(limit))
  redis.call('HINCRBY', KEYS[1], 'cuts', 1)
end
redis.call('HSET', KEYS[1], 'limit', tostring(limit))
return tostring(limit)
"""


def server_id(base_url: str) -> str:
    """The key every worker naming this base URL shares (a trailing slash is the same URL)."""
    return hashlib.sha256(base_url.rstrip("/").encode()).hexdigest()[:16]


def keys(base_url: str) -> tuple[str, str]:
    """(leases, state) keys of the server at `base_url`."""
    prefix = f"{KEY_PREFIX}{server_id(base_url)}"
    return f"{prefix}:leases", f"{prefix}:state"


@dataclass(frozen=True)
class ServerState:
    """What queue health, /metrics and the batch page show of one remote server."""

    base_url: str
    in_flight: int
    limit: float
    backoffs: int
    errors: int
    cuts: int
    # "ok", "busy" (it throttled us or held every slot lately) or "unreachable" (the
    # last attempt to reach it failed, within RECENT_SECONDS).
    condition: str
    last_error: str
    # Why the limit is where it is: "throttled" (cut on a 429, 503, timeout, reset or a
    # queue lately), "slo" (held by the online latency), "paused" (0: even one batch
    # request in flight breaks the SLO while online users are there; a lull resumes it),
    # "deadline_floor" (kept above where
    # the SLO would put it, for a batch's window), "ceiling", "no_online_traffic" (no
    # online request to protect lately), "measuring" (no latency alone yet), "adaptive"
    # (no SLO: AIMD on latency).
    reason: str = "adaptive"
    slo_ms: float | None = None  # the time to first token held (at slo_percentile)
    slo_percentile: float | None = None
    online_ms: float | None = None  # what was measured lately, at that percentile
    slo_samples: float | None = None  # online samples that measure holds
    slo_measure: str = ""  # "histogram" (the server's, less ours) or "probes"
    alone_ms: float | None = None  # the same with no batch request in flight
    itl_slo_ms: float | None = None
    online_itl_ms: float | None = None
    floor: float = 0.0  # the deadline floor in force, requests in flight

    @property
    def slo_traded(self) -> bool:
        """The SLO is being given up for a batch's window."""
        return self.reason == "deadline_floor"

    @property
    def paused(self) -> bool:
        """No batch request goes to the server: online users are there and even one
        breaks the SLO."""
        return self.reason == "paused"


def server_state(client: Any, base_url: str, *, ceiling: float) -> ServerState:
    """The shared state of the server at `base_url`, read with a synchronous redis-py
    client (the web's); leases past their expiry are not counted."""
    leases, state = keys(base_url)
    now_ms = time.time() * 1000
    pipe = client.pipeline()
    pipe.zcount(leases, now_ms, "+inf")
    pipe.hgetall(state)
    in_flight, raw = pipe.execute()
    fields = {_text(k): _text(v) for k, v in raw.items()}
    now = time.time()
    unreachable = float(fields.get("unreachable_at") or 0)
    reached = float(fields.get("reached_at") or 0)
    busy = float(fields.get("busy_at") or 0)
    if unreachable > reached and now - unreachable < RECENT_SECONDS:
        condition = "unreachable"
    elif now - busy < RECENT_SECONDS:
        condition = "busy"
    else:
        condition = "ok"
    limit = min(float(fields.get("limit") or ceiling), ceiling)
    # The prober writes its figures every few seconds: older ones are no one's now.
    steering = now - float(fields.get("slo_seen_at") or 0) < RECENT_SECONDS
    if steering and fields.get("reason") == "paused":
        reason = "paused"  # what holds the batch back now, whatever cut it before
    elif now - float(fields.get("cut_at") or 0) / 1000 < RECENT_SECONDS:
        reason = "throttled"
    elif steering:
        reason = fields.get("reason") or "slo"
    else:
        reason = "ceiling" if limit >= ceiling else "adaptive"
    return ServerState(base_url=base_url, in_flight=int(in_flight), limit=limit,
                       backoffs=int(fields.get("backoffs") or 0),
                       errors=int(fields.get("errors") or 0), cuts=int(fields.get("cuts") or 0),
                       condition=condition, last_error=fields.get("last_error", ""),
                       reason=reason,
                       slo_ms=_number(fields, "slo_ms", steering),
                       slo_percentile=_number(fields, "slo_percentile", steering),
                       online_ms=_number(fields, "online_ms", steering),
                       slo_samples=_number(fields, "slo_samples", steering),
                       slo_measure=fields.get("slo_measure", "") if steering else "",
                       alone_ms=_number(fields, "alone_ms", steering),
                       itl_slo_ms=_number(fields, "itl_slo_ms", steering),
                       online_itl_ms=_number(fields, "online_itl_ms", steering),
                       floor=_number(fields, "floor_now", steering) or 0.0)


def _number(fields: dict[str, str], name: str, fresh: bool) -> float | None:
    value = fields.get(name, "")
    return float(value) if fresh and value else None


def token_seconds(client: Any, base_url: str) -> float:
    """A batch request's seconds per output token there lately (0: none measured)."""
    value = client.hget(keys(base_url)[1], "token_seconds")
    return float(value) if value else 0.0


def set_floor(client: Any, base_url: str, floor: float) -> None:
    """The deadline floor of the server at `base_url`: the requests in flight its batches
    need to meet their windows (the SLO steers no lower; engine/remote_slo.py)."""
    client.hset(keys(base_url)[1], mapping={"floor": f"{floor:.3f}",
                                            "floor_at": f"{time.time():.3f}"})


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
