"""The remote engine (engine/remote.py) against `vllm serve` on this machine.

--part throughput: the same mixed chat requests (harness.make_requests, temperature 0,
ignore_eos so every path generates exactly max_tokens) through
  (1) the remote engine against `vllm serve`,
  (2) batchweb's in-process engine (VllmEngine, what `batchworker` runs),
  (3) vLLM's `run_batch` (its batch phase, after its engine start),
with the same engine settings on every path: the in-process engine's batch sizes (vLLM's
LLM_CLASS defaults), max_model_len 2048, eager, the same dtype, 2 GiB of KV cache,
VLLM_CPU_NUM_OF_RESERVED_CPU=0. Output tokens/s over each run (engine start excluded);
rounds alternate the order of the paths; the ratio (1)/(2) is taken per round, and the
median reported.

--part interactive: llm-d's way of measuring an online server's protection. A steady
interactive client (short streamed chats at a fixed rate, priority 0) alone, then a batch
draining through the remote engine alone, then both together, against `vllm serve` with
and without `--scheduling-policy priority`. Reported: the client's p50/p99 time to first
token and latency in each phase, and the batch's output tokens/s with the client against
without it (the server's own count of generated tokens, less the client's). The batch's
limit first finds its level in an unmeasured window, and each measured window starts once
the batch flows (SETTLE). Rounds alternate the two server settings.

--part interactive --slo-factors 2,1.25: the online latency SLO (engine/remote_slo.py), on
a server with priority scheduling, judged against the best fixed limit. Per round: the
batch at a fixed ceiling with no client (its tokens/s: the idle rate every share below is
of); the batch with the first factor's SLO (of the steady client alone, measured first)
and no client (does the controller hold it back?); then, per online pattern (--patterns:
steady, one request every --every seconds; bursty, --burst-on seconds of seeded Poisson
arrivals at that mean rate then --burst-off seconds of none): the client alone in that
pattern (its p99 TTFT is the "alone" the pattern's SLO is a multiple of: ttft_slo_ms =
factor x that, at p99; bursty arrivals queue on each other, so their p99 alone is higher
than a steady client's), the batch with each factor's SLO started afresh beside the
client, and the oracle: each fixed max_concurrency of --oracle beside the same client (the
same seed), the best one that holds each SLO being the bar (0, no batch, where none does).
A p99 of fewer than 100 samples is their largest: --seconds should give a window 100. Each run
settles for --settle seconds, then is measured for --seconds. Reported, medians over the
rounds: the client's p99 TTFT against the SLO (rounds met), the batch's share of its idle
rate for the controller and for the oracle, and their ratio. Here the client runs in a
process of its own, as online users do (in the batch worker's process it would wait on
that interpreter's lock too). `--pin`: the engine's compute on core 1, the server's front
end and this process on core 0 (pin_apart); `--server-flags`: more `vllm serve` flags (e.g.
`--long-prefill-token-threshold 48 --enable-per-request-metrics`, without which the
controller measures by its probes alone: docs/remote-engine.md); the SLO's server counts
time to first token in buckets 10 ms wide (SLO_TTFT_EDGES).

Every engine here holds /tmp/engine.lock: run as `flock /tmp/engine.lock .venv/bin/python
bench/remote_engine.py ...`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

try:
    from bench import harness
except ImportError:  # run as `python bench/remote_engine.py`: start again as the module,
    # which imports this checkout's tests/ and bench/ as packages.
    os.execv(sys.executable, [sys.executable, "-m", "bench.remote_engine", *sys.argv[1:]])
from bench.engine_efficiency import llm_class_batch_sizes, run_vllm_batch
from engine.base import EngineRequest, ModelSpec
from engine.endpoints import CHAT
from tests.vllmserve import MODELS, VllmServe

MAX_MODEL_LEN = 2048
KV_GIB = 2
# interactive: seconds a drain runs before its window (and the client) starts.
SETTLE = 10.0
# interactive with an SLO: seconds the client and the batch run together before the window
# (--settle): a p99 controller decides once 100 samples are in, so it needs several times
# 100 / the client's rate to settle.
SLO_SETTLE = 30.0
# The SLO's server counts time to first token in buckets 10 ms wide up to 1 s, 50 ms up
# to 3 s (docs/remote-engine.md asks for an edge at the SLO; here the SLO is a multiple of
# a latency measured once the server runs). vLLM's own edges are 250 ms apart from
# 250 ms on: a bucket across the SLO leaves the controller unsure which users met it.
SLO_TTFT_EDGES = [round(0.01 * i, 2) for i in range(1, 101)] + [
    round(1 + 0.05 * i, 2) for i in range(1, 41)] + [5.0, 10.0, 20.0, 40.0]


def engine_requests(requests: list[dict], model: str) -> list[EngineRequest]:
    return [EngineRequest(r["custom_id"], CHAT, {**r["body"], "model": model,
                                                 "ignore_eos": True}) for r in requests]


def drive(engine: Any, requests: list[EngineRequest]) -> dict[str, Any]:
    started = time.monotonic()
    tokens = failed = 0
    for result in engine.run(requests):
        if result.status_code == 200:
            tokens += result.body["usage"]["completion_tokens"]
        else:
            failed += 1
    seconds = time.monotonic() - started
    return {"tokens": tokens, "failed": failed, "seconds": seconds, "tok_s": tokens / seconds}


def serve(dtype: str, policy: str, seqs: int, batched: int, log: Path, *extra: str
          ) -> VllmServe:
    server = VllmServe(harness.MODEL, "smol", "--dtype", dtype, "--max-model-len",
                       str(MAX_MODEL_LEN), "--max-num-seqs", str(seqs),
                       "--max-num-batched-tokens", str(batched), "--scheduling-policy",
                       policy, "--enable-prompt-tokens-details", *extra, log=log,
                       kv_cache_gib=KV_GIB)
    server.wait_ready()
    return server


def pin_apart(server: VllmServe) -> None:
    """The engine's compute on core 1 alone (VLLM_CPU_OMP_THREADS_BIND=1, set before the
    server started), everything else on core 0: the server's front end (its HTTP and
    detokenizing process) and this process with its threads and the clients it starts.
    On 2 cores an engine whose OpenMP threads share both with the front end waits at each
    parallel region for a thread the front end displaced, so a step's time follows every
    other process's load."""
    for task in Path(f"/proc/{server.proc.pid}/task").iterdir():
        os.sched_setaffinity(int(task.name), {0})
    for task in Path("/proc/self/task").iterdir():
        os.sched_setaffinity(int(task.name), {0})


