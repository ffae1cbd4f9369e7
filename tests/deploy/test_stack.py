"""The deployment as an operator runs it, on this machine (`make deploy-test`: root; a cold
image build adds about 7 minutes; docs/deployment.md).

dockerd is started if it is not running (Debian's docker.io, installed if missing); the
bases the deployment pulls from registries are built locally from Debian's packages
(deploy/local/build-bases.sh); the CPU image is built from deploy/Dockerfile as the docs
say; a .env is written from deploy/env.example; and `docker compose up` starts the whole
stack: PostgreSQL, Redis, SeaweedFS, migrate, Granian and one CPU worker with the default
model (deploy/compose.cpu.yaml). The test then talks to it as the TLS proxy in front of it
would, through the published port on 127.0.0.1 only, and to the containers through
`docker compose run/exec` as the docs show. Everything it started is stopped and removed
(the built images stay, as the build cache); the firewall state dockerd changed is put
back (tests/deploy/dockerhost.py).

The tests run in file order and share one stack: a later one uses the API key and the batch
of an earlier one."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import http.server
import json
import os
import re
import secrets
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.deploy.dockerhost import DockerHost, run, why_not
from tests.factories import ROOT

pytestmark = pytest.mark.deploy

DEPLOY = ROOT / "deploy"
PROJECT = "batchweb-deploytest"  # not `batchweb`: a real deployment here is left alone
HOST = "batch.example.com"  # env.example's ALLOWED_HOSTS
MODEL = "SmolLM2-135M-Instruct"
IMAGE = "batchweb:cpu"
CLIENT = "198.51.100.7"  # the address the proxy appends to X-Forwarded-For
REQUESTS = 200
# What the operator must set: compose refuses to start without each.
SECRETS = ("POSTGRES_PASSWORD", "SECRET_KEY", "REDIS_PASSWORD", "BATCHWEB_S3_ACCESS_KEY_ID",
           "BATCHWEB_S3_SECRET_ACCESS_KEY")
# The local torch index's port: a fixed one, since the index's URL is a build argument
# and so part of the key of the build cache's dependency layer.
TORCH_INDEX_PORT = 18099
# The engine lock of this machine: no two vLLM engines run at once (the worker is one).
ENGINE_LOCK = Path("/tmp/engine.lock")


# Compose prefers the shell's variables to the .env file's: none of this process's (a
# DATABASE_URL or REDIS_URL of the machine's services, say) may reach the stack.
COMPOSE_ENV = {name: value for name, value in os.environ.items()
               if name in ("PATH", "HOME", "DOCKER_HOST", "DOCKER_CONFIG")}


def log(message: str) -> None:
    print(f"[deploy {time.strftime('%H:%M:%S')}] {message}", flush=True)


# --- dockerd and the image ---


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    """The test's own files (.env, logs): not pytest's numbered temporary folders, which
    any other pytest run on the machine may prune while the stack still needs them."""
    folder = Path(tempfile.mkdtemp(prefix="batchweb-deploytest-"))
    log(f"files: {folder}")
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def docker_host(workdir: Path) -> Iterator[DockerHost]:
    reason = why_not()
    if reason:
        pytest.skip(reason)
    host = DockerHost(workdir)
    try:
        host.up()
        yield host
    finally:
        host.down()


def torch_wheel() -> Path | None:
    """The CPU build of torch engine/install_cpu.sh pins, where pip finds it on local disk
    (PIP_FIND_LINKS): the machines this runs on cannot reach the PyTorch index."""
    for folder in os.environ.get("PIP_FIND_LINKS", "").split():
        found = sorted(Path(folder).glob("torch-*+cpu-cp311-*.whl"))
        if found:
            return found[-1]
    return None


@contextlib.contextmanager
def torch_index() -> Iterator[list[str]]:
    """The `docker build` arguments that give pip the local torch wheel: a package index
    of that one file on 127.0.0.1, which the build reaches with the host's network (pip
    trusts loopback over plain HTTP). None are needed where the PyTorch index answers."""
    wheel = torch_wheel()
    if wheel is None:
        yield []
        return
    handler = functools.partial(_WheelIndex, wheel)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", TORCH_INDEX_PORT), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield ["--network", "host", "--build-arg",
               f"TORCH_CPU_INDEX=http://127.0.0.1:{server.server_address[1]}/"]
    finally:
        server.shutdown()
        server.server_close()


class _WheelIndex(http.server.BaseHTTPRequestHandler):
    """A PEP 503 index of one wheel: /torch/ links it, everything else is 404."""

    def __init__(self, wheel: Path, *args: Any) -> None:
        self.wheel = wheel
        super().__init__(*args)

    def do_GET(self) -> None:
        if self.path in ("/torch/", "/torch"):
            body = f'<a href="/files/{self.wheel.name}">{self.wheel.name}</a>'.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        elif self.path == f"/files/{self.wheel.name}".replace("+", "%2B") or \
                self.path == f"/files/{self.wheel.name}":
            self.send_response(200)
            self.send_header("Content-Length", str(self.wheel.stat().st_size))
            self.end_headers()
            with self.wheel.open("rb") as handle:
                while chunk := handle.read(1 << 20):
                    self.wfile.write(chunk)
        else:
            self.send_error(404)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def image(docker_host: DockerHost) -> dict[str, str]:
    """The stand-in bases, then the CPU image as docs/deployment.md builds it. Returns the
    variables that select the stand-ins."""
    started = time.monotonic()
    bases = run("sh", str(DEPLOY / "local" / "build-bases.sh"), timeout=1800).stdout
    variables = dict(line.split("=", 1) for line in bases.split())
    log(f"bases ready in {time.monotonic() - started:.0f} s: {variables}")
    started = time.monotonic()
    with torch_index() as extra:
        built = run("docker", "build", "-f", "deploy/Dockerfile",
                    "--build-arg", "VLLM_TARGET=cpu",
                    "--build-arg", f"CPU_IMAGE={variables['CPU_IMAGE']}", *extra,
                    "-t", IMAGE, ".", cwd=ROOT, check=False, timeout=3600)
    assert built.returncode == 0, built.stderr[-4000:]
    size = int(run("docker", "image", "inspect", "-f", "{{.Size}}", IMAGE).stdout)
    log(f"{IMAGE} built in {time.monotonic() - started:.0f} s, {size / 1e9:.2f} GB")
    return variables


# --- the stack ---


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def env_file_text(values: dict[str, str]) -> str:
    """deploy/env.example with `values` filled in: each NAME= line (commented or not) of
    a name in `values` is set; the rest is kept as the example has it."""
    lines = []
    seen = set()
    for line in (DEPLOY / "env.example").read_text().splitlines():
        match = re.match(r"^#? ?([A-Z0-9_]+)=", line)
        if match and match.group(1) in values:
            name = match.group(1)
            lines.append(f"{name}={values[name]}")
            seen.add(name)
        else:
            lines.append(line)
    missing = set(values) - seen
    assert not missing, f"deploy/env.example lacks {sorted(missing)}"
    return "\n".join(lines) + "\n"


def small_batch_models(folder: Path) -> Path:
    models = json.loads((DEPLOY / "models.cpu.json").read_text())
    for model in models:
        model["options"]["max_num_seqs"] = 16
    path = folder / "models.json"
    path.write_text(json.dumps(models))
    path.chmod(0o644)  # read inside the containers by their unprivileged user
    return path


@dataclass
class Stack:
    env_file: Path
    env: dict[str, str]
    port: int
    logs: Path
    api_key: str = ""
    batch_id: str = ""
    output: bytes = b""
    timings: dict[str, float] = field(default_factory=dict)

    def compose(self, *args: str, check: bool = True, timeout: float = 600,
                env_file: Path | None = None) -> Any:
        result = run("docker", "compose", "-p", PROJECT,
                     "--env-file", str(env_file or self.env_file),
                     "-f", str(DEPLOY / "compose.yaml"), "-f", str(DEPLOY / "compose.cpu.yaml"),
                     *args, cwd=ROOT, check=False, timeout=timeout, env=COMPOSE_ENV)
        if check:
            assert result.returncode == 0, f"compose {args}: {result.stderr[-3000:]}"
        return result

    def exec_python(self, service: str, code: str) -> Any:
        """`code` run by the service's Python inside its container; its last line of
        output, parsed as JSON."""
        out = self.compose("exec", "-T", service, "python", "-c", code).stdout
        return json.loads(out.strip().splitlines()[-1])

    def container(self, service: str) -> str:
        return self.compose("ps", "-aq", service).stdout.strip()

    def inspect(self, service: str, template: str) -> str:
        return run("docker", "inspect", "-f", template, self.container(service)).stdout.strip()

    def headers(self, client: str = CLIENT) -> dict[str, str]:
        """What the TLS proxy adds to each request it passes on."""
        return {"Host": HOST, "X-Forwarded-Proto": "https", "X-Forwarded-For": client}

    def get(self, path: str, **headers: str) -> httpx.Response:
        return httpx.get(f"http://127.0.0.1:{self.port}{path}",
                         headers={**self.headers(), **headers}, timeout=30, trust_env=False)

    def client(self) -> Any:
        import openai

        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key=self.api_key,
                             default_headers=self.headers(), max_retries=5, timeout=60)

    def wait_healthy(self, timeout: float = 300) -> float:
        """Seconds until the web container's health check passed."""
        started = time.monotonic()
        while True:
            state = self.inspect("web", "{{.State.Health.Status}}") if self.container(
                "web") else ""
            if state == "healthy":
                return time.monotonic() - started
            assert time.monotonic() - started < timeout, f"web is {state!r} after {timeout} s"
            time.sleep(1)

    def up(self, *services: str) -> float:
        """Seconds from `compose up -d` to the web container healthy."""
        started = time.monotonic()
        self.compose("up", "-d", *services)
        self.wait_healthy()
        return time.monotonic() - started

    def save_logs(self) -> None:
        self.logs.write_text(self.compose("logs", "--no-color", "-t", check=False).stdout)


