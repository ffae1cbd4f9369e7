"""The control-plane timings a worker records for bench/fleet.py (BATCHWEB_TIMINGS_DIR)."""

from __future__ import annotations

import os

import pytest

from jobs.worker import timings


def test_nothing_is_written_unless_a_directory_is_set(settings, tmp_path, monkeypatch):
    monkeypatch.setattr(timings, "_out", None)
    settings.BATCHWEB = {**settings.BATCHWEB, "TIMINGS_DIR": ""}
    with timings.timed("claim"):
        pass
    assert timings._out is None


def test_each_call_is_one_line_even_when_it_fails(settings, tmp_path, monkeypatch):
    monkeypatch.setattr(timings, "_out", None)
    settings.BATCHWEB = {**settings.BATCHWEB, "TIMINGS_DIR": str(tmp_path / "timings")}
    with timings.timed("claim"):
        pass
    with pytest.raises(RuntimeError), timings.timed("heartbeat"):
        raise RuntimeError("database gone")
    assert timings._out is not None
    timings._out.close()
    lines = (tmp_path / "timings" / f"{os.getpid()}.txt").read_text().splitlines()
    assert [line.split()[1] for line in lines] == ["claim", "heartbeat"]
    assert all(float(line.split()[2]) >= 0 and float(line.split()[0]) > 0 for line in lines)
