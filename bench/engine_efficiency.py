"""Benchmark 1: what batchweb costs around the engine, on three shapes of batch.

The same chat requests (temperature 0, every one distinct so dedup cannot help; see
bench/workloads.py) through, in one run and one engine at a time:
  (a) raw `vllm.LLM.chat` on the whole list in file order (engine already loaded;
      generation timed),
  (b) vLLM's own batch runner `python -m vllm.entrypoints.openai.run_batch`, given the batch
      sizes `LLM.chat` and batchweb's worker get (vLLM's offline LLM_CLASS defaults, on CPU
      --max-num-seqs 256 --max-num-batched-tokens 4096; its own usage context would get the
      fallback 128 / 2048) and --enable-prompt-tokens-details. Timed as one command (wall
      time, its engine start included); its start (until it logs "Reading batch from") is
      measured too, and the output tokens/s of its batch phase (from then until it has
      written its output file) reported beside,
  (c) batchweb end to end with one worker already running: upload, create, validate and
      plan, run, finalize, download (timed from the upload to the batch's completed_at,
      plus the download: the client's poll, every --poll-seconds, adds nothing to it).
For each path: output and prompt tokens/s, the prefix-cache hit rate (prompt tokens served
from vLLM's prefix cache over all prompt tokens: (a) from `RequestOutput.num_cached_tokens`,
(b) and (c) from each output line's `usage.prompt_tokens_details.cached_tokens`, counted as
0 where a line lacks it, and said so), wall seconds, CPU seconds; how many requests got the
same generated text on every path (float32 greedy output is deterministic; bf16 output
changes with batching); the ratios c/a and c/b of output tokens/s; the engine-idle fraction
the worker measured across shard boundaries; and how batchweb's validation planned the
shards (grouped by prompt prefix or in file order).

Workloads (--workload; sizes in bench/workloads.py):
  mixed          prompts of one line to a few paragraphs, max_tokens 64-256 (the default):
      .venv/bin/python bench/engine_efficiency.py [-n 512] [--min-tokens 64 --max-tokens 256]
  shared-prefix  TEMPLATES task templates (a ~520-570-token system prompt each) x ITEMS
                 items, shuffled, max_tokens 6-8; VLLM_CPU_KVCACHE_SPACE 1 GiB unless
                 --kv-cache-gib, so the templates' prefixes (~31k tokens) do not all fit in
                 the KV cache (~23k tokens for SmolLM2-135M in float32):
      .venv/bin/python bench/engine_efficiency.py --workload shared-prefix --dtype float32 \
          [--templates 60 --items 4]
  long           short prompts, long answers (max_tokens 384-512):
      .venv/bin/python bench/engine_efficiency.py --workload long [-n 48]
  all            the three above one after another, each in a fresh process of this script
                 (so each gets a fresh vLLM and its own KV cache setting), one report:
      .venv/bin/python bench/engine_efficiency.py --workload all --dtype float32 \
          --json engine.json
      -n applies to mixed and long, --min-tokens / --max-tokens (when given) to all three.

--kv-cache-gib sets VLLM_CPU_KVCACHE_SPACE for all three paths (default: the environment's,
else the service's default of 2; 1 for shared-prefix). batchweb's planner sizes the cache
by what its worker reports (BATCHWEB_PREFIX_CACHE_TOKENS, when set, overrides it).

The limit: each report gives, beside every path's prompt and cached tokens, the fewest
prompt tokens the file lets an engine with a prefix cache compute (engine.prefix_limit:
the model's tokenizer and chat template, the engine's block size; every distinct full
block once, plus every request's own tail), and how far over it each path computed.

Another model or a GPU (see bench/gpu.md): --model-name, --model-path, --dtype, --no-eager
(CUDA graphs / torch.compile), --tensor-parallel-size; the same engine settings for all three
paths (max_model_len 2048, vLLM's default prefix caching, which is on).

A machine shared with others drifts in speed over minutes, by more than the few percent
between (b) and (c): --rounds N runs (b) and (c) N times, swapping which runs first each
round (--batchweb-first sets the first round's order), and reports every round's c/b
against run_batch's batch phase and their median. The table shows the first round.

CPU outside the engine core: what each path's own processes spend beside vLLM's engine
core, per 1,000 output tokens and per request, the figure that says how far its front end
would weigh beside a faster engine (bench/gpu.md). vLLM's engine core names itself
"VLLM::EngineCore" (setproctitle; its workers "VLLM::Worker..."): the processes so titled and
everything below them are the engine (harness.cpu_split), every other process counted is
the front end. (a) this process over LLM.chat; (b) run_batch's processes over its batch
phase (sampled every 0.1 s, the last sample before its output file was written); (c) the
worker, the web server and the private Redis this script starts, from the upload to the end
of the download (the database is SQLite, inside them). --profile-worker DIR samples (c)'s
worker with py-spy in the first round and prints where its CPU went, by thread and frame.

--keep-scratch keeps the scratch folder: run_batch's log and the worker's log, whose engine
configuration lines ("Initializing a V1 LLM engine ... with config") can be compared.

The dtype defaults to the service's CPU default (bfloat16 where the CPU has native bf16,
else float32); compare outputs across paths in float32.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

try:
    from bench import harness, workloads
except ImportError:  # run as `python bench/engine_efficiency.py`: bench/ itself is on the path
    import harness  # type: ignore[no-redef]
    import workloads  # type: ignore[no-redef]

ROOT, MODEL = harness.ROOT, harness.MODEL
PATHS = {"a": "a raw LLM.chat", "b": "b vllm run_batch", "c": "c batchweb",
         "d": "d batchweb, no gate", "e": "e batchweb eager"}
# The KV cache of the shared-prefix workload when --kv-cache-gib is not given: smaller than
# its templates' prefixes, the case where the order requests run in decides the hits.
SHARED_PREFIX_KV_GIB = 1


def llm_class_batch_sizes(tp: int) -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens) that the installed vLLM gives an engine built
    by `LLM` (usage context LLM_CLASS) on this platform; batchweb's worker asks for the same
    context. run_batch's own context (OPENAI_BATCH_RUNNER) has no entry in these defaults
    and gets the fallback 128 / 2048, so it is given these explicitly."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext

    batched_tokens, seqs = EngineArgs.get_batch_defaults(world_size=tp)
    return seqs[UsageContext.LLM_CLASS], batched_tokens[UsageContext.LLM_CLASS]


def read_output_lines(lines: list[str]) -> dict[str, Any]:
    """The figures of OpenAI batch output lines (run_batch's, batchweb's): output and prompt
    tokens, cached prompt tokens, and each custom_id's generated text."""
    tokens = prompt = cached = missing = failed = 0
    texts: dict[str, str] = {}
    for line in lines:
        record = json.loads(line)
        response = record.get("response") or {}
        body = response.get("body")
        if response.get("status_code") != 200 or not body:
            failed += 1  # run_batch writes its errors into the output file
            continue
        usage = body["usage"]
        tokens += usage["completion_tokens"]
        prompt += usage["prompt_tokens"]
        details = usage.get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is None:
            missing += 1
        cached += details.get("cached_tokens") or 0
        texts[record["custom_id"]] = body["choices"][0]["message"]["content"]
    return {"tokens": tokens, "prompt_tokens": prompt, "cached_tokens": cached,
            "cached_field_missing": missing, "failed": failed, "texts": texts}