def remote_engine(url: str, ceiling: int, **options: Any) -> Any:
    from engine.remote import RemoteEngine

    return RemoteEngine(ModelSpec(name="smol", backend="remote", options={
        "base_url": url, "redis_url": os.environ["REDIS_URL"], "max_concurrency": ceiling,
        **options}))


def reset_limit(url: str) -> None:
    import redis

    from engine.remote_limits import keys
    from engine.remote_slo import keys as slo_keys

    redis.Redis.from_url(os.environ["REDIS_URL"]).delete(*keys(url), *slo_keys(url))


# --- throughput -------------------------------------------------------------------------


def run_remote(requests: list[dict], dtype: str, seqs: int, batched: int,
               scratch: Path) -> dict[str, Any]:
    server = serve(dtype, "fcfs", seqs, batched, scratch / "serve.log")
    try:
        reset_limit(server.url)
        # A server of its own: the limit starts at the ceiling (a shared server's would
        # start at 4 and find its way up).
        engine = remote_engine(server.url, seqs, initial_concurrency=seqs)
        try:
            return drive(engine, engine_requests(requests, "smol"))
        finally:
            engine.close()
    finally:
        server.stop()


def run_in_process(requests: list[dict], dtype: str, seqs: int, batched: int
                   ) -> dict[str, Any]:
    from engine import load_engine

    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(KV_GIB)
    engine = load_engine(ModelSpec(name="smol", backend="vllm", path=str(MODELS / harness.MODEL),
                                   options={"dtype": dtype, "enforce_eager": True,
                                            "max_model_len": MAX_MODEL_LEN,
                                            "max_num_seqs": seqs,
                                            "max_num_batched_tokens": batched}))
    try:
        return drive(engine, engine_requests(requests, "smol"))
    finally:
        engine.close()