@pytest.fixture(scope="module")
def stack(image: dict[str, str], workdir: Path) -> Iterator[Stack]:
    folder = workdir
    port = free_port()
    env = {
        "POSTGRES_PASSWORD": secrets.token_hex(16),
        "SECRET_KEY": secrets.token_urlsafe(50),
        "REDIS_PASSWORD": secrets.token_hex(16),
        "BATCHWEB_S3_ACCESS_KEY_ID": f"batchweb{secrets.token_hex(6)}",
        "BATCHWEB_S3_SECRET_ACCESS_KEY": secrets.token_hex(20),
        "BATCHWEB_METRICS_TOKEN": secrets.token_hex(16),
        "BATCHWEB_PORT": str(port),
        "WORKER_HOST": "deploytest",
        "WORKER_MODEL": MODEL,
        # deploy/models.cpu.json with the engine's batch cut to 16 sequences, and shards of
        # 20: the worker holds a shard or two at a time, so a drain (compose restart) hands
        # most of the 200 requests back instead of finishing them all, and the batch is
        # still running when the worker is killed.
        "MODELS_FILE": str(small_batch_models(folder)),
        "BATCHWEB_SHARD_SIZE": "20",
        "MODELS_DIR": str(ROOT / "var" / "models"),
        "VLLM_TARGET": "cpu",
        "BATCHWEB_IMAGE": IMAGE,
        **image,
    }
    assert (ROOT / "var" / "models" / MODEL).is_dir(), "run `make models` first"
    env_file = folder / ".env"
    env_file.write_text(env_file_text(env))
    env_file.chmod(0o600)
    artifacts = ROOT / "tests" / "artifacts"
    artifacts.mkdir(exist_ok=True)
    stack = Stack(env_file=env_file, env=env, port=port, logs=artifacts / "deploy-compose.log")
    try:
        # Everything but the worker, which starts (fixture `worker`) once this machine's
        # engine lock is held.
        stack.timings["up_to_healthy"] = stack.up("web")
        log(f"compose up to web healthy: {stack.timings['up_to_healthy']:.0f} s")
        yield stack
    finally:
        stack.save_logs()
        log(f"compose logs: {stack.logs}")
        stack.compose("down", "-v", "--remove-orphans", "-t", "30", check=False)


