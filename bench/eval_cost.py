"""What an eval set adds to a batch: its requests' time, and no more.

On a scratch deployment (SQLite, private Redis, Granian, one `batchworker` of the model,
loaded once), the same batch of distinct chat requests (harness.make_requests) runs
alternately without and with an eval set of --items items attached (short questions with a
number as the answer, the numeric rule, max_tokens 8), --rounds times each. Timed from the
batch's creation to its end (without) or to its eval run's score (with). What the eval's
requests cost is read from the usage ledger: the engine seconds charged to the run's own
batch (each busy moment of the engine split evenly among the requests in it). Reported: the
medians of the two wall times, of their difference, of the eval requests' engine seconds,
and the ratio of the added time to the eval requests' time (1.0: it adds its requests'
time and nothing else).

    .venv/bin/python bench/eval_cost.py [-n 128] [--items 200] [--rounds 3]
    .venv/bin/python bench/eval_cost.py --model echo-test --echo-seconds 0.05   # smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

try:
    from bench import harness
except ImportError:  # run as `python bench/eval_cost.py`: bench/ itself is on the path
    import harness  # type: ignore[no-redef]

TERMINAL = ("completed", "failed", "expired", "cancelled")
SET_NAME = "bench-numbers"


def eval_items(count: int) -> list[dict]:
    return [{"custom_id": f"sum-{i}", "body": {
        "temperature": 0, "max_tokens": 8, "messages": [
            {"role": "user", "content": f"What is {i} + {i % 7 + 2}? Answer with the number "
                                        "only."}]}, "expected": i + i % 7 + 2}
            for i in range(count)]


CREATE_SET = """
from pathlib import Path
from jobs.services.evals import create_eval_set
create_eval_set(name={name!r}, path=Path({path!r}), rule="numeric", tolerance=0.0)
"""


def run_once(client: object, file_id: str, database: Path, *, with_eval: bool
             ) -> dict[str, float]:
    started = time.monotonic()
    extra = {"eval_set": SET_NAME} if with_eval else {}
    batch = client.batches.create(  # type: ignore[attr-defined]
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h",
        extra_body=extra)
    while True:
        batch = client.batches.retrieve(batch.id)  # type: ignore[attr-defined]
        runs = (batch.model_extra or {}).get("evaluations") or []
        if batch.status in TERMINAL and (not with_eval or (
                runs and runs[0]["status"] not in ("running", "scoring"))):
            break
        time.sleep(0.2)
    seconds = time.monotonic() - started
    assert batch.status == "completed", batch
    row = {"seconds": seconds, "eval_engine_seconds": 0.0, "score": None}
    if with_eval:
        assert runs[0]["status"] == "scored", runs
        with sqlite3.connect(database) as db:
            run_batch = db.execute("SELECT run_batch_id FROM jobs_evalrun WHERE id = ?",
                                   (runs[0]["id"],)).fetchone()[0]
            row["eval_engine_seconds"] = db.execute(
                "SELECT COALESCE(SUM(engine_seconds), 0) FROM jobs_usagerecord "
                "WHERE batch_id = ?", (run_batch,)).fetchone()[0]
        row["score"] = runs[0]["score"]
    row["batch_engine_seconds"] = _engine_seconds(database, batch.id)
    return row


def _engine_seconds(database: Path, batch_id: str) -> float:
    with sqlite3.connect(database) as db:
        return db.execute("SELECT COALESCE(SUM(engine_seconds), 0) FROM jobs_usagerecord "
                          "WHERE batch_id = ?", (batch_id,)).fetchone()[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("-n", type=int, default=128, help="requests of the user's batch")
    parser.add_argument("--items", type=int, default=200, help="items of the eval set")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--min-tokens", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--echo-seconds", type=float, default=0.05)
    harness.add_json_option(parser)
    args = parser.parse_args()
    import openai

    scratch = Path(tempfile.mkdtemp(prefix="bw-eval-bench-"))
    env = {**os.environ, "BATCHWEB_VAR_DIR": str(scratch), "BATCHWEB_DTYPE": args.dtype,
           "BATCHWEB_SHARD_SIZE": "64", "BATCHWEB_ECHO_MODEL": "1",
           "BATCHWEB_ECHO_SECONDS": str(args.echo_seconds), "LOG_LEVEL": "INFO",
           "PYTHONUNBUFFERED": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
           "VLLM_CPU_KVCACHE_SPACE": "1", "BATCHWEB_HTTPS": "0",
           "SECRET_KEY": os.environ.get("SECRET_KEY", "bench-" + "x" * 50)}
    env.setdefault("BATCHWEB_MODELS_DIR", str(harness.ROOT / "var" / "models"))
    env.pop("DATABASE_URL", None)
    rows: list[dict] = []
    with harness.private_redis(scratch):
        key = harness.prepare(env)
        set_path = scratch / "set.jsonl"
        set_path.write_bytes(harness.jsonl(eval_items(args.items)))
        harness.manage(env, "shell", "-c", CREATE_SET.format(name=SET_NAME,
                                                              path=str(set_path)))
        port = harness.free_port()
        server = harness.granian(port, env, "--workers", "1", "--blocking-threads", "4",
                                 stderr=subprocess.DEVNULL)
        log = scratch / "worker.log"
        worker = harness.batchworker(args.model, env, log)
        try:
            deadline = time.monotonic() + 900
            while b"ready on" not in log.read_bytes():
                if worker.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(log.read_text()[-3000:])
                time.sleep(0.2)
            harness.wait_http(f"http://127.0.0.1:{port}/v1/models")
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key,
                                   max_retries=5)
            source = scratch / "in.jsonl"
            source.write_bytes(harness.jsonl(harness.make_requests(
                args.n, args.min_tokens, args.max_tokens, args.model)))
            file_id = client.files.create(file=source.open("rb"), purpose="batch").id
            # A first eval run on the model is its baseline: run one before measuring, so
            # every measured round compares with a baseline, as a deployment's would.
            run_once(client, file_id, scratch / "batchweb.sqlite3", with_eval=True)
            for round_number in range(args.rounds):
                order = (False, True) if round_number % 2 == 0 else (True, False)
                pair = {}
                for with_eval in order:
                    pair[with_eval] = run_once(client, file_id, scratch / "batchweb.sqlite3",
                                               with_eval=with_eval)
                rows.append({"without": pair[False], "with": pair[True],
                             "added": pair[True]["seconds"] - pair[False]["seconds"]})
                print(json.dumps(rows[-1]), flush=True)
        finally:
            harness.stop(worker)
            server.terminate()
            server.wait()

    without = statistics.median(r["without"]["seconds"] for r in rows)
    with_eval = statistics.median(r["with"]["seconds"] for r in rows)
    added = statistics.median(r["added"] for r in rows)
    eval_time = statistics.median(r["with"]["eval_engine_seconds"] for r in rows)
    print(f"\n{args.model}: {args.n} requests, eval set of {args.items} items, "
          f"{args.rounds} alternating rounds, {args.dtype}")
    print(f"without eval {without:.1f} s, with {with_eval:.1f} s: +{added:.1f} s; the eval "
          f"requests' engine time {eval_time:.1f} s; added / eval time "
          f"{added / eval_time if eval_time else float('nan'):.2f}")
    harness.write_json(args.json, {
        "model": args.model, "n": args.n, "items": args.items, "rounds": rows,
        "without_s": without, "with_s": with_eval, "added_s": added,
        "eval_engine_s": eval_time, "ratio": added / eval_time if eval_time else None})
    harness.remove(scratch)


if __name__ == "__main__":
    harness.run(main)
