"""jobs.storage on a real S3 server (and its filesystem twin): ranges read exactly their
bytes, writes stream as multipart uploads, concatenation copies on the server, cleanup's
listing and deletion by prefix, presigned URLs, and the start-up check naming the setting."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from datetime import timedelta
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.core.files.base import ContentFile
from django.core.files.storage import default_storage
from django.utils import timezone

from jobs.storage import backends as storage
from jobs.storage.embedded import PrivateS3
from jobs.storage.lines import open_range_lines
from tests.factories import ROOT, free_port

MIB = 1024 * 1024


def calls(client: Any, operation: str) -> list[dict[str, Any]]:
    """Record the parameters of every `operation` this client sends."""
    seen: list[dict[str, Any]] = []
    client.meta.events.register(f"provide-client-params.s3.{operation}",
                                lambda params, **_: seen.append(dict(params)))
    return seen


def test_a_range_is_one_get_of_exactly_its_bytes(s3):
    lines = b"".join(f'{{"n": {i}}}\n'.encode() for i in range(1000))
    default_storage.save("files/input", ContentFile(lines))
    gets = calls(storage.backend().client, "GetObject")
    start, end = lines.index(b'{"n": 100}'), lines.index(b'{"n": 200}')
    with open_range_lines("files/input", start=start, end=end, first_number=101) as found:
        got = list(found)
    assert [line.number for line in got] == list(range(101, 201))
    assert got[0].content == b'{"n": 100}' and got[-1].end == end
    assert [g["Range"] for g in gets] == [f"bytes={start}-{end - 1}"]
    with storage.backend().open_range("files/input", end - 5, end) as stream:
        assert stream.read() == lines[end - 5:end]
    with storage.backend().open_range("files/input", len(lines)) as stream:
        assert stream.read() == b""  # at the end: nothing, not an error
    with pytest.raises(FileNotFoundError):
        storage.backend().open_range("files/missing")


def test_reads_from_many_threads_share_one_client(s3):
    # A grouped shard reads its lines from a pool of threads: a client per thread (what
    # django-storages' per-thread connection gives) cost ~90 ms of CPU a Range GET.
    from concurrent.futures import ThreadPoolExecutor

    lines = b"".join(f'{{"n": {i}}}\n'.encode() for i in range(100))
    default_storage.save("files/input", ContentFile(lines))
    backend = storage.backend()

    def read(start: int) -> tuple[int, bytes]:
        with backend.open_range("files/input", start, start + 5) as stream:
            return id(backend.client), stream.read()

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(read, range(0, 400, 10)))
    assert {data for _, data in answers} >= {lines[:5], lines[390:395]}
    assert len({client for client, _ in answers}) == 1


@pytest.mark.parametrize("size", [0, 1000, 2 * storage.PART_BYTES + 12345])
def test_writes_stream_as_multipart_uploads(s3, size):
    data = os.urandom(size)
    creates = calls(storage.backend().client, "CreateMultipartUpload")
    with storage.backend().open_writer("parts/b1/s1-1.output.jsonl") as writer:
        for at in range(0, size, 100_000):
            writer.write(data[at:at + 100_000])
            # Never more than a part held here.
            assert len(writer.buffer) < storage.PART_BYTES  # type: ignore[attr-defined]
        assert s3.stored() == []  # nothing visible before the commit
        name = writer.commit()
    if size == 0:
        assert name == "" and s3.stored() == []  # empty: no object, as before
        return
    assert name == "parts/b1/s1-1.output.jsonl"
    assert s3.stored() == [s3.key(name)]
    assert s3.client.get_object(Bucket=s3.bucket, Key=s3.key(name))["Body"].read() == data
    assert len(creates) == (1 if size > storage.PART_BYTES else 0)


def test_a_failed_write_leaves_nothing(s3):
    with pytest.raises(RuntimeError), \
            storage.backend().open_writer("parts/b1/s1-2.output.jsonl") as writer:
        writer.write(os.urandom(storage.PART_BYTES + 1))  # one part sent
        raise RuntimeError("the engine died")
    assert s3.stored() == []
    assert not s3.client.list_multipart_uploads(Bucket=s3.bucket).get("Uploads")


def test_concatenation_copies_whole_parts_on_the_server(s3):
    big_a, big_b = os.urandom(6 * MIB), os.urandom(16 * MIB)
    small = b'{"small": 1}\n' * 10
    for name, data in (("parts/b/a", big_a), ("parts/b/s", small), ("parts/b/c", big_b),
                       ("parts/b/t", small)):
        default_storage.save(name, ContentFile(data))
    client = storage.backend().client
    copies, sent = calls(client, "UploadPartCopy"), calls(client, "UploadPart")
    made = [b"made on the way 1\n", b"made on the way 2\n"]
    size = storage.backend().concatenate(
        "files/merged", ["parts/b/a", "parts/b/s", iter(made), "parts/b/c", "parts/b/t"])
    expected = big_a + small + b"".join(made) + big_b + small
    assert size == len(expected)
    body = s3.client.get_object(Bucket=s3.bucket, Key=s3.key("files/merged"))["Body"].read()
    assert body == expected
    # The first big part is copied whole; the small pieces join the start of the second
    # big part in one streamed part, and the rest of it is copied.
    assert [c["CopySourceRange"] for c in copies] == [
        f"bytes=0-{len(big_a) - 1}",
        f"bytes={storage.PART_BYTES - len(small) - 36}-{len(big_b) - 1}"]
    streamed = sum(len(c["Body"]) for c in sent)
    assert streamed == storage.PART_BYTES + len(small)
    assert streamed < len(expected) / 2
    assert storage.backend().concatenate("files/nothing", [iter([])]) == 0
    assert s3.key("files/nothing") not in s3.stored()


def test_concatenation_on_the_filesystem(tmp_path, settings):
    settings.STORAGES = {**settings.STORAGES, "default": {
        "BACKEND": "django.core.files.storage.FileSystemStorage",
        "OPTIONS": {"location": str(tmp_path)}}}
    default_storage.save("parts/b/a", ContentFile(b"one\n"))
    default_storage.save("parts/b/b", ContentFile(b"two\n"))
    assert storage.backend().concatenate("files/m", ["parts/b/a", [b"x\n"], "parts/b/b"]) == 10
    assert (tmp_path / "files" / "m").read_bytes() == b"one\nx\ntwo\n"
    assert sorted(p.name for p in (tmp_path / "files").iterdir()) == ["m"]  # no scratch left
    assert storage.backend().concatenate("files/e", []) == 0
    assert not (tmp_path / "files" / "e").exists()


def test_listing_deleting_and_stale_writes_by_prefix(s3):
    for name in ("parts/b1/x", "parts/b1/y", "parts/b2/z", "files/f"):
        default_storage.save(name, ContentFile(b"data\n"))
    found = {o.name: o.size for o in storage.backend().list_prefix("parts")}
    assert found == {"parts/b1/x": 5, "parts/b1/y": 5, "parts/b2/z": 5}
    storage.backend().delete_many(["parts/b1/x", "parts/b1/y", "parts/b1/gone"])
    assert s3.stored() == [s3.key("files/f"), s3.key("parts/b2/z")]
    # A write whose process was killed: invisible, but kept by S3 until aborted.
    for name in ("parts/b3/killed", "parts/live/running"):
        s3.client.create_multipart_upload(Bucket=s3.bucket, Key=s3.key(name))
    later = timezone.now() + timedelta(hours=1)
    assert storage.backend().abort_incomplete("parts", before=later, keep=lambda n: set(),
                                              dry_run=True) \
        == ["parts/b3/killed", "parts/live/running"]
    assert storage.backend().abort_incomplete(
        "parts", before=later, keep=lambda names: {n for n in names if "/live/" in n}) \
        == ["parts/b3/killed"]
    left = s3.client.list_multipart_uploads(Bucket=s3.bucket)["Uploads"]
    assert [u["Key"] for u in left] == [s3.key("parts/live/running")]


def test_presigned_download_url_is_an_attachment(s3):
    default_storage.save("files/out", ContentFile(b'{"a": 1}\n'))
    url = storage.backend().download_url("files/out", filename="b_output.jsonl", seconds=30)
    assert url and "X-Amz-Expires=30" in url
    with urllib.request.urlopen(url) as response:  # noqa: S310 (the local test server)
        assert response.read() == b'{"a": 1}\n'
        assert response.headers["Content-Disposition"] == \
            'attachment; filename="b_output.jsonl"'


def test_missing_bucket_setting_names_it(monkeypatch):
    from batchweb.settings import s3_storage_options

    monkeypatch.delenv("BATCHWEB_S3_BUCKET", raising=False)
    with pytest.raises(ImproperlyConfigured, match="BATCHWEB_S3_BUCKET is required"):
        s3_storage_options()


def _start_check(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`manage.py check` as an operator would start any process with this storage."""
    return subprocess.run([sys.executable, str(ROOT / "manage.py"), "check"], cwd=ROOT,
                          env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=60)