@pytest.fixture(scope="module")
def worker(stack: Stack) -> Iterator[Stack]:
    """The stack with its worker (a vLLM engine) running, the engine lock held until the
    stack is taken down."""
    with ENGINE_LOCK.open("a") as lock:
        log("waiting for the engine lock")
        fcntl.flock(lock, fcntl.LOCK_EX)
        log("engine lock held: starting the worker")
        stack.compose("up", "-d", "worker")
        try:
            yield stack
        finally:
            stack.compose("stop", "-t", "30", "worker", check=False)


# --- the tests, in order ---


def test_web_is_healthy_migrate_ran_once_login_and_metrics_answer(stack: Stack) -> None:
    assert stack.inspect("web", "{{.State.Health.Status}}") == "healthy"
    migrate = stack.container("migrate").split()
    assert len(migrate) == 1, migrate
    assert stack.inspect("migrate", "{{.State.Status}} {{.State.ExitCode}} "
                                    "{{.RestartCount}}") == "exited 0 0"
    assert "Applying jobs.0001_initial... OK" in stack.compose("logs", "migrate").stdout

    login = stack.get("/accounts/login/")
    assert login.status_code == 200 and 'name="password"' in login.text
    # Without the proxy's X-Forwarded-Proto the service sends the client to https.
    plain = httpx.get(f"http://127.0.0.1:{stack.port}/accounts/login/", headers={"Host": HOST},
                      trust_env=False)
    assert plain.status_code == 301, (plain.headers, plain.text[:500])
    assert plain.headers["location"] == f"https://{HOST}/accounts/login/"
    metrics = stack.get("/metrics", Authorization=f"Bearer {stack.env['BATCHWEB_METRICS_TOKEN']}")
    assert metrics.status_code == 200 and "batchweb_redis_up 1" in metrics.text
    assert stack.get("/metrics").status_code == 401  # no token, no staff session


