"""The whole service on S3: upload through the API, a batch run by a real echo-engine
worker process, the output downloaded (streamed, or by presigned redirect); the Uploads
API; cancel; cleanup; the storage quota. Every process reads the same storage settings,
pointed at the local S3 server; the workers reach it through a proxy that counts what they
fetch."""

from __future__ import annotations

import hashlib
import json
from datetime import timedelta

import pytest
import requests
from django.utils import timezone

from jobs.models import Batch, File, Quota, Shard, UploadPart
from jobs.services import cleanup
from jobs.storage.backends import backend
from tests.factories import (
    assert_exactly_once,
    chat_line,
    jsonl,
    lazy_import,
    new_batch,
    shared_prefix_lines,
    upload,
    wait_for,
    wait_status,
)

openai = lazy_import("openai")

pytestmark = pytest.mark.django_db(transaction=True)


def submit(client, data: bytes):
    file = upload(client, data)
    return file, new_batch(client, file.id)


def test_a_batch_runs_on_s3_and_each_shard_reads_only_its_bytes(
        s3, openai_client, workers, settings, live_server, api_key):
    lines = [chat_line(f"req-{i}", f"question number {i} " + "x" * (i % 50))
             for i in range(400)]
    data = jsonl(lines)
    file, batch = submit(openai_client, data)
    assert s3.stored() == [s3.key(File.objects.get(pk=file.id).storage_name)]
    workers.start(env={**s3.worker_env, "BATCHWEB_SHARD_SIZE": "25"})
    batch = wait_status(openai_client, batch.id, {"completed"}, timeout=90)
    assert batch.request_counts.completed == 400

    output = openai_client.files.content(batch.output_file_id).text.splitlines()
    assert sorted(json.loads(line)["custom_id"] for line in output) == \
        sorted(line["custom_id"] for line in lines)
    # Everything lives under the deployment's key prefix: input, output, shard parts.
    stored = File.objects.get(pk=batch.output_file_id).storage_name
    assert s3.key(stored) in s3.stored()
    assert all(key.startswith(s3.prefix + "/") for key in s3.stored())

    shards = list(Shard.objects.filter(batch_id=batch.id).order_by("index"))
    assert len(shards) == 16
    input_key = s3.key(File.objects.get(pk=file.id).storage_name)
    fetches = s3.proxy.fetched(input_key)
    # Validation streams the file once, from its start; each shard is one Range GET of
    # exactly [start, end).
    ranged = [f for f in fetches if f.range != "bytes=0-"]
    assert sorted(f.range for f in ranged) == sorted(
        f"bytes={s.start_byte}-{s.end_byte - 1}" for s in shards)
    shard_bytes = sum(f.bytes for f in ranged)
    print(f"{len(shards)} shards read {shard_bytes} bytes of a {len(data)}-byte file "
          f"({shard_bytes / len(data):.3f}x); validation read "
          f"{sum(f.bytes for f in fetches) - shard_bytes}")
    assert shard_bytes <= 1.1 * len(data)
    assert shard_bytes == len(data)

    # Downloads stream through the web process by default...
    response = requests.get(f"{live_server.url}/v1/files/{batch.output_file_id}/content",
                            headers={"Authorization": f"Bearer {api_key}"},
                            allow_redirects=False, timeout=30)
    assert response.status_code == 200
    assert response.headers["Content-Length"] == str(len(response.content))
    # ...or, when asked, redirect to a presigned URL of a few seconds, after the owner check.
    settings.DOWNLOAD_REDIRECT = True
    settings.DOWNLOAD_URL_SECONDS = 20
    redirected = requests.get(f"{live_server.url}/v1/files/{batch.output_file_id}/content",
                              headers={"Authorization": f"Bearer {api_key}"},
                              allow_redirects=False, timeout=30)
    assert redirected.status_code == 302
    location = redirected.headers["Location"]
    assert location.startswith(s3.worker_env["BATCHWEB_S3_ENDPOINT_URL"])
    assert "X-Amz-Expires=20" in location
    assert requests.get(location, timeout=30).content == response.content



def test_a_grouped_batch_on_s3_reads_each_line_once_through_its_line_index(
        s3, openai_client, workers):
    lines = shared_prefix_lines(300, groups=6)
    data = jsonl(lines)
    file, batch = submit(openai_client, data)
    workers.start(env={**s3.worker_env, "BATCHWEB_SHARD_SIZE": "25"})
    batch = wait_status(openai_client, batch.id, {"completed"}, timeout=90)
    row = Batch.objects.get(pk=batch.id)
    assert row.plan["grouped"] and row.line_index
    output = [json.loads(line) for line in
              openai_client.files.content(batch.output_file_id).text.splitlines()]
    assert_exactly_once(output, [], {line["custom_id"] for line in lines})

    # Each shard reads its records of the line index (one Range GET), then its lines: the
    # input bytes the shards fetch stay within 1.1x of the file.
    shards = list(Shard.objects.filter(batch_id=batch.id))
    index_fetches = s3.proxy.fetched(s3.key(row.line_index))
    record = 16
    assert sorted(f.range for f in index_fetches) == sorted(
        f"bytes={s.lines_from * record}-{s.lines_to * record - 1}" for s in shards)
    fetches = s3.proxy.fetched(s3.key(File.objects.get(pk=file.id).storage_name))
    shard_bytes = sum(f.bytes for f in fetches if f.range != "bytes=0-")
    print(f"{len(shards)} grouped shards read {shard_bytes} bytes of a {len(data)}-byte "
          f"file ({shard_bytes / len(data):.3f}x) in {len(fetches) - 1} range GETs")
    assert len(data) * 0.99 <= shard_bytes <= 1.1 * len(data)

