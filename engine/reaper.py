"""Engine processes never outlive the worker that started them.

vLLM runs its engine core (and, under it, the model workers) in child processes. When the
worker process dies without closing the engine (SIGKILL, the OOM killer, a crash in C), the
engine core is re-parented to init and keeps running, holding the model and its KV cache
(GPU memory on a GPU machine), so the replacement worker a supervisor starts finds the
memory taken. The model workers watch their engine core; nothing in vLLM watches ours.

So a worker that loads an engine also starts one small watchdog process. The watchdog holds
the read end of a pipe whose write end only the worker holds: the kernel closes it however
the worker ends, and the watchdog then kills the child processes the worker registered
(checked by start time, so a reused pid is left alone). The watchdog runs in its own
session, so a signal to the worker's process group (Ctrl-C) does not take it first.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import threading

log = logging.getLogger(__name__)

# Runs in the watchdog: read "pid start_time" lines until the worker's end of the pipe
# closes, then kill whatever of those processes still runs.
_WATCHDOG = """
import sys, psutil
registered = {}
for line in sys.stdin:
    pid, started = line.split()
    registered[int(pid)] = float(started)
for pid, started in registered.items():
    try:
        proc = psutil.Process(pid)
        if abs(proc.create_time() - started) < 0.01:
            proc.kill()
    except psutil.Error:
        pass
"""

_lock = threading.Lock()
_watchdog: subprocess.Popen | None = None
_registered: set[int] = set()


def reap_children_on_exit() -> None:
    """Register this process's current child processes (recursively) to be killed when this
    process ends, however it ends. Called after an engine has started its processes; safe
    to call again after another engine loads."""
    import psutil

    global _watchdog
    with _lock:
        if _watchdog is None or _watchdog.poll() is not None:
            _watchdog = subprocess.Popen(
                [sys.executable, "-c", _WATCHDOG], stdin=subprocess.PIPE, text=True,
                start_new_session=True, close_fds=True)
            _registered.clear()
        assert _watchdog.stdin is not None
        me = psutil.Process(os.getpid())
        for child in me.children(recursive=True):
            if child.pid == _watchdog.pid or child.pid in _registered:
                continue
            try:
                _watchdog.stdin.write(f"{child.pid} {child.create_time()}\n")
            except psutil.Error:
                continue
            _registered.add(child.pid)
        _watchdog.stdin.flush()
        log.debug("engine processes %s are killed if this process dies", sorted(_registered))


def _close_in_forked_child() -> None:
    # A child forked without exec (vLLM's "fork" start method) inherits the write end of
    # the pipe; holding it, that child would keep the watchdog from ever seeing this
    # process die. (Exec'd children never get it: the pipe is close-on-exec.)
    global _watchdog
    if _watchdog is not None and _watchdog.stdin is not None:
        with contextlib.suppress(OSError):
            _watchdog.stdin.close()
    _watchdog = None
    _registered.clear()


os.register_at_fork(after_in_child=_close_in_forked_child)