def test_createsuperuser_and_createapikey_as_the_docs_show(stack: Stack) -> None:
    password = secrets.token_urlsafe(16)
    stack.compose("run", "--rm", "-e", f"DJANGO_SUPERUSER_PASSWORD={password}", "web",
                  "python", "manage.py", "createsuperuser", "--noinput",
                  "--username", "admin", "--email", "admin@example.com")
    stack.env["ADMIN_PASSWORD"] = password
    out = stack.compose("exec", "-T", "web", "python", "manage.py", "createapikey",
                        "admin").stdout
    stack.api_key = out.strip().splitlines()[-1].strip()
    assert stack.api_key.startswith("sk-bw-"), out
    models = [m.id for m in stack.client().models.list()]
    assert MODEL in models


def test_nothing_the_operator_did_not_set_has_a_default_secret(stack: Stack) -> None:
    for name in SECRETS:
        partial = stack.env_file.with_name(f"without-{name}")
        partial.write_text(env_file_text({k: v for k, v in stack.env.items()
                                          if k != name and k != "ADMIN_PASSWORD"}))
        refused = stack.compose("config", "-q", env_file=partial, check=False)
        assert refused.returncode != 0 and name in refused.stderr, (name, refused.stderr)
    # /metrics without BATCHWEB_METRICS_TOKEN is for signed-in staff only (above), and the
    # compose file gives none of these a default: env.example leaves them empty.
    example = (DEPLOY / "env.example").read_text()
    for name in (*SECRETS, "BATCHWEB_METRICS_TOKEN"):
        assert re.search(rf"^{name}=$", example, re.M), name