def prefix_limit(requests: list[dict], model_path: str, block_size: int) -> dict[str, Any]:
    """The limit of prefix caching for the file (engine.prefix_limit): its prompt tokens
    (the model's tokenizer and chat template, as the engine renders them) and the fewest
    of them an engine with a prefix cache of `block_size`-token blocks must compute, each
    distinct full block once and every request's own tail."""
    from transformers import AutoTokenizer

    from engine.prefix_limit import PrefixLimit, block_keys

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    limit = PrefixLimit()
    for request in requests:
        ids = tokenizer.apply_chat_template(request["body"]["messages"], tokenize=True,
                                            add_generation_prompt=True)
        if not isinstance(ids, list):  # newer transformers return a BatchEncoding
            ids = ids["input_ids"]
        limit.add(len(ids), block_keys(ids, block_size))
    return {"block_size": block_size, "prompt_tokens": limit.prompt_tokens,
            "cacheable_tokens": limit.cacheable, "computed_tokens": limit.computed}


def default_block_size() -> int:
    """vLLM's KV cache block size where (a) did not run to say: 128 on CPU, 16 on GPU."""
    import torch

    return 16 if torch.cuda.is_available() else 128


def run_raw(requests: list[dict], model_path: str, dtype: str, eager: bool = True,
            tp: int = 1) -> dict:
    from vllm import LLM, SamplingParams

    started = time.monotonic()
    llm = LLM(model=model_path, dtype=dtype, enforce_eager=eager, max_model_len=2048,
              tensor_parallel_size=tp)
    load = time.monotonic() - started
    config = llm.llm_engine.vllm_config
    params = [SamplingParams(temperature=0, max_tokens=r["body"]["max_tokens"])
              for r in requests]
    cpu = harness.cpu_seconds(os.getpid())
    split = harness.cpu_split(os.getpid())
    started = time.monotonic()
    outputs = llm.chat([r["body"]["messages"] for r in requests], params, use_tqdm=False)
    elapsed = time.monotonic() - started
    cpu = harness.cpu_seconds(os.getpid()) - cpu
    # This process is LLM.chat's front end (nothing else of the benchmark runs meanwhile).
    split = _spent(split, harness.cpu_split(os.getpid()))
    row = {"tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
           "prompt_tokens": sum(len(o.prompt_token_ids or ()) for o in outputs),
           "cached_tokens": sum(o.num_cached_tokens or 0 for o in outputs),
           "seconds": elapsed, "start": load, "cpu": cpu,
           "front_cpu": split["front"], "engine_cpu": split["engine"],
           # What this engine was built with, for the report (the other paths use the same).
           "max_num_seqs": config.scheduler_config.max_num_seqs,
           "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
           "kv_cache_tokens": (config.cache_config.num_gpu_blocks or 0)
           * config.cache_config.block_size,
           "block_size": config.cache_config.block_size,
           "texts": {r["custom_id"]: o.outputs[0].text for r, o in zip(requests, outputs,
                                                                    strict=True)}}
    # Shut the engine core down now: run_batch starts the next engine right after.
    llm.llm_engine.engine_core.shutdown()
    del llm
    return row


