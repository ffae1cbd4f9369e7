"""A shard's parts in storage (`jobs.worker.part_storage`): a checkpoint's segment holds
what each part got since the last one; the finished parts join the segments with the bytes
written since, each part whole and in order. On the filesystem storage of the test's own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from django.core.files.base import ContentFile
from django.core.files.storage import default_storage

from jobs.formats.prompts import Room
from jobs.worker.part_storage import delete_stored, store_parts, store_segment
from jobs.worker.work import ShardWork
from tests.factories import storage_snapshot, use_private_storage


@pytest.fixture
def storage(settings: Any, tmp_path: Path) -> Path:
    return use_private_storage(settings, tmp_path)


def make_work() -> ShardWork:
    return ShardWork(shard_id="s1", attempt=3, batch_id="b1", copies={}, skip=set(),
                     screened={}, room=Room(context=None, cap=64))


def test_a_segment_holds_what_each_part_got_since_the_last(storage: Path):
    work = make_work()
    work.out.write(b'{"n": 1}\n')
    work.err.write(b'{"e": 1}\n')
    names = store_segment(work, (0, 0, 0), (work.out.tell(), work.err.tell(), 0))
    out, err, flags = names
    assert flags == ""  # nothing new in it: no object
    assert out == "parts/b1/s1-3.ckpt0.output.jsonl"
    assert (storage / out).read_bytes() == b'{"n": 1}\n'
    assert (storage / err).read_bytes() == b'{"e": 1}\n'


def test_the_finished_parts_join_the_segments_and_what_came_after(storage: Path):
    work = make_work()
    work.out.write(b"first\n")
    segment = store_segment(work, (0, 0, 0), (work.out.tell(), 0, 0))
    work.saved.segments = [segment]
    work.out.release(work.out.tell())
    work.out.write(b"second\n")
    stored: list[str] = []
    store_parts(work, stored)
    out, err, flags = stored
    assert out == "parts/b1/s1-3.output.jsonl"
    assert (storage / out).read_bytes() == b"first\nsecond\n"
    assert (err, flags) == ("", "")  # empty parts are stored as nothing


def test_deleting_what_was_stored_tolerates_names_already_gone(storage: Path):
    name = default_storage.save("parts/b1/x.jsonl", ContentFile(b"x\n"))
    delete_stored(["", name, "parts/b1/never-stored.jsonl"])
    assert storage_snapshot(storage) == {}
