"""`manage.py gpuworkers --model NAME`: one `batchworker` per GPU (or per GPU group) on a host.

A GPU machine serves a model with one engine per GPU, or per group of GPUs when the model
is split over several (`tensor_parallel_size`, times `pipeline_parallel_size` and
`data_parallel_size` where set: vLLM's world size). This command finds the GPUs it may use
(`--gpus`, else `CUDA_VISIBLE_DEVICES`, else `nvidia-smi -L`), cuts them into groups of that
size and starts one worker per group with `CUDA_VISIBLE_DEVICES` set to the group, named
`<host>.gpu<ids>.<model>` so the admin's queue health and each shard's `worker` say which
machine and which GPUs ran it.

It supervises them as `runservice` does its processes: a worker that dies is started again
(under a fresh name if its old RQ registration is still in Redis, as a SIGKILLed worker's
is until it expires: RQ refuses a second live worker of one name), and one that keeps dying
stops everything. SIGTERM (or Ctrl-C) is forwarded once to every worker, which drains; a
second one is forwarded too, which makes them hand everything back at once. The workers
get SIGTERM as well if this process dies without forwarding it (SIGKILL).
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from engine.base import ModelSpec
from jobs.lib.model_registry import model_spec
from jobs.management.commands.batchworker import Command as BatchWorker
from jobs.management.commands.runservice import MAX_RESTARTS, RESTART_WINDOW_SECONDS, Restarts
from jobs.worker.presence import free_name, registered

# The vLLM options whose product is the number of GPUs one engine uses.
PARALLEL_OPTIONS = ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size")
# After the first SIGTERM, how much longer than the drain a worker may take to hand back
# its shards and close its engine before it is killed (its engine core is then killed by
# engine/reaper.py, and its shards retried elsewhere after the heartbeat timeout).
STOP_MARGIN_SECONDS = 30.0
_NVIDIA_SMI_GPU = re.compile(r"^GPU (\d+):", re.MULTILINE)
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class Devices:
    """The GPUs this host's workers may use, and where that list came from."""

    ids: tuple[str, ...]
    source: str
    # True when the ids are nvidia-smi's numbering (PCI bus order), which CUDA follows
    # only with CUDA_DEVICE_ORDER=PCI_BUS_ID; ids inherited from CUDA_VISIBLE_DEVICES keep
    # whatever order the parent meant.
    pci_order: bool


@dataclass(frozen=True)
class WorkerPlan:
    """One worker to run: its GPUs, its base name, and how to start it."""

    devices: tuple[str, ...]
    name: str
    env: dict[str, str]
    args: tuple[str, ...]  # batchworker's arguments besides --name

    def command(self, name: str) -> list[str]:
        return [sys.executable, str(settings.BASE_DIR / "manage.py"), "batchworker",
                *self.args, "--name", name]


def gpus_per_engine(spec: ModelSpec) -> int:
    """How many GPUs one engine of this model uses, from its vLLM options."""
    count = 1
    for option in PARALLEL_OPTIONS:
        count *= int(spec.options.get(option) or 1)
    return count


def parse_nvidia_smi(listing: str) -> tuple[str, ...]:
    """The GPU indices in `nvidia-smi -L` output ("GPU 0: NVIDIA A100 (UUID: GPU-...)");
    MIG devices listed under a GPU are not separate lines starting with "GPU"."""
    return tuple(_NVIDIA_SMI_GPU.findall(listing))


def nvidia_smi_listing() -> str:
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=True,
                              timeout=30).stdout
    except FileNotFoundError:
        raise CommandError("no GPU list: nvidia-smi is not installed; set "
                           "CUDA_VISIBLE_DEVICES or --gpus") from None
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        raise CommandError(f"nvidia-smi -L failed ({exc}); set CUDA_VISIBLE_DEVICES or "
                           "--gpus") from None


def visible_devices(*, explicit: str, environ: Mapping[str, str],
                    listing: Callable[[], str] = nvidia_smi_listing) -> Devices:
    """`--gpus` if given, else CUDA_VISIBLE_DEVICES if set (an empty value means no GPU,
    as CUDA reads it), else every GPU `nvidia-smi -L` lists."""
    def split(value: str) -> tuple[str, ...]:
        return tuple(item.strip() for item in value.split(",") if item.strip())

    if explicit:
        devices = Devices(split(explicit), "--gpus", pci_order=True)
    elif "CUDA_VISIBLE_DEVICES" in environ:
        devices = Devices(split(environ["CUDA_VISIBLE_DEVICES"]), "CUDA_VISIBLE_DEVICES",
                          pci_order=False)
    else:
        devices = Devices(parse_nvidia_smi(listing()), "nvidia-smi -L", pci_order=True)
    if not devices.ids:
        raise CommandError(f"no GPUs visible ({devices.source} lists none)")
    if len(set(devices.ids)) != len(devices.ids):
        raise CommandError(f"{devices.source} lists a GPU twice: {','.join(devices.ids)}")
    return devices