def run_vllm_batch(requests: list[dict], model_path: str, dtype: str, scratch: Path,
                   model_name: str = MODEL, eager: bool = True, tp: int = 1) -> dict:
    source, target = scratch / "in.jsonl", scratch / "out.jsonl"
    log_path = scratch / "run_batch.log"
    source.write_bytes(harness.jsonl(requests))
    max_num_seqs, max_num_batched_tokens = llm_class_batch_sizes(tp)
    command = [sys.executable, "-m", "vllm.entrypoints.openai.run_batch", "-i", str(source),
               "-o", str(target), "--model", model_path, "--served-model-name", model_name,
               "--dtype", dtype, *(["--enforce-eager"] if eager else []),
               *(["--tensor-parallel-size", str(tp)] if tp != 1 else []),
               "--max-model-len", "2048", "--max-num-seqs", str(max_num_seqs),
               "--max-num-batched-tokens", str(max_num_batched_tokens),
               "--enable-prompt-tokens-details"]
    start = ready = sampler = None
    started = time.monotonic()
    # Its log, read as it comes: the line it writes once its engine is up ends its start.
    with open(log_path, "w") as log, subprocess.Popen(
            command, env=dict(os.environ), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            if start is None and "Reading batch from" in line:
                start, ready = time.monotonic() - started, time.time()
                # Its processes are all there now (front end, engine core).
                sampler = CpuSampler(harness.process_tree(proc.pid))
        if sampler is not None:
            sampler.stop()
    elapsed = time.monotonic() - started
    if proc.returncode:
        raise RuntimeError(f"run_batch exited {proc.returncode}:\n"
                           f"{log_path.read_text()[-3000:]}")
    row = read_output_lines(target.read_text().splitlines())
    row.update(seconds=elapsed, max_num_seqs=max_num_seqs,
               max_num_batched_tokens=max_num_batched_tokens)
    if start is not None and ready is not None and sampler is not None:
        # Its batch phase ends when it has written the output file, once at the end;
        # its engine shutdown (seconds) comes after.
        phase = target.stat().st_mtime - ready
        row.update(start=start, batch_phase_seconds=phase,
                   batch_phase_tok_s=row["tokens"] / phase)
        # Its processes' CPU over the batch phase: from its "Reading batch from" to the
        # last sample before its output file was written (its engine shutdown after).
        split = _spent(sampler.first, sampler.before(target.stat().st_mtime))
        row.update(front_cpu=split["front"], engine_cpu=split["engine"])
    return row


def _spent(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in ("front", "engine")}


class CpuSampler:
    """`harness.tree_cpu` of a process tree every `every` seconds on a thread of its own,
    for processes that exit at their end (run_batch): what they had spent at a moment of
    their run is the last sample before it. The tree is read once (a few /proc reads per
    sample, not a scan of every process, which would take CPU from the engine)."""

    def __init__(self, tree: list[tuple[Any, bool]], every: float = 0.1) -> None:
        self.tree, self.every = tree, every
        self.first = harness.tree_cpu(tree)
        self.samples: list[tuple[float, dict[str, float]]] = [(time.time(), self.first)]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            split = harness.tree_cpu(self.tree)
            last = self.samples[-1][1]
            if split["engine"] < last["engine"] or split["front"] < last["front"]:
                return  # one of them exited: what follows no longer counts it
            self.samples.append((time.time(), split))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def before(self, moment: float) -> dict[str, float]:
        return next((split for at, split in reversed(self.samples) if at <= moment), {})


def run_batchweb(requests: list[dict], dtype: str, shard_size: int, scratch: Path,
                 model_name: str = MODEL, model_path: str = "", eager: bool = True,
                 tp: int = 1, poll_seconds: float = 2.0, prefix_gate: bool = True,
                 profile: Path | None = None) -> dict:
    with harness.private_redis(scratch, reuse=True) as redis_pid:
        return _run_batchweb(requests, dtype, shard_size, scratch, model_name, model_path,
                             eager, tp, poll_seconds, prefix_gate, redis_pid, profile)


def _run_batchweb(requests: list[dict], dtype: str, shard_size: int, scratch: Path,
                  model_name: str, model_path: str, eager: bool, tp: int,
                  poll_seconds: float, prefix_gate: bool, redis_pid: int | None,
                  profile: Path | None) -> dict:
    import openai

    env = {**os.environ, "BATCHWEB_VAR_DIR": str(scratch), "BATCHWEB_DTYPE": dtype,
           "BATCHWEB_SHARD_SIZE": str(shard_size), "LOG_LEVEL": "INFO",
           "BATCHWEB_MODELS_DIR": str(ROOT / "var" / "models"),
           # The mode asked for, whatever the default's auto would pick; a compiled worker
           # loads the checkout's compile cache as `make run` does (its start, which a
           # compilation lengthens, is not in the timed batch).
           "BATCHWEB_ENGINE_MODE": "eager" if eager else "compiled"}
    env.setdefault("BATCHWEB_COMPILE_CACHE_DIR", str(ROOT / "var" / "compile-cache"))
    env.pop("DATABASE_URL", None)
    if model_name != MODEL or model_path or not eager or tp != 1 or not prefix_gate:
        # Not the default model as configured: declare it with the engine settings (a) and
        # (b) use.
        models = scratch / "models.json"
        models.write_text(json.dumps([{
            "name": model_name, "backend": "vllm",
            "path": model_path or str(ROOT / "var" / "models" / model_name),
            "endpoints": ["/v1/chat/completions", "/v1/completions"],
            "options": {"dtype": dtype, "enforce_eager": eager, "max_model_len": 2048,
                        "tensor_parallel_size": tp, "prefix_gate": prefix_gate}}]))
        env["BATCHWEB_MODELS_FILE"] = str(models)
    key = harness.prepare(env)
    log_path = scratch / "worker.log"
    port = harness.free_port()
    server = harness.granian(port, env, "--workers", "1", "--blocking-threads", "4",
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
        source.write_bytes(harness.jsonl(requests))
        cpu = harness.cpu_seconds(worker.pid) + harness.cpu_seconds(server.pid)
        # Ours: the worker's front end (its engine core apart), the web server, and Redis
        # when this benchmark started it (SQLite is in those processes).
        parts = {"worker": worker.pid, "web": server.pid, "redis": redis_pid}
        split = {name: harness.cpu_split(pid) for name, pid in parts.items()}
        spy = _profiler(worker.pid, profile) if profile else None
        threads = harness.thread_cpu(worker.pid)
        started, wall_started = time.monotonic(), time.time()
        file = client.files.create(file=source.open("rb"), purpose="batch")
        batch = client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                                      completion_window="24h")
        polls = 1
        while (batch := client.batches.retrieve(batch.id)).status not in (
                "completed", "failed", "expired", "cancelled"):
            time.sleep(poll_seconds)
            polls += 1
        assert batch.status == "completed", batch
        assert batch.output_file_id and batch.request_counts and batch.usage, batch
        polled = time.monotonic()
        lines = client.files.content(batch.output_file_id).text.splitlines()
        downloaded = time.monotonic()
        cpu = harness.cpu_seconds(worker.pid) + harness.cpu_seconds(server.pid) - cpu
        split = {name: _spent(split[name], harness.cpu_split(pid))
                 for name, pid in parts.items()}
        threads = {tid: spent - threads.get(tid, 0.0)
                   for tid, spent in harness.thread_cpu(worker.pid).items()}
        if spy is not None:
            _stop_profiler(spy)
        assert len(lines) + batch.request_counts.failed == len(requests)
        row = read_output_lines(lines)
        row["failed"] += batch.request_counts.failed  # those are in the error file
        # Every request is distinct, so dedup cannot make batchweb look better than it is:
        # every output line was computed.
        assert row["tokens"] == batch.usage.output_tokens
        details = batch.usage.input_tokens_details
        row["batch_usage_cached_tokens"] = details.cached_tokens if details else None
        plan = harness.in_deployment(env, "plan", batch.id)
        # Its end: when the batch completed (its row's completed_at, the moment a poll
        # could first see it), then the download; not when this client's poll, every
        # POLL_SECONDS, happened to see it.
        ended = harness.in_deployment(env, "completed_at", batch.id)
    finally:
        worker.terminate()
        worker.wait(timeout=120)
        server.terminate()
        server.wait()
    idle = re.search(r"engine idle ([\d.]+)% of ([\d.]+)s", log_path.read_text())
    if profile is not None and profile.exists():
        row["profile"] = {"file": str(profile), **profile_summary(profile),
                          "thread_cpu": _named_threads(threads, profile)}
    elapsed = ended - wall_started + downloaded - polled
    row.update(seconds=elapsed, seconds_polled=downloaded - started, polls=polls,
               start=load, cpu=cpu, plan=plan,
               front_cpu=sum(part["front"] for part in split.values()),
               engine_cpu=split["worker"]["engine"],
               front_parts={name: part["front"] for name, part in split.items()
                            if parts[name] is not None},
               idle=float(idle.group(1)) if idle else None,
               window=float(idle.group(2)) if idle else None)
    return row


def _profiler(pid: int, path: Path) -> subprocess.Popen:
    """py-spy sampling the worker's front end (its engine core is a process of its own, not
    sampled), without pausing it (--nonblocking), until SIGINT: collapsed stacks per thread
    to PATH (`profile_summary` reads them)."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    return subprocess.Popen([spy, "record", "--pid", str(pid), "--format", "raw",
                             "--output", str(path), "--rate", "100", "--nonblocking",
                             "--threads"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def _stop_profiler(spy: subprocess.Popen) -> None:
    spy.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
    try:
        spy.wait(timeout=60)
    except subprocess.TimeoutExpired:
        spy.kill()
        spy.wait()


# Innermost frames of a thread that waits: py-spy --nonblocking takes some of those for
# running, so they are left out of the summary.
WAITS = ("Condition.wait ", "Event.wait ", "EpollSelector.select ", "_PollLikeSelector.select ",
         "SocketBuffer._read_from_socket ", "BaseSelector.select ", "sleep ")


def profile_summary(path: Path, top: int = 15) -> dict[str, Any]:
    """Where the sampled CPU went, from py-spy's collapsed stacks: the share of samples per
    thread, per innermost frame (self time) and per frame anywhere on the stack (samples
    waiting, `WAITS`, left out)."""
    threads: dict[str, int] = {}
    inner: dict[str, int] = {}
    anywhere: dict[str, int] = {}
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        if frames[-1].startswith(WAITS):
            continue
        total += n
        thread = re.sub(r" ?\(?0x[0-9a-f]+\)?", "", frames[0])
        threads[thread] = threads.get(thread, 0) + n
        inner[frames[-1]] = inner.get(frames[-1], 0) + n
        for frame in set(frames[1:]):
            anywhere[frame] = anywhere.get(frame, 0) + n

    def shares(counts: dict[str, int]) -> list[tuple[str, float]]:
        ranked = sorted(counts.items(), key=lambda kv: -kv[1])[:top]
        return [(name, round(n / max(1, total), 4)) for name, n in ranked]

    return {"samples": total, "threads": shares(threads), "self": shares(inner),
            "inclusive": shares(anywhere)}


def _named_threads(threads: dict[int, float], profile: Path) -> list[tuple[str, float]]:
    """The worker's threads' CPU seconds (from /proc), named as py-spy's samples name them
    ("thread (TID): name"); threads py-spy never saw running keep their id."""
    names = {int(m.group(1)): m.group(2) for m in re.finditer(
        r"^thread \((\d+)\): ([^;]+);", profile.read_text(), re.MULTILINE)}
    ranked = sorted(threads.items(), key=lambda kv: -kv[1])
    return [(names.get(tid, str(tid)), round(cpu, 2)) for tid, cpu in ranked if cpu > 0]


def compare_outputs(results: dict[str, dict], count: int) -> dict[str, Any]:
    """How many of the COUNT requests got the same text on each pair of paths that ran, and
    on all of them; the first few custom_ids that differ."""
    texts = {name[0]: row["texts"] for name, row in results.items()}
    ran = sorted(texts)
    ids = sorted(set().union(*texts.values())) if texts else []
    same = {f"{x}={y}": sum(1 for i in ids if i in texts[x] and texts[x].get(i) ==
                            texts[y].get(i)) for n, x in enumerate(ran) for y in ran[n + 1:]}
    differ = [i for i in ids if len({texts[p].get(i) for p in ran}) > 1
              or any(i not in texts[p] for p in ran)]
    if len(ran) > 1:
        same["all"] = len(ids) - len(differ)
    return {"requests": count, "paths": "".join(ran), "identical": same,
            "first_differing": differ[:5]}


def _kv_gib(args: argparse.Namespace, workload: str) -> int | None:
    if args.kv_cache_gib is not None:
        return args.kv_cache_gib
    return SHARED_PREFIX_KV_GIB if workload == "shared-prefix" else None


def run_workload(args: argparse.Namespace, workload: str) -> dict[str, Any]:
    """All three paths (less --skip) on WORKLOAD's requests; prints its table, returns its
    figures."""
    from engine.vllm_engine import best_cpu_dtype, set_env_defaults

    kv = _kv_gib(args, workload)
    if kv is not None:
        # Before set_env_defaults (which only fills what is unset): the three paths (this
        # process's engine, run_batch and the worker) inherit it.
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(kv)
    args.dtype = args.dtype or best_cpu_dtype()
    set_env_defaults()  # the same CPU settings (cores, KV cache) for all three paths
    model_path = args.model_path or str(ROOT / "var" / "models" / args.model_name)
    tp = args.tensor_parallel_size
    sizes = {k: default if getattr(args, k) is None else getattr(args, k)
             for k, default in workloads.DEFAULTS[workload].items()}
    requests = workloads.make(workload, args.model_name, **sizes)
    scratch = Path(tempfile.mkdtemp(prefix="bw-engine-bench-"))
    results: dict[str, dict] = {}
    skip = set(args.skip.split(","))
    if "a" not in skip:
        results[PATHS["a"]] = run_raw(requests, model_path, args.dtype, args.eager, tp)
        results[PATHS["a"]]["requests"] = len(requests)
        print(_brief(results), flush=True)
    block_size = results.get(PATHS["a"], {}).get("block_size") or default_block_size()
    limit = prefix_limit(requests, model_path, block_size)
    # A shared machine drifts in speed over minutes, so the path run last can be slowed
    # (or sped) by its neighbours alone: --batchweb-first swaps (b) and (c) to tell, and
    # --rounds runs them again with the order swapped each round. The table shows the
    # first round; the rounds' ratios follow it.
    rounds: list[dict[str, Any]] = []
    for number in range(args.rounds):
        batchweb_first = args.batchweb_first != (number % 2 == 1)
        ran: dict[str, dict] = {}
        place = scratch / f"round-{number}" if number else scratch
        place.mkdir(exist_ok=True)
        order = ["b", "c", *(["d"] if args.without_gate_too else []),
                 *(["e"] if args.eager_too else [])]
        order = [p for p in (reversed(order) if batchweb_first else order) if p not in skip]
        for path in order:
            if path == "b":
                ran[PATHS["b"]] = run_vllm_batch(requests, model_path, args.dtype, place,
                                                 args.model_name, args.eager, tp)
            else:
                where = place / {"d": "without-gate", "e": "eager"}.get(path, "")
                where.mkdir(exist_ok=True)
                ran[PATHS[path]] = run_batchweb(requests, args.dtype, args.shard_size,
                                                where, args.model_name, args.model_path,
                                                args.eager or path == "e", tp,
                                                args.poll_seconds, prefix_gate=path != "d",
                                                profile=_profile_path(args, path, number))
            # The machine's 1-minute load as the path ends: others' jobs share its cores,
            # and a round run beside them says so.
            ran[PATHS[path]].update(load=os.getloadavg()[0], requests=len(requests))
            print(_brief(ran), flush=True)
        if number == 0:
            results.update(ran)
        rounds.append(_round(ran, ",".join(order), len(requests), limit))
    if args.keep_scratch:
        print(f"scratch kept (run_batch.log, worker.log): {scratch}", flush=True)
    else:
        harness.remove(scratch)
    figures = {
        "workload": workload, **sizes, "model": args.model_name, "dtype": args.dtype,
        "eager": args.eager, "tensor_parallel_size": tp, "shard_size": args.shard_size,
        "order": "a,c,b" if args.batchweb_first else "a,b,c",
        "kv_cache_gib": os.environ.get("VLLM_CPU_KVCACHE_SPACE"),
        # None: what the worker reports (settings.PREFIX_CACHE_TOKENS overrides it).
        "prefix_cache_tokens_setting": os.environ.get("BATCHWEB_PREFIX_CACHE_TOKENS"),
        "limit": limit,
        "paths": {name: _figures(row, limit) for name, row in results.items()},
        "outputs": compare_outputs(results, len(requests))}
    if args.rounds > 1 or args.eager_too:
        figures["rounds"] = rounds
        for ratio in ("c/b_phase", "c/b", "c/e"):
            values = [r[ratio] for r in rounds if ratio in r]
            if values:
                figures[f"{ratio}_median"] = statistics.median(values)
    rate = {k[0]: v["tok_s"] for k, v in figures["paths"].items()}
    figures.update({f"{k}/{base}": rate[k] / rate[base] for k, base in (("c", "a"), ("c", "b"))
                    if k in rate and base in rate})
    print_table(figures)
    return figures


def _profile_path(args: argparse.Namespace, path: str, number: int) -> Path | None:
    """Where (c)'s worker is profiled in the first round, with --profile-worker."""
    if args.profile_worker is None or path != "c" or number:
        return None
    args.profile_worker.mkdir(parents=True, exist_ok=True)
    return args.profile_worker / "worker.txt"


def _round(ran: dict[str, dict], order: str, count: int, limit: dict[str, Any]
           ) -> dict[str, Any]:
    """One round of (b) and (c): their seconds, batchweb's rate against run_batch's whole
    run and its batch phase, how many outputs they share, and the prompt tokens each
    computed over the limit's."""
    out: dict[str, Any] = {"order": order}
    for path in ("b", "c", "d", "e"):
        row = ran.get(PATHS[path])
        if row:
            out[f"{path}_seconds"] = row["seconds"]
            out[f"{path}_load"] = row.get("load")
        if row and "front_cpu" in row:
            out[f"{path}_front_cpu_per_1k"] = 1000 * row["front_cpu"] / max(1, row["tokens"])
        if row and limit["computed_tokens"]:
            out[f"{path}_over_limit"] = ((row["prompt_tokens"] - row["cached_tokens"])
                                         / limit["computed_tokens"] - 1)
    b, c, e = ran.get(PATHS["b"]), ran.get(PATHS["c"]), ran.get(PATHS["e"])
    if c and e:
        out.update(e_seconds=e["seconds"], **{"c/e": (c["tokens"] / c["seconds"])
                                             / (e["tokens"] / e["seconds"])},
                   identical_ce=compare_outputs(ran, count)["identical"].get("c=e"))
    if b and c:
        c_rate = c["tokens"] / c["seconds"]
        out.update(b_seconds=b["seconds"], c_seconds=c["seconds"],
                   **{"c/b": c_rate / (b["tokens"] / b["seconds"])},
                   identical=compare_outputs(ran, count)["identical"].get("b=c"))
        if "batch_phase_tok_s" in b:
            out.update(b_phase_seconds=b["batch_phase_seconds"],
                       **{"c/b_phase": c_rate / b["batch_phase_tok_s"]})
    return out


def _figures(row: dict, limit: dict[str, Any]) -> dict:
    """A path's row for the report: its figures without the texts, with its rates and the
    prompt tokens it computed against the limit's."""
    out = {k: v for k, v in row.items() if k != "texts"}
    computed = row["prompt_tokens"] - row["cached_tokens"]
    if "front_cpu" in row:
        out.update(front_cpu_per_1k_tokens=1000 * row["front_cpu"] / max(1, row["tokens"]),
                   front_cpu_per_request=row["front_cpu"] / max(1, row["requests"]))
    out.update(tok_s=row["tokens"] / row["seconds"],
               prompt_tok_s=row["prompt_tokens"] / row["seconds"],
               cache_hit_rate=row["cached_tokens"] / row["prompt_tokens"]
               if row["prompt_tokens"] else 0.0,
               computed_tokens=computed,
               over_limit=computed / limit["computed_tokens"] - 1
               if limit["computed_tokens"] else 0.0)
    return out


def _brief(results: dict[str, dict]) -> dict:
    return {name: {k: v for k, v in row.items() if k != "texts"}
            for name, row in results.items()}


def print_table(f: dict[str, Any]) -> None:
    sizes = ", ".join(f"{k} {f[k]}" for k in workloads.DEFAULTS[f["workload"]])
    print(f"\n{f['model']}: {f['workload']} ({sizes}), {f['dtype']}, "
          f"{'eager' if f['eager'] else 'compiled'}, tensor parallel "
          f"{f['tensor_parallel_size']}, shards of {f['shard_size']}, KV cache "
          f"{f['kv_cache_gib']} GiB of KV cache (batchweb's planner: "
          f"{f['prefix_cache_tokens_setting'] or 'its worker reports it'})")
    limit = f["limit"]
    print(f"{'path':<18} {'out tok':>8} {'prompt tok':>10} {'cached':>7} {'computed':>9} "
          f"{'vs limit':>8} {'seconds':>8} {'out tok/s':>9} {'prompt tok/s':>12} "
          f"{'start s':>8} {'cpu s':>7}")
    print(f"{'limit':<18} {'':>8} {limit['prompt_tokens']:>10} "
          f"{limit['cacheable_tokens'] / max(1, limit['prompt_tokens']):>7.1%} "
          f"{limit['computed_tokens']:>9} {'':>8}   (blocks of {limit['block_size']} tokens: "
          "each distinct one computed once, plus every request's own tail)")
    for name, row in f["paths"].items():
        start = f"{row['start']:.0f}" if "start" in row else "incl."
        cpu = f"{row['cpu']:.0f}" if "cpu" in row else "-"
        print(f"{name:<18} {row['tokens']:>8} {row['prompt_tokens']:>10} "
              f"{row['cache_hit_rate']:>7.1%} {row['computed_tokens']:>9} "
              f"{row['over_limit']:>+8.1%} {row['seconds']:>8.1f} {row['tok_s']:>9.1f} "
              f"{row['prompt_tok_s']:>12.1f} {start:>8} {cpu:>7}")
    for name, row in f["paths"].items():
        if row.get("cached_field_missing"):
            print(f"{name}: {row['cached_field_missing']} output lines lack "
                  "usage.prompt_tokens_details.cached_tokens (counted as 0 cached)")
        if row.get("failed"):
            print(f"{name}: {row['failed']} requests failed")
    b = f["paths"].get(PATHS["b"], {})
    if "batch_phase_tok_s" in b:
        print(f"b in its batch phase ({b['batch_phase_seconds']:.1f} s, after its "
              f"{b['start']:.0f} s start): {b['batch_phase_tok_s']:.1f} out tok/s")
    for ratio in ("c/a", "c/b"):
        if ratio in f:
            print(f"{ratio} = {f[ratio]:.3f}")
    out = f["outputs"]
    if out["identical"]:
        print(f"identical outputs (of {out['requests']}): " + ", ".join(
            f"{k} {v}" for k, v in out["identical"].items()))
        if out["first_differing"]:
            print(f"  first differing custom_ids: {', '.join(out['first_differing'])}")
    for number, r in enumerate(f.get("rounds", ())):
        if "c/b" in r:
            phase = (f", against its batch phase ({r['b_phase_seconds']:.1f} s) "
                     f"{r['c/b_phase']:.3f}" if "c/b_phase" in r else "")
            over = "".join(f"; {p} computed {r[f'{p}_over_limit']:+.1%} over the limit"
                           for p in ("b", "c", "d") if f"{p}_over_limit" in r)
            print(f"round {number + 1} ({r['order']}): b {r['b_seconds']:.1f} s, c "
                  f"{r['c_seconds']:.1f} s; c/b {r['c/b']:.3f}{phase}; identical b=c "
                  f"{r['identical']}{over}; load after b {r['b_load']:.1f}, c "
                  f"{r['c_load']:.1f}")
        if "c/e" in r:
            print(f"  compiled / eager batchweb: e {r['e_seconds']:.1f} s; c/e {r['c/e']:.3f}; "
                  f"identical c=e {r['identical_ce']}; load after e {r['e_load']:.1f}")
    print_front_cpu(f)
    if "c/b_phase_median" in f:
        print(f"c/b against the batch phase, median of {len(f['rounds'])} rounds: "
              f"{f['c/b_phase_median']:.3f}")
    if "c/e_median" in f:
        print(f"compiled / eager batchweb, median of {len(f['rounds'])} rounds: "
              f"{f['c/e_median']:.3f}")
    c = f["paths"].get(PATHS["c"])
    if c:
        d = f["paths"].get(PATHS["d"])
        print(f"engine idle in the worker: {c['idle']}% of the {c['window']}s between its "
              "first request and its last result"
              + (f" (without the gate: {d['idle']}% of {d['window']}s)" if d else ""))
        plan = c["plan"]
        print(f"batchweb's plan: {'grouped' if plan.get('grouped') else 'file order'}, "
              f"{plan.get('groups', 0)} prefix groups, hits expected in file order "
              f"{plan.get('hits_file_order', 0):.0%}, grouped {plan.get('hits_grouped', 0):.0%}"
              f" (for a cache of {plan.get('cache_tokens', '?')} tokens)"
              f"{': ' + plan['reason'] if plan.get('reason') else ''}")


def print_front_cpu(f: dict[str, Any]) -> None:
    """Each path's CPU outside its engine core, per 1,000 output tokens and per request
    (what its front end would cost beside a faster engine), and where the worker's went."""
    rows = {name: row for name, row in f["paths"].items() if "front_cpu" in row}
    if not rows:
        return
    print("CPU outside the engine core (engine core: the processes titled VLLM::*; (a) "
          "this process during LLM.chat, (b) run_batch's batch phase, (c) worker, web "
          "server and Redis from upload to download):")
    print(f"{'path':<18} {'cpu s':>7} {'per 1k out tok':>14} {'per request':>11} "
          f"{'engine core s':>13}  parts")
    for name, row in rows.items():
        parts = ", ".join(f"{k} {v:.2f}" for k, v in row.get("front_parts", {}).items())
        print(f"{name:<18} {row['front_cpu']:>7.2f} {row['front_cpu_per_1k_tokens']:>14.3f} "
              f"{row['front_cpu_per_request']:>11.4f} {row['engine_cpu']:>13.1f}  {parts}")
    b, c = rows.get(PATHS["b"]), rows.get(PATHS["c"])
    if b and c:
        ratio = c["front_cpu_per_1k_tokens"] / max(1e-9, b["front_cpu_per_1k_tokens"])
        print(f"batchweb / run_batch, CPU outside the engine core per 1k output tokens: "
              f"{ratio:.2f}x (target <= 1: {'met' if ratio <= 1 else 'NOT MET'})")
    rounds = [r for r in f.get("rounds", ()) if "c_front_cpu_per_1k" in r
              and "b_front_cpu_per_1k" in r]
    if len(rounds) > 1:
        print("  per round, b / c per 1k output tokens: " + "; ".join(
            f"{r['b_front_cpu_per_1k']:.3f} / {r['c_front_cpu_per_1k']:.3f}" for r in rounds))
    profile = (c or {}).get("profile")
    if profile:
        print(f"worker front end sampled ({profile['samples']} samples, {profile['file']}):")
        print("  CPU s by thread (/proc): " + "; ".join(
            f"{name} {cpu:.2f}" for name, cpu in profile["thread_cpu"][:10]))
        for title in ("threads", "self", "inclusive"):
            print(f"  by {title}: " + "; ".join(f"{share:.1%} {name}"
                                                for name, share in profile[title][:10]))


def run_all(args: argparse.Namespace) -> None:
    """Each workload in a fresh process of this script (a fresh vLLM, whose settings are
    read once per process, and the workload's KV cache), one after another; one report."""
    report: dict[str, Any] = {"workloads": {}}
    argv = _without_options(sys.argv[1:], ("--workload", "--json"))
    with tempfile.TemporaryDirectory(prefix="bw-engine-all-") as tmp:
        for workload in workloads.WORKLOADS:
            path = Path(tmp) / f"{workload}.json"
            subprocess.run([sys.executable, "-m", "bench.engine_efficiency", *argv,
                            "--workload", workload, "--json", str(path)], cwd=ROOT,
                           check=True)
            report["workloads"][workload] = json.loads(path.read_text())
    harness.write_json(args.json, report)


def _without_options(argv: list[str], names: tuple[str, ...]) -> list[str]:
    """ARGV less the options NAMES and their values (as `--x v` or `--x=v`)."""
    out, skip_next = [], False
    for arg in argv:
        if skip_next:
            skip_next = False
        elif arg in names:
            skip_next = True
        elif not arg.startswith(tuple(f"{n}=" for n in names)):
            out.append(arg)
    return out


def main() -> None:
    # No abbreviations: `--workload all` passes the other options on to each workload's
    # run as they were written, less --workload and --json.
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--workload", choices=[*workloads.WORKLOADS, "all"], default="mixed")
    parser.add_argument("-n", type=int, default=None,
                        help="requests of mixed (default 512) and long (48)")
    parser.add_argument("--templates", type=int, default=None,
                        help="shared-prefix: task templates (default 60)")
    parser.add_argument("--items", type=int, default=None,
                        help="shared-prefix: items per template (default 4)")
    parser.add_argument("--prefix-tokens", type=int, default=None,
                        help="shared-prefix: system prompt tokens, about (default 540)")
    parser.add_argument("--min-tokens", type=int, default=None,
                        help="max_tokens range (default: mixed 64-256, shared-prefix 6-8, "
                             "long 384-512)")
    parser.add_argument("--max-tokens", type=int, default=None)
    # vLLM reads VLLM_CPU_KVCACHE_SPACE as a whole number of GiB.
    parser.add_argument("--kv-cache-gib", type=int, default=None,
                        help="VLLM_CPU_KVCACHE_SPACE for all three paths (default: the "
                             f"environment's; shared-prefix {SHARED_PREFIX_KV_GIB})")
    parser.add_argument("--dtype", default=None, help="default: engine.best_cpu_dtype()")
    parser.add_argument("--shard-size", type=int, default=128)
    parser.add_argument("--keep-scratch", action="store_true",
                        help="keep the scratch folder with each path's log")
    parser.add_argument("--skip", default="", help="comma list of a,b,c to leave out")
    parser.add_argument("--model-name", default=MODEL)
    parser.add_argument("--model-path", default="", help="default: var/models/<model-name>")
    parser.add_argument("--eager", action=argparse.BooleanOptionalAction, default=True,
                        help="enforce_eager (--no-eager: CUDA graphs / compilation)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--poll-seconds", type=float, default=2.0,
                        help="how often (c)'s client asks for its batch's status (the "
                             "dashboard's own pace); each poll is work for the web tier, "
                             "counted in its CPU. Its time does not depend on it: it ends "
                             "at the batch's completed_at, then the download")
    parser.add_argument("--without-gate-too", action="store_true",
                        help="also run (d): batchweb with its engine's prefix gate off "
                             "(the option prefix_gate: false), to measure what it gains")
    parser.add_argument("--eager-too", action="store_true",
                        help="with --no-eager: also run (e) batchweb eager each round, for "
                             "compiled / eager (c/e) and their outputs compared")
    parser.add_argument("--profile-worker", type=Path, default=None, metavar="DIR",
                        help="sample (c)'s worker front end with py-spy in the first round "
                             "(DIR/worker.txt, collapsed stacks) and report where its CPU "
                             "went")
    parser.add_argument("--batchweb-first", action="store_true",
                        help="run (c) batchweb before (b) run_batch")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run (b) and (c) this many times, swapping their order each "
                             "round, and report each round's ratio and the median")
    harness.add_json_option(parser)
    args = parser.parse_args()
    if args.workload == "all":
        run_all(args)
    else:
        harness.write_json(args.json, run_workload(args, args.workload))


if __name__ == "__main__":
    harness.run(main)