def test_redis_and_the_store_refuse_the_compose_network_without_credentials(
        stack: Stack) -> None:
    seen = stack.exec_python("web", """
import json, os, socket
import boto3, redis
from botocore.config import Config
out = {}
try:
    redis.Redis(host="redis", port=6379).ping()
    out["redis"] = "answered"
except redis.RedisError as exc:
    out["redis"] = type(exc).__name__
out["redis_url"] = redis.Redis.from_url(os.environ["REDIS_URL"]).ping()
out["ports"] = {}
for port in (8333, 18333, 9333, 8080, 8888, 19333, 18080, 18888, 8181, 9101, 16777, 17777):
    try:
        socket.create_connection(("s3", port), timeout=3).close()
        out["ports"][port] = "open"
    except OSError:
        out["ports"][port] = "closed"
# The S3 gateway's gRPC port: adding an admin identity without the filer key's JWT.
import grpc
def field(number, data):
    return bytes([number << 3 | 2, len(data)]) + data
put = grpc.insecure_channel("s3:18333").unary_unary(
    "/messaging_pb.SeaweedS3IamCache/PutIdentity", request_serializer=bytes,
    response_deserializer=bytes)
try:
    put(field(1, field(1, b"probe") + field(3, b"Admin")), timeout=5)
    out["grpc"] = "allowed"
except grpc.RpcError as exc:
    out["grpc"] = exc.code().name
s3 = boto3.client("s3", endpoint_url=os.environ["BATCHWEB_S3_ENDPOINT_URL"],
                  aws_access_key_id=os.environ["BATCHWEB_S3_ACCESS_KEY_ID"],
                  aws_secret_access_key=os.environ["BATCHWEB_S3_SECRET_ACCESS_KEY"],
                  region_name="us-east-1", config=Config(s3={"addressing_style": "path"}))
try:
    s3.create_bucket(Bucket="another")
    out["create_bucket"] = "allowed"
except Exception as exc:
    out["create_bucket"] = type(exc).__name__ + str(exc)[:80]
print(json.dumps(out))""")
    assert seen["redis"] == "AuthenticationError" and seen["redis_url"] is True, seen
    # S3 and its gRPC port (SeaweedFS binds both on -s3.ip.bind: there is no flag to close
    # the gRPC one) on the compose network; the master's, volume server's and filer's HTTP
    # and gRPC ports, the catalogs' and the message queue's gRPC ports closed.
    assert seen["ports"] == {"8333": "open", "18333": "open", **{str(p): "closed" for p in (
        9333, 8080, 8888, 19333, 18080, 18888, 8181, 9101, 16777, 17777)}}, seen
    # What the S3 gRPC port serves (identities, policies, lifecycle deletes) wants a JWT
    # signed with the filer key seaweedfs.sh makes at each start.
    assert seen["grpc"] == "UNAUTHENTICATED", seen
    assert "AccessDenied" in seen["create_bucket"], seen


def test_the_stores_own_servers_want_signed_requests(stack: Stack) -> None:
    # Even from inside the store's container (its network namespace, where its master,
    # volume server and filer listen), nothing is read or written without the master's
    # JWT.
    probe = """
import json, urllib.error, urllib.request
def status(url, data=None):
    request = urllib.request.Request(url, data=data, method="POST" if data else "GET")
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code
fid = json.load(urllib.request.urlopen("http://127.0.0.1:9333/dir/assign", timeout=5))["fid"]
print(json.dumps({"volume write": status(f"http://127.0.0.1:8080/{fid}", b"x"),
                  "volume read": status(f"http://127.0.0.1:8080/{fid}"),
                  "filer read": status("http://127.0.0.1:8888/buckets/"),
                  "filer write": status("http://127.0.0.1:8888/probe.txt", b"x")}))"""
    out = run("docker", "run", "--rm", "--network", f"container:{stack.container('s3')}",
              "--entrypoint", "python", IMAGE, "-c", probe).stdout
    assert json.loads(out) == {"volume write": 401, "volume read": 401, "filer read": 401,
                               "filer write": 401}, out


def sign_in(stack: Stack, client: str, password: str) -> int:
    """One dashboard sign-in of `admin` from `client` (behind the proxy): 302 signed in,
    200 refused, 429 locked out."""
    page = stack.get("/accounts/login/", **{"X-Forwarded-For": client})
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text).group(1)
    # The cookie is Secure (the proxy speaks HTTPS to clients): passed on by hand.
    cookie = re.search(r"csrftoken=([^;]+)", page.headers["set-cookie"]).group(1)
    response = httpx.post(
        f"http://127.0.0.1:{stack.port}/accounts/login/",
        data={"username": "admin", "password": password, "csrfmiddlewaretoken": token},
        headers={**stack.headers(client), "Cookie": f"csrftoken={cookie}",
                 "Referer": f"https://{HOST}/accounts/login/"}, timeout=30, trust_env=False)
    return response.status_code


