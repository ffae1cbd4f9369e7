"""`make run` as a user runs it: `manage.py runservice` in a `var/` of its own (SQLite, the
private Redis, the echo model), driven through the API. A second instance in the same
`var/` waits for the first; the test command beside it leaves it alone; a private Redis
killed under it is started again and the batch still completes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.factories import ROOT, TLS_CONTEXT, chat_line, computed_twice, free_port, jsonl, wait_for

pytestmark = pytest.mark.timeout(300)


class Service:
    """One `runservice` process tree in `var_dir`, on its own port."""

    def __init__(self, var_dir: Path, log: Path) -> None:
        self.var_dir = var_dir
        self.port = free_port()
        self.log_path = log
        self.env = {key: value for key, value in os.environ.items()
                    if key not in ("DATABASE_URL", "REDIS_URL", "BATCHWEB_TMP_DIR",
                                   "BATCHWEB_STORAGE_DIR")}
        self.env.update({
            "DJANGO_SETTINGS_MODULE": "batchweb.settings", "BATCHWEB_VAR_DIR": str(var_dir),
            "BATCHWEB_ECHO_MODEL": "1", "BATCHWEB_RUN_MODELS": "echo-test",
            # About 20 requests a second: a 400-request batch runs long enough to be
            # interrupted.
            "BATCHWEB_ECHO_SECONDS": "0.1", "BATCHWEB_ECHO_MAX_IN_FLIGHT": "2",
            "BATCHWEB_SHARD_SIZE": "20",
            "BATCHWEB_HEARTBEAT_SECONDS": "1", "BATCHWEB_RECONCILE_SECONDS": "2",
            "BATCHWEB_HEARTBEAT_TIMEOUT_SECONDS": "6",
            "BATCHWEB_SHARD_RETRY_BASE_SECONDS": "1"})
        self.proc: subprocess.Popen[bytes] | None = None

    def manage(self, *args: str) -> str:
        return subprocess.run([sys.executable, str(ROOT / "manage.py"), *args], env=self.env,
                              cwd=ROOT, check=True, capture_output=True, text=True,
                              timeout=120).stdout

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, str(ROOT / "manage.py"), "runservice", "--web-workers", "1",
                 "--bind", f"127.0.0.1:{self.port}"], env=self.env, cwd=ROOT, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True)

    def terminal(self) -> str:
        """What runservice printed."""
        return self.log_path.read_text(errors="replace")

    def log(self) -> str:
        """What runservice printed, then each process's own log (var/log/)."""
        return "\n".join([self.terminal(), *(path.read_text(errors="replace") for path in
                                              sorted((self.var_dir / "log").glob("*.log")))])

    def get(self, path: str, key: str, *, timeout: float) -> httpx.Response:
        return httpx.get(f"http://127.0.0.1:{self.port}{path}", timeout=timeout,
                         headers={"Authorization": f"Bearer {key}"}, verify=TLS_CONTEXT)

    def up(self) -> bool:
        try:
            return self.get("/v1/models", "none", timeout=2).status_code == 401
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


@pytest.fixture
def service(tmp_path: Path) -> Iterator[Service]:
    var = tmp_path / "var"
    first = Service(var, tmp_path / "service.log")
    first.manage("migrate", "--noinput", "-v0")
    yield first
    first.stop()


def api_key(service: Service) -> str:
    out = service.manage("demouser")
    return out.split("API key:")[1].strip()


def submit(service: Service, key: str, n: int) -> str:
    client = httpx.Client(base_url=f"http://127.0.0.1:{service.port}/v1",
                          headers={"Authorization": f"Bearer {key}"}, timeout=30,
                          verify=TLS_CONTEXT)
    body = jsonl([chat_line(f"req-{i}", f"hello {i}") for i in range(n)])
    file_id = client.post("/files", data={"purpose": "batch"},
                          files={"file": ("in.jsonl", body)}).json()["id"]
    batch = client.post("/batches", json={"input_file_id": file_id, "completion_window": "24h",
                                          "endpoint": "/v1/chat/completions"}).json()
    return batch["id"]


def batch_state(service: Service, key: str, batch_id: str) -> dict[str, Any]:
    return service.get(f"/v1/batches/{batch_id}", key, timeout=10).json()


def custom_ids(service: Service, key: str, batch: dict[str, Any]) -> list[str]:
    found = []
    for field in ("output_file_id", "error_file_id"):
        if batch.get(field):
            content = service.get(f"/v1/files/{batch[field]}/content", key,
                                  timeout=30).content
            found += [json.loads(line)["custom_id"] for line in content.splitlines()]
    return found


def finished(service: Service, key: str, batch_id: str, *, timeout: float) -> dict[str, Any]:
    return wait_for(lambda: (b := batch_state(service, key, batch_id))["status"] == "completed"
                    and b, timeout=timeout, every=0.5, message="the batch to complete")


def running_batch(service: Service, n: int) -> tuple[str, str]:
    """Start the service, submit `n` requests and wait until some are done: (key, batch id)."""
    service.start()
    wait_for(service.up, timeout=90, message="the service")
    key = api_key(service)
    batch_id = submit(service, key, n)
    wait_for(lambda: batch_state(service, key, batch_id)["request_counts"]["completed"] > 20,
             timeout=90, message="progress")
    return key, batch_id


