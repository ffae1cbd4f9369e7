"""`manage.py controlworker`: the service's own work without an engine: validation,
finalization and result deliveries (the control queue), webhook deliveries, and the
reconciler's pass (expiry, lost jobs, cleanup, the capacity plan).

Every `batchworker` does this work too, beside its shards, so a fleet with a worker up
needs nothing more. It is what keeps the service going while a model's workers are scaled
to zero: a new batch is validated here, on a CPU and in seconds, becomes `in_progress`,
and only then asks for a worker of its model (`batchweb_workers_needed`, jobs/capacity/plan.py).
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
from typing import Any

from django.conf import settings
from django.core.checks import Tags
from django.core.management.base import BaseCommand

from jobs.lib import queues
from jobs.storage.embedded import redis_in_use
from jobs.worker.periodic import Periodic
from jobs.worker.presence import Presence, free_name
from jobs.worker.rq_worker import take_jobs


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
        self.stdout.write(f"controlworker {name}: Redis {redis_in_use(settings.REDIS_URL)}")
        self.stdout.write(f"controlworker {name}: ready on {', '.join(queue_names)}")
        try:
            take_jobs(queue_names, name=name, presence=presence,
                      say=lambda text: self.stderr.write(f"controlworker {name}: {text}"))
        finally:
            closing.set()
            periodic.join(timeout=10)
            presence.join(timeout=10)
        self.stdout.write(f"controlworker {name}: stopped")
