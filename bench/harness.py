"""What the benchmarks share: scratch deployments (free ports, a private Redis, the database
migrated with a user and an API key, Granian and `batchworker` processes), the figures
they measure (CPU seconds and peak RSS of a process, percentiles), the requests they send,
and the `--json PATH` report every script writes.

Each script runs from the repository root as `python -m bench.X` or as `python bench/X.py`
(see `run`), and imports this module as `bench.harness` or `harness` (bench/ itself is first
on the path then). The setup steps that must run inside a scratch deployment (its Django
settings, its database) run in a child process as `python -m bench.harness COMMAND` (see
`in_deployment`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable


def run(main: Callable[[], None]) -> None:
    """Run a script's `main`. Started as a file from the repository root (`python
    bench/X.py`), the script first starts again as the module (`python -m bench.X`): then
    the project it imports in this process (Django, the engine, the embedded Redis) is this
    checkout's, as it is in the processes it starts (manage.py, Granian, all run from the
    root), not whichever copy is installed."""
    spec = sys.modules["__main__"].__spec__
    if spec is None and Path.cwd().resolve() == ROOT:
        script = Path(sys.modules["__main__"].__file__ or "").stem
        os.execv(PY, [PY, "-m", f"bench.{script}", *sys.argv[1:]])
    main()


# --- scratch deployments ---


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_port(port: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"nothing listens on {port}")


def wait_http(url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            httpx.get(url, timeout=2)
            return
        except httpx.HTTPError:
            time.sleep(0.2)
    raise RuntimeError(f"{url} does not answer")


def remove(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def private_s3(stack: ExitStack, scratch: Path) -> dict[str, str]:
    """A local S3 server (stopped when `stack` closes) with a bucket for the scratch
    deployment: the variables that point batchweb's storage at it."""
    from jobs.storage.embedded import PrivateS3

    server = PrivateS3(scratch)
    stack.callback(server.stop)
    server.client().create_bucket(Bucket="batchweb-bench")
    return server.storage_env("batchweb-bench")


@contextmanager
def private_redis(scratch: Path, *, reuse: bool = False) -> Iterator[int | None]:
    """A private Redis (jobs.storage.embedded) for the scratch deployment, exported as
    REDIS_URL to this process and the children started meanwhile. Private by default, so
    that no other worker takes the benchmark's jobs; with `reuse`, a REDIS_URL already set
    is used instead.
    Yields the pid of the Redis it started (None when it reused one)."""
    from jobs.storage.embedded import ensure_redis

    if not reuse:
        os.environ.pop("REDIS_URL", None)
    server = ensure_redis(scratch / "redis")
    try:
        yield server.process.pid if server is not None and server.process else None
    finally:
        if server is not None:
            server.stop()
            os.environ.pop("REDIS_URL", None)


def pg_connect(url: str, **kwargs: Any) -> Any:
    import psycopg

    return psycopg.connect(url, autocommit=True, **kwargs)


def create_database(server: str, name: str) -> None:
    """A new, empty PostgreSQL database `name` on `server` (postgres://user@host:port),
    dropping one of that name first."""
    with pg_connect(f"{server}/postgres") as db:
        db.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        db.execute(f'CREATE DATABASE "{name}"')


def drop_database(server: str, name: str) -> None:
    with pg_connect(f"{server}/postgres") as db:
        db.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def manage(env: dict[str, str], *args: str) -> str:
    """Run `manage.py ARGS` in the deployment of `env`; its output."""
    return subprocess.run([PY, "manage.py", *args], cwd=ROOT, env=env, check=True,
                          capture_output=True, text=True).stdout


def in_deployment(env: dict[str, str], command: str, *args: str) -> Any:
    """Run one of this module's COMMANDS inside the deployment of `env`; what it printed
    last, as JSON."""
    done = subprocess.run([PY, "-m", "bench.harness", command, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    if done.returncode:  # its traceback, not only its exit status
        raise RuntimeError(f"bench.harness {command} exited {done.returncode}:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def prepare(env: dict[str, str]) -> str:
    """Migrate the database named by `env` (SQLite under its BATCHWEB_VAR_DIR unless
    DATABASE_URL is set), add one user and return an API key of it."""
    manage(env, "migrate", "-v0")
    in_deployment(env, "user", "b")
    return manage(env, "createapikey", "b").strip()


def gunicorn(port: int, env: dict[str, str], *options: str,
             app: str = "batchweb.wsgi:application", **popen: Any) -> subprocess.Popen:
    """The same application under gunicorn, with gunicorn `options` (workers, threads...):
    bench/dashboard_load.py --server gunicorn compares the two web servers."""
    return subprocess.Popen([PY, "-m", "gunicorn", app, "-b",
                             f"127.0.0.1:{port}", *options], cwd=ROOT, env=env, **popen)


def granian(port: int, env: dict[str, str], *options: str,
            app: str = "batchweb.wsgi:application", **popen: Any) -> subprocess.Popen:
    """The web server on 127.0.0.1:`port`: Granian serving the WSGI application, as
    `manage.py runservice` does, with Granian `options` (--workers, --blocking-threads...);
    `app` bench.timed_wsgi:application adds what each request cost (see there)."""
    return subprocess.Popen([PY, "-m", "granian", "--interface", "wsgi", "--host", "127.0.0.1",
                             "--port", str(port), *options, app], cwd=ROOT, env=env, **popen)


def batchworker(model: str, env: dict[str, str], out: Any, *options: str,
                prefix: Sequence[str] = (), **popen: Any) -> subprocess.Popen:
    """`manage.py batchworker --model MODEL OPTIONS`, its output (and errors) to `out`: a
    path (the worker's own log) or an open file."""
    return manage_process(["batchworker", "--model", model, *options], env, out,
                          prefix=prefix, **popen)


def controlworker(env: dict[str, str], out: Any, *options: str) -> subprocess.Popen:
    """`manage.py controlworker OPTIONS` (no engine), its output to `out` as above."""
    return manage_process(["controlworker", *options], env, out)


def manage_process(args: Sequence[str], env: dict[str, str], out: Any, *,
                   prefix: Sequence[str] = (), **popen: Any) -> subprocess.Popen:
    """`manage.py ARGS` started (after `prefix`, e.g. taskset), its output to `out`."""
    command = [*prefix, PY, "manage.py", *args]
    if isinstance(out, Path):
        with open(out, "wb") as log:
            return subprocess.Popen(command, cwd=ROOT, env=env, stdout=log,
                                    stderr=subprocess.STDOUT, **popen)
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                            **popen)


def stop(proc: subprocess.Popen, timeout: float = 120) -> None:
    """SIGTERM, then SIGKILL if it has not exited within `timeout` seconds."""
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def models_file(env: dict[str, str], model: str, options: dict, path: Path) -> None:
    """Point env at a models file: the deployment's models (as its settings list them), with
    `options` added to `model`'s."""
    models = in_deployment(env, "models")
    entry = next(m for m in models if m["name"] == model)
    entry["options"] = {**entry.get("options", {}), **options}
    path.write_text(json.dumps(models))
    env.update(BATCHWEB_MODELS_FILE=str(path), BATCHWEB_ECHO_MODEL="0")


# --- what is measured ---


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


# How vLLM's engine processes name themselves (setproctitle, vllm.utils.system_utils):
# "VLLM::EngineCore" (or "VLLM::EngineCore_DP0"), and with tensor parallelism its
# workers "VLLM::Worker_TP0"...; the prefix is VLLM_PROCESS_NAME_PREFIX's default.
ENGINE_TITLE = "VLLM::"


def is_engine_process(proc: Any) -> bool:
    """Whether a psutil Process is one of vLLM's engine processes: its title (the cmdline
    setproctitle writes, and the name, which it sets too) begins with "VLLM::"."""
    import psutil

    try:
        cmdline = proc.cmdline()
        return (proc.name().startswith(ENGINE_TITLE)
                or bool(cmdline) and cmdline[0].startswith(ENGINE_TITLE))
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def process_tree(*pids: int | None) -> list[tuple[Any, bool]]:
    """The processes of the trees rooted at PIDS (psutil Processes), each with whether it is
    one of vLLM's engine processes or below one (`is_engine_process`)."""
    import psutil

    out: list[tuple[Any, bool]] = []
    stack: list[tuple[Any, bool]] = []
    for pid in pids:
        if pid is not None:
            with contextlib.suppress(psutil.NoSuchProcess):
                stack.append((psutil.Process(pid), False))
    while stack:
        proc, engine = stack.pop()
        engine = engine or is_engine_process(proc)
        try:
            children = proc.children()
        except psutil.NoSuchProcess:
            continue
        out.append((proc, engine))
        stack.extend((child, engine) for child in children)
    return out


def tree_cpu(tree: list[tuple[Any, bool]]) -> dict[str, float]:
    """CPU seconds (user + system) so far of a `process_tree`, split in two: "engine",
    vLLM's engine processes (the engine core a front end spawns, and everything below it),
    and "front", every other process (the front end that tokenizes, detokenizes and writes
    the results; the web server; Redis). A process that exited counts nothing: measure
    while the trees run."""
    import psutil

    out = {"front": 0.0, "engine": 0.0}
    for proc, engine in tree:
        try:
            times = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        out["engine" if engine else "front"] += times.user + times.system
    return out


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) so far of each thread of a process, by its native id
    (what py-spy names a thread by); {} once it has exited."""
    import psutil

    try:
        return {t.id: t.user_time + t.system_time for t in psutil.Process(pid).threads()}
    except psutil.NoSuchProcess:
        return {}


def cpu_split(*pids: int | None) -> dict[str, float]:
    """`tree_cpu` of the process trees rooted at PIDS as they are now."""
    return tree_cpu(process_tree(*pids))


def cpu_model() -> str:
    """The CPU's model name (lscpu's), for a benchmark's report; "" where lscpu has none."""
    for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return ""


def peak_rss_mb(pid: int) -> float:
    """The process's peak resident memory so far (VmHWM), in MB; 0 once it has exited."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except FileNotFoundError:
        pass
    return 0.0


def web_worker_pid(server: subprocess.Popen) -> int:
    """The pid of the web server's (first) worker process: the one that serves requests."""
    out = subprocess.run(["pgrep", "-P", str(server.pid)], capture_output=True,
                         text=True).stdout
    return int(out.split()[0])


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def add_json_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", type=Path, help="also write the measured figures here")


def write_json(path: Path | None, figures: dict[str, Any]) -> None:
    if path:
        path.write_text(json.dumps(figures, indent=2))


# --- the requests sent ---


def chat_request(custom_id: str, text: str, *, model: str = "echo-test", max_tokens: int,
                 **body: Any) -> dict[str, Any]:
    """One line of a chat batch input file."""
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "max_tokens": max_tokens, **body,
                     "messages": [{"role": "user", "content": text}]}}


def write_labelling_file(path: Path, count: int, system: Callable[[int], str],
                         user: Callable[[int], str]) -> int:
    """COUNT echo-model chat lines of a system prompt and a user message each (request i
    gets `system(i)` and `user(i)`), streamed to PATH for files of a million lines; its
    size in bytes."""
    with open(path, "w") as out:
        for i in range(count):
            out.write(json.dumps({
                "custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
                "body": {"model": "echo-test", "max_tokens": 16, "messages": [
                    {"role": "system", "content": system(i)},
                    {"role": "user", "content": user(i)}]},
            }) + "\n")
    return path.stat().st_size


def jsonl(lines: Sequence[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


MODEL = "SmolLM2-135M-Instruct"
TOPICS = ["the history of Rome", "how vaccines work", "the water cycle", "sorting algorithms",
          "the French revolution", "photosynthesis", "black holes", "the stock market",
          "machine learning", "the Great Wall of China", "volcanoes", "jazz music"]


def make_requests(count: int, min_tokens: int, max_tokens: int, model: str = MODEL
                  ) -> list[dict]:
    """`count` distinct chat requests (so that dedup cannot help), prompts of one line to a
    few paragraphs, max_tokens spread over min..max, temperature 0; the same for a seed."""
    rng = random.Random(42)
    requests = []
    for i in range(count):
        topic = rng.choice(TOPICS)
        # Prompt lengths from one line to a few paragraphs.
        context = " ".join(f"Note {k}: {rng.choice(TOPICS)} matters." for k in
                           range(rng.choice([0, 2, 8, 30])))
        requests.append({
            "custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "temperature": 0,
                     "max_tokens": rng.randint(min_tokens, max_tokens),
                     "messages": [{"role": "user",
                                   "content": f"{context}\nRequest {i}: explain {topic} "
                                              "briefly."}]}})
    return requests


# --- COMMANDS: run inside a scratch deployment (`in_deployment`) ---


def _user(name: str) -> dict[str, Any]:
    from django.contrib.auth.models import User

    User.objects.create(username=name)
    return {}


def _keys(users: str) -> list[str]:
    """One API key for each of USERS users load-0, load-1..."""
    from django.contrib.auth import get_user_model

    from jobs.services.keys import create_api_key

    keys = []
    for i in range(int(users)):
        user, _ = get_user_model().objects.get_or_create(username=f"load-{i}")
        keys.append(create_api_key(owner=user, name="load")[1])
    return keys


def _more_keys(username: str, count: str) -> list[str]:
    """COUNT more API keys of user USERNAME (clients of one user, each with its own key)."""
    from django.contrib.auth import get_user_model

    from jobs.services.keys import create_api_key

    user = get_user_model().objects.get(username=username)
    return [create_api_key(owner=user, name=f"client {i}")[1] for i in range(int(count))]


def _models() -> list[dict[str, Any]]:
    from django.conf import settings

    return settings.BATCHWEB_MODELS


def _history(count: str, per_batch: str, password: str) -> dict[str, str]:
    """User `dash` (with PASSWORD), an API key of it, and COUNT ended batches of PER_BATCH
    requests each, the requests whose custom_id ends in -3 failed. Made by the calls a
    worker makes (claim each shard, write its parts, finish it, finalize), then Redis
    emptied of the jobs those calls queued (they would be no-ops anyway)."""
    from django.contrib.auth import get_user_model
    from django.core.files.base import ContentFile
    from django.core.files.storage import default_storage

    from jobs.formats.checkpoint_record import Progress
    from jobs.formats.wire import response_line
    from jobs.lib import queues
    from jobs.models import Shard
    from jobs.services.batches import create_batch
    from jobs.services.files import create_input_file
    from jobs.services.finalize import finalize_batch
    from jobs.services.keys import create_api_key
    from jobs.services.shard_input import shard_custom_ids
    from jobs.services.shards import claim_shard, finish_shard
    from jobs.services.validation import run_validation
    from jobs.storage.objects import new_storage_name

    user = get_user_model().objects.create_user("dash", password=password)
    key = create_api_key(owner=user, name="bench")[1]
    tmp = Path(tempfile.mkdtemp())

    def part(batch_id: str, lines: list[bytes]) -> str:
        return (default_storage.save(new_storage_name(f"parts/{batch_id}"),
                                     ContentFile(b"".join(lines))) if lines else "")

    for i in range(int(count)):
        path = tmp / f"history-{i}.jsonl"
        path.write_bytes(jsonl([chat_request(f"h{i}-{j}", f"earlier question {i} {j}",
                                             max_tokens=16) for j in range(int(per_batch))]))
        file = create_input_file(owner=user, path=path, filename="in.jsonl", purpose="batch")
        batch = create_batch(owner=user, input_file_id=file.pk,
                             endpoint="/v1/chat/completions", completion_window="24h")
        run_validation(batch_id=batch.pk)
        for shard_id in Shard.objects.filter(batch=batch).order_by("index").values_list(
                "pk", flat=True):
            shard = claim_shard(shard_id=shard_id, worker="bench")
            assert shard is not None
            ok, failed = [], []
            for custom_id in shard_custom_ids(shard):
                if custom_id.endswith("-3"):
                    failed.append(response_line(custom_id, 400, {"error": {
                        "message": "This model's maximum context length is 2048 tokens.",
                        "type": "BadRequestError", "param": None, "code": 400}}))
                else:
                    ok.append(response_line(custom_id, 200, {
                        "id": f"chatcmpl-{custom_id[:20]}", "object": "chat.completion",
                        "model": "echo-test", "choices": [{
                            "index": 0, "finish_reason": "stop",
                            "message": {"role": "assistant", "content": f"echo: {custom_id}"}}],
                        "usage": {"prompt_tokens": 5, "completion_tokens": 3,
                                  "total_tokens": 8}}))
            finish_shard(shard_id=shard_id, attempt=shard.attempt,
                         output_part=part(batch.pk, ok), error_part=part(batch.pk, failed),
                         progress=Progress(completed=len(ok), failed=len(failed),
                                           input_tokens=5 * len(ok),
                                           output_tokens=3 * len(ok)))
        finalize_batch(batch_id=batch.pk)
    queues.connection().flushdb()
    return {"key": key}


def _plan(batch_id: str) -> dict[str, Any]:
    """How validation planned BATCH_ID's shards (Batch.plan: grouped by prefix or not)."""
    from jobs.models import Batch

    return Batch.objects.get(pk=batch_id).plan


def _completed_at(batch_id: str) -> float:
    """When BATCH_ID completed (its row's completed_at, as a Unix time)."""
    from jobs.models import Batch

    ended = Batch.objects.get(pk=batch_id).completed_at
    assert ended is not None, f"{batch_id} has not completed"
    return ended.timestamp()


COMMANDS = {"user": _user, "keys": _keys, "more_keys": _more_keys, "models": _models,
            "history": _history, "plan": _plan, "completed_at": _completed_at}


def main() -> None:
    """`python -m bench.harness COMMAND ARGS...` with the deployment's environment."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "batchweb.settings")
    import django

    django.setup()
    print(json.dumps(COMMANDS[sys.argv[1]](*sys.argv[2:])))


if __name__ == "__main__":
    main()