def test_login_throttling_tells_clients_apart_behind_the_proxy(stack: Stack) -> None:
    # BATCHWEB_PROXY_COUNT=1: the address the proxy appended, not the proxy's own, is
    # the one locked. (With 0 every client would be the proxy, locked out together.)
    attacker, owner = "203.0.113.9", "198.51.100.20"
    statuses = [sign_in(stack, attacker, "wrong") for _ in range(5)]
    assert statuses[:-1] == [200] * 4 and statuses[-1] == 429, statuses
    assert sign_in(stack, attacker, stack.env["ADMIN_PASSWORD"]) == 429
    assert sign_in(stack, owner, stack.env["ADMIN_PASSWORD"]) == 302


def batch_lines(marker: str) -> bytes:
    # Long answers (256 tokens each), so the batch is still running when the worker is
    # restarted and when it is killed.
    return b"".join(json.dumps({
        "custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": MODEL, "max_tokens": 256, "temperature": 0,
                 "messages": [{"role": "user", "content":
                               f"{marker} Tell a long story about a lighthouse number {i}."}]},
    }).encode() + b"\n" for i in range(REQUESTS))


def wait_progress(client: Any, batch_id: str, above: int, timeout: float = 600) -> Any:
    """The batch once more than `above` requests completed (or it finished)."""
    deadline = time.monotonic() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        done = batch.request_counts.completed if batch.request_counts else 0
        if done > above or batch.status in ("completed", "failed", "expired", "cancelled"):
            return batch
        assert time.monotonic() < deadline, f"no progress past {above}: {batch}"
        time.sleep(2)


