"""Benchmark: a day of batches on a fleet that follows `batchweb_workers_needed`, with the
capacity plan's deadline order and without it (jobs/capacity/plan.py, jobs/services/deadlines.py,
docs/operations.md "Capacity and deadlines").

Everything that decides is real: the API, validation, the scheduler, the reconciler's pass
(every `--reconcile-seconds`) and `batchworker` processes; only the engine is the echo
engine, made an engine of a known speed at no CPU cost: each request takes `--echo-seconds`,
`--in-flight` at once per worker, so a worker with a full engine answers
in-flight / echo-seconds requests a second. A `controlworker` (no engine) runs validation,
finalization and the reconciler whatever the fleet's size, as deploy/k8s/control-
deployment.yaml does where the workers scale to zero; the fleet's workers take those jobs
too, as deployed. Its time is not counted.

The day, compressed: `--day-seconds` of wall time stand for 24 hours, a factor
C = 86,400 / day-seconds. Every duration shrinks by C: arrivals, windows (each batch is
created with `completion_window` 1h or 24h, then its `expires_at` is set to its creation
plus the window / C), the autoscaler's periods. Sizes shrink by `--size-scale` S (a batch of
N requests has max(10, N / S)), so a simulated worker stands for a real one of
in-flight / echo-seconds x S / C requests a second. The mix (`day_mix`, seeded): three
users; one sends 24h batches of 500k-1M requests, one a 24h batch of 100k every 3 hours,
one 1h batches of 10 to 300k requests (log-uniform) through the working day and two bursts
of three 1h batches of 20k-150k; all of priority `default`.

The autoscaler (here, as an HPA would do it) reads `batchweb_workers_needed{model}` from
`/metrics` every `--scale-every` seconds: more workers start at once (a new process, counted
from its start: its start-up is a real pod's); fewer stop one at a time, by SIGTERM (the
worker's drain), after the number asked for stayed below the fleet for the stabilisation
window (HPA's 300 s, / C) and no sooner than 150 s (/ C) after the last stop (the manifests'
scale-down policy).

Figures, per order:
- windows missed: batches not `completed` by their `expires_at` (target 0);
- worker time: the fleet's processes alive (start-up and drain included), in compressed
  seconds and in real worker-hours (x C / 3,600);
- against the fewest that meet every window, computed offline from the same arrivals and
  the same work (an EDF schedule that runs, at every tick, the fewest whole workers of full
  engines that still meet every known window: `offline_fewest`; target: within 15%), and
  against a fixed fleet sized for the peak (the fewest constant whole workers that meet every
  window, all day: `offline_fixed`).
`--order fifo` sets BATCHWEB_DEADLINE_ORDER=0 (jobs/services/deadlines.py): the plan and the
signal as before, but no batch's shards go first; the order before deadlines (fair share
within a priority). `--order both` runs the two, one after the other, on the same arrivals.

    .venv/bin/python bench/simulation.py                    # both orders, ~22 minutes
    .venv/bin/python bench/simulation.py --order deadline   # ~11 minutes
    .venv/bin/python bench/simulation.py --day-seconds 120 --size-scale 500 --order deadline
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

try:
    from bench import harness
except ImportError:  # run as `python bench/simulation.py`: bench/ itself is on the path
    import harness  # type: ignore[no-redef]

MODEL = "echo-sim"
DAY = 86_400.0
HOUR = 3_600.0
TERMINAL = ("completed", "failed", "expired", "cancelled")
# Kubernetes' defaults the autoscaler copies: HPA's scale-down stabilisation window, and the
# manifests' one pod per 150 s (deploy/k8s/autoscaling-*), in real seconds.
STABILISE_DOWN = 300.0
STOP_EVERY = 150.0
METRICS_TOKEN = secrets.token_hex(16)  # what the settings accept: 32 characters
NEEDED = re.compile(r'^batchweb_workers_needed\{model="' + re.escape(MODEL)
                    + r'"\}\s+([0-9.eE+-]+)', re.M)


@dataclass(frozen=True)
class Arrival:
    at_hours: float
    user: int
    requests: int  # real size
    window_hours: int


def day_mix(seed: int) -> list[Arrival]:
    """A day of three users' batches (real sizes, hours from midnight)."""
    rng = random.Random(seed)
    mix = [Arrival(0.5, 0, 1_000_000, 24), Arrival(9.0, 0, 500_000, 24),
           Arrival(15.0, 0, 1_000_000, 24)]
    mix += [Arrival(1.0 + 3 * i, 1, 100_000, 24) for i in range(8)]
    # Interactive-ish work: 1h batches through the working day, log-uniform 10..300k.
    for _ in range(24):
        at = rng.uniform(7.0, 20.0)
        mix.append(Arrival(at, 2, int(10 ** rng.uniform(1, math.log10(300_000))), 1))
    # Two bursts: three 1h batches of 20k..150k within minutes.
    for at in (10.0, 16.5):
        for _ in range(3):
            mix.append(Arrival(at + rng.uniform(0, 0.1), 2,
                               int(10 ** rng.uniform(math.log10(20_000),
                                                     math.log10(150_000))), 1))
    return sorted(mix, key=lambda a: a.at_hours)