def run_run_batch(requests: list[dict], dtype: str, scratch: Path) -> dict[str, Any]:
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(KV_GIB)
    lines = [{**r, "body": {**r["body"], "ignore_eos": True}} for r in requests]
    row = run_vllm_batch(lines, str(MODELS / harness.MODEL), dtype, scratch)
    return {"tokens": row["tokens"], "failed": row.get("failed", 0),
            "seconds": row["batch_phase_seconds"], "tok_s": row["batch_phase_tok_s"]}


def throughput(args: argparse.Namespace) -> dict[str, Any]:
    seqs, batched = llm_class_batch_sizes(1)
    requests = harness.make_requests(args.n, args.min_tokens, args.max_tokens)
    rounds = []
    paths = ["remote", "in_process", "run_batch"]
    for index in range(args.rounds):
        order = paths[index % 3:] + paths[:index % 3]
        row: dict[str, Any] = {"order": order}
        for path in order:
            with tempfile.TemporaryDirectory(prefix="bench-remote-") as folder:
                scratch = Path(folder)
                if path == "remote":
                    row[path] = run_remote(requests, args.dtype, seqs, batched, scratch)
                elif path == "in_process":
                    row[path] = run_in_process(requests, args.dtype, seqs, batched)
                else:
                    row[path] = run_run_batch(requests, args.dtype, scratch)
            print(f"round {index + 1} {path}: {row[path]}", flush=True)
        row["remote/in_process"] = row["remote"]["tok_s"] / row["in_process"]["tok_s"]
        row["run_batch/in_process"] = row["run_batch"]["tok_s"] / row["in_process"]["tok_s"]
        rounds.append(row)
    return {"requests": args.n, "max_num_seqs": seqs, "max_num_batched_tokens": batched,
            "rounds": rounds,
            "median_remote_over_in_process": statistics.median(
                r["remote/in_process"] for r in rounds),
            "median_run_batch_over_in_process": statistics.median(
                r["run_batch/in_process"] for r in rounds),
            "median_tok_s": {p: statistics.median(r[p]["tok_s"] for r in rounds)
                             for p in paths}}


# --- interactive protection -------------------------------------------------------------


def arrivals(pattern: str, seconds: float, every: float, *, seed: int = 0,
             on: float = 20.0, off: float = 20.0) -> list[float]:
    """When the online client sends its requests, in seconds from its start, over
    `seconds`: "steady", one every `every` seconds; "bursty", `on` seconds of traffic then
    `off` seconds of none, in turn, the requests of each burst a Poisson process of the
    same mean rate (seeded: the controller and each fixed limit meet the same users)."""
    if pattern == "steady":
        return [i * every for i in range(math.ceil(seconds / every))]
    if pattern != "bursty":
        raise ValueError(f"no online pattern {pattern!r}")
    rng = random.Random(seed)
    times: list[float] = []
    start = 0.0
    while start < seconds:
        end = min(seconds, start + on)
        at = start + rng.expovariate(1 / every)
        while at < end:
            times.append(at)
            at += rng.expovariate(1 / every)
        start = end + off
    return times


async def interactive_client(url: str, seconds: float, every: float,
                             skip: float = 0.0, pattern: str = "steady", seed: int = 0,
                             on: float = 20.0, off: float = 20.0) -> dict[str, Any]:
    """Short streamed chats sent as `pattern` says (`arrivals`) for `skip` + `seconds`:
    each one's (TTFT, latency) of those sent after `skip`, and the output tokens they had
    (to tell the batch's from the server's count)."""
    samples: list[tuple[float, float]] = []
    tokens = 0
    begun = time.monotonic()

    async def one(client: httpx.AsyncClient, i: int) -> None:
        nonlocal tokens
        body = {"model": "smol", "max_tokens": 16, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True},
                "messages": [{"role": "user", "content": f"Say hello to user {i}."}]}
        started = time.monotonic()
        counted = started - begun >= skip
        first = None
        async with client.stream("POST", url + "/chat/completions", json=body) as response:
            async for line in response.aiter_lines():
                if first is None and line.startswith("data: {") and '"content"' in line:
                    first = time.monotonic() - started
                if counted and line.startswith("data: {") and \
                        '"usage":{' in line.replace(" ", ""):
                    usage = json.loads(line[len("data: "):]).get("usage") or {}
                    tokens += usage.get("completion_tokens") or 0
        if counted:
            samples.append((first if first is not None else float("nan"),
                            time.monotonic() - started))

    async with httpx.AsyncClient(timeout=120) as client:
        tasks = []
        for i, at in enumerate(arrivals(pattern, skip + seconds, every, seed=seed, on=on,
                                        off=off)):
            await asyncio.sleep(max(0.0, begun + at - time.monotonic()))
            tasks.append(asyncio.create_task(one(client, i)))
        await asyncio.sleep(max(0.0, begun + skip + seconds - time.monotonic()))
        await asyncio.gather(*tasks)
    return {"samples": samples, "tokens": tokens}


