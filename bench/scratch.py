"""A scratch deployment for benchmarks: migrate the database named by `env` (SQLite under
its BATCHWEB_VAR_DIR unless DATABASE_URL is set), add one user, return an API key."""

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
