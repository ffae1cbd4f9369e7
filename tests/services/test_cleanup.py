"""Retention and cleanup against real (filesystem) storage of the test's own: expired vs
still-needed files, stale upload parts, merged shard parts, orphans young and old, dry run,
and the schedule."""

from __future__ import annotations

import io
import os
import time
from datetime import timedelta

import pytest
from django.core.files.base import ContentFile
from django.core.files.storage import default_storage
from django.core.management import call_command
from django.utils import timezone

from jobs import tasks
from jobs.lib import queues
from jobs.models import Batch, File, Shard, Upload, UploadPart
from jobs.services import cleanup
from jobs.services.uploads import add_upload_part, create_upload
from tests.factories import chat_line, make_batch, make_file, run_batch

# Transactional: file deletion removes the content once the row's deletion commits.
pytestmark = pytest.mark.django_db(transaction=True)

PAST = timedelta(days=1)


@pytest.fixture(autouse=True)
def own_storage(settings, tmp_path):
    """A storage of this test only: the orphan sweep walks the whole storage, and other
    test runs share the default test storage directory."""
    root = tmp_path / "storage"
    root.mkdir()
    settings.STORAGES = {**settings.STORAGES, "default": {
        "BACKEND": "django.core.files.storage.FileSystemStorage",
        "OPTIONS": {"location": str(root)}}}
    assert default_storage.location == str(root)
    return root


def put(name: str, *, age: timedelta = timedelta(0)) -> str:
    """An object in storage, with its modification time `age` ago."""
    stored = default_storage.save(name, ContentFile(b"x\n"))
    stamp = time.time() - age.total_seconds()
    os.utime(default_storage.path(stored), (stamp, stamp))
    return stored


def expire(file: File) -> File:
    File.objects.filter(pk=file.pk).update(expires_at=timezone.now() - PAST)
    return File.objects.get(pk=file.pk)


def exists(file: File) -> bool:
    return File.objects.filter(pk=file.pk).exists() and default_storage.exists(file.storage_name)


def test_expired_files_go_still_needed_stay(user, tmp_path):
    lines = [chat_line("a", "x")]
    unused = expire(make_file(user, lines, tmp_path))
    fresh = make_file(user, lines, tmp_path)
    running = make_batch(user, lines, tmp_path)  # in progress: its input is needed
    needed = expire(File.objects.get(pk=running.input_file_id))
    ended = run_batch(make_batch(user, lines, tmp_path))
    output = expire(File.objects.get(pk=ended.output_file_id))
    ended_input = expire(File.objects.get(pk=ended.input_file_id))

    report = cleanup.run_cleanup()

    assert sorted(report.expired_files) == sorted([unused.pk, output.pk, ended_input.pk])
    assert report.kept_in_use == [needed.pk]
    assert not exists(unused) and not default_storage.exists(unused.storage_name)
    assert not exists(output) and not exists(ended_input)
    assert exists(fresh) and exists(needed)
    # The batch keeps the ids of its deleted files, as OpenAI's do.
    assert Batch.objects.get(pk=ended.pk).output_file_id == output.pk


def test_dry_run_lists_and_deletes_nothing(user, tmp_path):
    file = expire(make_file(user, [chat_line("a", "x")], tmp_path))
    orphan = put("files/orphan-old", age=timedelta(hours=2))
    out = io.StringIO()
    call_command("cleanup", "--dry-run", "-v", "2", stdout=out)
    text = out.getvalue()
    assert "would delete 1 expired files" in text and file.pk in text
    assert "would delete 1 orphaned objects" in text and orphan in text
    assert exists(file) and default_storage.exists(orphan)

    out = io.StringIO()
    call_command("cleanup", stdout=out)
    assert "deleted 1 expired files" in out.getvalue()
    assert "deleted 1 orphaned objects" in out.getvalue()
    assert not exists(file) and not default_storage.exists(orphan)


def test_orphans_only_when_old_and_never_under_an_active_batch(user, tmp_path):
    lines = [chat_line("a", "x")]
    running = make_batch(user, lines, tmp_path)
    ended = run_batch(make_batch(user, lines, tmp_path))
    pending = create_upload(owner=user, filename="big.jsonl", purpose="batch", bytes=100,
                            mime_type="application/jsonl")
    old = timedelta(hours=2)
    orphans = [put("files/lost", age=old), put(f"parts/{ended.pk}/shard_x-1.output.jsonl",
                                               age=old),
               put("uploads/upload_gone/part", age=old)]
    kept = [put("files/young"),  # a file saved a moment before its row
            put(f"parts/{running.pk}/shard_y-1.output.jsonl", age=old),  # batch still runs
            put(f"uploads/{pending.pk}/part", age=old)]  # upload still pending
    referenced = [f.storage_name for f in File.objects.all()]
    for name in referenced:
        stamp = time.time() - 3 * 3600
        os.utime(default_storage.path(name), (stamp, stamp))

    report = cleanup.run_cleanup()

    assert sorted(report.orphans) == sorted(orphans)
    for name in orphans:
        assert not default_storage.exists(name)
    for name in kept + referenced:
        assert default_storage.exists(name), name


