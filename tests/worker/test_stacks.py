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
    stacks = wait_for(lambda: "take_jobs" in (text := log.read_text()) and text,
                      timeout=10, message="the stacks in the log")
    assert "take_jobs" in stacks  # the main thread, in RQ's loop
    assert stacks.count("Thread 0x") >= 3  # the pipeline's threads as well
    assert worker.poll() is None
    workers.stop_all()
    assert worker.returncode == 0
