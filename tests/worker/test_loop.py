"""The shape of the worker's background threads (`jobs.worker.loop.Loop`): a failed step
never ends its loop (a lost database connection is closed, to be opened anew by the next
step), and the thread's database connection ends with the thread."""

from __future__ import annotations

import logging
import threading
from typing import Any

import pytest
from django.db import OperationalError, connection, connections

from jobs.worker.loop import Loop
from tests.factories import wait_for


def test_a_failing_step_is_logged_and_the_loop_goes_on(caplog):
    caplog.set_level(logging.WARNING, logger="jobs.worker.loop")

    def fails() -> None:
        raise ValueError("broken step")

    Loop.step("a duty", fails)
    ran: list[int] = []
    Loop.step("the next duty", lambda: ran.append(1))
    assert ran == [1]
    [record] = [r for r in caplog.records if r.name == "jobs.worker.loop"]
    assert record.levelno == logging.ERROR and record.getMessage() == "a duty failed"


@pytest.mark.django_db(transaction=True)
def test_a_lost_connection_is_closed_for_the_next_step_to_open_again(caplog):
    caplog.set_level(logging.WARNING, logger="jobs.worker.loop")
    seen: list[object] = []

    def lost() -> None:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
        seen.append(connection.connection)
        raise OperationalError("server closed the connection unexpectedly")

    Loop.step("heartbeat", lost)
    assert seen[0] is not None and connection.connection is None
    assert "heartbeat: database unavailable" in caplog.text
    with connection.cursor() as cursor:  # the next step opens a new one
        cursor.execute("SELECT 1")
        assert cursor.fetchone() == (1,)


@pytest.mark.django_db(transaction=True)
def test_the_threads_connection_ends_with_its_loop():
    opened: list[tuple[Any, int]] = []
    done = threading.Event()
    postgres = connection.vendor == "postgresql"

    class Reading(Loop):
        name = "reading"

        def _loop(self) -> None:
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_backend_pid()" if postgres else "SELECT 1")
                opened.append((connections["default"], cursor.fetchone()[0]))
            done.set()

    loop = Reading()
    loop.start()
    assert done.wait(10)
    loop.join(timeout=10)
    assert not loop.thread.is_alive() and loop.thread.name == "reading"
    # Django's connection of that thread, closed as it ended: no idle session is left.
    [(thread_connection, backend)] = opened
    assert thread_connection is not connections["default"]
    assert thread_connection.connection is None
    if postgres:
        def sessions() -> int:
            with connection.cursor() as cursor:
                cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s",
                               [backend])
                return cursor.fetchone()[0]

        # The server ends the backend as it reads the client's goodbye.
        wait_for(lambda: sessions() == 0, timeout=10, message="the loop's session ended")
