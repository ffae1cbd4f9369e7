"""`manage.py runservice`: the whole service on one machine (what `make run` starts).

A private Redis when REDIS_URL is unset, Granian for the web and API, and one `batchworker`
per model. It supervises what it started: a worker, the web server or the private Redis that
dies is started again (the reconciler puts back the queue entries a new Redis lacks); one
that keeps dying stops everything with a message naming it, so the service is never left up
and unable to make progress. Ctrl-C stops everything it started. On real infrastructure run
these pieces separately instead (docs/deployment.md).

What each process prints goes to its own file under var/log/ (`--verbose`: to this
terminal); the terminal shows the steps a newcomer needs: the address, each worker loading
and ready, and the last lines of the log of a process that died.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from jobs.lib.model_registry import model_specs
from jobs.storage.embedded import (
    EmbeddedRedisError,
    InstanceLock,
    ensure_redis,
    keep_files_private,
    redis_in_use,
)

# A process that dies this often within the window is not going to recover by itself.
MAX_RESTARTS = 5
RESTART_WINDOW_SECONDS = 120.0


class ProcessLog:
    """A supervised process's log file, and what of it is new since the last look."""

    # The lines of a log worth a line in the terminal (a worker's own steps, the web
    # server's address); everything else stays in the file.
    SHOWN = (": loading ", ": ready on ", ": switching from ", "Listening at: ")

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = path.stat().st_size if path.exists() else 0

    def new_lines(self) -> list[str]:
        try:
            with open(self.path, "rb") as handle:
                handle.seek(self.offset)
                data = handle.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1  # whole lines only
        self.offset += end
        return data[:end].decode(errors="replace").splitlines()

    def tail(self, count: int = 20) -> str:
        try:
            lines = self.path.read_bytes().decode(errors="replace").splitlines()
        except FileNotFoundError:
            return ""
        return "\n".join(lines[-count:])


class Restarts:
    """When each supervised process last died, to tell a crash loop from a rare crash."""

    def __init__(self) -> None:
        self.deaths: dict[str, deque[float]] = {}

    def record(self, name: str, now: float) -> bool:
        """Record a death; False once `name` died MAX_RESTARTS times within the window."""
        deaths = self.deaths.setdefault(name, deque())
        deaths.append(now)
        while deaths and deaths[0] < now - RESTART_WINDOW_SECONDS:
            deaths.popleft()
        return len(deaths) < MAX_RESTARTS


def web_server(bind: str, workers: int) -> list[str]:
    """The web server's command: Granian serving the WSGI application on `bind` (HOST:PORT)
    with `workers` processes of 8 threads each. A worker process that dies is replaced; one
    still busy 30 s after SIGTERM (a request running) is killed.

    No access log unless GRANIAN_LOG_ACCESS_ENABLED=1 (Granian's own setting): most of what
    the web tier answers is polls, and logging each cost ~0.2 ms of CPU, a fifth of a poll,
    on the 2-core machines of bench/RESULTS.md. A proxy in front logs requests anyway."""
    host, _, port = bind.rpartition(":")
    return [sys.executable, "-m", "granian", "--interface", "wsgi",
            "--host", host.strip("[]"), "--port", port,
            "--workers", str(workers), "--blocking-threads", "8",
            "--respawn-failed-workers", "--workers-kill-timeout", "30",
            "batchweb.wsgi:application"]


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL what is left of an exited process's group (it started a session of its own).
    Granian's worker processes outlive a main process that was killed (gunicorn's exited
    once their arbiter was gone) and would go on taking connections on the port beside
    the web server started again."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