def gpu_groups(ids: Sequence[str], size: int) -> tuple[list[tuple[str, ...]], tuple[str, ...]]:
    """Consecutive groups of `size` GPUs, and the GPUs left over (fewer than `size`)."""
    if size < 1:
        raise CommandError(f"GPUs per worker must be at least 1, not {size}")
    if len(ids) < size:
        raise CommandError(f"one worker needs {size} GPUs; only {len(ids)} visible "
                           f"({','.join(ids)})")
    whole = len(ids) - len(ids) % size
    return [tuple(ids[i:i + size]) for i in range(0, whole, size)], tuple(ids[whole:])


def worker_name(*, host: str, devices: Sequence[str], model: str) -> str:
    return f"{host}.gpu{','.join(devices)}.{model}"


def plan_workers(*, spec: ModelSpec, devices: Devices, per_worker: int, host: str,
                 environ: Mapping[str, str], worker_args: Sequence[str] = ()
                 ) -> tuple[list[WorkerPlan], tuple[str, ...]]:
    """One plan per GPU group (and the GPUs left idle): each worker sees only its group."""
    groups, idle = gpu_groups(devices.ids, per_worker)
    plans = []
    for group in groups:
        env = {**environ, "CUDA_VISIBLE_DEVICES": ",".join(group)}
        if devices.pci_order:
            env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
        plans.append(WorkerPlan(devices=group, env=env,
                                name=worker_name(host=host, devices=group, model=spec.name),
                                args=("--model", spec.name, "--host", host, *worker_args)))
    return plans, idle


def _die_with_supervisor() -> None:
    # Runs in the child between fork and exec: if the supervisor is SIGKILLed, the kernel
    # sends the worker SIGTERM, so it drains instead of holding its GPU unsupervised.
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class Supervisor:
    """The workers of one host: started, restarted when they die, stopped on a signal.

    The signal handler only counts signals; the loop forwards them, so a worker gets
    exactly as many SIGTERMs as this process got (one drains, two stop cold), whichever
    moment they arrive in."""

    def __init__(self, plans: Sequence[WorkerPlan], *, stop_after: float,
                 write: Callable[[str], None], taken: Callable[[str], bool] = registered
                 ) -> None:
        self.plans = list(plans)
        self.stop_after = stop_after
        self.write = write
        self.taken = taken
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.names: dict[int, str] = {}
        self.sent: dict[int, int] = {}  # SIGTERMs forwarded to each worker's current process
        self.signals = 0
        self.restarts = Restarts()

    def on_signal(self, signum: int, frame: Any) -> None:
        self.signals += 1

    def spawn(self, index: int) -> None:
        plan = self.plans[index]
        name = free_name(plan.name, self.taken)
        self.names[index], self.sent[index] = name, 0
        self.procs[index] = subprocess.Popen(
            plan.command(name), env=plan.env, cwd=settings.BASE_DIR,
            # Own session: a Ctrl-C in the terminal reaches only this process, which
            # forwards one SIGTERM; a worker that got both would stop cold.
            start_new_session=True,
            preexec_fn=_die_with_supervisor if sys.platform == "linux" else None)
        self.write(f"gpuworkers: {name} on CUDA_VISIBLE_DEVICES="
                   f"{plan.env['CUDA_VISIBLE_DEVICES']} (pid {self.procs[index].pid})")

    def forward(self) -> None:
        for index, proc in self.procs.items():
            while proc.poll() is None and self.sent[index] < self.signals:
                self.sent[index] += 1
                proc.send_signal(signal.SIGTERM)

    def restart_dead(self) -> str:
        """Start again each worker that exited; the failure once one keeps dying."""
        for index, proc in list(self.procs.items()):
            if proc.poll() is None:
                continue
            name = self.names[index]
            if not self.restarts.record(name, time.monotonic()):
                return (f"{name} exited {MAX_RESTARTS} times within "
                        f"{RESTART_WINDOW_SECONDS:.0f}s (last code {proc.returncode})")
            self.write(f"gpuworkers: {name} exited with {proc.returncode}; restarting")
            self.spawn(index)
        return ""

    def run(self, *, poll_seconds: float = 0.5) -> str:
        """Supervise until a signal, then stop the workers; the failure, if any."""
        signal.signal(signal.SIGTERM, self.on_signal)
        signal.signal(signal.SIGINT, self.on_signal)
        for index in range(len(self.plans)):
            self.spawn(index)
        failure = ""
        while not self.signals and not failure:
            time.sleep(poll_seconds)
            if not self.signals:
                failure = self.restart_dead()
        self.signals = max(self.signals, 1)
        self.stop(poll_seconds=min(poll_seconds, 0.2))
        return failure

    def stop(self, *, poll_seconds: float) -> None:
        deadline = time.monotonic() + self.stop_after
        while any(proc.poll() is None for proc in self.procs.values()):
            self.forward()
            if time.monotonic() > deadline:
                for index, proc in self.procs.items():
                    if proc.poll() is None:
                        self.write(f"gpuworkers: {self.names[index]} did not stop; killing it")
                        proc.kill()
                        proc.wait()
                return
            time.sleep(poll_seconds)


