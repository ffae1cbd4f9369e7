"""The engine's idle meter (`jobs.worker.idle.IdleMeter`): the engine's time split among the
shard attempts whose requests were in flight (each request's share of the time it shared
the engine), taken once when an attempt ends; and the room the intake waits for."""

from __future__ import annotations

import threading
import time

import pytest

from jobs.worker.idle import IdleMeter


def test_the_attempts_shares_add_up_to_the_engines_busy_time():
    meter = IdleMeter()
    meter.request_started("s1:1:0")
    meter.request_started("s2:1:0")
    meter.request_started("s2:1:1")
    time.sleep(0.05)
    meter.request_finished("s1:1:0")
    time.sleep(0.05)
    meter.request_finished("s2:1:0")
    meter.request_finished("s2:1:1")
    first, second = meter.engine_seconds("s1:1"), meter.engine_seconds("s2:1")
    busy, _, _ = meter.totals()
    # Whatever the timing: the shares split the busy time, two requests to one.
    assert first + second == pytest.approx(busy)
    assert 0 < first < second
    assert meter.in_flight == 0 and meter.requests == 3


def test_an_attempts_share_is_taken_once():
    meter = IdleMeter()
    meter.request_started("s1:1:0")
    meter.request_finished("s1:1:0")
    share = meter.engine_seconds("s1:1", take=True)
    assert share > 0
    assert meter.engine_seconds("s1:1", take=True) == 0.0
    # A late result of a dropped attempt starts no share of its own.
    meter.request_finished("s1:1:1")
    assert "s1:1" not in meter.shares


def test_the_idle_time_is_the_time_with_nothing_in_flight():
    meter = IdleMeter()
    meter.request_started()
    meter.request_finished()
    time.sleep(0.05)  # nothing in flight
    meter.request_started()
    meter.request_finished()
    assert meter.idle_total >= 0.05
    assert meter.idle_total <= meter.window() and 0 < meter.fraction() <= 1


def test_idle_accounting_is_never_negative():
    meter = IdleMeter()
    assert (meter.window(), meter.fraction()) == (0.0, 0.0)
    # A worker stopped with requests handed in but no result out yet: no window, not
    # "0.00% of -4610.0s" (the clock's origin to the first request).
    meter.request_started()
    assert meter.window() == 0.0 and meter.fraction() == 0.0
    meter.request_finished()
    meter.request_started()
    meter.request_finished()
    assert meter.window() >= 0.0 and 0.0 <= meter.fraction() <= 1.0


def test_the_intake_waits_for_room_until_a_request_finishes():
    meter = IdleMeter()
    meter.request_started("s1:1:0")
    meter.request_started("s1:1:1")
    assert not meter.wait_for_room(2, timeout=0.01)
    finisher = threading.Timer(0.05, meter.request_finished, args=("s1:1:0",))
    finisher.start()
    try:
        assert meter.wait_for_room(2, timeout=10)
    finally:
        finisher.join()
    assert meter.in_flight == 1