@dataclass
class Planned:
    """An arrival as the simulation runs it."""

    arrival: Arrival
    requests: int  # simulated size
    at: float  # seconds from the day's start
    window: float  # seconds
    file_id: str = ""
    batch_id: str = ""
    created: float = 0.0  # seconds from the day's start, when the API answered


def compress(mix: list[Arrival], args: argparse.Namespace) -> list[Planned]:
    c = DAY / args.day_seconds
    return [Planned(a, max(10, round(a.requests / args.size_scale)), a.at_hours * HOUR / c,
                    a.window_hours * HOUR / c) for a in mix]


# --- the offline references ---


def worker_speed(args: argparse.Namespace) -> float:
    """Requests a second of one worker with a full engine."""
    return args.in_flight / args.echo_seconds


def offline_fixed(plan: list[Planned], speed: float, tick: float = 0.05) -> int:
    """The fewest constant whole workers with which EDF meets every window."""
    k = 1
    while not _edf_meets(plan, speed, lambda _t, _left, k=k: k, tick)[0]:
        k += 1
    return k


def offline_fewest(plan: list[Planned], speed: float, tick: float = 0.05
                   ) -> tuple[bool, float, int]:
    """EDF that runs at every tick the fewest whole workers that still meet every window
    known then (what has arrived): (every window met, worker-seconds, peak workers)."""

    def fewest(now: float, left: list[tuple[float, float]]) -> int:
        need, work = 0, 0.0
        for deadline, remaining in left:  # earliest deadline first
            work += remaining
            room = deadline - now
            if room > 1e-9:  # one due now is past helping (as jobs.capacity.plan counts it)
                need = max(need, math.ceil(work / (speed * room) - 1e-9))
        return need

    return _edf_meets(plan, speed, fewest, tick)


def _edf_meets(plan: list[Planned], speed: float, workers: Any, tick: float
               ) -> tuple[bool, float, int]:
    """Run EDF over the arrivals with `workers(now, [(deadline, remaining)...])` whole
    workers each tick (idle ones stopped): (every window met, worker-seconds, peak)."""
    pending = sorted(plan, key=lambda p: p.at)
    left: list[list[float]] = []  # [deadline, remaining requests]
    now, used, peak, met, i = 0.0, 0.0, 0, True, 0
    while i < len(pending) or left:
        while i < len(pending) and pending[i].at <= now + 1e-9:
            left.append([pending[i].at + pending[i].window, float(pending[i].requests)])
            i += 1
        left.sort()
        if not left:
            now = pending[i].at
            continue
        k = workers(now, [(d, r) for d, r in left])
        peak = max(peak, k)
        capacity = k * speed * tick
        busy = 0.0
        for item in left:
            take = min(item[1], capacity - busy)
            item[1] -= take
            busy += take
        # A worker left idle for part of the tick is stopped: count the share it worked.
        used += tick * min(k, math.ceil(busy / (speed * tick) - 1e-9))
        now += tick
        for item in left:
            if item[1] <= 1e-9:
                item[1] = 0.0
            elif item[0] < now - 1e-9:
                met = False
        left = [item for item in left if item[1] > 0 and item[0] >= now - 1e-9]
    return met, used, peak


# --- the deployment ---


def write_models(env: dict[str, str], scratch: Path, args: argparse.Namespace) -> None:
    """The simulated model: the echo engine of the known speed."""
    models = [m for m in harness.in_deployment({**env, "BATCHWEB_ECHO_MODEL": "1"}, "models")
              if m["name"] == "echo-test"]
    (echo,) = models
    sim = {**echo, "name": MODEL, "endpoints": ["/v1/chat/completions"],
           "options": {**echo["options"], "seconds_per_request": args.echo_seconds,
                       "max_in_flight": args.in_flight, "request_log": ""}}
    path = scratch / "models.json"
    path.write_text(json.dumps([sim]))
    env.update(BATCHWEB_MODELS_FILE=str(path), BATCHWEB_ECHO_MODEL="0")


