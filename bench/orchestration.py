"""Benchmark 2: orchestration at scale with the zero-cost echo engine.

For each size: write an N-request JSONL file, upload it through the Uploads API, create the
batch, let 2 `batchworker` processes validate, shard, run and finalize it, download the
output. Reports requests/s of each stage and the peak RSS of the web server and of each
worker (VmHWM). Uses its own scratch SQLite database, storage and (unless REDIS_URL is set)
a private Redis. With `--storage s3` every file lives in a bucket of a local S3 server
(moto's, jobs.storage.embedded.PrivateS3) instead of the filesystem.

    .venv/bin/python bench/orchestration.py [--sizes 100000,1000000] [--workers 2]
    .venv/bin/python bench/orchestration.py --sizes 1000000 --storage s3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

try:
    from bench import harness
except ImportError:  # run as `python bench/orchestration.py`: bench/ itself is on the path
    import harness  # type: ignore[no-redef]

# ~500 bytes a line, so 1M requests make the ~0.5 GB file of issue 6.
SYSTEM = ("You label customer messages. Answer with one word from: billing, shipping, "
          "returns, technical, account, other. Use 'other' when unsure; never explain. "
          "The message follows; it may be in any language and may contain typos.")


def write_input(path: Path, count: int) -> int:
    return harness.write_labelling_file(path, count, lambda i: SYSTEM,
                                        lambda i: f"Classify document number {i} please.")


def run_size(count: int, workers: int, env: dict[str, str], scratch: Path) -> dict:
    import openai

    port = harness.free_port()
    server = harness.granian(port, env, "--workers", "1", "--blocking-threads", "4",
                             stderr=subprocess.DEVNULL)
    procs = [harness.batchworker("echo-test", env, scratch / f"worker-{count}-{i}.log")
             for i in range(workers)]
    try:
        time.sleep(4)
        web_pid = harness.web_worker_pid(server)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=env["BENCH_KEY"],
                               max_retries=2, timeout=900)
        path = scratch / f"in-{count}.jsonl"
        size = write_input(path, count)
        t0 = time.monotonic()
        upload = client.uploads.upload_file_chunked(file=path, mime_type="application/jsonl",
                                                    purpose="batch", part_size=64 * 1024 * 1024)
        t_upload = time.monotonic() - t0
        t1 = time.monotonic()
        batch = client.batches.create(input_file_id=upload.file.id,
                                      endpoint="/v1/chat/completions", completion_window="24h")
        while (batch := client.batches.retrieve(batch.id)).status == "validating":
            time.sleep(0.2)
        t_validate = time.monotonic() - t1
        while (batch := client.batches.retrieve(batch.id)).status not in (
                "completed", "failed", "expired", "cancelled"):
            time.sleep(0.5)
        t_run = time.monotonic() - t1 - t_validate
        assert batch.status == "completed", batch
        assert batch.request_counts.completed == count, batch.request_counts
        t2 = time.monotonic()
        downloaded = 0
        with client.files.with_streaming_response.content(batch.output_file_id) as response:
            for chunk in response.iter_bytes(1024 * 1024):
                downloaded += chunk.count(b"\n")
        t_download = time.monotonic() - t2
        assert downloaded == count
        total = time.monotonic() - t0
        path.unlink()
        return {
            "requests": count, "MB": size / 1e6,
            "upload r/s": count / t_upload, "validate r/s": count / t_validate,
            "run+finalize r/s": count / t_run, "download r/s": count / t_download,
            "end-to-end r/s": count / total, "web RSS MB": harness.peak_rss_mb(web_pid),
            "worker RSS MB": max(harness.peak_rss_mb(p.pid) for p in procs),
        }
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=120)
        server.terminate()
        server.wait()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="100000,1000000")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--storage", choices=("filesystem", "s3"), default="filesystem")
    harness.add_json_option(parser)
    args = parser.parse_args()

    scratch = Path(tempfile.mkdtemp(prefix="bw-orch-bench-"))
    rows = []
    try:
        with ExitStack() as stack:
            stack.enter_context(harness.private_redis(scratch, reuse=True))
            env = {**os.environ, "BATCHWEB_VAR_DIR": str(scratch), "BATCHWEB_ECHO_MODEL": "1",
                   "BATCHWEB_MAX_FILE_BYTES": str(4 * 1024**3),
                   "BATCHWEB_MAX_REQUESTS_PER_BATCH": str(10_000_000), "LOG_LEVEL": "WARNING"}
            env.pop("DATABASE_URL", None)
            if args.storage == "s3":
                env.update(harness.private_s3(stack, scratch))
            env["BENCH_KEY"] = harness.prepare(env)
            for size in (int(s) for s in args.sizes.split(",")):
                rows.append(run_size(size, args.workers, env, scratch))
                print(json.dumps(rows[-1]), flush=True)
    finally:
        harness.remove(scratch)
    columns = list(rows[0])
    print(" | ".join(columns))
    for row in rows:
        print(" | ".join(f"{row[c]:.0f}" if isinstance(row[c], float) else str(row[c])
                         for c in columns))
    harness.write_json(args.json, {"workers": args.workers, "storage": args.storage,
                                   "sizes": rows})


if __name__ == "__main__":
    harness.run(main)
