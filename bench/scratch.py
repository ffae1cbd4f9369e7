"""What the benchmarks share: a scratch deployment (migrate the database named by `env`,
SQLite under its BATCHWEB_VAR_DIR unless DATABASE_URL is set, add one user, return an API
key) and the CPU time of a process tree."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def prepare(env: dict[str, str]) -> str:
    def manage(*args: str) -> str:
        return subprocess.run([sys.executable, "manage.py", *args], cwd=ROOT, env=env,
                              check=True, capture_output=True, text=True).stdout

    manage("migrate", "-v0")
    manage("shell", "-c",
           "from django.contrib.auth.models import User; User.objects.create(username='b')")
    return manage("createapikey", "b").strip()


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) of a process and all its children so far (a vLLM engine
    core runs in a child process). Less sensitive to other load on the machine than wall
    time."""
    import psutil

    root = psutil.Process(pid)
    total = 0.0
    for proc in [root, *root.children(recursive=True)]:
        try:
            times = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total