def test_bad_configuration_fails_at_start_naming_the_setting(s3):
    assert _start_check(s3.env).returncode == 0
    wrong_bucket = _start_check({**s3.env, "BATCHWEB_S3_BUCKET": "no-such-bucket-here"})
    assert wrong_bucket.returncode != 0
    assert "BATCHWEB_S3_BUCKET='no-such-bucket-here': no such bucket" in wrong_bucket.stderr
    closed = f"http://127.0.0.1:{free_port()}"
    wrong_endpoint = _start_check({**s3.env, "BATCHWEB_S3_ENDPOINT_URL": closed})
    assert wrong_endpoint.returncode != 0
    assert f"BATCHWEB_S3_ENDPOINT_URL='{closed}': cannot reach" in wrong_endpoint.stderr


def test_refused_credentials_fail_at_start_naming_the_setting(s3_server, tmp_path):
    # A server of its own that checks signatures (the shared one accepts any key, which
    # its presigned URLs need): the first three calls set up a user and its key.
    server = PrivateS3(tmp_path, env={"INITIAL_NO_AUTH_ACTION_COUNT": "3"})
    try:
        import boto3

        iam = boto3.client("iam", endpoint_url=server.url, region_name="us-east-1",
                           aws_access_key_id="setup", aws_secret_access_key="setup")
        iam.create_user(UserName="batchweb")
        key = iam.create_access_key(UserName="batchweb")["AccessKey"]
        iam.put_user_policy(UserName="batchweb", PolicyName="s3", PolicyDocument=json.dumps(
            {"Version": "2012-10-17",
             "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}))
        good = {**server.storage_env("bw-auth"),
                "BATCHWEB_S3_ACCESS_KEY_ID": key["AccessKeyId"],
                "BATCHWEB_S3_SECRET_ACCESS_KEY": key["SecretAccessKey"]}
        server.client(access_key=key["AccessKeyId"],
                      secret_key=key["SecretAccessKey"]).create_bucket(Bucket="bw-auth")
        assert _start_check(good).returncode == 0, _start_check(good).stderr
        for bad in ({"BATCHWEB_S3_SECRET_ACCESS_KEY": "wrong"},
                    {"BATCHWEB_S3_ACCESS_KEY_ID": "AKIAUNKNOWN"}):
            result = _start_check({**good, **bad})
            assert result.returncode != 0
            assert "BATCHWEB_S3_ACCESS_KEY_ID / BATCHWEB_S3_SECRET_ACCESS_KEY" in result.stderr
    finally:
        server.stop()


@pytest.mark.django_db
def test_store_concatenated_makes_the_merged_file(s3, user):
    """What finalize uses to merge a batch's parts: the File row of the joined object,
    hashed and counted as a local merge made it."""
    import hashlib

    from jobs.services.files import store_concatenated

    default_storage.save("parts/b/1.out", ContentFile(b'{"r": 1}\n'))
    default_storage.save("parts/b/2.out", ContentFile(b'{"r": 2}\n'))
    file = store_concatenated(owner=user, sources=["parts/b/1.out", [b'{"e": 3}\n'],
                                                   "parts/b/2.out"],
                              filename="b_error.jsonl", purpose="batch_error")
    expected = b'{"r": 1}\n{"e": 3}\n{"r": 2}\n'
    assert file is not None
    assert (file.bytes, file.line_count, file.sha256) == \
        (len(expected), 3, hashlib.sha256(expected).hexdigest())
    with storage.backend().open_range(file.storage_name) as stream:
        assert stream.read() == expected
    assert store_concatenated(owner=user, sources=[], filename="x", purpose="batch_output") \
        is None