def write_input(path: Path, tag: str, count: int) -> None:
    # Every answer reaches its limit (16 words): each request is the same work.
    with open(path, "w") as out:
        for i in range(count):
            out.write(json.dumps(harness.chat_request(
                f"{tag}-{i}", f"Summarise ticket {tag}-{i}: the parcel did not arrive and "
                "the customer asks for a refund or a new parcel this week please",
                model=MODEL, max_tokens=16)) + "\n")


@dataclass
class Worker:
    proc: subprocess.Popen
    started: float
    stopping: float | None = None
    ended: float | None = None


@dataclass
class Fleet:
    """The autoscaled workers and their time."""

    env: dict[str, str]
    scratch: Path
    workers: list[Worker] = field(default_factory=list)
    count: int = 0
    closed: bool = False

    def start(self) -> None:
        if self.closed:  # the run is over: the autoscaler may still be reading
            return
        log = self.scratch / f"worker-{self.count}.log"
        proc = harness.batchworker(MODEL, self.env, log, "--name", f"sim-{self.count}")
        self.count += 1
        self.workers.append(Worker(proc, time.monotonic()))

    def stop_one(self) -> None:
        # The youngest: the one least likely to hold a long shard (any would drain).
        live = self.live()
        if live:
            worker = live[-1]
            worker.proc.terminate()
            worker.stopping = time.monotonic()

    def live(self) -> list[Worker]:
        """Workers not told to stop."""
        return [w for w in self.workers if w.stopping is None and w.ended is None]

    def poll(self) -> None:
        now = time.monotonic()
        for worker in self.workers:
            if worker.ended is None and worker.proc.poll() is not None:
                worker.ended = now

    def seconds(self, until: float) -> float:
        return sum((w.ended or until) - w.started for w in self.workers)

    def stop_all(self) -> None:
        self.closed = True
        for worker in self.workers:
            if worker.ended is None:
                harness.stop(worker.proc, timeout=90)
        self.poll()


def read_needed(client: Any) -> int | None:
    try:
        answer = client.get("/metrics", timeout=30)
    except Exception:  # noqa: BLE001 (a missed scrape is what an HPA rides out too)
        return None
    found = NEEDED.search(answer.text) if answer.status_code == 200 else None
    return int(float(found.group(1))) if found else None


def autoscale(fleet: Fleet, client: Any, args: argparse.Namespace, done: threading.Event,
              trace: list[tuple[float, int, int]], t0: float) -> None:
    c = DAY / args.day_seconds
    stabilise, stop_every = STABILISE_DOWN / c, STOP_EVERY / c
    history: list[tuple[float, int]] = []
    last_stop = -math.inf
    while not done.wait(args.scale_every):
        fleet.poll()
        needed = read_needed(client)
        now = time.monotonic()
        if needed is None:
            continue
        needed = min(needed, args.max_workers)
        history = [(t, n) for t, n in history if t >= now - stabilise] + [(now, needed)]
        live = len(fleet.live())
        if needed > live:
            for _ in range(needed - live):
                fleet.start()
        # As HPA: the highest number asked for within the window decides a scale-down.
        elif (live > 0 and now - last_stop >= stop_every
              and max(n for _, n in history) < live
              and history[0][0] <= now - stabilise + args.scale_every):
            fleet.stop_one()
            last_stop = now
        trace.append((round(now - t0, 2), needed, len(fleet.live())))


