"""Helpers for tests: request lines, JSONL bodies, worker processes, waiting."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def chat_line(custom_id: str, text: str, *, model: str = "echo-test", **body: Any) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "messages": [{"role": "user", "content": text}], **body}}


def jsonl(lines: list[dict] | list[str]) -> bytes:
    return b"".join((json.dumps(x) if isinstance(x, dict) else x).encode() + b"\n"
                    for x in lines)


def database_url() -> str:
    """The test database as a URL, for worker processes."""
    from django.db import connection

    s = connection.settings_dict
    if s["ENGINE"].endswith("sqlite3"):
        return f"sqlite:///{s['NAME']}"
    auth = s["USER"] + (f":{s['PASSWORD']}" if s["PASSWORD"] else "")
    return f"postgres://{auth}@{s['HOST'] or '127.0.0.1'}:{s['PORT'] or 5432}/{s['NAME']}"


class Workers:
    """Real `manage.py batchworker` processes on the test database."""

    def __init__(self, log_dir: Path) -> None:
        self.procs: list[subprocess.Popen] = []
        self.log_dir = log_dir

    def start(self, model: str = "echo-test", *, env: dict[str, str] | None = None,
              args: list[str] | None = None) -> subprocess.Popen:
        full_env = {**os.environ, "DATABASE_URL": database_url(), **(env or {})}
        with open(self.log_dir / f"worker-{len(self.procs)}.log", "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, str(ROOT / "manage.py"), "batchworker", "--model", model,
                 *(args or [])], env=full_env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        self.procs.append(proc)
        return proc

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def logs(self) -> str:
        return "\n".join(p.read_text(errors="replace")[-4000:]
                         for p in sorted(self.log_dir.glob("worker-*.log")))


def wait_for(predicate: Callable[[], Any], *, timeout: float = 60, every: float = 0.2,
             message: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout}s waiting for {message}")


def engine_request_log(path: Path) -> dict[tuple[str, int], int]:
    """How often the echo engine computed each (shard, input line), from the request log
    it writes when BATCHWEB_ECHO_REQUEST_LOG (its `request_log` option) names a file.
    A JSON retry counts as a second computation of its line."""
    counts: dict[tuple[str, int], int] = {}
    if not path.exists():
        return counts
    for request_id in path.read_text().split():
        shard_id, _attempt, line = request_id.rsplit(":", 2)
        key = (shard_id, int(line.rstrip("r")))
        counts[key] = counts.get(key, 0) + 1
    return counts


def computed_twice(path: Path) -> int:
    """Computations beyond the first of each line in an echo engine's request log."""
    return sum(n - 1 for n in engine_request_log(path).values())
