"""Database calls of the worker's threads, retried across a dropped connection."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

from django.db import InterfaceError, OperationalError, connection

log = logging.getLogger(__name__)
T = TypeVar("T")


def with_db_retry(fn: Callable[[], T], *, attempts: int = 5) -> T:
    """Run a database call, reconnecting if the connection was dropped (PostgreSQL
    restarted, backend terminated). Each call is one conditional write, safe to repeat."""
    for attempt in range(attempts):
        try:
            return fn()
        except (OperationalError, InterfaceError):
            if attempt == attempts - 1:
                raise
            log.warning("database connection lost; reconnecting", exc_info=True)
            connection.close()
            time.sleep(min(2**attempt, 10))
    raise AssertionError("unreachable")