def run_order(order: str, plan: list[Planned], args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    c = DAY / args.day_seconds
    scratch = Path(tempfile.mkdtemp(prefix=f"bw-sim-{order}-"))
    server = args.database_server.rstrip("/")
    db_name = f"{args.db_name}_{order}"
    direct = f"{server}/{db_name}"
    harness.create_database(server, db_name)
    env = {**os.environ, "BATCHWEB_VAR_DIR": str(scratch), "DATABASE_URL": direct,
           "BATCHWEB_SHARD_SIZE": str(args.shard_size),
           "BATCHWEB_RECONCILE_SECONDS": str(args.reconcile_seconds),
           "BATCHWEB_METRICS_TOKEN": METRICS_TOKEN,
           # A model nothing has measured yet is assumed to be as fast as this one is.
           "BATCHWEB_DEFAULT_WORKER_TOKENS_PER_SECOND": str(16 * worker_speed(args)),
           "BATCHWEB_DEADLINE_ORDER": "1" if order == "deadline" else "0",
           "BATCHWEB_HTTPS": "0", "LOG_LEVEL": "WARNING", "PYTHONUNBUFFERED": "1"}
    env.setdefault("BATCHWEB_MODELS_DIR", str(harness.ROOT / "var" / "models"))
    procs: list[subprocess.Popen] = []
    fleet = Fleet(env, scratch)
    done = threading.Event()
    try:
        with harness.private_redis(scratch):
            write_models(env, scratch, args)
            harness.manage(env, "migrate", "-v0")
            keys = harness.in_deployment(env, "keys", "3")
            port = harness.free_port()
            web_log = open(scratch / "web.log", "wb")  # noqa: SIM115 (closed with the run)
            procs.append(harness.granian(port, env, "--workers", "1", "--blocking-threads",
                                         "4", stdout=web_log, stderr=subprocess.STDOUT))
            harness.wait_http(f"http://127.0.0.1:{port}/v1/models")
            procs.append(harness.controlworker(env, scratch / "control.log",
                                               "--name", "control"))
            clients = [httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120,
                                    headers={"Authorization": f"Bearer {key}"})
                       for key in keys]
            metrics = httpx.Client(base_url=f"http://127.0.0.1:{port}",
                                   headers={"Authorization": f"Bearer {METRICS_TOKEN}"})
            for n, item in enumerate(plan):  # the files exist before the day starts
                path = scratch / "in.jsonl"
                write_input(path, f"b{n}", item.requests)
                with path.open("rb") as handle:
                    answer = clients[item.arrival.user].post(
                        "/v1/files", files={"file": ("in.jsonl", handle)},
                        data={"purpose": "batch"})
                answer.raise_for_status()
                item.file_id = answer.json()["id"]
            path.unlink()
            while b"ready on" not in (scratch / "control.log").read_bytes():
                if procs[-1].poll() is not None:
                    raise RuntimeError((scratch / "control.log").read_text()[-3000:])
                time.sleep(0.2)

            trace: list[tuple[float, int, int]] = []
            t0 = time.monotonic()
            scaler = threading.Thread(target=autoscale, daemon=True,
                                      args=(fleet, metrics, args, done, trace, t0))
            scaler.start()
            with harness.pg_connect(direct) as db:
                for item in plan:
                    time.sleep(max(0.0, t0 + item.at - time.monotonic()))
                    answer = clients[item.arrival.user].post("/v1/batches", json={
                        "input_file_id": item.file_id, "endpoint": "/v1/chat/completions",
                        "completion_window": f"{item.arrival.window_hours}h"})
                    answer.raise_for_status()
                    item.batch_id = answer.json()["id"]
                    item.created = time.monotonic() - t0
                    # The window, compressed: from its creation.
                    db.execute("UPDATE jobs_batch SET expires_at = created_at + "
                               "make_interval(secs => %s) WHERE id = %s",
                               (item.window, item.batch_id))
                last = max(p.at + p.window for p in plan) + 30
                while time.monotonic() - t0 < last:
                    ended = db.execute("SELECT COUNT(*) FROM jobs_batch WHERE status = ANY(%s)",
                                       (list(TERMINAL),)).fetchone()[0]
                    if ended == len(plan):
                        break
                    time.sleep(1)
                ended_at = time.monotonic()
                rows = db.execute(
                    "SELECT id, status, EXTRACT(EPOCH FROM completed_at - expires_at), "
                    "EXTRACT(EPOCH FROM COALESCE(completed_at, expired_at, now()) - "
                    "created_at), at_risk, EXTRACT(EPOCH FROM in_progress_at - created_at), "
                    "EXTRACT(EPOCH FROM finalizing_at - in_progress_at) FROM jobs_batch"
                ).fetchall()
            done.set()
            scaler.join(timeout=60)
            # Whatever still runs after the last batch ended (the drain) counts.
            fleet.stop_all()
            worker_seconds = fleet.seconds(ended_at)
            for client in [*clients, metrics]:
                client.close()
    finally:
        done.set()
        fleet.stop_all()
        for proc in procs:
            harness.stop(proc, timeout=60)
        harness.drop_database(server, db_name)
        if args.keep:
            print(f"kept {scratch}")
        else:
            harness.remove(scratch)

    by_id = {p.batch_id: p for p in plan}
    missed = {"1h": 0, "24h": 0}
    batches = []
    for batch_id, status, late, seconds, at_risk, validating, running in rows:
        item = by_id[batch_id]
        window = f"{item.arrival.window_hours}h"
        miss = status != "completed" or late is None or float(late) > 0
        missed[window] += miss
        batches.append({"id": batch_id, "window": window, "requests": item.requests,
                        "status": status, "at": round(item.at, 1),
                        "seconds": round(float(seconds), 1),
                        "window_seconds": round(item.window, 1), "missed": miss,
                        "at_risk": at_risk,
                        # Where its time went: validation, then its shards.
                        "validating": None if validating is None else round(float(validating), 1),
                        "running": None if running is None else round(float(running), 1)})
    return {"order": order, "missed": missed, "missed_total": sum(missed.values()),
            "worker_seconds": round(worker_seconds, 1),
            "worker_hours_real": round(worker_seconds * c / HOUR, 1),
            "workers_started": fleet.count,
            "peak_workers": max((live for _, _, live in trace), default=0),
            "run_seconds": round(ended_at - t0, 1), "batches": batches,
            "trace": trace}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--order", choices=("deadline", "fifo", "both"), default="both")
    parser.add_argument("--day-seconds", type=float, default=600.0,
                        help="wall seconds that stand for 24 hours")
    parser.add_argument("--size-scale", type=float, default=250.0,
                        help="a batch of N requests runs max(10, N / this)")
    parser.add_argument("--echo-seconds", type=float, default=0.5)
    parser.add_argument("--in-flight", type=int, default=10)
    parser.add_argument("--shard-size", type=int, default=20)
    parser.add_argument("--reconcile-seconds", type=int, default=1)
    parser.add_argument("--scale-every", type=float, default=1.0,
                        help="seconds between the autoscaler's reads of /metrics")
    parser.add_argument("--max-workers", type=int, default=8)
    parser.add_argument("--seed", type=int, default=56)
    parser.add_argument("--database-server", default="postgres://postgres@127.0.0.1:5432")
    parser.add_argument("--db-name", default="batchweb_simulation")
    parser.add_argument("--keep", action="store_true", help="keep the scratch folders")
    harness.add_json_option(parser)
    args = parser.parse_args()
    # A SIGTERM (or a SIGINT, ignored in a background job) stops the run with its cleanup:
    # workers drained, the web server, Redis and the database dropped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    c = DAY / args.day_seconds
    mix = day_mix(args.seed)
    speed = worker_speed(args)
    reference = compress(mix, args)
    met, fewest, fewest_peak = offline_fewest(reference, speed)
    fixed = offline_fixed(reference, speed)
    work = sum(p.requests for p in reference) / speed
    print(f"{len(mix)} batches ({sum(a.window_hours == 1 for a in mix)} of 1h), "
          f"{sum(a.requests for a in mix):,} requests real, "
          f"{sum(p.requests for p in reference):,} simulated; a day in {args.day_seconds:.0f} s "
          f"(C = {c:.0f}), sizes / {args.size_scale:g}; a worker {speed:.0f} r/s "
          f"({speed * args.size_scale / c:.1f} r/s real)", flush=True)
    print(f"offline: the work {work:.0f} worker-s; fewest meeting every window "
          f"{fewest:.0f} worker-s (peak {fewest_peak}, all met: {met}); fixed fleet "
          f"{fixed} workers x {args.day_seconds:.0f} s = {fixed * args.day_seconds:.0f} "
          "worker-s", flush=True)
    results = []
    for order in (("deadline", "fifo") if args.order == "both" else (args.order,)):
        result = run_order(order, compress(mix, args), args)
        result["vs_fewest"] = round(result["worker_seconds"] / fewest, 3)
        result["vs_fixed"] = round(result["worker_seconds"] / (fixed * args.day_seconds), 3)
        results.append(result)
        print(f"{order}: windows missed {result['missed']['1h']} of 1h, "
              f"{result['missed']['24h']} of 24h; {result['worker_seconds']:.0f} worker-s "
              f"({result['worker_hours_real']} worker-hours real), "
              f"{result['vs_fewest']:.3f}x the fewest, {result['vs_fixed']:.3f}x the fixed "
              f"fleet; peak {result['peak_workers']} workers, {result['workers_started']} "
              f"started; {result['run_seconds']:.0f} s", flush=True)
    harness.write_json(args.json, {
        "cpu": harness.cpu_model(), "day_seconds": args.day_seconds, "compression": c,
        "size_scale": args.size_scale, "worker_rps": speed, "seed": args.seed,
        "work_worker_seconds": round(work, 1), "fewest_worker_seconds": round(fewest, 1),
        "fewest_peak": fewest_peak, "fixed_workers": fixed,
        "fixed_worker_seconds": fixed * args.day_seconds, "orders": results})


if __name__ == "__main__":
    harness.run(main)
