"""Engine processes die with their worker however it dies (engine/reaper.py). A vLLM engine
core left running holds the model and KV cache; tests/chaos covers it with the real engine
(SIGKILL mid-generation), this with plain processes, in seconds."""

from __future__ import annotations

import signal
import subprocess
import sys

import psutil
import pytest

from tests.factories import ROOT, wait_for

# Its tests start child processes.
pytestmark = pytest.mark.processes

# A stand-in worker: one exec'd child (vLLM's "spawn") and, started after the watchdog, one
# forked child (vLLM's "fork": it inherits the worker's descriptors), both registered.
WORKER = f"""
import os, subprocess, sys, time
sys.path.insert(0, {str(ROOT)!r})
from engine.reaper import reap_children_on_exit
spawned = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
reap_children_on_exit()
forked = os.fork()
if forked == 0:
    time.sleep(600)
    os._exit(0)
reap_children_on_exit()
print(spawned.pid, forked, flush=True)
time.sleep(600)
"""


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM])
def test_registered_children_die_with_the_worker(how):
    worker = subprocess.Popen([sys.executable, "-c", WORKER], stdout=subprocess.PIPE,
                              text=True)
    assert worker.stdout is not None
    children = [int(pid) for pid in worker.stdout.readline().split()]
    assert len(children) == 2 and all(running(pid) for pid in children)
    worker.send_signal(how)
    worker.wait()
    try:
        wait_for(lambda: not any(running(pid) for pid in children), timeout=20,
                 message="the worker's children to be killed")
    finally:
        for pid in children:
            if running(pid):
                psutil.Process(pid).kill()
