"""Benchmark 1: what batchweb costs around the engine.

The same chat requests (mixed prompt lengths, temperature 0) through, in one run:
  (a) raw `vllm.LLM.chat` on the whole list (engine already loaded; generation timed),
  (b) vLLM's own batch runner `python -m vllm.entrypoints.openai.run_batch` (wall time,
      which includes its engine start; its start time is measured and reported too),
  (c) batchweb end to end with one worker already running: upload, create, run,
      finalize, download (timed from the upload to the end of the download).
Reports output tokens/s of each, the ratios, and the engine-idle fraction the worker
measured across shard boundaries (--shard-size makes 4+ shards).

    .venv/bin/python bench/engine_efficiency.py [-n 512] [--min-tokens 64 --max-tokens 256]

Another model or a GPU (see bench/gpu.md): --model-name, --model-path, --dtype, --no-eager
(CUDA graphs / torch.compile), --tensor-parallel-size; the same engine settings for all three
paths.

One engine runs at a time. The dtype defaults to the service's CPU default (bfloat16 where
the CPU has native bf16, else float32).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

try:
    from bench import harness
except ImportError:  # run as `python bench/engine_efficiency.py`: bench/ itself is on the path
    import harness  # type: ignore[no-redef]

ROOT, MODEL = harness.ROOT, harness.MODEL


def run_raw(requests: list[dict], model_path: str, dtype: str, eager: bool = True,
            tp: int = 1) -> dict:
    from vllm import LLM, SamplingParams

    started = time.monotonic()
    llm = LLM(model=model_path, dtype=dtype, enforce_eager=eager, max_model_len=2048,
              tensor_parallel_size=tp)
    load = time.monotonic() - started
    params = [SamplingParams(temperature=0, max_tokens=r["body"]["max_tokens"])
              for r in requests]
    cpu = harness.cpu_seconds(os.getpid())
    started = time.monotonic()
    outputs = llm.chat([r["body"]["messages"] for r in requests], params, use_tqdm=False)
    elapsed = time.monotonic() - started
    cpu = harness.cpu_seconds(os.getpid()) - cpu
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    del llm
    return {"tokens": tokens, "seconds": elapsed, "start": load, "cpu": cpu}


def run_vllm_batch(requests: list[dict], model_path: str, dtype: str, scratch: Path,
                   model_name: str = MODEL, eager: bool = True, tp: int = 1) -> dict:
    source, target = scratch / "in.jsonl", scratch / "out.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in requests))
    env = dict(os.environ)
    started = time.monotonic()
    subprocess.run([sys.executable, "-m", "vllm.entrypoints.openai.run_batch", "-i",
                    str(source), "-o", str(target), "--model", model_path,
                    "--served-model-name", model_name, "--dtype", dtype,
                    *(["--enforce-eager"] if eager else []),
                    *(["--tensor-parallel-size", str(tp)] if tp != 1 else []),
                    "--max-model-len", "2048"], check=True, env=env,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    elapsed = time.monotonic() - started
    tokens = sum(json.loads(line)["response"]["body"]["usage"]["completion_tokens"]
                 for line in target.read_text().splitlines())
    return {"tokens": tokens, "seconds": elapsed}


def run_batchweb(requests: list[dict], dtype: str, shard_size: int, scratch: Path,
                 model_name: str = MODEL, model_path: str = "", eager: bool = True,
                 tp: int = 1) -> dict:
    with harness.private_redis(scratch, reuse=True):
        return _run_batchweb(requests, dtype, shard_size, scratch, model_name, model_path,
                             eager, tp)


def _run_batchweb(requests: list[dict], dtype: str, shard_size: int, scratch: Path,
                  model_name: str, model_path: str, eager: bool, tp: int) -> dict:
    import openai

    env = {**os.environ, "BATCHWEB_VAR_DIR": str(scratch), "BATCHWEB_DTYPE": dtype,
           "BATCHWEB_SHARD_SIZE": str(shard_size), "LOG_LEVEL": "INFO",
           "BATCHWEB_MODELS_DIR": str(ROOT / "var" / "models")}
    env.pop("DATABASE_URL", None)
    if model_name != MODEL or model_path or not eager or tp != 1:
        # Not the default model as configured: declare it with the engine settings (a) and
        # (b) use.
        models = scratch / "models.json"
        models.write_text(json.dumps([{
            "name": model_name, "backend": "vllm",
            "path": model_path or str(ROOT / "var" / "models" / model_name),
            "endpoints": ["/v1/chat/completions", "/v1/completions"],
            "options": {"dtype": dtype, "enforce_eager": eager, "max_model_len": 2048,
                        "tensor_parallel_size": tp}}]))
        env["BATCHWEB_MODELS_FILE"] = str(models)
    key = harness.prepare(env)
    log_path = scratch / "worker.log"
    port = harness.free_port()
    server = harness.gunicorn(port, env, "-w", "1", "--threads", "4",
                              stderr=subprocess.DEVNULL)
    worker = harness.batchworker(model_name, env, log_path)
    try:
        started = time.monotonic()
        while b"ready on" not in log_path.read_bytes():
            if worker.poll() is not None:
                raise RuntimeError(log_path.read_text()[-3000:])
            time.sleep(0.5)
        load = time.monotonic() - started
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key,
                               max_retries=2)
        source = scratch / "in.jsonl"
        source.write_text("".join(json.dumps(r) + "\n" for r in requests))
        cpu = harness.cpu_seconds(worker.pid) + harness.cpu_seconds(server.pid)
        started = time.monotonic()
        file = client.files.create(file=source.open("rb"), purpose="batch")
        batch = client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                                      completion_window="24h")
        while (batch := client.batches.retrieve(batch.id)).status not in (
                "completed", "failed", "expired", "cancelled"):
            time.sleep(0.5)
        assert batch.status == "completed", batch
        lines = client.files.content(batch.output_file_id).text.splitlines()
        elapsed = time.monotonic() - started
        cpu = harness.cpu_seconds(worker.pid) + harness.cpu_seconds(server.pid) - cpu
        assert len(lines) + batch.request_counts.failed == len(requests)
        tokens = sum(json.loads(line)["response"]["body"]["usage"]["completion_tokens"]
                     for line in lines)
        # Every request is distinct ("Request {i}"), so dedup cannot make batchweb look
        # better than it is: every output line was computed.
        assert tokens == batch.usage.output_tokens
    finally:
        worker.terminate()
        worker.wait(timeout=120)
        server.terminate()
        server.wait()
    idle = re.search(r"engine idle ([\d.]+)% of ([\d.]+)s", log_path.read_text())
    return {"tokens": tokens, "seconds": elapsed, "start": load, "cpu": cpu,
            "idle": float(idle.group(1)) if idle else None,
            "window": float(idle.group(2)) if idle else None}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("-n", type=int, default=512)
    parser.add_argument("--min-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--dtype", default=None, help="default: engine.best_cpu_dtype()")
    parser.add_argument("--shard-size", type=int, default=128)
    parser.add_argument("--skip", default="", help="comma list of a,b,c to leave out")
    parser.add_argument("--model-name", default=MODEL)
    parser.add_argument("--model-path", default="", help="default: var/models/<model-name>")
    parser.add_argument("--eager", action=argparse.BooleanOptionalAction, default=True,
                        help="enforce_eager (--no-eager: CUDA graphs / compilation)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    harness.add_json_option(parser)
    args = parser.parse_args()
    from engine.vllm_engine import best_cpu_dtype, set_env_defaults

    args.dtype = args.dtype or best_cpu_dtype()
    set_env_defaults()  # the same CPU settings (cores, KV cache) for all three paths
    model_path = args.model_path or str(ROOT / "var" / "models" / args.model_name)
    tp = args.tensor_parallel_size
    requests = harness.make_requests(args.n, args.min_tokens, args.max_tokens, args.model_name)
    scratch = Path(tempfile.mkdtemp(prefix="bw-engine-bench-"))
    results: dict[str, dict] = {}
    skip = set(args.skip.split(","))
    if "a" not in skip:
        results["a raw LLM.chat"] = run_raw(requests, model_path, args.dtype, args.eager, tp)
        print(results, flush=True)
    if "b" not in skip:
        results["b vllm run_batch"] = run_vllm_batch(requests, model_path, args.dtype, scratch,
                                                     args.model_name, args.eager, tp)
        print(results, flush=True)
    if "c" not in skip:
        results["c batchweb"] = run_batchweb(requests, args.dtype, args.shard_size, scratch,
                                             args.model_name, args.model_path, args.eager, tp)
    print(f"\n{args.model_name}: {args.n} chat requests, max_tokens {args.min_tokens}-"
          f"{args.max_tokens}, {args.dtype}, {'eager' if args.eager else 'compiled'}, "
          f"tensor parallel {tp}, shards of {args.shard_size}")
    print(f"{'path':<18} {'out tokens':>10} {'seconds':>8} {'tok/s':>7} {'start s':>8} "
          f"{'cpu s':>7}")
    for name, row in results.items():
        start = f"{row['start']:.0f}" if "start" in row else "incl."
        cpu = f"{row['cpu']:.0f}" if "cpu" in row else "-"
        print(f"{name:<18} {row['tokens']:>10} {row['seconds']:>8.1f} "
              f"{row['tokens'] / row['seconds']:>7.1f} {start:>8} {cpu:>7}")
    rate = {k[0]: v["tokens"] / v["seconds"] for k, v in results.items()}
    if "a" in rate and "c" in rate:
        print(f"c/a = {rate['c'] / rate['a']:.3f}")
    if "b" in rate and "c" in rate:
        print(f"c/b = {rate['c'] / rate['b']:.3f}")
    if "c batchweb" in results:
        row = results["c batchweb"]
        print(f"engine idle in the worker: {row['idle']}% of the {row['window']}s between "
              "its first request and its last result")
    harness.write_json(args.json, {
        "model": args.model_name, "n": args.n, "min_tokens": args.min_tokens,
        "max_tokens": args.max_tokens, "dtype": args.dtype, "eager": args.eager,
        "tensor_parallel_size": tp, "shard_size": args.shard_size,
        "paths": {name: {**row, "tok_s": row["tokens"] / row["seconds"]}
                  for name, row in results.items()},
        **{f"{k}/{base}": rate[k] / rate[base] for k, base in (("c", "a"), ("c", "b"))
           if k in rate and base in rate}})


if __name__ == "__main__":
    harness.run(main)