def test_stale_upload_parts_are_deleted(user, tmp_path):
    def upload_with_part():
        upload = create_upload(owner=user, filename="big.jsonl", purpose="batch", bytes=100,
                               mime_type="application/jsonl")
        part_path = tmp_path / f"part-{upload.pk}"
        part_path.write_bytes(b'{"a": 1}\n')
        return upload, add_upload_part(upload=upload, path=part_path)

    stale_upload, stale_part = upload_with_part()
    live_upload, live_part = upload_with_part()
    Upload.objects.filter(pk=stale_upload.pk).update(expires_at=timezone.now() - PAST)

    report = cleanup.run_cleanup(dry_run=True)
    assert report.expired_uploads == [stale_upload.pk]
    assert report.upload_parts == [stale_part.storage_name]
    assert UploadPart.objects.filter(pk=stale_part.pk).exists()

    cleanup.run_cleanup()
    assert Upload.objects.get(pk=stale_upload.pk).status == "expired"
    assert not UploadPart.objects.filter(pk=stale_part.pk).exists()
    assert not default_storage.exists(stale_part.storage_name)
    assert Upload.objects.get(pk=live_upload.pk).status == "pending"
    assert default_storage.exists(live_part.storage_name)


def test_merged_parts_of_ended_batches_only(user, tmp_path, settings):
    lines = [chat_line(f"r{i}", "x") for i in range(4)]
    ended = run_batch(make_batch(user, lines, tmp_path, shard_size=2, settings=settings))
    running = make_batch(user, lines, tmp_path, shard_size=2, settings=settings)
    run_batch(running, only=1)  # one shard done, its part needed until the batch ends
    running_part = Shard.objects.get(batch=running, index=0).output_part
    ended_parts = list(Shard.objects.filter(batch=ended).values_list("output_part", flat=True))
    assert running_part and all(ended_parts)

    # Finalized just now: the grace period protects readers that started before the end.
    assert cleanup.run_cleanup().merged_parts == []
    Batch.objects.filter(pk=ended.pk).update(
        finalize_claimed_at=timezone.now() - timedelta(hours=2))
    report = cleanup.run_cleanup()

    assert sorted(report.merged_parts) == sorted(ended_parts)
    assert not any(default_storage.exists(n) for n in ended_parts)
    assert set(Shard.objects.filter(batch=ended).values_list("output_part", flat=True)) == {""}
    assert default_storage.exists(running_part)
    # The results are still there, in the merged output file.
    assert default_storage.exists(File.objects.get(pk=ended.output_file_id).storage_name)


def test_schedule_enqueues_once_per_interval(settings):
    settings.BATCHWEB = {**settings.BATCHWEB, "CLEANUP_INTERVAL_SECONDS": 60}
    control = queues.queue(queues.CONTROL_QUEUE)
    assert cleanup.enqueue_if_due() is True
    assert cleanup.enqueue_if_due() is False  # another worker, same interval
    assert control.job_ids == ["batchweb-cleanup"]
    assert 0 < queues.connection().ttl(cleanup.SCHEDULE_KEY) <= 60
    job = control.fetch_job("batchweb-cleanup")
    assert job.func_name == "jobs.tasks.scheduled_cleanup"
    assert tasks.scheduled_cleanup()["orphans"] == 0

    settings.BATCHWEB = {**settings.BATCHWEB, "CLEANUP_INTERVAL_SECONDS": 0}
    queues.connection().delete(cleanup.SCHEDULE_KEY)
    assert cleanup.enqueue_if_due() is False  # turned off


def test_temp_sweep_removes_what_killed_processes_left(settings, tmp_path):
    settings.TMP_DIR = str(tmp_path / "tmp")
    scratch = cleanup.temp_dir()

    def touch(name: str, *, age: timedelta = timedelta(0)) -> str:
        path = scratch / name
        path.write_bytes(b"x\n")
        stamp = time.time() - age.total_seconds()
        os.utime(path, (stamp, stamp))
        return str(path)

    kept = [
        touch("tmpabc.upload.jsonl", age=timedelta(hours=1)),  # an upload still arriving
        touch("writer-0123"),  # a storage writer's local copy, being written
    ]
    swept = [
        touch("tmpdef.upload.jsonl", age=timedelta(hours=7)),  # a web process killed mid-upload
        touch("tmpghi.copies", age=timedelta(days=2)),  # a validation killed midway
    ]

    assert sorted(cleanup.sweep_temp_dir(dry_run=True)) == sorted(swept)
    assert all(os.path.exists(p) for p in swept)
    assert sorted(cleanup.run_cleanup().temp_files) == sorted(swept)
    assert not any(os.path.exists(p) for p in swept)
    assert all(os.path.exists(p) for p in kept)
