"""batchweb's own CPU beside a running batch, with an engine that costs nothing.

What a batch costs batchweb's processes apart from the engine has two parts: one paid by
the token and the request (the engine front end's output handling, intake, results), and
one paid by the second while a batch runs, however fast the engine is (heartbeats, the
reconciler's pass, checkpoints, Redis, the client's polls). On a CPU, where a model
generates a few hundred tokens a second, the second part weighs as much as the first per
1,000 tokens (bench/engine_efficiency.py's "CPU outside the engine core"); on a GPU it is
spread over a hundred times more tokens (bench/gpu.md). This measures it alone: the echo
model (engine/echo.py) holds each of N requests for --hold seconds, all at once, so the
batch runs --hold seconds doing nothing but being a running batch.

The deployment is what `make run` starts: SQLite, the private Redis (jobs/storage/embedded.py),
the web server (Granian) and one batch worker. The client uploads, creates the batch and
polls it every --poll-seconds, as engine_efficiency.py's does. Reported per process (user +
system CPU, psutil): idle with no batch, ms of CPU per second; with the batch running, ms
per second over the run (upload to download) and in all. Run twice or more: CPU times
are counted in 10 ms ticks.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

try:
    from bench import harness
except ImportError:  # run as `python bench/service_floor.py`: start again as the module
    os.execv(sys.executable, [sys.executable, "-m", "bench.service_floor", *sys.argv[1:]])

ROOT = Path(__file__).resolve().parent.parent


def cpu(parts: dict[str, int | None]) -> dict[str, float]:
    return {name: harness.cpu_split(pid)["front"] for name, pid in parts.items()}


def measure(args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    env = {**os.environ, "BATCHWEB_VAR_DIR": str(scratch), "BATCHWEB_ECHO_MODEL": "1",
           "BATCHWEB_ECHO_SECONDS": str(args.hold), "BATCHWEB_SHARD_SIZE": str(args.shard_size),
           "BATCHWEB_HTTPS": "0", "LOG_LEVEL": "INFO"}
    env.pop("DATABASE_URL", None)
    with ExitStack() as stack:
        redis_pid = stack.enter_context(harness.private_redis(scratch))
        env["REDIS_URL"] = os.environ["REDIS_URL"]
        key = harness.prepare(env)
        port = harness.free_port()
        server = harness.granian(port, env, "--workers", "1", "--blocking-threads", "4",
                                 stderr=subprocess.DEVNULL)
        log = scratch / "worker.log"
        worker = harness.batchworker("echo-test", env, log)
        stack.callback(harness.stop, server)
        stack.callback(harness.stop, worker)
        while b"ready on" not in log.read_bytes():
            if worker.poll() is not None:
                raise RuntimeError(log.read_text()[-3000:])
            time.sleep(0.5)
        harness.wait_port(port)
        parts = {"worker": worker.pid, "web": harness.web_worker_pid(server),
                 "redis": redis_pid}
        time.sleep(2)  # past the worker's start
        before = cpu(parts)
        time.sleep(args.idle)
        idle = {k: 1000 * (v - before[k]) / args.idle for k, v in cpu(parts).items()}

        import openai

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key)
        source = scratch / "in.jsonl"
        source.write_bytes(harness.jsonl([
            harness.chat_request(f"r{i}", f"request {i}: " + "a few words " * 20,
                                 max_tokens=16) for i in range(args.n)]))
        before, started = cpu(parts), time.monotonic()
        file = client.files.create(file=source.open("rb"), purpose="batch")
        batch = client.batches.create(input_file_id=file.id,
                                      endpoint="/v1/chat/completions",
                                      completion_window="24h")
        while (batch := client.batches.retrieve(batch.id)).status not in (
                "completed", "failed", "expired", "cancelled"):
            time.sleep(args.poll_seconds)
        assert batch.status == "completed" and batch.output_file_id, batch
        lines = client.files.content(batch.output_file_id).text.splitlines()
        seconds = time.monotonic() - started
        spent = {k: v - before[k] for k, v in cpu(parts).items()}
        assert len(lines) == args.n, len(lines)
    return {"requests": args.n, "hold_s": args.hold, "seconds": seconds,
            "idle_ms_per_s": idle,
            "busy_ms_per_s": {k: 1000 * v / seconds for k, v in spent.items()},
            "busy_cpu_s": spent, "total_ms_per_s": 1000 * sum(spent.values()) / seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=48, help="requests, all held at once")
    parser.add_argument("--hold", type=float, default=60.0,
                        help="seconds the echo engine holds each request")
    parser.add_argument("--shard-size", type=int, default=16)
    parser.add_argument("--idle", type=float, default=20.0,
                        help="seconds measured with no batch first")
    parser.add_argument("--poll-seconds", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=1)
    harness.add_json_option(parser)
    args = parser.parse_args()
    rows = []
    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="bench-floor-") as folder:
            rows.append(measure(args, Path(folder)))
    print(f"batchweb's CPU beside a running batch of {args.n} requests held {args.hold:g} s "
          f"(echo engine, shards of {args.shard_size}), ms of CPU per second:")
    print(f"{'round':<6} {'seconds':>8} {'worker':>7} {'web':>6} {'redis':>6} {'total':>6}"
          f"   idle: worker / web / redis")
    for i, row in enumerate(rows, 1):
        busy, idle = row["busy_ms_per_s"], row["idle_ms_per_s"]
        print(f"{i:<6} {row['seconds']:>8.1f} {busy['worker']:>7.2f} {busy['web']:>6.2f} "
              f"{busy['redis']:>6.2f} {row['total_ms_per_s']:>6.2f}   "
              f"{idle['worker']:.2f} / {idle['web']:.2f} / {idle['redis']:.2f}")
    totals = sorted(row["total_ms_per_s"] for row in rows)
    print(f"median: {totals[len(totals) // 2]:.2f} ms of CPU per second")
    harness.write_json(args.json, {"rounds": rows, "median_total_ms_per_s":
                                   totals[len(totals) // 2], "cpu": harness.cpu_model()})


if __name__ == "__main__":
    harness.run(main)
