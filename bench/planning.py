"""What prefix planning costs validation: the same files validated with prefix grouping
off (no keys computed: the validation of before prefix planning) and on, alternating, in
one run.

Two files of N requests (~500 bytes a line, as bench/orchestration.py writes):
  shared-prefix  TEMPLATES task templates (a ~1.3 kB system prompt each), shuffled: grouped;
  labels         one short system prompt for all (no prefix key): never grouped.
Each validation is the real task (`run_validation`: the streaming check, dedup, the plan,
the line index written to storage, the shard rows) in a fresh process on a scratch SQLite
database and storage. Reports requests/s and the median time ratio on/off per file.

    .venv/bin/python bench/planning.py [-n 1000000] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

try:
    from bench import harness
except ImportError:  # run as `python bench/planning.py`: bench/ itself is on the path
    import harness  # type: ignore[no-redef]

TEMPLATES = 2000
LABELS = ("You label customer messages. Answer with one word from: billing, shipping, "
          "returns, technical, account, other.")


def write_input(path: Path, count: int, shape: str, seed: int = 7) -> int:
    rng = random.Random(seed)

    def system(i: int) -> str:
        if shape != "shared-prefix":
            return LABELS
        template = rng.randrange(TEMPLATES)
        return (f"Task {template}: extract the fields of form {template} from the "
                f"message; answer in JSON with the keys name, date and amount. ") * 9

    return harness.write_labelling_file(path, count, system,
                                        lambda i: f"Document number {i}, please.")


def child(path: str) -> None:
    """In the deployment: store the file, create its batch, time its validation."""
    import django

    django.setup()
    from django.contrib.auth import get_user_model

    from jobs.models import Batch, Shard
    from jobs.services.batches import create_batch
    from jobs.services.files import create_input_file
    from jobs.services.validation import run_validation

    owner = get_user_model().objects.get(username="b")
    file = create_input_file(owner=owner, path=Path(path), filename="in.jsonl",
                             purpose="batch")
    batch = create_batch(owner=owner, input_file_id=file.pk,
                         endpoint="/v1/chat/completions", completion_window="24h")
    started = time.perf_counter()
    run_validation(batch_id=batch.pk)
    seconds = time.perf_counter() - started
    batch = Batch.objects.get(pk=batch.pk)
    assert batch.status == "in_progress", batch.errors
    print(json.dumps({"seconds": seconds, "plan": batch.plan,
                      "shards": Shard.objects.filter(batch=batch).count()}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("-n", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--child")
    harness.add_json_option(parser)
    args = parser.parse_args()
    if args.child:
        child(args.child)
        return

    scratch = Path(tempfile.mkdtemp(prefix="bw-planning-bench-"))
    try:
        env = {**os.environ, "BATCHWEB_VAR_DIR": str(scratch), "BATCHWEB_ECHO_MODEL": "1",
               "BATCHWEB_MAX_FILE_BYTES": str(4 * 1024**3),
               "BATCHWEB_MAX_REQUESTS_PER_BATCH": str(10_000_000), "LOG_LEVEL": "WARNING",
               "DJANGO_SETTINGS_MODULE": "batchweb.settings"}
        env.pop("DATABASE_URL", None)
        harness.prepare(env)
        figures: dict[str, dict] = {}
        for shape in ("shared-prefix", "labels"):
            path = scratch / f"{shape}.jsonl"
            size = write_input(path, args.n, shape)
            runs: dict[str, list[float]] = {"off": [], "on": []}
            plan: dict = {}
            for _ in range(args.repeats):
                for grouping in ("off", "on"):
                    out = subprocess.run(
                        [sys.executable, __file__, "--child", str(path)], cwd=harness.ROOT,
                        env={**env, "BATCHWEB_PREFIX_GROUPING": "1" if grouping == "on"
                             else "0"}, check=True, capture_output=True, text=True).stdout
                    result = json.loads(out.strip().splitlines()[-1])
                    runs[grouping].append(result["seconds"])
                    if grouping == "on":
                        plan = result["plan"]
                    print(f"{shape} grouping {grouping}: {result['seconds']:.1f} s "
                          f"({args.n / result['seconds']:,.0f} r/s), {result['shards']} "
                          f"shards", flush=True)
            ratios = [on / off for on, off in zip(runs["on"], runs["off"], strict=True)]
            figures[shape] = {
                "requests": args.n, "MB": round(size / 1e6, 1),
                "off r/s": round(args.n / statistics.median(runs["off"])),
                "on r/s": round(args.n / statistics.median(runs["on"])),
                "on/off time": round(statistics.median(ratios), 3),
                "grouped": plan.get("grouped"), "groups": plan.get("groups"),
                "reason": plan.get("reason")}
            print(json.dumps({shape: figures[shape]}), flush=True)
            path.unlink()
        harness.write_json(args.json, figures)
    finally:
        harness.remove(scratch)


if __name__ == "__main__":
    harness.run(main)
