"""`manage.py gpuworkers`: the GPU list, the groups, each worker's environment and name, and
the supervision (signals forwarded, restarts, crash loops), with the GPU listing faked and
trivial child processes; then the real command with real `batchworker`s (echo engine) on
two fake GPUs running a batch."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from engine.base import ModelSpec
from jobs.management.commands import batchworker, gpuworkers
from jobs.management.commands.gpuworkers import (
    Devices,
    Supervisor,
    WorkerPlan,
    gpu_groups,
    gpus_per_engine,
    parse_nvidia_smi,
    plan_workers,
    visible_devices,
)
from jobs.worker.presence import free_name, registered
from tests.factories import ROOT, chat_line, database_url, wait_for

NVIDIA_SMI = """\
GPU 0: NVIDIA A100-SXM4-80GB (UUID: GPU-1b4c0c6e-0000-0000-0000-000000000000)
GPU 1: NVIDIA A100-SXM4-80GB (UUID: GPU-2b4c0c6e-0000-0000-0000-000000000000)
  MIG 3g.40gb     Device  0: (UUID: MIG-3b4c0c6e-0000-0000-0000-000000000000)
GPU 2: NVIDIA A100-SXM4-80GB (UUID: GPU-4b4c0c6e-0000-0000-0000-000000000000)
GPU 3: NVIDIA A100-SXM4-80GB (UUID: GPU-5b4c0c6e-0000-0000-0000-000000000000)
"""


def spec(**options: Any) -> ModelSpec:
    return ModelSpec(name="llama", backend="vllm", path="/models/llama",
                     endpoints=("/v1/chat/completions",), options=options, source="")


def no_listing() -> str:
    raise AssertionError("nvidia-smi must not be asked when the GPUs are given")


# --- finding and grouping the GPUs ---

def test_nvidia_smi_listing_gives_the_gpu_indices_not_mig_devices() -> None:
    assert parse_nvidia_smi(NVIDIA_SMI) == ("0", "1", "2", "3")
    assert parse_nvidia_smi("No devices were found\n") == ()


def test_gpus_come_from_the_option_then_cuda_visible_devices_then_nvidia_smi() -> None:
    env = {"CUDA_VISIBLE_DEVICES": "2,3"}
    assert visible_devices(explicit="5, 6", environ=env, listing=no_listing) == Devices(
        ("5", "6"), "--gpus", pci_order=True)
    assert visible_devices(explicit="", environ=env, listing=no_listing) == Devices(
        ("2", "3"), "CUDA_VISIBLE_DEVICES", pci_order=False)
    assert visible_devices(explicit="", environ={}, listing=lambda: NVIDIA_SMI) == Devices(
        ("0", "1", "2", "3"), "nvidia-smi -L", pci_order=True)
    uuids = "GPU-1b4c0c6e-0000-0000-0000-000000000000,GPU-2b4c0c6e-0000-0000-0000-000000000000"
    assert visible_devices(explicit="", environ={"CUDA_VISIBLE_DEVICES": uuids},
                           listing=no_listing).ids == tuple(uuids.split(","))


@pytest.mark.parametrize(("explicit", "environ", "listing", "message"), [
    ("", {"CUDA_VISIBLE_DEVICES": ""}, no_listing, "CUDA_VISIBLE_DEVICES lists none"),
    ("", {}, lambda: "No devices were found\n", "nvidia-smi -L lists none"),
    ("0,1,0", {}, no_listing, "lists a GPU twice"),
])
def test_no_gpu_or_a_gpu_twice_is_refused(explicit: str, environ: dict[str, str],
                                          listing: Callable[[], str], message: str) -> None:
    with pytest.raises(CommandError, match=message):
        visible_devices(explicit=explicit, environ=environ, listing=listing)


@pytest.mark.processes
def test_without_nvidia_smi_the_operator_is_told_what_to_set(monkeypatch: Any) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(CommandError, match="nvidia-smi is not installed.*CUDA_VISIBLE_DEVICES"):
        visible_devices(explicit="", environ={})


def test_gpus_per_engine_is_vllms_world_size() -> None:
    assert gpus_per_engine(spec()) == 1
    assert gpus_per_engine(spec(tensor_parallel_size=2)) == 2
    assert gpus_per_engine(spec(tensor_parallel_size=2, pipeline_parallel_size=2)) == 4


def test_gpus_are_cut_into_consecutive_groups_and_the_rest_left_idle() -> None:
    assert gpu_groups(["0", "1", "2", "3"], 1) == ([("0",), ("1",), ("2",), ("3",)], ())
    assert gpu_groups(["0", "1", "2", "3"], 2) == ([("0", "1"), ("2", "3")], ())
    assert gpu_groups(["0", "1", "2"], 2) == ([("0", "1")], ("2",))
    with pytest.raises(CommandError, match="needs 4 GPUs; only 2 visible"):
        gpu_groups(["0", "1"], 4)


# --- what each worker is started with ---

def test_one_worker_per_gpu_sees_only_its_gpu_and_is_named_by_host_and_gpu() -> None:
    devices = Devices(("0", "1"), "nvidia-smi -L", pci_order=True)
    plans, idle = plan_workers(spec=spec(), devices=devices, per_worker=1, host="node7",
                               environ={"DATABASE_URL": "postgres://db/x"},
                               worker_args=["--drain-seconds", "60.0"])
    assert idle == ()
    assert [p.name for p in plans] == ["node7.gpu0.llama", "node7.gpu1.llama"]
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in plans] == ["0", "1"]
    # nvidia-smi numbers GPUs in PCI bus order; CUDA agrees only when told so.
    assert all(p.env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID" for p in plans)
    assert all(p.env["DATABASE_URL"] == "postgres://db/x" for p in plans)
    command = plans[1].command("node7.gpu1.llama")
    assert command[:3] == [sys.executable, str(ROOT / "manage.py"), "batchworker"]
    # The arguments are batchworker's own.
    parsed = batchworker.Command().create_parser("manage.py", "batchworker").parse_args(
        command[3:])
    # One model (batchworker's --model may be given several times).
    assert (parsed.model, parsed.name, parsed.drain_seconds) == (
        ["llama"], "node7.gpu1.llama", 60.0)
    # The host each worker reports to queue health: the machine's, not a container's.
    assert parsed.host == "node7"


def test_a_tensor_parallel_model_gets_a_group_per_worker() -> None:
    devices = Devices(("0", "1", "2", "3"), "nvidia-smi -L", pci_order=True)
    plans, _ = plan_workers(spec=spec(tensor_parallel_size=2), devices=devices, per_worker=2,
                            host="node7", environ={})
    assert [(p.name, p.env["CUDA_VISIBLE_DEVICES"]) for p in plans] == [
        ("node7.gpu0,1.llama", "0,1"), ("node7.gpu2,3.llama", "2,3")]


def test_gpus_inherited_from_cuda_visible_devices_keep_the_parents_order() -> None:
    devices = Devices(("2", "3"), "CUDA_VISIBLE_DEVICES", pci_order=False)
    plans, _ = plan_workers(spec=spec(), devices=devices, per_worker=1, host="h",
                            environ={"CUDA_VISIBLE_DEVICES": "2,3"})
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in plans] == ["2", "3"]
    assert all("CUDA_DEVICE_ORDER" not in p.env for p in plans)


def test_a_name_rq_still_holds_is_not_reused() -> None:
    held = {"h.gpu0.m", "h.gpu0.m.r2"}
    assert free_name("h.gpu0.m", held.__contains__) == "h.gpu0.m.r3"
    assert free_name("h.gpu1.m", held.__contains__) == "h.gpu1.m"


@pytest.mark.redis
def test_registered_reads_rqs_worker_registration() -> None:
    from jobs.lib import queues

    conn = queues.connection()
    assert not registered("h.gpu0.m")
    conn.hset("rq:worker:h.gpu0.m", mapping={"birth": "x"})  # what a SIGKILLed worker leaves
    assert registered("h.gpu0.m")
    conn.hset("rq:worker:h.gpu0.m", "death", "y")  # what a worker that stopped leaves
    assert not registered("h.gpu0.m")


@pytest.mark.django_db
def test_the_command_refuses_gpus_per_worker_that_the_model_does_not_use() -> None:
    with pytest.raises(CommandError, match="--gpus-per-worker 2, but echo-test's options "
                                           "make one engine use 1 GPU"):
        call_command("gpuworkers", "--model", "echo-test", "--gpus-per-worker", "2",
                     "--gpus", "0,1")
    with pytest.raises(CommandError, match="Unknown model 'nope'"):
        call_command("gpuworkers", "--model", "nope", "--gpus", "0")


def test_batchworkers_own_options_are_passed_on_to_every_worker() -> None:
    command = gpuworkers.Command()
    parser = command.create_parser("manage.py", "gpuworkers")
    options = vars(parser.parse_args(["--model", "llama", "--no-control",
                                      "--drain-seconds", "120", "--host", "node7"]))
    assert command.worker_options.passed_on(options) == ["--no-control",
                                                         "--drain-seconds", "120.0"]
    options = vars(parser.parse_args(["--model", "llama"]))
    assert command.worker_options.passed_on(options) == ["--drain-seconds", "60.0"]


@pytest.mark.django_db
def test_the_command_names_the_workers_itself() -> None:
    with pytest.raises(CommandError, match="--name: gpuworkers names each worker"):
        call_command("gpuworkers", "--model", "echo-test", "--name", "w", "--gpus", "0")


# --- supervision, with trivial children ---

# A stand-in worker: records its name, GPUs and every SIGTERM it gets in a file, stops after
# its second SIGTERM or a second after its first (as a draining batchworker would).
CHILD = """
import os, signal, sys, time
path, name, mode = sys.argv[1], sys.argv[2], sys.argv[3]
def log(text):
    with open(path, "a") as f:
        f.write(text + "\\n")
