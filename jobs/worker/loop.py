"""The worker's background threads share one shape: a daemon thread running `_loop` until
the pipeline closes, started with it and joined when it closes."""

from __future__ import annotations

import threading


class Loop:
    name = "loop"

    def __init__(self) -> None:
        self.thread = threading.Thread(target=self._loop, name=self.name, daemon=True)

    def start(self) -> None:
        self.thread.start()

    def join(self, timeout: float) -> None:
        self.thread.join(timeout=timeout)

    def _loop(self) -> None:
        raise NotImplementedError