class WorkerOptions:
    """batchworker's own options, declared on this command's parser as batchworker declares
    them, and passed on to every worker; except --model, --name and --host, which
    gpuworkers sets."""

    SET_HERE = ("--model", "--name", "--host")

    def __init__(self, parser: Any) -> None:
        self.parser = parser
        self.actions: list[Any] = []

    def add_argument(self, *flags: str, **kwargs: Any) -> None:
        if "--model" in flags:
            # One model per GPU here; a worker of several models is batchworker's own.
            kwargs = {**kwargs, "action": "store", "help": "A name from BATCHWEB_MODELS."}
        action = self.parser.add_argument(*flags, **kwargs)
        if not set(flags) & set(self.SET_HERE):
            self.actions.append(action)

    def passed_on(self, options: Mapping[str, Any]) -> list[str]:
        args: list[str] = []
        for action in self.actions:
            value, flag = options[action.dest], action.option_strings[0]
            if action.nargs == 0:  # a switch
                args += [flag] if value else []
            elif value is not None:
                args += [flag, str(value)]
        return args


class Command(BaseCommand):
    help = "Run one batchworker per GPU (or per tensor-parallel GPU group) on this host."

    def add_arguments(self, parser: Any) -> None:
        self.worker_options = WorkerOptions(parser)
        BatchWorker().add_arguments(self.worker_options)
        parser.add_argument("--gpus-per-worker", type=int, default=0,
                            help="GPUs per engine; must match the model's tensor_parallel_size"
                                 " (x pipeline/data parallel size). Default: that product.")
        parser.add_argument("--gpus", default="",
                            help="Comma-separated GPUs to use (default CUDA_VISIBLE_DEVICES, "
                                 "else every GPU nvidia-smi -L lists).")

    def handle(self, *args: Any, **options: Any) -> None:
        spec = model_spec(options["model"])
        if spec is None:
            known = ", ".join(m["name"] for m in settings.BATCHWEB_MODELS)
            raise CommandError(f"Unknown model {options['model']!r}; served here: {known}")
        per_engine = gpus_per_engine(spec)
        if options["gpus_per_worker"] and options["gpus_per_worker"] != per_engine:
            raise CommandError(
                f"--gpus-per-worker {options['gpus_per_worker']}, but {spec.name}'s options "
                f"make one engine use {per_engine} GPU(s) ({' x '.join(PARALLEL_OPTIONS)}); "
                "set tensor_parallel_size in BATCHWEB_MODELS_FILE to change it")
        devices = visible_devices(explicit=options["gpus"], environ=os.environ)
        if options["name"]:
            raise CommandError("--name: gpuworkers names each worker <host>.gpu<ids>.<model>"
                               " (set the host part with --host)")
        worker_args = self.worker_options.passed_on(options)
        plans, idle = plan_workers(spec=spec, devices=devices, per_worker=per_engine,
                                   host=options["host"] or socket.gethostname(),
                                   environ=os.environ, worker_args=worker_args)
        self.stdout.write(f"gpuworkers: {len(plans)} worker(s) of {spec.name}, {per_engine} "
                          f"GPU(s) each, from {devices.source} ({','.join(devices.ids)})")
        if idle:
            self.stderr.write(f"gpuworkers: GPU(s) {','.join(idle)} left idle: fewer than "
                              f"the {per_engine} one worker needs")
        supervisor = Supervisor(plans, write=self.stdout.write,
                                stop_after=options["drain_seconds"] + STOP_MARGIN_SECONDS)
        failure = supervisor.run()
        if failure:
            sys.exit(f"gpuworkers cannot make progress: {failure}. Stopped.")
        self.stdout.write("gpuworkers: stopped")