log(f"start {name} {os.environ['CUDA_VISIBLE_DEVICES']} {os.getpid()}")
if mode == "crash":
    time.sleep(0.3)  # slower than a healthy sibling's start, so it is up when told to stop
    sys.exit(3)
terms = []
def on_term(signum, frame):
    terms.append(time.monotonic())
    log(f"term {name}")
if mode != "stubborn":
    signal.signal(signal.SIGTERM, on_term)
else:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
while not (len(terms) >= 2 or (terms and time.monotonic() - terms[0] > 1.0)):
    time.sleep(0.02)
log(f"exit {name}")
"""


@dataclass(frozen=True)
class FakePlan(WorkerPlan):
    log: Path = Path()
    mode: str = "serve"

    def command(self, name: str) -> list[str]:
        return [sys.executable, "-c", CHILD, str(self.log), name, self.mode]


@pytest.fixture
def restore_signals() -> Iterator[None]:
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)


def fake_plans(log: Path, count: int, mode: str = "serve") -> list[WorkerPlan]:
    return [FakePlan(devices=(str(i),), name=f"h.gpu{i}.m", args=(), log=log, mode=mode,
                     env={**os.environ, "CUDA_VISIBLE_DEVICES": str(i)}) for i in range(count)]


def events(log: Path) -> list[list[str]]:
    return [line.split() for line in log.read_text().splitlines()] if log.exists() else []


def signal_later(supervisor: Supervisor, log: Path, *, started: int, times: int = 1) -> None:
    """Like a SIGTERM to the supervisor once `started` children have started."""
    def go() -> None:
        wait_for(lambda: sum(e[0] == "start" for e in events(log)) >= started, timeout=30)
        time.sleep(0.3)  # the children's handlers are in place
        for n in range(1, times + 1):
            supervisor.on_signal(signal.SIGTERM, None)
            # Two signals that reach a process before its handler ran are one (Unix does
            # not queue them): the next waits until every child has seen this one.
            if n < times:
                wait_for(lambda n=n: sum(e[0] == "term" for e in events(log)) >= n * started,
                         timeout=30)
    threading.Thread(target=go, daemon=True).start()


@pytest.mark.processes
@pytest.mark.usefixtures("restore_signals")
def test_each_child_gets_its_gpu_and_one_sigterm_drains_it(tmp_path: Path) -> None:
    log = tmp_path / "events"
    supervisor = Supervisor(fake_plans(log, 2), stop_after=20, write=lambda _: None,
                            taken=lambda _: False)
    signal_later(supervisor, log, started=2)
    assert supervisor.run(poll_seconds=0.05) == ""
    seen = events(log)
    assert sorted(e[1:3] for e in seen if e[0] == "start") == [["h.gpu0.m", "0"],
                                                               ["h.gpu1.m", "1"]]
    assert sorted(e[1] for e in seen if e[0] == "term") == ["h.gpu0.m", "h.gpu1.m"]
    assert sorted(e[1] for e in seen if e[0] == "exit") == ["h.gpu0.m", "h.gpu1.m"]
    assert all(p.poll() is not None for p in supervisor.procs.values())


@pytest.mark.processes
@pytest.mark.usefixtures("restore_signals")
def test_a_second_signal_is_forwarded_too(tmp_path: Path) -> None:
    log = tmp_path / "events"
    supervisor = Supervisor(fake_plans(log, 2), stop_after=20, write=lambda _: None,
                            taken=lambda _: False)
    signal_later(supervisor, log, started=2, times=2)
    assert supervisor.run(poll_seconds=0.05) == ""
    terms = [e[1] for e in events(log) if e[0] == "term"]
    assert sorted(terms) == ["h.gpu0.m", "h.gpu0.m", "h.gpu1.m", "h.gpu1.m"]


@pytest.mark.processes
@pytest.mark.usefixtures("restore_signals")
def test_a_dead_child_is_restarted_under_a_name_rq_does_not_hold(tmp_path: Path) -> None:
    log = tmp_path / "events"
    crash_once = tmp_path / "crashed"
    # The child crashes the first time only; its registration stays behind, as a SIGKILLed
    # worker's does, so the restarted one must take another name.
    holder = {"used": set()}

    def taken(name: str) -> bool:
        return name in holder["used"]

    class CrashOnce(FakePlan):
        def command(self, name: str) -> list[str]:
            holder["used"].add(name)
            mode = "serve" if crash_once.exists() else "crash"
            crash_once.touch()
            return [sys.executable, "-c", CHILD, str(self.log), name, mode]

    plan = CrashOnce(devices=("0",), name="h.gpu0.m", args=(), log=log,
                     env={**os.environ, "CUDA_VISIBLE_DEVICES": "0"})
    messages: list[str] = []
    supervisor = Supervisor([plan], stop_after=20, write=messages.append, taken=taken)
    signal_later(supervisor, log, started=2)
    assert supervisor.run(poll_seconds=0.05) == ""
    assert [e[1] for e in events(log) if e[0] == "start"] == ["h.gpu0.m", "h.gpu0.m.r2"]
    assert any("h.gpu0.m exited with 3; restarting" in m for m in messages)


@pytest.mark.processes
@pytest.mark.usefixtures("restore_signals")
def test_a_child_that_keeps_dying_stops_everything(tmp_path: Path) -> None:
    log = tmp_path / "events"
    healthy, crashing = fake_plans(log, 1)[0], fake_plans(log, 2, mode="crash")[1]
    supervisor = Supervisor([healthy, crashing], stop_after=20, write=lambda _: None,
                            taken=lambda _: False)
    failure = supervisor.run(poll_seconds=0.05)
    assert failure.startswith(f"h.gpu1.m exited {gpuworkers.MAX_RESTARTS} times within")
    assert "last code 3" in failure
    # The healthy one was told to drain and did.
    assert ["term", "h.gpu0.m"] in events(log) and ["exit", "h.gpu0.m"] in events(log)


@pytest.mark.processes
@pytest.mark.usefixtures("restore_signals")
def test_a_child_that_ignores_sigterm_is_killed_after_the_drain(tmp_path: Path) -> None:
    log = tmp_path / "events"
    messages: list[str] = []
    supervisor = Supervisor(fake_plans(log, 1, mode="stubborn"), stop_after=1.0,
                            write=messages.append, taken=lambda _: False)
    signal_later(supervisor, log, started=1)
    started = time.monotonic()
    assert supervisor.run(poll_seconds=0.05) == ""
    assert time.monotonic() - started < 15
    assert supervisor.procs[0].returncode == -signal.SIGKILL
    assert "gpuworkers: h.gpu0.m did not stop; killing it" in messages


# --- the real command: real batchworkers on two fake GPUs ---

class GpuWorkers:
    """`manage.py gpuworkers --model echo-test` with a fake nvidia-smi listing two GPUs."""

    def __init__(self, tmp_path: Path) -> None:
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir()
        smi = bin_dir / "nvidia-smi"
        smi.write_text("#!/bin/sh\nprintf '%s' '" + "".join(NVIDIA_SMI.splitlines(True)[:2])
                       + "'\n")
        smi.chmod(0o755)
        self.log_path = tmp_path / "gpuworkers.log"
        env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
        env.update(DATABASE_URL=database_url(), PATH=f"{bin_dir}:{env['PATH']}")
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, str(ROOT / "manage.py"), "gpuworkers", "--model", "echo-test",
                 "--host", "testhost", "--drain-seconds", "20"],
                env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)

    def workers(self) -> set[str]:
        """Its live workers' names (RQ retitles the processes, and with them what /proc
        shows of their command line and environment, so they are found by the pid
        gpuworkers printed; their environment is checked with trivial children above)."""
        found = set()
        for name, pid in re.findall(r"gpuworkers: (\S+) on \S+ \(pid (\d+)\)", self.log()):
            try:
                if psutil.Process(int(pid)).ppid() == self.proc.pid:
                    found.add(name)
            except psutil.Error:
                continue
        return found

    def pid(self, name: str) -> int:
        return int(re.findall(rf"gpuworkers: {re.escape(name)} on \S+ \(pid (\d+)\)",
                              self.log())[-1])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def rq_workers() -> set[str]:
    from rq import Worker

    from jobs.lib import queues

    return {w.name for w in Worker.all(connection=queues.connection())}


@pytest.fixture
def gpu_host(transactional_db: Any, tmp_path: Path) -> Iterator[GpuWorkers]:
    host = GpuWorkers(tmp_path)
    try:
        yield host
    finally:
        host.stop()
        print("--- gpuworkers log ---\n" + host.log()[-6000:])


NAMES = {"testhost.gpu0.echo-test", "testhost.gpu1.echo-test"}


@pytest.mark.timeout(240)
def test_gpuworkers_runs_a_batch_on_one_worker_per_gpu_and_drains_on_sigterm(
        gpu_host: GpuWorkers, openai_client: Any) -> None:
    import io

    from jobs.models import Shard
    from tests.factories import jsonl

    wait_for(lambda: rq_workers() >= NAMES, timeout=90, message="both workers registered")
    assert gpu_host.workers() == NAMES
    assert "testhost.gpu1.echo-test on CUDA_VISIBLE_DEVICES=1 " in gpu_host.log()

    # A worker SIGKILLed (the OOM killer) leaves its RQ registration behind: its
    # replacement takes another name instead of being refused by RQ.
    os.kill(gpu_host.pid("testhost.gpu0.echo-test"), signal.SIGKILL)
    replacement = "testhost.gpu0.echo-test.r2"
    wait_for(lambda: replacement in rq_workers(), timeout=90, message="the replacement")
    assert gpu_host.workers() == {replacement, "testhost.gpu1.echo-test"}
    assert f"{replacement} on CUDA_VISIBLE_DEVICES=0 " in gpu_host.log()

    file_id = openai_client.files.create(
        file=("in.jsonl", io.BytesIO(jsonl([chat_line(f"r{i}", f"hi {i}") for i in range(30)]))),
        purpose="batch").id
    batch = openai_client.batches.create(input_file_id=file_id, completion_window="24h",
                                         endpoint="/v1/chat/completions")
    done = wait_for(lambda: (b := openai_client.batches.retrieve(batch.id)).status
                    == "completed" and b, timeout=90, message="the batch")
    assert done.request_counts.completed == 30
    ran_on = set(Shard.objects.filter(batch_id=batch.id).values_list("worker", flat=True))
    assert ran_on <= {"testhost.gpu1.echo-test", replacement, ""}

    gpu_host.proc.send_signal(signal.SIGTERM)
    assert gpu_host.proc.wait(timeout=60) == 0
    assert not gpu_host.workers()
    assert not ({"testhost.gpu1.echo-test", replacement} & rq_workers())
    assert "gpuworkers: stopped" in gpu_host.log()


@pytest.mark.timeout(180)
def test_workers_drain_when_gpuworkers_is_sigkilled(gpu_host: GpuWorkers) -> None:
    wait_for(lambda: rq_workers() >= NAMES, timeout=90, message="both workers registered")
    children = [psutil.Process(gpu_host.pid(name)) for name in sorted(NAMES)]
    gpu_host.proc.kill()
    gpu_host.proc.wait()
    # The kernel's parent-death signal is a SIGTERM: each worker stops as on a drain and
    # unregisters, rather than holding its GPU unsupervised.
    _, alive = psutil.wait_procs(children, timeout=60)
    assert not alive
    wait_for(lambda: not (NAMES & rq_workers()), timeout=10, message="unregistered")