def test_a_batch_survives_a_worker_restart_and_a_sigkill(worker: Stack) -> None:
    stack = worker
    client = stack.client()
    marker = f"mark{secrets.token_hex(8)}"
    started = time.monotonic()
    upload = client.files.create(file=("requests.jsonl", batch_lines(marker)), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    stack.batch_id = batch.id

    batch = wait_progress(client, batch.id, 0)
    log(f"first results after {time.monotonic() - started:.0f} s: {batch.request_counts}")
    assert batch.status == "in_progress", batch
    log(f"worker restarting at {batch.request_counts.completed} completed")
    # SIGTERM: the worker drains (up to 60 s for its shard in flight), then hands the rest
    # back; the new one takes it up.
    stack.compose("restart", "worker", timeout=300)
    batch = client.batches.retrieve(batch.id)
    at_restart = batch.request_counts.completed
    log(f"worker restarted at {at_restart} completed")
    assert batch.status == "in_progress", f"finished before the restart was done: {batch}"

    batch = wait_progress(client, batch.id, at_restart)  # the new worker's first results
    assert batch.status == "in_progress", f"finished before the kill: {batch}"
    stack.compose("kill", "-s", "SIGKILL", "worker")
    at_kill = batch.request_counts.completed
    log(f"worker SIGKILLed at {at_kill} completed")
    # A killed container stays down (Docker restarts it only when the daemon or the
    # machine does): the operator starts it again.
    time.sleep(3)
    assert stack.inspect("worker", "{{.State.Status}}") == "exited"
    stack.compose("start", "worker")

    deadline = time.monotonic() + 1200
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        assert time.monotonic() < deadline, batch
        time.sleep(3)
        batch = client.batches.retrieve(batch.id)
    stack.timings["first_batch"] = time.monotonic() - started
    log(f"batch {batch.status} in {stack.timings['first_batch']:.0f} s: {batch.request_counts}")
    assert batch.status == "completed", batch
    assert batch.request_counts.total == REQUESTS
    assert batch.request_counts.completed == REQUESTS and batch.request_counts.failed == 0

    stack.output = client.files.content(batch.output_file_id).content
    lines = [json.loads(line) for line in stack.output.splitlines()]
    ids = [line["custom_id"] for line in lines]
    assert len(ids) == len(set(ids)), f"{len(ids) - len(set(ids))} custom_ids doubled"
    assert set(ids) == {f"req-{i}" for i in range(REQUESTS)}, "custom_ids lost"
    assert all(line["response"]["status_code"] == 200 for line in lines)
    assert batch.error_file_id is None or not client.files.content(batch.error_file_id).content

    # The files are objects in the bucket, and no container keeps a copy on its disk.
    stored = stack.exec_python("web", f"""
import django, json; django.setup()
from django.core.files.storage import default_storage, storages
from jobs.models import Batch
batch = Batch.objects.get(pk={batch.id!r})
files = [batch.input_file, batch.output_file]
print(json.dumps({{"storage": type(storages["default"]).__name__,
                  "objects": [default_storage.size(f.storage_name) for f in files],
                  "bytes": [f.bytes for f in files]}}))""")
    assert stored["storage"] == "S3Storage"
    assert stored["objects"] == stored["bytes"] and all(stored["bytes"]), stored
    for service in ("web", "worker"):
        # Everywhere its user may write.
        found = stack.compose("exec", "-T", service, "sh", "-c",
                              f"grep -rl {marker} /tmp /var/tmp /var/lib/batchweb "
                              "/home/batchweb /dev/shm /app 2>/dev/null; true").stdout
        assert found.strip() == "", f"{service} keeps the batch on its disk: {found}"


def test_down_then_up_keeps_the_batches_and_files(worker: Stack) -> None:
    stack = worker
    assert stack.batch_id and stack.output
    stack.compose("down", "-t", "30")
    assert stack.compose("ps", "-aq").stdout.strip() == ""
    stack.timings["up_again"] = stack.up()
    log(f"compose down, then up to healthy: {stack.timings['up_again']:.0f} s")
    assert "No migrations to apply" in stack.compose("logs", "migrate").stdout
    client = stack.client()
    batch = client.batches.retrieve(stack.batch_id)
    assert batch.status == "completed"
    assert client.files.content(batch.output_file_id).content == stack.output


def test_containers_run_unprivileged_and_only_the_web_port_is_published(worker: Stack
                                                                        ) -> None:
    stack = worker
    for service in ("web", "worker"):
        uids = stack.compose("exec", "-T", service, "sh", "-c",
                             "cat /proc/[0-9]*/status | awk '/^Uid:/ {print $2}' | sort -u"
                             ).stdout.split()
        assert uids == ["10001"], f"{service}: processes run as {uids}"
        # As compose.yaml confines them: the image read-only, no capability, no privilege
        # to gain; the volumes where the processes write, and only those, writable.
        host = json.loads(stack.inspect(service, "{{json .HostConfig}}"))
        assert host["ReadonlyRootfs"] is True, service
        assert host["CapDrop"] == ["ALL"], service
        assert "no-new-privileges:true" in host["SecurityOpt"], service
        wrote = stack.compose(
            "exec", "-T", service, "sh", "-c",
            'for d in /var/lib/batchweb/tmp /tmp "$HOME"; do '
            'touch "$d/.probe" && rm "$d/.probe" || exit 1; done; '
            "touch /app/.probe 2>/dev/null && exit 2; exit 0", check=False)
        assert wrote.returncode == 0, (service, wrote.returncode, wrote.stderr)
    published = {}
    for line in run("docker", "ps", "--filter", f"label=com.docker.compose.project={PROJECT}",
                    "--format", "{{.Label \"com.docker.compose.service\"}} {{.Ports}}"
                    ).stdout.splitlines():
        service, _, ports = line.partition(" ")
        published[service] = [p.strip() for p in ports.split(",") if "->" in p]
    assert set(published) == {"postgres", "redis", "s3", "web", "worker"}, published
    assert published.pop("web") == [f"127.0.0.1:{stack.port}->8000/tcp"]
    assert not any(published.values()), published