def test_a_second_instance_waits_for_the_first_and_takes_over(service: Service,
                                                              tmp_path: Path) -> None:
    # Both instances' engines log each request they compute: the restart must not
    # compute a finished request again (the first drains and hands back checkpoints).
    request_log = tmp_path / "engine-requests.log"
    service.env["BATCHWEB_ECHO_REQUEST_LOG"] = str(request_log)
    key, batch_id = running_batch(service, 400)

    second = Service(service.var_dir, tmp_path / "second.log")
    second.port = service.port
    second.env["BATCHWEB_ECHO_REQUEST_LOG"] = str(request_log)
    # The interruption is the first instance's; the second may run the rest at full speed.
    second.env["BATCHWEB_ECHO_SECONDS"] = "0.005"
    try:
        second.start()
        wait_for(lambda: "waiting for it to stop" in second.log(), timeout=60,
                 message="the second instance to say it waits")
        # While it waits the first keeps working: its Redis is its own.
        before = batch_state(service, key, batch_id)["request_counts"]["completed"]
        wait_for(lambda: batch_state(service, key, batch_id)["request_counts"]["completed"]
                 > before, timeout=30, message="the first service to keep going")

        service.stop()  # the second takes over once the first drained and released var/
        wait_for(second.up, timeout=120, message="the second service")
        batch = finished(second, key, batch_id, timeout=180)
        ids = custom_ids(second, key, batch)
        assert sorted(ids) == sorted(f"req-{i}" for i in range(400))
        assert computed_twice(request_log) == 0
    finally:
        second.stop()


def test_the_test_command_beside_a_service_leaves_it_alone(service: Service) -> None:
    service.start()
    wait_for(service.up, timeout=90, message="the service")
    key = api_key(service)
    # What `make test` wraps its run in: a Redis of its own, started and stopped.
    subprocess.run([sys.executable, "-m", "jobs.storage.embedded", sys.executable, "-c", "pass"],
                   cwd=ROOT, check=True, timeout=60,
                   env={k: v for k, v in service.env.items() if k != "REDIS_URL"})
    batch_id = submit(service, key, 60)
    batch = finished(service, key, batch_id, timeout=120)
    assert sorted(custom_ids(service, key, batch)) == sorted(f"req-{i}" for i in range(60))
    assert "Redis unavailable" not in service.log()
    # The terminal shows the steps (a worker ready), the processes' chatter is in var/log/.
    assert ": ready on " in service.terminal() and "Spawning worker" not in service.terminal()
    assert "Spawning worker" in (service.var_dir / "log" / "web.log").read_text()


def test_the_services_files_are_its_users_alone(service: Service) -> None:
    # The database was made by `manage.py migrate` under this test's umask (0644):
    # runservice makes it private, and everything it and its children create.
    database = service.var_dir / "batchweb.sqlite3"
    database.chmod(0o644)
    service.start()
    wait_for(service.up, timeout=90, message="the service")
    key = api_key(service)
    batch = finished(service, key, submit(service, key, 30), timeout=120)
    assert len(custom_ids(service, key, batch)) == 30
    stored = [path for path in (service.var_dir / "storage").rglob("*") if path.is_file()]
    assert len(stored) >= 2  # the input file and the output file at least
    for path in [service.var_dir, database, *stored,
                 *(service.var_dir / "storage").rglob("*"), *(service.var_dir / "tmp").rglob("*"),
                 *(service.var_dir / "run").rglob("*")]:
        assert path.stat().st_mode & 0o077 == 0, (path, oct(path.stat().st_mode))


def test_a_killed_private_redis_is_started_again(service: Service) -> None:
    # Killed after 20 of 150 results: at ~20 requests a second the rest takes ~6 s, so the
    # batch is still running when Redis comes back.
    key, batch_id = running_batch(service, 150)
    os.kill(int((service.var_dir / "run" / "redis.pid").read_text()), signal.SIGKILL)
    wait_for(lambda: "private Redis exited; starting it again" in service.log(), timeout=30,
             message="runservice to notice")
    assert batch_state(service, key, batch_id)["status"] == "in_progress"
    batch = finished(service, key, batch_id, timeout=240)
    assert sorted(custom_ids(service, key, batch)) == sorted(f"req-{i}" for i in range(150))


def test_a_process_that_keeps_dying_stops_the_service(service: Service) -> None:
    # A worker whose engine cannot start exits at once, every time: runservice must stop
    # everything and say why, not stay up doing nothing.
    models = service.var_dir.parent / "models.json"
    models.write_text(json.dumps([{"name": "broken", "backend": "no-such-engine",
                                   "endpoints": ["/v1/chat/completions"]}]))
    service.env.update(BATCHWEB_MODELS_FILE=str(models), BATCHWEB_RUN_MODELS="broken",
                       BATCHWEB_ECHO_MODEL="0")
    service.start()
    assert service.proc is not None
    service.proc.wait(timeout=120)
    assert service.proc.returncode == 1
    assert "batchweb cannot make progress: worker:broken exited" in service.log()
