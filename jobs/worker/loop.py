"""The worker's background threads share one shape: a daemon thread running `_loop` until
the pipeline closes, started with it and joined when it closes. A step of a loop that fails
never ends the loop (`step`), and the thread's database connection ends with the thread."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from django.db import InterfaceError, OperationalError, connection

log = logging.getLogger(__name__)


class Loop:
    name = "loop"

    def __init__(self) -> None:
        self.thread = threading.Thread(target=self._run, name=self.name, daemon=True)

    def start(self) -> None:
        self.thread.start()

    def join(self, timeout: float) -> None:
        self.thread.join(timeout=timeout)

    def _run(self) -> None:
        try:
            self._loop()
        finally:
            # Django opens a connection per thread and never closes it on its own: left
            # open, it outlives the loop as an idle session on the server.
            connection.close()

    def _loop(self) -> None:
        raise NotImplementedError

    @staticmethod
    def step(what: str, run: Callable[[], object]) -> None:
        """One step of a loop: a dropped database connection is closed, to be opened anew
        by the next step; any other failure is logged. The loop goes on either way."""
        try:
            run()
        except (OperationalError, InterfaceError):
            log.warning("%s: database unavailable", what, exc_info=True)
            connection.close()
        except Exception:
            log.exception("%s failed", what)
