"""`manage.py controlworker`: the service's own work without an engine: validation,
finalization and result deliveries (the control queue), webhook deliveries, and the
reconciler's pass (expiry, lost jobs, cleanup, the capacity plan).

Every `batchworker` does this work too, beside its shards, so a fleet with a worker up
needs nothing more. It is what keeps the service going while a model's workers are scaled
to zero: a new batch is validated here, on a CPU and in seconds, becomes `in_progress`,
and only then asks for a worker of its model (`batchweb_workers_needed`, jobs/capacity.py).
Without it nothing would take the validation job of a batch that arrives at zero workers,
the batch would never ask for a worker, and none would come. A batch whose file fails
validation never starts a GPU. Run one or two beside the web server (each job is
idempotent, so two never do a job twice).

SIGTERM lets the job in hand finish (RQ's warm shutdown); a second SIGTERM stops at once.
A job cut short is found again by the reconciler and enqueued anew.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import Any

import redis
from django.conf import settings
from django.core.checks import Tags
from django.core.management.base import BaseCommand

from jobs.lib import queues
from jobs.worker.periodic import Periodic
from jobs.worker.presence import Presence, free_name
from jobs.worker.rq_worker import BatchWorker


class Command(BaseCommand):
    help = "Run validation, finalization, webhooks and the reconciler, without an engine."
    # As batchworker: only the checks about what a worker uses.
    requires_system_checks = [Tags.models, Tags.caches, Tags.files, Tags.signals,
                              Tags.compatibility]

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--name", default="",
                            help="Worker name (default <host>.<pid>.control).")

    def handle(self, *args: Any, **options: Any) -> None:
        name = options["name"] or free_name(f"{socket.gethostname()}.{os.getpid()}.control")
        conf = settings.BATCHWEB
        closing = threading.Event()
        periodic = Periodic(closing, reconcile_every=conf["RECONCILE_SECONDS"],
                            sweep_every=conf["CLEANUP_INTERVAL_SECONDS"])
        periodic.start()
        # RQ refreshes an idle worker's heartbeat only every few minutes: without this
        # queue health would soon call an idle control worker lost.
        presence = Presence(closing, every=conf["HEARTBEAT_SECONDS"])
        presence.start()
        # Control jobs first (a new batch waits on its validation), webhooks after.
        queue_names = [queues.CONTROL_QUEUE, queues.WEBHOOK_QUEUE]
        self.stdout.write(f"controlworker {name}: ready on {', '.join(queue_names)}")
        try:
            self.take_jobs(queue_names, name, presence)
        finally:
            closing.set()
            periodic.join(timeout=10)
            presence.join(timeout=10)
        self.stdout.write(f"controlworker {name}: stopped")

    def take_jobs(self, queue_names: list[str], name: str, presence: Presence) -> None:
        """RQ's work loop until a stop is requested, started again after a Redis outage
        (RQ's loop returns when Redis goes away)."""
        loops = 0
        while True:
            worker = None
            try:
                # A fresh name per loop: the last loop's registration may still be in Redis.
                worker = BatchWorker([queues.queue(q) for q in queue_names],
                                     name=f"{name}.{loops}" if loops else name,
                                     connection=queues.connection())
                presence.worker = worker
                worker.work(logging_level=settings.LOG_LEVEL)
            except redis.exceptions.RedisError as exc:
                self.stderr.write(f"controlworker {name}: Redis unavailable ({exc})")
            finally:
                presence.worker = None
            loops += 1
            if worker is not None and worker._shutdown_requested_date is not None:
                return  # SIGTERM / SIGINT
            time.sleep(2)
            self.stderr.write(f"controlworker {name}: reconnecting to Redis")
