"""What live workers say of themselves through Redis, per model: their engine's KV cache (for
prefix planning) and their throughput while busy (for the capacity plan: how many workers
a model has, and how fast each one is).

Every worker's presence thread writes a field of a per-model hash every few seconds, with
the time it wrote it; a field older than the caller's `max_age` is a worker gone, and is
forgotten as it is read. Here, below validation, the worker and queue health, which all
read or write it."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import redis

# Per model, a hash of its workers' engine KV caches: worker name -> "tokens stamp".
KV_CACHE_KEY = "batchweb:kv-cache:{model}"
# Per model, a hash of its workers' throughput: worker name -> JSON (WorkerRate).
RATES_KEY = "batchweb:worker-rates:{model}"


def _expire_after(every: float) -> int:
    return int(max(60, 10 * every))


def report_kv_cache(connection: redis.Redis, name: str, model: str, tokens: int,
                    every: float) -> None:
    """Say that worker `name`'s engine of `model` keeps `tokens` tokens of KV cache (and so
    of prompt prefix); the entry counts for a few beats (`kv_cache_tokens`)."""
    key = KV_CACHE_KEY.format(model=model)
    pipe = connection.pipeline()
    pipe.hset(key, name, f"{tokens} {time.time():.0f}")
    pipe.expire(key, _expire_after(every))
    pipe.execute()


def kv_cache_tokens(connection: redis.Redis, model: str, *, max_age: float) -> int | None:
    """The KV cache the live workers of `model` report, in tokens: the smallest, since a
    shard may run on any of them; None when none reported within `max_age` seconds."""
    key = KV_CACHE_KEY.format(model=model)
    fresh = []
    for name, value in connection.hgetall(key).items():
        tokens, stamp = value.decode().split()
        if time.time() - float(stamp) <= max_age:
            fresh.append(int(tokens))
        else:
            connection.hdel(key, name)  # a worker gone: forget it
    return min(fresh) if fresh else None


@dataclass(frozen=True)
class WorkerRate:
    """A worker's throughput, measured over its recent busy time (the engine had requests
    in flight): prompt and output tokens per busy second apart (prefill and decode), and
    the share of the recent wall time it was busy. Zeros until it has run something."""

    name: str
    prompt_tokens_per_second: float = 0.0
    output_tokens_per_second: float = 0.0
    busy: float = 0.0
    stamp: float = 0.0

    def to_json(self) -> str:
        return json.dumps({"prompt": round(self.prompt_tokens_per_second, 2),
                           "output": round(self.output_tokens_per_second, 2),
                           "busy": round(self.busy, 3), "stamp": round(self.stamp)})

    @classmethod
    def from_json(cls, name: str, raw: Any) -> WorkerRate:
        data = json.loads(raw)
        return cls(name=name, prompt_tokens_per_second=float(data["prompt"]),
                   output_tokens_per_second=float(data["output"]), busy=float(data["busy"]),
                   stamp=float(data["stamp"]))


def report_rate(connection: redis.Redis, model: str, rate: WorkerRate, every: float) -> None:
    """Say that worker `rate.name` serves `model`, at that throughput."""
    key = RATES_KEY.format(model=model)
    pipe = connection.pipeline()
    pipe.hset(key, rate.name, rate.to_json())
    pipe.expire(key, _expire_after(every))
    pipe.execute()


def worker_rates(connection: redis.Redis, model: str, *, max_age: float) -> list[WorkerRate]:
    """The live workers of `model` (each reported within `max_age` seconds), with their
    throughput; those gone are forgotten."""
    key = RATES_KEY.format(model=model)
    fresh = []
    for raw_name, value in connection.hgetall(key).items():
        name = raw_name.decode()
        try:
            rate = WorkerRate.from_json(name, value)
        except (ValueError, KeyError, TypeError):
            rate = WorkerRate(name=name)
        if time.time() - rate.stamp <= max_age:
            fresh.append(rate)
        else:
            connection.hdel(key, raw_name)
    return sorted(fresh, key=lambda r: r.name)
