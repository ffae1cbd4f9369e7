"""SIGUSR1 to a worker writes every thread's stack to its log and changes nothing else:
the way to see where a worker that seems stuck is waiting, before it is killed."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest

from tests.factories import wait_for

pytestmark = pytest.mark.django_db(transaction=True)


def test_sigusr1_logs_every_threads_stack_and_the_worker_goes_on(workers: Any,
                                                                  tmp_path: Path) -> None:
    worker = workers.start()
    log = tmp_path / "worker-0.log"
    wait_for(lambda: "ready on" in log.read_text(), timeout=60, message="the worker to start")
    worker.send_signal(signal.SIGUSR1)
    # faulthandler writes "Current thread 0x..." for the main thread (where the signal
    # is handled) and "Thread 0x..." for each other one. The main thread's own frames
    # vary: idle it is in take_jobs, but a job still importing at start is deeper than
    # the 100 frames faulthandler prints, so its outer frames are cut.
    def dumped() -> bool:
        stacks = log.read_text()
        return ("Current thread 0x" in stacks  # the main thread
                and stacks.count("hread 0x") >= 3
                and " in _loop\n" in stacks)  # the pipeline's own threads

    wait_for(dumped, timeout=10, message="every thread's stack in the log")
    assert worker.poll() is None
    workers.stop_all()
    assert worker.returncode == 0
