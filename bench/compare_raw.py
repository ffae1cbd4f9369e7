"""Throughput of VllmEngine.run against raw `vllm.LLM.chat` on the same requests.

    .venv/bin/python bench/compare_raw.py [--model var/models/SmolLM2-135M-Instruct] [-n 128]

Both engines get the same model options (bf16, eager) and run one after the other in this
process (never two engines at once). Output tokens/s counts completion tokens over the
generation call only; engine start is reported separately.
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import time
from pathlib import Path
from typing import Any

try:
    from bench import harness
except ImportError:  # run as `python bench/compare_raw.py`: bench/ itself is on the path
    import harness  # type: ignore[no-redef]

TOPICS = ["the sea", "a city at night", "bread", "mountains", "a library", "rain", "robots",
          "an old clock", "coffee", "the moon", "a garden", "trains", "winter", "music"]


def conversations(n: int) -> list[tuple[list[dict[str, str]], int]]:
    """n deterministic (messages, max_tokens) pairs, max_tokens spread over 64..128."""
    out = []
    for i in range(n):
        topic = TOPICS[i % len(TOPICS)]
        text = f"Request {i}: write a few sentences about {topic}, in detail."
        out.append(([{"role": "user", "content": text}], 64 + (i * 37) % 65))
    return out


def cpu_seconds() -> float:
    """CPU time of this (frontend) process, all threads: what it takes from the model."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run_engine(path: str, options: dict[str, Any], n: int) -> dict[str, float]:
    from engine.base import EngineRequest, ModelSpec
    from engine.endpoints import CHAT
    from engine.vllm_engine import VllmEngine

    start = time.perf_counter()
    engine = VllmEngine(ModelSpec(name="bench", backend="vllm", path=path, options=options))
    started = time.perf_counter() - start
    reqs = [
        EngineRequest(str(i), CHAT, {"model": "bench", "messages": m, "max_tokens": mt,
                                     "temperature": 0})
        for i, (m, mt) in enumerate(conversations(n))
    ]
    start, cpu = time.perf_counter(), cpu_seconds()
    tokens = 0
    for r in engine.run(reqs):
        assert r.status_code == 200, r.body
        tokens += r.body["usage"]["completion_tokens"]
    elapsed, cpu = time.perf_counter() - start, cpu_seconds() - cpu
    engine.close()
    return {"start_s": started, "run_s": elapsed, "tokens": tokens, "tok_s": tokens / elapsed,
            "cpu_s": cpu}


def run_raw(path: str, options: dict[str, Any], n: int) -> dict[str, float]:
    from vllm import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(model=path, **options)
    started = time.perf_counter() - start
    convs = conversations(n)
    params = [SamplingParams(max_tokens=mt, temperature=0) for _, mt in convs]
    start, cpu = time.perf_counter(), cpu_seconds()
    outputs = llm.chat([m for m, _ in convs], params, use_tqdm=False)
    elapsed, cpu = time.perf_counter() - start, cpu_seconds() - cpu
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    return {"start_s": started, "run_s": elapsed, "tokens": tokens, "tok_s": tokens / elapsed,
            "cpu_s": cpu}


def main() -> None:
    from engine.vllm_engine import set_env_defaults

    set_env_defaults()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("--model", default=str(Path("var/models/SmolLM2-135M-Instruct")))
    parser.add_argument("-n", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--order", choices=["engine-first", "raw-first"], default="engine-first")
    harness.add_json_option(parser)
    args = parser.parse_args()
    options = {"dtype": args.dtype, "enforce_eager": True, "max_model_len": 2048}
    runs = [("VllmEngine.run", run_engine), ("LLM.chat", run_raw)]
    if args.order == "raw-first":
        runs.reverse()
    # Alternate A/B rounds: on a shared 2-core machine other load comes and goes, and one
    # pair of runs can differ by 2x for reasons that have nothing to do with the code.
    best: dict[str, float] = {}
    measured = []
    for round_ in range(args.rounds):
        for name, fn in runs:
            r = fn(args.model, options, args.n)
            measured.append({"round": round_, "path": name, **r})
            best[name] = max(best.get(name, 0.0), r["tok_s"])
            print(f"round {round_} {name:15s} start {r['start_s']:5.1f} s  "
                  f"run {r['run_s']:6.1f} s  {int(r['tokens'])} tokens  "
                  f"{r['tok_s']:6.1f} output tok/s  frontend CPU {r['cpu_s']:5.1f} s  "
                  f"load {os.getloadavg()[0]:.1f}", flush=True)
            gc.collect()
            time.sleep(3)  # let the engine process exit before the next one starts
    ratio = best["VllmEngine.run"] / best["LLM.chat"]
    print(f"best of {args.rounds}: VllmEngine / LLM.chat = {ratio:.3f}")
    harness.write_json(args.json, {"model": args.model, "n": args.n, "dtype": args.dtype,
                                   "runs": measured, "best_tok_s": best, "ratio": ratio})


if __name__ == "__main__":  # the engine core is a spawned process: keep the guard
    harness.run(main)
