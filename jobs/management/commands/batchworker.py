"""`manage.py batchworker --model NAME`: a long-lived RQ worker with one engine loaded
(or, with several --model, one of them at a time: jobs/worker/switching.py).

It never forks per job (CUDA cannot be forked, and loading a model per shard would waste
minutes): jobs run in this process (rq's SimpleWorker: jobs/worker/rq_worker.py) and feed
the engine pipeline.
SIGTERM stops taking jobs, lets the shards in flight finish (up to --drain-seconds) and
hands back the rest; a second SIGTERM hands everything back at once. SIGKILL loses
nothing: the reconciler gives the shards of a silent worker to another. SIGUSR1 writes
every thread's stack to the worker's stderr and changes nothing else: for a worker that
seems stuck, before it is killed.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import socket
import sys
import time
from typing import Any

import redis
from django.conf import settings
from django.core.checks import Tags
from django.core.management.base import BaseCommand, CommandError

from engine import load_engine
from engine.base import ModelSpec
from jobs.capacity import fleet
from jobs.formats.prompts import counter_for
from jobs.lib import queues
from jobs.lib.model_registry import model_spec
from jobs.policy import close_engines
from jobs.services.cleanup import sweep_temp_dir
from jobs.storage.embedded import redis_in_use
from jobs.worker import rq_worker
from jobs.worker.pipeline import Pipeline
from jobs.worker.presence import Presence, free_name
from jobs.worker.switching import model_due

# With several models, how often an idle worker looks whether another model is due.
IDLE_CHECK_SECONDS = 5


class Command(BaseCommand):
    help = "Run a worker that loads one model's engine once and runs its shards."
    # Only the checks about what a worker uses. The URL, admin, template, security and
    # static file checks are the web tier's (`runservice` and `manage.py check` run them),
    # and the URL check imports every view: ~0.3 s of CPU at each worker's start, paid by
    # every worker a host (or a test) starts.
    requires_system_checks = [Tags.models, Tags.caches, Tags.files, Tags.signals,
                              Tags.compatibility]

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--model", required=True, action="append",
                            help="A name from BATCHWEB_MODELS. Given several times, the "
                                 "worker loads one at a time and switches when its queues "
                                 "are empty and another's shards have waited "
                                 "BATCHWEB_MODEL_SWITCH_SECONDS.")
        parser.add_argument("--name", default="",
                            help="Worker name (default <host>.<pid>.<model>).")
        parser.add_argument("--host", default="",
                            help="This machine's name (default its host name): queue health "
                                 "and /metrics group workers by it. Set it where the host "
                                 "name is not the machine's, as in a container.")
        parser.add_argument("--no-control", action="store_true",
                            help="Do not take validation/finalization jobs.")
        parser.add_argument("--drain-seconds", type=float, default=60.0,
                            help="On SIGTERM, how long shards in flight may take to finish.")

    def handle(self, *args: Any, **options: Any) -> None:
        faulthandler.register(signal.SIGUSR1, all_threads=True)
        specs = []
        for model in dict.fromkeys(options["model"]):  # in order, each once
            found = model_spec(model)
            if found is None:
                known = ", ".join(m["name"] for m in settings.BATCHWEB_MODELS)
                raise CommandError(f"Unknown model {model!r}; served here: {known}")
            specs.append(found)
        host = options["host"] or socket.gethostname()
        # A pid repeats in a container (a restarted worker is pid 7 again) and across
        # containers of one host name, while RQ refuses a name a live or just-killed worker
        # still holds: then the first free `.rN` of it.
        name = options["name"] or free_name(
            f"{host}.{os.getpid()}.{'+'.join(s.name for s in specs)}")
        # Which Redis it takes jobs from: one started by hand without REDIS_URL would
        # otherwise wait silently on a Redis no batch is queued in.
        self.stdout.write(f"batchworker {name}: Redis {redis_in_use(settings.REDIS_URL)}")
        # What a killed predecessor on this machine left in TMP_DIR.
        sweep_temp_dir()
        spec: ModelSpec | None = specs[0]
        while spec is not None:
            others = [other for other in specs if other is not spec]
            spec = self.serve(spec, others, name=name, host=host, options=options)

    def serve(self, spec: ModelSpec, others: list[ModelSpec], *, name: str, host: str,
              options: dict[str, Any]) -> ModelSpec | None:
        """Load `spec`'s engine and take its jobs until a stop (None) or until one of
        `others` is due (that model: the engine is closed first, nothing is in flight)."""
        queue_names = queues.model_queue_names(spec.name)
        if not options["no_control"]:
            # Control jobs first: they are short, and a new batch should not wait for
            # a long queue of shards to be validated.
            queue_names = [queues.CONTROL_QUEUE, *queue_names]
        # Webhooks last, and in every worker (--no-control too), so deliveries need no
        # process of their own yet never delay a batch's own work.
        queue_names = [*queue_names, queues.WEBHOOK_QUEUE]
        started = time.monotonic()
        self.stdout.write(f"batchworker {name}: loading {spec.name} ({spec.backend})")
        with contextlib.suppress(redis.RedisError):  # a batch waiting for it counts it
            fleet.report_starting(queues.connection(), spec.name, name)
        engine = load_engine(spec)
        # The model's prompt counter (its tokenizer and chat template), which every shard's
        # input is read with and this worker's validations count with: loaded now, beside
        # the engine, not by the first batch (~0.3 s of CPU taken from its engine's steps).
        counter_for(spec)
        pipeline = Pipeline(engine, worker_name=name)
        pipeline.start()
        presence = Presence(pipeline.state.closing, every=settings.BATCHWEB["HEARTBEAT_SECONDS"],
                            standby=tuple(other.name for other in others), model=spec.name,
                            kv_cache_tokens=engine.prefix_cache_tokens,
                            meter=pipeline.state.idle)
        presence.start()
        if engine.prefix_cache_tokens:
            override = settings.BATCHWEB["PREFIX_CACHE_TOKENS"]
            self.stdout.write(
                f"batchworker {name}: KV cache of {engine.prefix_cache_tokens} tokens"
                + (f" (prefix planning assumes {override}: BATCHWEB_PREFIX_CACHE_TOKENS)"
                   if override else " (reported for prefix planning)"))
        loaded = time.monotonic() - started
        self.stdout.write(f"batchworker {name}: ready on {', '.join(queue_names)} "
                          f"({loaded:.1f} s to load)")
        # What a batch waiting for this model's next first worker is planned with (Redis
        # away: the worker rides it out, and the plan keeps the last one).
        with contextlib.suppress(redis.RedisError):
            fleet.report_cold_start(queues.connection(), spec.name, loaded, name=name)
        cold = False
        due: ModelSpec | None = None
        try:
            due = self.take_jobs(queue_names, name, host, pipeline, presence, others)
            if due is None:
                pipeline.drain(timeout=options["drain_seconds"])
        except (SystemExit, KeyboardInterrupt):
            cold = True
            due = None
            pipeline.hand_back_all()
        finally:
            closing = time.monotonic()
            pipeline.close()  # closes the engine too
            close_engines()
        if pipeline.state.broken is not None:
            sys.exit(f"batchworker {name}: engine failed: {pipeline.state.broken}")
        if due is not None:
            self.stdout.write(f"batchworker {name}: switching from {spec.name} to {due.name} "
                              f"({time.monotonic() - closing:.1f} s to close)")
            return due
        self.stdout.write(f"batchworker {name}: stopped{' (cold)' if cold else ''}")
        return None

    def take_jobs(self, queue_names: list[str], name: str, host: str, pipeline: Pipeline,
                  presence: Presence, others: list[ModelSpec]) -> ModelSpec | None:
        """RQ's work loop (jobs/worker/rq_worker.py) until a stop is requested (None) or
        the engine breaks; Redis outages keep the engine loaded (a reload costs a minute).

        With other models to switch to, RQ's loop also returns after IDLE_CHECK_SECONDS
        without a job; the model due then (if nothing of this one is in flight) is
        returned."""
        switch_after = settings.BATCHWEB["MODEL_SWITCH_SECONDS"]

        def due() -> ModelSpec | None:
            # Idle: switch only with nothing of this model claimed or in flight.
            if pipeline.state.works:
                return None
            return model_due(others, waited_seconds=switch_after, store=pipeline.store)

        return rq_worker.take_jobs(
            queue_names, name=name, presence=presence, host=host,
            say=lambda text: self.stderr.write(f"batchworker {name}: {text}"),
            on_idle=(max(1, int(min(IDLE_CHECK_SECONDS, switch_after))), due) if others
            else None,
            running=lambda: pipeline.state.broken is None)