def online_client(url: str, seconds: float, every: float, skip: float = 0.0,
                  pattern: str = "steady", seed: int = 0, on: float = 20.0,
                  off: float = 20.0) -> dict[str, Any]:
    """interactive_client in a process of its own: online users do not share the batch
    worker's interpreter, so its lock and event loop are no part of their time to first
    token."""
    code = ("import asyncio, json, sys; from bench.remote_engine import interactive_client; "
            "print(json.dumps(asyncio.run(interactive_client(*json.loads(sys.argv[1])))))")
    given = [url, seconds, every, skip, pattern, seed, on, off]
    done = subprocess.run([sys.executable, "-c", code, json.dumps(given)],
                          cwd=Path(__file__).resolve().parents[1], capture_output=True,
                          text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def generated_tokens(url: str) -> float:
    """vLLM's own count of output tokens generated so far (every request, finished or not)."""
    text = httpx.get(url.removesuffix("/v1") + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:generation_tokens_total"))


def percentiles(samples: list[tuple[float, float]]) -> dict[str, float]:
    ttft = sorted(s[0] for s in samples)
    latency = sorted(s[1] for s in samples)

    def at(values: list[float], q: float) -> float:
        return values[min(len(values) - 1, int(q * len(values)))]

    return {"n": len(samples), "ttft_p50": at(ttft, 0.5), "ttft_p99": at(ttft, 0.99),
            "latency_p50": at(latency, 0.5), "latency_p99": at(latency, 0.99)}


class BatchDrain:
    """The batch through the remote engine in a thread, for `seconds`. What it measures is
    the server's count of output tokens generated in the window (requests still running at
    its end count for what they made; a request of 64-128 tokens outlasts a short window),
    and the batch's concurrency limit and requests in flight, sampled every second."""

    def __init__(self, url: str, requests: list[EngineRequest] | Any, ceiling: int,
                 **options: Any) -> None:
        self.url = url
        self.ceiling = ceiling
        self.engine = remote_engine(url, ceiling, **options)
        # One pass over the batch across windows (and drains, given the same iterator): no
        # window gets prompts already cached.
        self.requests = iter(requests)

    def run(self, seconds: float, settle: float = 0.0) -> dict[str, Any]:
        """`settle` seconds first, unmeasured: a drain started again hands in a whole
        limit's worth of prompts at once, which a batch flowing steadily never does."""
        import redis

        from engine.remote_limits import server_state

        client = redis.Redis.from_url(os.environ["REDIS_URL"])
        pending: set[str] = set()
        deadline = time.monotonic() + settle + seconds
        window: dict[str, float] = {}
        limits: list[float] = []
        in_flight: list[int] = []
        reasons: dict[str, int] = {}
        online_ms: list[float] = []

        def source() -> Any:
            for req in self.requests:
                if time.monotonic() >= deadline:
                    return
                pending.add(req.request_id)
                yield req

        def watch() -> None:
            time.sleep(settle)
            window["before"] = generated_tokens(self.url)
            while time.monotonic() < deadline - 0.5:
                state = server_state(client, self.url, ceiling=self.ceiling)
                limits.append(state.limit)
                in_flight.append(state.in_flight)
                reasons[state.reason] = reasons.get(state.reason, 0) + 1
                if state.online_ms is not None:
                    online_ms.append(state.online_ms)
                time.sleep(1.0)
            window["after"] = generated_tokens(self.url)
            self.engine.abort(list(pending))

        watcher = threading.Thread(target=watch)
        watcher.start()
        finished = 0
        for result in self.engine.run(source()):
            pending.discard(result.request_id)
            finished += result.status_code == 200 and deadline - seconds <= time.monotonic() \
                <= deadline
        watcher.join()
        return {"generated": window["after"] - window["before"], "seconds": seconds,
                "finished": finished,
                "limit_mean": statistics.fmean(limits) if limits else 0.0,
                "in_flight_mean": statistics.fmean(in_flight) if in_flight else 0.0,
                "reasons": reasons,
                "probe_ms_median": statistics.median(online_ms) if online_ms else None}

    def close(self) -> None:
        self.engine.close()


def interactive_round(policy: str, args: argparse.Namespace, batch: list[EngineRequest],
                      scratch: Path) -> dict[str, Any]:
    seqs, batched = llm_class_batch_sizes(1)
    server = serve(args.dtype, policy, seqs, batched, scratch / f"serve-{policy}.log")
    row: dict[str, Any] = {"policy": policy, "max_num_seqs": seqs,
                           "max_num_batched_tokens": batched}
    try:
        reset_limit(server.url)
        asyncio.run(interactive_client(server.url, 5, args.every))  # warm up
        alone = asyncio.run(interactive_client(server.url, args.seconds, args.every))
        row["alone"] = percentiles(alone["samples"])
        drain = BatchDrain(server.url, batch, args.ceiling)
        try:
            drain.run(min(20.0, args.seconds))  # the limit finds its level, unmeasured
            idle = drain.run(args.seconds, settle=SETTLE)
            done: list[dict[str, Any]] = []
            thread = threading.Thread(
                target=lambda: done.append(drain.run(args.seconds, settle=SETTLE)))
            thread.start()
            time.sleep(SETTLE)
            beside = asyncio.run(interactive_client(server.url, args.seconds, args.every))
            thread.join()
        finally:
            drain.close()
        row["with_batch"] = percentiles(beside["samples"])
        row["batch_idle"] = idle
        # The server's count less the client's own tokens: the batch's share of the window.
        row["batch_busy"] = {**done[0], "generated": done[0]["generated"] - beside["tokens"]}
        row["batch_idle_tok_s"] = idle["generated"] / args.seconds
        row["batch_busy_tok_s"] = row["batch_busy"]["generated"] / args.seconds
    finally:
        server.stop()
    row["ttft_p99_ratio"] = row["with_batch"]["ttft_p99"] / row["alone"]["ttft_p99"]
    row["batch_share"] = row["batch_busy_tok_s"] / row["batch_idle_tok_s"]
    print(json.dumps(row), flush=True)
    return row


def endless(batch: list[EngineRequest]) -> Iterator[EngineRequest]:
    """The batch's requests over and over (a round's many runs drain more than one pass),
    each pass after the first with its pass number in front of every prompt, so that none
    finds its prompt cached from a pass before."""
    for n in itertools.count():
        for req in batch:
            if n == 0:
                yield req
                continue
            messages = [{**m, "content": f"({n}) {m['content']}"} if i == 0 else m
                        for i, m in enumerate(req.body["messages"])]
            yield dataclasses.replace(req, request_id=f"{req.request_id}-{n}",
                                      body={**req.body, "messages": messages})


def fixed_options(limit: int) -> dict[str, Any]:
    """A limit that stays where it is put: starts at its ceiling, grows past nothing,
    watches no queue (the oracle's fixed max_concurrency)."""
    return {"initial_concurrency": limit, "metrics_url": "", "latency_tolerance": 1e9}


def beside_client(args: argparse.Namespace, url: str, source: Any, idle_tok_s: float,
                  ceiling: int, pattern: str, seed: int, **options: Any) -> dict[str, Any]:
    """A batch started afresh beside the online client in `pattern`, both through the
    settling time (args.settle, unmeasured) and a window of args.seconds: the client's p99
    TTFT over the window, and the batch's tokens/s as a share of `idle_tok_s`. A ceiling
    of 0 runs no batch (the client's own p99 in that pattern)."""
    client = {"every": args.every, "skip": args.settle, "pattern": pattern, "seed": seed,
              "on": args.burst_on, "off": args.burst_off}
    if ceiling == 0:
        beside = online_client(url, args.seconds, **client)
        return {"ttft_p99_ms": percentiles(beside["samples"])["ttft_p99"] * 1000,
                "n": len(beside["samples"]), "batch_tok_s": 0.0, "share": 0.0}
    reset_limit(url)
    drain = BatchDrain(url, source, ceiling, **options)
    done: list[dict[str, Any]] = []
    try:
        thread = threading.Thread(target=lambda: done.append(drain.run(args.seconds,
                                                                       settle=args.settle)))
        thread.start()
        beside = online_client(url, args.seconds, **client)
        thread.join()
    finally:
        drain.close()
    batch_tok_s = (done[0]["generated"] - beside["tokens"]) / args.seconds
    return {"ttft_p99_ms": percentiles(beside["samples"])["ttft_p99"] * 1000,
            "n": len(beside["samples"]), "batch_tok_s": batch_tok_s,
            "share": batch_tok_s / idle_tok_s, "limit_mean": done[0]["limit_mean"],
            "in_flight_mean": done[0]["in_flight_mean"], "reasons": done[0]["reasons"]}


def slo_round(args: argparse.Namespace, batch: list[EngineRequest], scratch: Path,
              seed: int) -> dict[str, Any]:
    """One round of the SLO measurement (the module's docstring)."""
    seqs, batched = llm_class_batch_sizes(1)
    factors = [float(f) for f in args.slo_factors.split(",")]
    buckets = json.dumps({"time_to_first_token": SLO_TTFT_EDGES}, separators=(",", ":"))
    server = serve(args.dtype, "priority", seqs, batched, scratch / "serve-slo.log",
                   "--custom-histogram-buckets", buckets, *args.server_flags.split())
    if args.pin:
        pin_apart(server)
    row: dict[str, Any] = {"policy": "priority", "max_num_seqs": seqs,
                           "max_num_batched_tokens": batched, "pinned": args.pin,
                           "server_flags": args.server_flags, "seed": seed}
    source = endless(batch)
    try:
        reset_limit(server.url)
        asyncio.run(interactive_client(server.url, 5, args.every))  # warm up
        alone = percentiles(online_client(server.url, args.seconds, args.every)["samples"])
        row["alone"] = alone
        slo = {f: f * alone["ttft_p99"] * 1000 for f in factors}
        # The batch's idle rate: at the ceiling, fixed, no online client.
        # Both idle drains settle as long as the runs beside the client: a drain started
        # afresh hands in a whole ceiling of prompts at once, and its requests outlive
        # SETTLE, so a shorter settling measures where their phases happen to be.
        idle = BatchDrain(server.url, source, args.ceiling, **fixed_options(args.ceiling))
        try:
            row["ceiling_idle"] = idle.run(args.seconds, settle=args.settle)
        finally:
            idle.close()
        idle_tok_s = row["ceiling_idle"]["generated"] / args.seconds
        row["idle_tok_s"] = idle_tok_s
        # The controller with no online client: it should not hold the batch back.
        reset_limit(server.url)
        alone_slo = BatchDrain(server.url, source, args.ceiling, ttft_slo_ms=slo[factors[0]],
                               ttft_slo_percentile=99, slo_probe_interval=args.probe_every)
        try:
            row["slo_idle"] = alone_slo.run(args.seconds, settle=args.settle)
        finally:
            alone_slo.close()
        row["no_online_ratio"] = row["slo_idle"]["generated"] / args.seconds / idle_tok_s
        for pattern in args.patterns.split(","):
            # The client alone in this pattern, settled and measured as every run beside it.
            alone_here = beside_client(args, server.url, source, idle_tok_s, 0, pattern, seed)
            slo = {f: f * alone_here["ttft_p99_ms"] for f in factors}
            mine: dict[str, Any] = {"alone": alone_here}
            print(json.dumps({pattern: {"alone": alone_here}}), flush=True)
            for factor in factors:
                got = beside_client(args, server.url, source, idle_tok_s, args.ceiling,
                                    pattern, seed, ttft_slo_ms=slo[factor],
                                    ttft_slo_percentile=99,
                                    slo_probe_interval=args.probe_every)
                mine[f"slo_{factor:g}"] = {"slo_ms": slo[factor], "controller": got,
                                           "slo_met": got["ttft_p99_ms"] <= slo[factor]}
                print(json.dumps({pattern: {f"slo_{factor:g}": mine[f"slo_{factor:g}"]}}),
                      flush=True)
            # The oracle: each fixed limit in turn (up to the first that holds no SLO
            # asked for), in the same pattern and seed.
            sweep = [{"limit": 0, **alone_here}]
            for limit in (int(x) for x in args.oracle.split(",") if int(x)):
                got = beside_client(args, server.url, source, idle_tok_s, limit, pattern,
                                    seed, **fixed_options(limit))
                sweep.append({"limit": limit, **got})
                print(json.dumps({pattern: {"oracle": sweep[-1]}}), flush=True)
                if got["ttft_p99_ms"] > max(slo.values()):
                    break
            mine["oracle_sweep"] = sweep
            for factor in factors:
                held = [r for r in sweep if r["ttft_p99_ms"] <= slo[factor]]
                best = max(held, key=lambda r: r["share"]) if held else None
                entry = mine[f"slo_{factor:g}"]
                entry["oracle"] = best
                entry["over_oracle"] = (entry["controller"]["share"] / best["share"]
                                        if best and best["share"] else None)
            row[pattern] = mine
    finally:
        server.stop()
    print(json.dumps(row), flush=True)
    return row


def slo_interactive(args: argparse.Namespace) -> dict[str, Any]:
    batch = engine_requests(harness.make_requests(args.batch, 32, 64), "smol")
    rows = []
    for index in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="bench-remote-") as folder:
            rows.append(slo_round(args, batch, Path(folder), args.seed + index))

    def median(values: list[float | None]) -> float | None:
        known = [v for v in values if v is not None]
        return statistics.median(known) if known else None

    summary: dict[str, Any] = {
        "no_online_ratio": statistics.median(r["no_online_ratio"] for r in rows),
        "alone_ttft_p99_ms": statistics.median(r["alone"]["ttft_p99"] * 1000 for r in rows)}
    for pattern in args.patterns.split(","):
        for factor in (float(f) for f in args.slo_factors.split(",")):
            mine = [r[pattern][f"slo_{factor:g}"] for r in rows]
            summary[f"{pattern}_slo_{factor:g}"] = {
                "alone_ms": statistics.median(r[pattern]["alone"]["ttft_p99_ms"]
                                              for r in rows),
                "slo_ms": statistics.median(m["slo_ms"] for m in mine),
                "controller_ttft_p99_ms": statistics.median(
                    m["controller"]["ttft_p99_ms"] for m in mine),
                "controller_share": statistics.median(m["controller"]["share"] for m in mine),
                "rounds_met": sum(m["slo_met"] for m in mine),
                "oracle_limit": median([m["oracle"]["limit"] if m["oracle"] else None
                                        for m in mine]),
                "oracle_ttft_p99_ms": median([m["oracle"]["ttft_p99_ms"] if m["oracle"]
                                              else None for m in mine]),
                "oracle_share": median([m["oracle"]["share"] if m["oracle"] else None
                                        for m in mine]),
                "controller_over_oracle": median([m["over_oracle"] for m in mine])}
    return {"rounds": rows, "summary": summary, "batch_requests": args.batch,
            "seconds": args.seconds, "every": args.every, "ceiling": args.ceiling,
            "probe_every": args.probe_every, "slo_settle": args.settle,
            "patterns": args.patterns, "oracle": args.oracle, "burst_on": args.burst_on,
            "burst_off": args.burst_off}


def interactive(args: argparse.Namespace) -> dict[str, Any]:
    if args.slo_factors:
        return slo_interactive(args)
    batch = engine_requests(harness.make_requests(args.batch, 32, 64), "smol")
    rows = []
    for index in range(args.rounds):
        policies = args.policies.split(",")
        policies = policies if index % 2 == 0 else policies[::-1]
        for policy in policies:
            with tempfile.TemporaryDirectory(prefix="bench-remote-") as folder:
                rows.append(interactive_round(policy, args, batch, Path(folder)))
    summary = {}
    for policy in args.policies.split(","):
        mine = [r for r in rows if r["policy"] == policy]
        summary[policy] = {
            key: statistics.median(r[key] for r in mine)
            for key in ("ttft_p99_ratio", "batch_share", "batch_idle_tok_s",
                        "batch_busy_tok_s")}
        for phase in ("alone", "with_batch"):
            for key in ("ttft_p50", "ttft_p99", "latency_p50", "latency_p99"):
                summary[policy][f"{phase}_{key}"] = statistics.median(r[phase][key]
                                                                      for r in mine)
    return {"rounds": rows, "summary": summary, "batch_requests": args.batch,
            "seconds": args.seconds, "every": args.every, "ceiling": args.ceiling,
            "max_num_batched_tokens": rows[0]["max_num_batched_tokens"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("throughput", "interactive"), required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("-n", type=int, default=256, help="throughput: requests")
    parser.add_argument("--min-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2000, help="interactive: batch size")
    parser.add_argument("--seconds", type=float, default=30, help="interactive: per phase")
    parser.add_argument("--every", type=float, default=0.5,
                        help="interactive: seconds between the client's requests")
    parser.add_argument("--ceiling", type=int, default=64,
                        help="interactive: the batch's max_concurrency")
    parser.add_argument("--policies", default="priority,fcfs",
                        help="interactive: the server's --scheduling-policy values, in turn")
    parser.add_argument("--slo-factors", default="",
                        help="interactive: SLOs to hold, as multiples of the client's p99 "
                        "TTFT alone (e.g. 2,1.25); empty: no SLO, as before")
    parser.add_argument("--settle", type=float, default=SLO_SETTLE,
                        help="interactive with an SLO: seconds before each window")
    parser.add_argument("--probe-every", type=float, default=1.0,
                        help="interactive with an SLO: slo_probe_interval, seconds")
    parser.add_argument("--pin", action="store_true",
                        help="interactive with an SLO: the engine on core 1, the rest on 0")
    parser.add_argument("--server-flags", default="",
                        help="interactive with an SLO: more `vllm serve` flags")
    parser.add_argument("--patterns", default="steady,bursty",
                        help="interactive with an SLO: the online client's patterns "
                        "(steady: one request every --every seconds; bursty: "
                        "--burst-on seconds of Poisson arrivals at that mean rate, then "
                        "--burst-off seconds of none)")
    parser.add_argument("--burst-on", type=float, default=20.0,
                        help="interactive with an SLO, bursty: seconds of traffic")
    parser.add_argument("--burst-off", type=float, default=20.0,
                        help="interactive with an SLO, bursty: seconds of none")
    parser.add_argument("--seed", type=int, default=1,
                        help="interactive with an SLO: the bursty pattern's seed (round i "
                        "uses seed + i, the same for the controller and every fixed limit)")
    parser.add_argument("--oracle", default="0,1,2,4,8,16",
                        help="interactive with an SLO: the fixed max_concurrency values "
                        "swept for the best that holds each SLO (ascending; the sweep "
                        "stops at the first past every SLO)")
    harness.add_json_option(parser)
    args = parser.parse_args()
    # The same for every path and every engine process (run_batch's, the server's).
    os.environ.update(VLLM_CPU_NUM_OF_RESERVED_CPU="0", VLLM_CPU_KVCACHE_SPACE=str(KV_GIB),
                      HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1")
    if args.pin:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "1"
    with tempfile.TemporaryDirectory(prefix="bench-redis-") as folder, \
            harness.private_redis(Path(folder)):
        result = throughput(args) if args.part == "throughput" else interactive(args)
    result["cpu"] = harness.cpu_model() or "unknown CPU"
    print(json.dumps(result, indent=1))
    harness.write_json(args.json, result)


if __name__ == "__main__":
    harness.run(main)
    sys.exit(0)
