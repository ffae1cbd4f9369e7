"""The worker's periodic duties (`jobs.worker.periodic`): each runs every so many seconds on
a thread of its own (never when its interval is 0); the scratch sweep removes what killed
processes left in this machine's TMP_DIR and leaves the files still being written."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

from jobs.worker.periodic import Duty, Periodic
from tests.factories import wait_for


def test_a_duty_is_due_every_interval_and_never_at_zero():
    duty = Duty("sweep", lambda: None, 10, last=100.0)
    assert duty.due_in(104.0) == 6.0
    assert duty.due_in(111.0) == -1.0
    assert Duty("off", lambda: None, 0).due_in(1e9) == float("inf")


def test_the_scratch_sweep_runs_on_its_schedule(settings: Any, tmp_path: Path):
    settings.TMP_DIR = tmp_path
    settings.BATCHWEB = {**settings.BATCHWEB, "STALE_TEMP_SECONDS": 600}
    stale = tmp_path / "upload-of-a-killed-process"
    stale.write_bytes(b"half an upload")
    an_hour_ago = time.time() - 3600
    os.utime(stale, (an_hour_ago, an_hour_ago))
    fresh = tmp_path / "upload-in-progress"
    fresh.write_bytes(b"still written")
    closing = threading.Event()
    # The reconciler off (0): no database here.
    periodic = Periodic(closing, reconcile_every=0, sweep_every=0.2)
    periodic.start()
    try:
        wait_for(lambda: not stale.exists(), timeout=10, every=0.05,
                 message="the stale file swept")
        assert fresh.exists()
    finally:
        closing.set()
        periodic.join(timeout=10)
    assert not periodic.thread.is_alive()


def test_closing_ends_the_thread_with_no_duty_due(settings: Any, tmp_path: Path):
    settings.TMP_DIR = tmp_path
    closing = threading.Event()
    periodic = Periodic(closing, reconcile_every=0, sweep_every=0)
    periodic.start()
    started = time.monotonic()
    closing.set()
    periodic.join(timeout=10)
    assert not periodic.thread.is_alive()
    # It waits on `closing` itself, not out its sixty-second cap.
    assert time.monotonic() - started < 5


def test_a_failing_duty_never_ends_the_thread(settings: Any, tmp_path: Path):
    # The scratch directory's path is a file: each sweep fails until it is a directory.
    scratch = tmp_path / "scratch"
    scratch.write_bytes(b"in the way")
    settings.TMP_DIR = scratch
    settings.BATCHWEB = {**settings.BATCHWEB, "STALE_TEMP_SECONDS": 600}
    closing = threading.Event()
    periodic = Periodic(closing, reconcile_every=0, sweep_every=0.1)
    periodic.start()
    try:
        time.sleep(0.3)  # a few failed sweeps
        assert periodic.thread.is_alive()
        scratch.unlink()
        scratch.mkdir()
        stale = scratch / "left-behind"
        stale.write_bytes(b"x")
        os.utime(stale, (time.time() - 3600,) * 2)
        wait_for(lambda: not stale.exists(), timeout=10, every=0.05,
                 message="the sweep working again")
    finally:
        closing.set()
        periodic.join(timeout=10)
