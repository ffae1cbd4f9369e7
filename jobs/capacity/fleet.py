"""What live workers say of themselves through Redis, per model: their engine's KV cache (for
prefix planning), their throughput while busy (for the capacity plan: how many workers
a model has, and how fast each one is; queue health shows it per worker), and how long the
last one took to start (for the plan of a batch waiting for a first worker).

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


def _fresh(connection: redis.Redis, key: str, *, max_age: float) -> dict[str, bytes]:
    """A per-model hash's fields written within `max_age` seconds (each value ends with the
    time it was written, or holds it as "stamp"); the older ones are workers gone, and are
    forgotten."""
    fresh = {}
    for raw_name, value in connection.hgetall(key).items():
        if time.time() - _stamp(value) <= max_age:
            fresh[raw_name.decode()] = value
        else:
            connection.hdel(key, raw_name)
    return fresh


def _stamp(value: bytes) -> float:
    try:
        text = value.decode()
        return float(json.loads(text)["stamp"] if text.startswith("{") else text.split()[1])
    except (ValueError, KeyError, IndexError, TypeError):
        return 0.0  # unreadable: as old as can be


def kv_cache_tokens(connection: redis.Redis, model: str, *, max_age: float) -> int | None:
    """The KV cache the live workers of `model` report, in tokens: the smallest, since a
    shard may run on any of them; None when none reported within `max_age` seconds."""
    fresh = _fresh(connection, KV_CACHE_KEY.format(model=model), max_age=max_age)
    return min((int(value.split()[0]) for value in fresh.values()), default=None)


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
    fresh = _fresh(connection, RATES_KEY.format(model=model), max_age=max_age)
    return [WorkerRate.from_json(name, value) for name, value in sorted(fresh.items())]


# Per model, how long its last worker took from loading its engine to taking jobs (its
# cold start, seconds): what a batch waiting for a first worker is projected to wait.
COLD_START_KEY = "batchweb:cold-start:{model}"
COLD_START_DAYS = 30
# Per model, its workers loading their engine now: worker name -> when it began (epoch).
STARTING_KEY = "batchweb:starting:{model}"


def report_starting(connection: redis.Redis, model: str, name: str) -> None:
    """Say that worker `name` begins to load `model`'s engine (until `report_cold_start`)."""
    key = STARTING_KEY.format(model=model)
    pipe = connection.pipeline()
    pipe.hset(key, name, f"{time.time():.0f}")
    pipe.expire(key, 86400)
    pipe.execute()


def report_cold_start(connection: redis.Redis, model: str, seconds: float, *,
                      name: str = "") -> None:
    """Say that a worker of `model` (`name`, no longer starting) took `seconds` to become
    ready (kept COLD_START_DAYS: the next first worker of it, maybe days later, is likely
    to take as long)."""
    pipe = connection.pipeline()
    pipe.set(COLD_START_KEY.format(model=model), f"{seconds:.1f}", ex=COLD_START_DAYS * 86400)
    if name:
        pipe.hdel(STARTING_KEY.format(model=model), name)
    pipe.execute()


def starting_since(connection: redis.Redis, model: str, *, max_age: float) -> float | None:
    """When the newest worker of `model` still loading its engine began (epoch); None when
    none began within `max_age` seconds (an older one died loading: forgotten)."""
    key = STARTING_KEY.format(model=model)
    newest = None
    for raw_name, value in connection.hgetall(key).items():
        try:
            began = float(value)
        except ValueError:
            began = 0.0
        if time.time() - began > max_age:
            connection.hdel(key, raw_name)
        elif newest is None or began > newest:
            newest = began
    return newest


def cold_start_seconds(connection: redis.Redis, model: str) -> float | None:
    """The last cold start a worker of `model` reported; None before any did."""
    value = connection.get(COLD_START_KEY.format(model=model))
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


# The field of an RQ worker's registration listing the models it can switch to (written
# by its presence beat, jobs/worker/presence.py).
STANDBY_FIELD = "batchweb_standby"


def standby_models(worker: Any) -> list[str]:
    """The models `worker` (an RQ worker, as `Worker.all` gives them) switches to when they
    wait (none for a one-model worker)."""
    value = worker.connection.hget(worker.key, STANDBY_FIELD)
    return [name for name in (value or b"").decode().split(",") if name]