def test_another_user_gets_no_presigned_url(s3, openai_client, other_client, settings):
    settings.DOWNLOAD_REDIRECT = True
    file, _ = submit(openai_client, jsonl([chat_line("a", "x")]))
    with pytest.raises(openai.NotFoundError):
        other_client.files.content(file.id)


def test_uploads_api_assembles_parts_on_the_server(s3, openai_client):
    # Big enough for a server-side copy: the first part is over S3's 5 MiB part minimum.
    lines = [chat_line(f"u{i}", "y" * 200) for i in range(25_000)]
    data = jsonl(lines)
    cut = 5 * 1024 * 1024 + 100
    upload = openai_client.uploads.create(bytes=len(data), filename="big.jsonl",
                                          mime_type="application/jsonl", purpose="batch")
    tail = openai_client.uploads.parts.create(upload.id, data=data[cut:])
    head = openai_client.uploads.parts.create(upload.id, data=data[:cut])
    part_names = dict(UploadPart.objects.values_list("pk", "storage_name"))
    done = openai_client.uploads.complete(upload.id, part_ids=[head.id, tail.id],
                                          md5=hashlib.md5(data).hexdigest())
    assert done.status == "completed" and done.file.bytes == len(data)
    row = File.objects.get(pk=done.file.id)
    assert row.line_count == 25_000 and row.sha256 == hashlib.sha256(data).hexdigest()
    head_key = s3.key(part_names[head.id])
    copies = s3.proxy.copies()
    assert [(c.copy_source.split("/", 1)[1], c.range) for c in copies] == \
        [(head_key, f"bytes=0-{cut - 1}")]
    # Only the small tail passed through the web process (read once to check it, and once
    # to join it); the big head was read once, for the check, and copied on the server.
    assert sum(c.sent for c in s3.proxy.calls if c.method in ("PUT", "POST")) < 2 * len(data)
    assert openai_client.files.content(done.file.id).read() == data
    # The parts are gone; only the assembled file remains.
    assert s3.stored() == [s3.key(row.storage_name)]

    bad = openai_client.uploads.create(bytes=len(data), filename="big.jsonl",
                                       mime_type="application/jsonl", purpose="batch")
    parts = [openai_client.uploads.parts.create(bad.id, data=data[:cut]).id,
             openai_client.uploads.parts.create(bad.id, data=data[cut:]).id]
    with pytest.raises(openai.BadRequestError, match="md5"):
        openai_client.uploads.complete(bad.id, part_ids=parts, md5="0" * 32)
    assert File.objects.count() == 1


def test_cancel_on_s3_keeps_finished_results(s3, openai_client, workers):
    _, batch = submit(openai_client, jsonl([chat_line(f"c{i}", f"q {i}") for i in range(60)]))
    workers.start(env={**s3.worker_env, "BATCHWEB_SHARD_SIZE": "10",
                       "BATCHWEB_ECHO_SECONDS": "0.1", "BATCHWEB_ECHO_MAX_IN_FLIGHT": "4"})
    wait_for(lambda: openai_client.batches.retrieve(batch.id).request_counts.completed >= 5,
             timeout=60, message="some results")
    assert openai_client.batches.cancel(batch.id).status == "cancelling"
    batch = wait_status(openai_client, batch.id, {"cancelled"}, timeout=90)
    done = batch.request_counts.completed
    errors = openai_client.files.content(batch.error_file_id).text.splitlines()
    assert len(errors) == 60 - done
    assert all('"batch_cancelled"' in line for line in errors)
    if done:
        assert len(openai_client.files.content(batch.output_file_id).text.splitlines()) == done


def test_cleanup_lists_and_deletes_by_prefix_on_s3(s3, openai_client, workers):
    file, batch = submit(openai_client, jsonl([chat_line(f"k{i}", "z") for i in range(30)]))
    workers.start(env={**s3.worker_env, "BATCHWEB_SHARD_SIZE": "10"})
    batch = wait_status(openai_client, batch.id, {"completed"}, timeout=90)
    workers.stop_all()
    parts = [n for s in Shard.objects.filter(batch_id=batch.id)
             for n in (s.output_part, s.error_part) if n]
    assert parts and all(s3.key(n) in s3.stored() for n in parts)
    orphan = "files/" + "0" * 32
    s3.client.put_object(Bucket=s3.bucket, Key=s3.key(orphan), Body=b"lost\n")
    s3.client.create_multipart_upload(Bucket=s3.bucket, Key=s3.key(f"parts/{batch.id}/x"))
    File.objects.filter(pk=file.id).update(expires_at=timezone.now())

    report = cleanup.run_cleanup(now=timezone.now() + timedelta(days=2))

    assert report.expired_files == [file.id]
    assert sorted(report.merged_parts) == sorted(parts)
    assert sorted(report.orphans) == sorted([orphan, f"parts/{batch.id}/x"])
    assert s3.stored() == [s3.key(File.objects.get(pk=batch.output_file_id).storage_name)]
    assert not s3.client.list_multipart_uploads(Bucket=s3.bucket).get("Uploads")


def test_stored_bytes_quota_counts_what_s3_holds(s3, openai_client, user):
    data = jsonl([chat_line(f"q{i}", "w") for i in range(20)])
    first, _ = submit(openai_client, data)
    stored = sum(o.size for o in backend().list_prefix("files"))
    assert stored == first.bytes == len(data)
    Quota.objects.create(user=user, max_stored_bytes=stored + len(data) - 1)
    with pytest.raises(openai.RateLimitError, match="stored bytes"):
        submit(openai_client, data)
    assert sum(o.size for o in backend().list_prefix("files")) == stored
    assert Batch.objects.count() == 1
