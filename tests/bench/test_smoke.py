"""Every benchmark in bench/ at its smallest size: it starts, runs to its end and prints its
table (and writes its `--json` report). No figure is checked: the sizes are far too small to
mean anything, and a benchmark's targets are its own (bench/RESULTS.md). What this catches is
a benchmark that no longer starts, or dies on the way, after a change elsewhere.

Each runs as a user runs it (`python bench/X.py`, from the repository root, with the
plain-HTTP servers of `make bench`) in a process group of its own, stopped at its timeout.
The smokes that take more than a few seconds are marked `bench` (`make test`, not `make
check`); those that load vLLM, `engine` too. The benchmarks on PostgreSQL use the server
of DATABASE_URL, and are skipped without one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.engine import needs_vllm

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
# What the test process's own deployment is made of: a benchmark makes its own scratch one.
OWN = ("DATABASE_URL", "REDIS_URL", "DJANGO_SETTINGS_MODULE")
# The modules the scripts share, not benchmarks.
SHARED = {"harness"}


@dataclass(frozen=True)
class Smoke:
    script: str
    args: tuple[str, ...]
    # Lines of its table (or report) that its output must hold.
    prints: tuple[str, ...]
    timeout: float = 180
    marks: tuple[Any, ...] = ()
    # Writes a --json report (every benchmark but workloads.py and --help).
    json: bool = True
    postgres: tuple[str, ...] = field(default=())  # options naming the server, then a name


SLOW = pytest.mark.bench
ENGINE = (SLOW, pytest.mark.engine, needs_vllm)

SMOKES = [
    Smoke("policy", ("--lines", "100", "--runs", "1"), ("overhead", "the validation task")),
    Smoke("workloads", ("mixed", "-n", "4"), ('"requests": 4',), json=False),
    Smoke("upload_memory", ("--file-mb", "1", "--upload-mb", "2"),
          ("peak RSS MB", "Uploads API 2 MB"), marks=(SLOW,)),
    Smoke("orchestration", ("--sizes", "100", "--workers", "1"),
          ("upload r/s | validate r/s",), marks=(SLOW,)),
    Smoke("service_floor", ("-n", "4", "--hold", "1", "--idle", "1"),
          ("ms of CPU per second", "median:"), marks=(SLOW,)),
    Smoke("planning", ("-n", "1000", "--repeats", "1"),
          ("shared-prefix grouping on", "labels grouping on"), marks=(SLOW,)),
    Smoke("dashboard_load", ("--seconds", "2", "--pollers", "2", "--listers", "1",
                             "--history", "1", "--change-seconds", "1", "--shard-size", "5",
                             "--web-workers", "1", "--threads", "2"),
          ("GET /v1/batches/{id} (openai)", "every poll, unchanged", "batch at the end"),
          marks=(SLOW,)),
    Smoke("load_api", ("--clients", "4", "--seconds", "3", "--users", "2", "--web-workers",
                       "1", "--threads", "2", "--batchworkers", "1", "--max-batches", "1",
                       "--lines", "3", "--settle", "60"),
          ('"per_operation"', "load: OK"), marks=(SLOW,)),
    Smoke("cold_start", ("--model", "echo-test"),
          ("(a) batchworker start", "(b) make run", "runservice -> first token"),
          marks=(SLOW,)),
    Smoke("eval_cost", ("--model", "echo-test", "--echo-seconds", "0.01", "-n", "4",
                        "--items", "4", "--rounds", "1"),
          ("without eval", "added / eval time"), marks=(SLOW,)),
    Smoke("scale_out", ("--model", "echo-test", "-n", "16", "--echo-seconds", "0.01"),
          ("out tokens", "speed-up 2 vs 1 worker"), marks=(SLOW,)),
    Smoke("usage_ledger", ("--rows", "1000", "--runs", "1"),
          ("Usage page, busiest user", "/metrics, the whole ledger"), marks=(SLOW,),
          postgres=("--server",)),
    Smoke("fleet", ("--workers", "2", "--rates", "20", "--step-seconds", "4", "--warm-seconds",
                    "1", "--drain-seconds", "30", "--batch-size", "40", "--shard-size", "10",
                    "--users", "1", "--pooler", "none", "--in-flight", "4", "--echo-seconds",
                    "0.05"),
          ("offered  finished", "load average at start"), marks=(SLOW,),
          postgres=("--database-server", "--db-name")),
    Smoke("simulation", ("--order", "deadline", "--day-seconds", "10", "--size-scale",
                         "100000", "--max-workers", "2"),
          ("offline: the work", "deadline: windows missed"), marks=(SLOW,),
          postgres=("--database-server", "--db-name")),
    Smoke("compare_raw", ("-n", "2"), ("VllmEngine.run", "LLM.chat", "best of 1"),
          timeout=300, marks=ENGINE),
    Smoke("engine_efficiency", ("-n", "2", "--min-tokens", "4", "--max-tokens", "8",
                                "--shard-size", "2"),
          ("a raw LLM.chat", "b vllm run_batch", "c batchweb", "identical outputs"),
          timeout=420, marks=ENGINE),
    Smoke("projection", ("-n", "4", "--min-tokens", "4", "--max-tokens", "8", "--shard-size",
                         "2", "--reconcile-seconds", "1"),
          ("done | at (s) | projected end (s) | error",), timeout=300, marks=ENGINE),
    # Its vLLM server rounds take minutes even at their smallest: only its options here.
    Smoke("remote_engine", ("--help",), ("--part {throughput,interactive}",), timeout=60,
          json=False),
]


def _postgres_server() -> str:
    """The PostgreSQL server (postgres://user@host:port) of the tests' DATABASE_URL."""
    url = os.environ.get("DATABASE_URL", "")
    if not url.startswith(("postgres://", "postgresql://")):
        pytest.skip("needs PostgreSQL (DATABASE_URL)")
    return url.rpartition("/")[0]


def _env() -> dict[str, str]:
    env = {name: value for name, value in os.environ.items()
           if name not in OWN and not name.startswith("BATCHWEB_")}
    env["BATCHWEB_HTTPS"] = "0"  # as `make bench`: the benchmarks' servers speak plain HTTP
    return env


def _run(command: list[str], timeout: float) -> tuple[int, str]:
    """Its exit status and output; at `timeout`, SIGINT to its group (so that the script's
    cleanup stops the servers it started), then SIGKILL, and a failure."""
    with subprocess.Popen(command, cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True,
                          start_new_session=True) as proc:
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                out, _ = proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                out, _ = proc.communicate()
            pytest.fail(f"{command[1]} still running after {timeout:.0f} s:\n"
                        + out[-4000:])
    return proc.returncode, out


@pytest.mark.parametrize("smoke", [pytest.param(s, id=s.script, marks=s.marks)
                                   for s in SMOKES])
def test_bench_runs_at_its_smallest_size(smoke: Smoke, tmp_path: Path) -> None:
    args = list(smoke.args)
    if smoke.postgres:
        args += [smoke.postgres[0], _postgres_server()]
        if len(smoke.postgres) > 1:  # a scratch database of this run's own
            args += [smoke.postgres[1], f"bw_smoke_{smoke.script}_{os.getpid()}"]
    report = tmp_path / "figures.json"
    if smoke.json:
        args += ["--json", str(report)]
    status, out = _run([sys.executable, f"bench/{smoke.script}.py", *args], smoke.timeout)
    assert status == 0, out[-4000:]
    for line in smoke.prints:
        assert line in out, out[-4000:]
    if smoke.json:
        assert isinstance(json.loads(report.read_text()), dict)


def test_every_benchmark_has_a_smoke() -> None:
    scripts = {path.stem for path in BENCH.glob("*.py")
               if 'if __name__ == "__main__"' in path.read_text()} - SHARED
    assert scripts == {smoke.script for smoke in SMOKES}
