"""Benchmark: how close the capacity plan's projected finish comes to the real one, on the real
engine (jobs/services/deadlines.py, docs/operations.md "Capacity and deadlines").

A scratch deployment (its own SQLite database, storage and Redis) with one `batchworker` of
the default CPU chat model (vLLM) runs a `-n`-request chat batch (distinct prompts of one line
to a few paragraphs, max_tokens spread over `--min-tokens`..`--max-tokens`, greedy) on a
fresh model: no ledger history, so the plan starts from the worker's own reported speed and
corrects itself as shards finish and the batch answers. The reconciler refreshes the plan
every `--reconcile-seconds`. The batch is polled through the API (`expected_completion_at`,
`request_counts`) every second; at the first poll past 10%, 50% and 90% of the requests
answered, the projected end is recorded and compared with when the batch really ended:

    error = (projected end - real end) / (real end - when the batch started running)

(negative: projected too early). Target: within 20% at 10% done. `--json` also keeps every
poll (seconds since the start, requests answered, projected end), to replay an estimate on.

    .venv/bin/python bench/projection.py                 # 2,000 requests
    .venv/bin/python bench/projection.py -n 500 --max-tokens 32
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

try:
    from bench import harness
except ImportError:  # run as `python bench/projection.py`: bench/ itself is on the path
    import harness  # type: ignore[no-redef]

MARKS = (0.10, 0.50, 0.90)


def run(args: argparse.Namespace, scratch: Path) -> dict:
    import openai

    env = {**os.environ, "BATCHWEB_VAR_DIR": str(scratch), "LOG_LEVEL": "INFO",
           "BATCHWEB_MODELS_DIR": str(harness.ROOT / "var" / "models"),
           "BATCHWEB_SHARD_SIZE": str(args.shard_size),
           "BATCHWEB_RECONCILE_SECONDS": str(args.reconcile_seconds),
           # Plain HTTP on loopback: the scratch server has no TLS proxy.
           "BATCHWEB_HTTPS": "0"}
    env.pop("DATABASE_URL", None)
    key = harness.prepare(env)
    log_path = scratch / "worker.log"
    port = harness.free_port()
    web_log = open(scratch / "web.log", "wb")  # noqa: SIM115 (closed with the server)
    server = harness.granian(port, env, "--workers", "1", "--blocking-threads", "2",
                             stdout=web_log, stderr=subprocess.STDOUT)
    worker = harness.batchworker(harness.MODEL, env, log_path)
    try:
        while b"ready on" not in log_path.read_bytes():
            if worker.poll() is not None:
                raise RuntimeError(log_path.read_text()[-3000:])
            time.sleep(0.5)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key,
                               max_retries=2)
        source = scratch / "in.jsonl"
        source.write_bytes(harness.jsonl(harness.make_requests(
            args.n, args.min_tokens, args.max_tokens)))
        file = client.files.create(file=source.open("rb"), purpose="batch")
        batch = client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                                      completion_window="24h")
        projected: dict[float, tuple[float, float, float | None]] = {}
        polls: list[tuple[float, int, float | None]] = []  # (when, answered, projected end)
        started: float | None = None
        while True:
            batch = client.batches.retrieve(batch.id)
            now = time.time()
            if batch.status in ("completed", "failed", "expired", "cancelled"):
                break
            counts = batch.request_counts
            done = (counts.completed + counts.failed) / args.n if counts else 0.0
            if started is None and batch.in_progress_at:
                started = float(batch.in_progress_at)
            polls.append((now, (counts.completed + counts.failed) if counts else 0,
                          (batch.model_extra or {}).get("expected_completion_at")))
            for mark in MARKS:
                if done >= mark and mark not in projected:
                    projected[mark] = (now, done, (batch.model_extra or {}).get(
                        "expected_completion_at"))
            time.sleep(1.0)
        assert batch.status == "completed", batch
        ended = float(batch.completed_at or time.time())
        start = started or float(batch.created_at)
        rows = []
        for mark in MARKS:
            at, done, expected = projected.get(mark, (None, None, None))
            error = None if expected is None else (expected - ended) / (ended - start)
            rows.append({"mark": mark, "done": done,
                         "seconds_in": None if at is None else round(at - start, 1),
                         "projected_seconds": None if expected is None
                         else round(expected - start, 1),
                         "error": None if error is None else round(error, 3)})
        trace = [[round(at - start, 1), answered,
                  None if expected is None else round(expected - start, 1)]
                 for at, answered, expected in polls]
        return {"requests": args.n, "seconds": round(ended - start, 1), "marks": rows,
                "trace": trace}
    except Exception:
        print((scratch / "web.log").read_text()[-4000:])
        raise
    finally:
        harness.stop(worker)
        server.terminate()
        server.wait()
        web_log.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("-n", type=int, default=2000)
    parser.add_argument("--min-tokens", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--shard-size", type=int, default=100)
    parser.add_argument("--reconcile-seconds", type=int, default=3)
    harness.add_json_option(parser)
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="bw-projection-"))
    try:
        with harness.private_redis(scratch):
            figures = run(args, scratch)
    finally:
        harness.remove(scratch)
    print(f"{figures['requests']} requests, {figures['seconds']} s running")
    print("done | at (s) | projected end (s) | error")
    for row in figures["marks"]:
        print(f"{row['mark']:.0%} | {row['seconds_in']} | {row['projected_seconds']} | "
              f"{row['error']}")
    print(json.dumps(figures))
    harness.write_json(args.json, figures)


if __name__ == "__main__":
    harness.run(main)
