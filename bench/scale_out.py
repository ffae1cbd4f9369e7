"""Benchmark 3: scale-out, 1 worker against 2 workers on the same batch.

The same batch of distinct chat requests (bench/harness.py's `make_requests`, as benchmark 1:
mixed prompt lengths, temperature 0) is run twice on a scratch deployment (SQLite, private
Redis, Granian unpinned):
  1. by one `batchworker` pinned to core 0,
  2. by two fresh `batchworker`s pinned to cores 0 and 1 (fresh, so that neither engine
     has the first run's prompts in its prefix cache).
Each worker runs under `taskset -c N` (its engine core process inherits the affinity) with
VLLM_CPU_OMP_THREADS_BIND=N, so the engine's OpenMP threads bind to that core only, and
VLLM_CPU_NUM_OF_RESERVED_CPU=0. Timed from the batch's creation to `completed` (validation,
every shard, finalization) with the workers already loaded ("ready on" in their logs).
Never more than 2 engines at once. A worker takes its next shard once its engine's batch
(max_num_seqs) has room, so a batch only spreads over two workers when it holds well over
two engine batches, as real batches do: by default 512 requests, shards of 32, and
max_num_seqs 64 (a batch that one engine takes whole cannot scale out). The table shows
how many shards each worker ran.

    .venv/bin/python bench/scale_out.py [-n 512] [--min-tokens 16 --max-tokens 64]
    .venv/bin/python bench/scale_out.py --model echo-test -n 64      # orchestration smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

try:
    from bench import harness
except ImportError:  # run as `python bench/scale_out.py`: bench/ itself is on the path
    import harness  # type: ignore[no-redef]

TERMINAL = ("completed", "failed", "expired", "cancelled")


class Worker:
    """`manage.py batchworker` on one core."""

    def __init__(self, model: str, core: int, env: dict[str, str], log: Path) -> None:
        self.name = f"core{core}-{time.monotonic_ns()}"
        self.log = log
        env = {**env, "VLLM_CPU_OMP_THREADS_BIND": str(core)}
        self.proc = harness.batchworker(model, env, log, "--name", self.name,
                                        prefix=("taskset", "-c", str(core)))
        self.started = time.monotonic()

    def wait_ready(self, timeout: float = 900) -> float:
        deadline = self.started + timeout
        while b"ready on" not in self.log.read_bytes():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"worker did not start:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.2)
        return time.monotonic() - self.started

    def stop(self) -> None:
        harness.stop(self.proc)


def run_batch(client: object, file_id: str, poll: float) -> tuple[object, float]:
    started = time.monotonic()
    batch = client.batches.create(input_file_id=file_id,  # type: ignore[attr-defined]
                                  endpoint="/v1/chat/completions", completion_window="24h")
    while batch.status not in TERMINAL:
        time.sleep(poll)
        batch = client.batches.retrieve(batch.id)  # type: ignore[attr-defined]
    return batch, time.monotonic() - started


def shards_by_worker(database: Path, batch_id: str) -> dict[str, int]:
    with sqlite3.connect(database) as db:
        return dict(db.execute("SELECT worker, COUNT(*) FROM jobs_shard WHERE batch_id = ? "
                               "GROUP BY worker ORDER BY worker", (batch_id,)).fetchall())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct",
                        help="a model of the deployment (BATCHWEB_MODELS), or echo-test")
    parser.add_argument("-n", type=int, default=512)
    parser.add_argument("--min-tokens", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--shard-size", type=int, help="default n/16")
    parser.add_argument("--dtype", default="",
                        help="dtype of the default CPU models (BATCHWEB_DTYPE; default: theirs)")
    parser.add_argument("--eager", action=argparse.BooleanOptionalAction, default=True,
                        help="enforce_eager of the default CPU models (BATCHWEB_ENFORCE_EAGER)")
    parser.add_argument("--echo-seconds", type=float, default=0.05,
                        help="echo-test only: seconds per request")
    parser.add_argument("--max-num-seqs", type=int, default=64,
                        help="the engine's batch size (vLLM max_num_seqs; echo-test: how "
                             "many requests it runs at once)")
    harness.add_json_option(parser)
    args = parser.parse_args()
    shard_size = args.shard_size or max(1, args.n // 16)
    if (os.cpu_count() or 1) < 2:
        sys.exit("needs 2 cores")

    scratch = Path(tempfile.mkdtemp(prefix="bw-scale-bench-"))
    with harness.private_redis(scratch):  # private: no other worker takes these shards
        rows = measure(args, shard_size, scratch)

    print(f"\n{args.model}: {args.n} chat requests, max_tokens {args.min_tokens}-"
          f"{args.max_tokens}, shards of {shard_size}, batch size {args.max_num_seqs}, "
          f"{args.dtype or 'default dtype'}, {'eager' if args.eager else 'compiled'}")
    print(f"{'workers':>7} {'cores':>5} {'shards':>7} {'out tokens':>10} {'seconds':>8} "
          f"{'tok/s':>8} {'ready s':>7}")
    for row in rows:
        print(f"{row['workers']:>7} {row['cores']:>5} {row['shards']:>7} {row['tokens']:>10} "
              f"{row['seconds']:>8.1f} {row['tokens'] / row['seconds']:>8.1f} "
              f"{row['start']:>7.0f}")
    one, two = (r["tokens"] / r["seconds"] for r in rows)
    print(f"speed-up 2 vs 1 worker: {two / one:.2f}x (target >= 1.8)")
    harness.write_json(args.json, {
        "model": args.model, "n": args.n, "min_tokens": args.min_tokens,
        "max_tokens": args.max_tokens, "shard_size": shard_size,
        "max_num_seqs": args.max_num_seqs, "dtype": args.dtype, "eager": args.eager,
        "runs": [{**row, "tok_s": row["tokens"] / row["seconds"]} for row in rows],
        "speed_up": two / one})
    harness.remove(scratch)


def measure(args: argparse.Namespace, shard_size: int, scratch: Path) -> list[dict]:
    """The batch on one worker, then on two: a row each."""
    import openai

    env = {**os.environ, "BATCHWEB_VAR_DIR": str(scratch),
           "BATCHWEB_ENFORCE_EAGER": "1" if args.eager else "0",
           "BATCHWEB_SHARD_SIZE": str(shard_size), "BATCHWEB_ECHO_MODEL": "1",
           "BATCHWEB_ECHO_SECONDS": str(args.echo_seconds), "LOG_LEVEL": "INFO",
           "PYTHONUNBUFFERED": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    env.setdefault("BATCHWEB_MODELS_DIR", str(harness.ROOT / "var" / "models"))
    env.pop("DATABASE_URL", None)
    if args.dtype:
        env["BATCHWEB_DTYPE"] = args.dtype
    batch_option = "max_in_flight" if args.model == "echo-test" else "max_num_seqs"
    harness.models_file(env, args.model, {batch_option: args.max_num_seqs},
                        scratch / "models.json")
    key = harness.prepare(env)
    port = harness.free_port()
    server = harness.granian(port, env, "--workers", "1", "--blocking-threads", "4",
                             stderr=subprocess.DEVNULL)
    workers: list[Worker] = []
    rows = []
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key,
                               max_retries=5)
        requests = harness.make_requests(args.n, args.min_tokens, args.max_tokens, args.model)
        source = scratch / "in.jsonl"
        source.write_text("".join(json.dumps(r) + "\n" for r in requests))
        file = client.files.create(file=source.open("rb"), purpose="batch")
        for cores in ([0], [0, 1]):
            for worker in workers:
                worker.stop()
            workers = [Worker(args.model, core, env, scratch / f"worker-{len(cores)}-{core}.log")
                       for core in cores]
            load = max(w.wait_ready() for w in workers)
            time.sleep(1)  # "ready on" is printed just before the RQ loop starts
            batch, seconds = run_batch(client, file.id, poll=0.2)
            assert batch.status == "completed", batch
            assert batch.request_counts.completed == args.n, batch.request_counts
            shards = shards_by_worker(scratch / "batchweb.sqlite3", batch.id)
            rows.append({"workers": len(cores), "cores": ",".join(map(str, cores)),
                         "shards": "+".join(str(shards.get(w.name, 0)) for w in workers),
                         "tokens": batch.usage.output_tokens, "seconds": seconds,
                         "start": load})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        for worker in workers:
            worker.stop()
        server.terminate()
        server.wait()
    return rows


if __name__ == "__main__":
    harness.run(main)