class Command(BaseCommand):
    help = "Run the web server and one worker per model, with a private Redis if needed."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--bind", default=os.environ.get("BATCHWEB_BIND", "127.0.0.1:8000"),
                            metavar="HOST:PORT",
                            help="Where the web server and the API listen (default "
                                 "BATCHWEB_BIND, else 127.0.0.1:8000); 0.0.0.0:PORT for "
                                 "every interface, [::1]:PORT for IPv6.")
        parser.add_argument("--models", default=os.environ.get("BATCHWEB_RUN_MODELS", ""),
                            help="Comma-separated models to start workers for (default "
                                 "BATCHWEB_RUN_MODELS, else every model).")
        parser.add_argument("--web-workers", type=int, default=2,
                            help="Web server processes (8 threads each; default 2).")
        parser.add_argument("--verbose", action="store_true",
                            help="Show every process's output here instead of in var/log/.")

    def handle(self, *args: Any, **options: Any) -> None:
        database = settings.DATABASES["default"]
        keep_files_private(
            [settings.VAR_DIR, settings.STORAGE_DIR, settings.TMP_DIR],
            Path(database["NAME"]) if database["ENGINE"].endswith("sqlite3") else None)
        lock = InstanceLock(settings.VAR_DIR)
        try:
            # Ctrl-C while waiting gives up (SIGINT's default KeyboardInterrupt).
            lock.acquire(on_wait=lambda message: self.stderr.write(message))
        except KeyboardInterrupt:
            raise CommandError("gave up waiting for the other batchweb to stop") from None
        stopping = False

        def stop(signum: int, frame: Any) -> None:
            nonlocal stopping
            stopping = True

        signal.signal(signal.SIGINT, stop)
        signal.signal(signal.SIGTERM, stop)
        try:
            redis = ensure_redis(settings.VAR_DIR / "run")
        except EmbeddedRedisError as exc:
            lock.release()
            raise CommandError(str(exc)) from None
        # Which Redis every process it starts uses (REDIS_URL, exported to them): a worker
        # started by hand beside it needs the same REDIS_URL to take its jobs.
        self.stdout.write(f"private Redis: {redis.url} (a process started by hand beside this "
                          f"one needs REDIS_URL={redis.url})" if redis is not None else
                          f"Redis: {redis_in_use(settings.REDIS_URL)}")
        wanted = {m for m in options["models"].split(",") if m}
        models = [s.name for s in model_specs() if not wanted or s.name in wanted]
        commands = {"web": web_server(options["bind"], options["web_workers"])} | {
            f"worker:{name}": [sys.executable, "manage.py", "batchworker", "--model", name]
            for name in models}
        procs: dict[str, subprocess.Popen[bytes]] = {}
        restarts = Restarts()
        failure = ""
        log_dir = settings.VAR_DIR / "log"
        log_dir.mkdir(exist_ok=True)
        logs = {name: ProcessLog(log_dir / f"{name.replace(':', '-')}.log") for name in commands}

        def start(name: str) -> subprocess.Popen[bytes]:
            if options["verbose"]:
                return subprocess.Popen(commands[name], start_new_session=True)
            with open(logs[name].path, "ab") as out:
                return subprocess.Popen(commands[name], start_new_session=True, stdout=out,
                                        stderr=subprocess.STDOUT)

        for name in commands:
            procs[name] = start(name)
        self.stdout.write(f"batchweb: http://{options['bind']}/  (workers: {', '.join(models)};"
                          f" logs in {log_dir})  Ctrl-C stops everything.")
        try:
            while not stopping and not failure:
                time.sleep(1)
                for log in logs.values():
                    for line in log.new_lines():
                        if any(mark in line for mark in ProcessLog.SHOWN):
                            self.stdout.write(line.strip())
                if redis is not None and not redis.alive() and not stopping:
                    if not restarts.record("redis", time.monotonic()):
                        failure = "the private Redis keeps dying"
                        break
                    self.stderr.write("the private Redis exited; starting it again")
                    try:
                        redis.start()
                    except EmbeddedRedisError as exc:
                        failure = str(exc)
                        break
                for name, proc in procs.items():
                    if proc.poll() is None or stopping:
                        continue
                    if not restarts.record(name, time.monotonic()):
                        failure = (f"{name} exited {MAX_RESTARTS} times within "
                                   f"{RESTART_WINDOW_SECONDS:.0f}s (last code "
                                   f"{proc.returncode}); see {logs[name].path}")
                        break
                    if name == "web":
                        kill_group(proc)
                    if not options["verbose"]:
                        self.stderr.write(logs[name].tail())
                    self.stderr.write(f"{name} exited with {proc.returncode}; restarting "
                                      f"(log: {logs[name].path})")
                    procs[name] = start(name)
        finally:
            if failure:
                self.stderr.write(f"batchweb cannot make progress: {failure}. Stopping.")
            for proc in procs.values():
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 90
            for proc in procs.values():
                try:
                    proc.wait(timeout=max(1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
            kill_group(procs["web"])
            if redis is not None:
                redis.stop()
            lock.release()
            self.stdout.write("batchweb stopped.")
        if failure:
            sys.exit(1)
