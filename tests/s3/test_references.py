"""Data by reference: a file registered from an object of the user's own bucket (a second
bucket, standing for their data) and read in place by range reads, results delivered to a
prefix of it, both only where a storage grant opens it; a changed object failing the batch
rather than running other data. On moto's server (through the counting proxy, so each read
of the user's object is seen) and on SeaweedFS, the store of the compose deployment."""

from __future__ import annotations

import hashlib
import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

import pytest
import requests
from django.contrib.auth.models import Group

from jobs.lib.errors import ServiceError
from jobs.models import Batch, File, Shard, StorageGrant
from jobs.services import delivery, grants, references
from jobs.services.batches import create_batch
from jobs.services.files import delete_file
from jobs.services.finalize import finalize_batch
from jobs.services.validation import run_validation
from jobs.storage.external import ObjectChanged, grant_problem, parse_s3_url
from tests.factories import (
    chat_line,
    jsonl,
    lazy_import,
    run_batch,
    wait_for,
    wait_status,
)

openai = lazy_import("openai")


@dataclass
class UserData:
    """The user's bucket: `in/` granted for reading, `out/` for writing."""

    client: Any
    bucket: str

    def url(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    def put(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=key, Body=data)

    def get(self, key: str) -> bytes:
        return self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read()

    def keys(self, prefix: str = "") -> list[str]:
        listed = self.client.list_objects_v2(Bucket=self.bucket, Prefix=prefix)
        return sorted(o["Key"] for o in listed.get("Contents", ()))


def user_data(store: Any, user: Any) -> UserData:
    data = UserData(store.client, f"data-{secrets.token_hex(5)}")
    data.client.create_bucket(Bucket=data.bucket)
    StorageGrant.objects.create(user=user, prefix=data.url("in/"), read=True, write=False)
    StorageGrant.objects.create(user=user, prefix=data.url("out/"), read=False, write=True)
    return data


@pytest.fixture(params=["moto", "seaweedfs"])
def store(request: Any) -> Any:
    """The service's storage and the user's bucket on one S3 server: moto, SeaweedFS."""
    return request.getfixturevalue("s3" if request.param == "moto" else "seaweedfs")


@pytest.fixture
def data(s3: Any, user: Any) -> UserData:
    return user_data(s3, user)


def lines(n: int, prefix: str = "r") -> list[dict]:
    return [chat_line(f"{prefix}-{i}", f"question {i} " + "x" * (i % 40)) for i in range(n)]


# --- the rule of names ---


@pytest.mark.parametrize("value", [
    "https://bucket/key.jsonl", "file:///etc/passwd", "s3:/bucket/key", "S3://bucket/key",
    "s3://Bucket/key", "s3://b/key", "s3://bucket", "s3://bucket/", "s3://bucket/in/",
    "s3://bucket/in/../secret.jsonl", "s3://bucket/in/./x.jsonl", "s3://bucket/in//x.jsonl",
    "s3://bucket//in/x.jsonl", "s3://bucket/in\\..\\x", "s3://bucket/in/x\n.jsonl",
    "s3://bucket/" + "k" * 1025, 42, None])
def test_names_that_are_no_plain_object_are_refused(value):
    with pytest.raises(ValueError):
        parse_s3_url(value, folder=False)


def test_names_and_folders_as_written():
    assert parse_s3_url("s3://my-data.eu/in/a b.jsonl", folder=False).key == "in/a b.jsonl"
    assert parse_s3_url("s3://bucket/results/", folder=True).key == "results/"
    assert parse_s3_url("s3://bucket/", folder=True).key == ""
    assert parse_s3_url("s3://bucket", folder=True).key == ""
    with pytest.raises(ValueError, match="folder"):
        parse_s3_url("s3://bucket/results", folder=True)
    inside = parse_s3_url("s3://bucket/in/x.jsonl", folder=False)
    assert inside.within(parse_s3_url("s3://bucket/in/", folder=True))
    assert not inside.within(parse_s3_url("s3://bucket/i/", folder=True))
    assert not inside.within(parse_s3_url("s3://bucket2/in/", folder=True))


@pytest.mark.django_db
def test_a_grant_may_not_open_the_services_own_storage(s3, settings):
    own = f"s3://{s3.bucket}/"
    assert grant_problem(prefix=own, credentials="")[0] == "prefix"
    assert grant_problem(prefix=f"s3://{s3.bucket}/deploy-a/files/", credentials="")
    assert grant_problem(prefix=f"s3://{s3.bucket}/other/", credentials="") is None
    assert grant_problem(prefix="s3://bucket/in", credentials="")[0] == "prefix"
    assert grant_problem(prefix="s3://bucket/in/", credentials="lower")[0] == "credentials"
    assert "BATCHWEB_DATA_NOSUCH_" in grant_problem(prefix="s3://bucket/in/",
                                                    credentials="NOSUCH")[1]


# --- registering, reading in place, delivering (in this process; moto and SeaweedFS) ---


@pytest.mark.django_db(transaction=True)
def test_a_file_by_reference_is_read_in_place_and_its_results_delivered(store, user,
                                                                         settings):
    data = user_data(store, user)
    content = jsonl(lines(120))
    data.put("in/requests.jsonl", content)
    file = references.register_reference(owner=user, source=data.url("in/requests.jsonl"),
                                         purpose="batch")
    head = data.client.head_object(Bucket=data.bucket, Key="in/requests.jsonl")
    assert (file.bytes, file.line_count, file.sha256) == (
        len(content), 120, hashlib.sha256(content).hexdigest())
    assert (file.storage_name, file.source, file.source_etag) == (
        "", data.url("in/requests.jsonl"), head["ETag"])
    assert file.source_modified is not None and file.filename == "requests.jsonl"
    assert file.to_openai()["source"] == data.url("in/requests.jsonl")
    assert store.stored() == []  # nothing copied into the service's storage

    settings.BATCHWEB = {**settings.BATCHWEB, "SHARD_SIZE": 25}
    batch = create_batch(owner=user, input_file_id=file.pk, endpoint="/v1/chat/completions",
                         completion_window="24h", output_prefix=data.url("out/run-1/"))
    assert batch.delivery_status == "pending"
    run_validation(batch_id=batch.pk)
    assert Shard.objects.filter(batch=batch).count() == 5
    done = run_batch(Batch.objects.get(pk=batch.pk), fails=lambda c: c.endswith("7"))
    assert done.status == "completed" and done.delivery_status == "delivered"
    if hasattr(store.proxy, "server"):  # moto, behind the counting proxy
        # Each shard read exactly its byte range of the user's object (plus the
        # registration's and validation's one streamed read each).
        shards = Shard.objects.filter(batch=batch)
        ranged = [c.range for c in store.proxy.fetched("in/requests.jsonl")
                  if c.range != "bytes=0-"]
        assert sorted(ranged) == sorted(f"bytes={s.start_byte}-{s.end_byte - 1}"
                                        for s in shards)

    delivered = done.to_openai()["output_delivery"]
    assert delivered["status"] == "delivered" and delivered["error"] is None
    assert delivered["output"] == data.url(f"out/run-1/{batch.pk}_output.jsonl")
    assert data.keys("out/") == [f"out/run-1/{batch.pk}_errors.jsonl",
                                 f"out/run-1/{batch.pk}_output.jsonl"]
    for file_id, name in ((done.output_file_id, "output"), (done.error_file_id, "errors")):
        stored = File.objects.get(pk=file_id)
        with open_stored(stored) as stream:
            assert data.get(f"out/run-1/{batch.pk}_{name}.jsonl") == stream.read()
    output = [json.loads(line) for line in data.get(
        f"out/run-1/{batch.pk}_output.jsonl").splitlines()]
    assert len(output) == 108 and all(not o["custom_id"].endswith("7") for o in output)

    # Deleting the File (now or when it expires) never deletes the user's object.
    delete_file(file=File.objects.get(pk=file.pk))
    assert data.get("in/requests.jsonl") == content


def open_stored(file: File) -> Any:
    from jobs.storage.objects import open_file

    return open_file(file)


@pytest.mark.django_db(transaction=True)
def test_an_object_changed_before_validation_fails_the_batch(store, user):
    data = user_data(store, user)
    data.put("in/a.jsonl", jsonl(lines(10)))
    file = references.register_reference(owner=user, source=data.url("in/a.jsonl"),
                                         purpose="batch")
    data.put("in/a.jsonl", jsonl(lines(10, prefix="other")))  # same size, other data
    batch = create_batch(owner=user, input_file_id=file.pk, endpoint="/v1/chat/completions",
                         completion_window="24h", output_prefix=data.url("out/"))
    run_validation(batch_id=batch.pk)
    finalize_batch(batch_id=batch.pk)  # the stop's finalization (a control job otherwise)
    failed = Batch.objects.get(pk=batch.pk)
    assert failed.status == "failed" and failed.failed_at is not None
    assert [e["code"] for e in failed.errors] == ["input_changed"]
    assert data.url("in/a.jsonl") in failed.errors[0]["message"]
    assert failed.output_file_id is None and failed.error_file_id is None
    assert not Shard.objects.filter(batch=batch).exists()
    assert data.keys("out/") == []  # nothing to deliver

    # A shard's read insists on the registered version too.
    from jobs.services.shard_input import shard_requests

    shard = Shard(batch=failed, index=0, start_byte=0, end_byte=file.bytes, first_line=1,
                  request_count=10)
    with pytest.raises(ObjectChanged, match="replaced"), shard_requests(
            shard, skip=set(), records=None) as rows:
        next(rows)
    # Downloads of it are refused rather than serving other bytes.
    from jobs.http.web import download_response

    with pytest.raises(ServiceError, match="replaced") as refused:
        download_response(file)
    assert refused.value.status == 409


@pytest.mark.django_db(transaction=True)
def test_a_failed_delivery_is_recorded_retried_and_never_loses_the_results(data, user,
                                                                          settings):
    data.put("in/b.jsonl", jsonl(lines(30)))
    file = references.register_reference(owner=user, source=data.url("in/b.jsonl"),
                                         purpose="batch")
    batch = create_batch(owner=user, input_file_id=file.pk, endpoint="/v1/chat/completions",
                         completion_window="24h", output_prefix=data.url("out/x/"))
    run_validation(batch_id=batch.pk)
    # The operator revokes the write grant before the batch ends.
    StorageGrant.objects.filter(write=True).delete()
    done = run_batch(Batch.objects.get(pk=batch.pk))
    assert done.status == "completed" and done.output_file_id
    assert done.delivery_status == "failed" and done.delivery_attempts == 1
    assert "output_prefix" in done.delivery_error and done.delivery_next_at is not None
    shown = done.to_openai()["output_delivery"]
    assert shown["status"] == "failed" and "not under a prefix" in shown["error"]
    assert data.keys("out/") == []
    assert File.objects.filter(pk=done.output_file_id).exists()

    # Not due yet: the reconciler leaves it; once due, it enqueues one job.
    assert delivery.enqueue_due() == 0
    Batch.objects.filter(pk=batch.pk).update(delivery_next_at=done.created_at)
    assert delivery.enqueue_due() == 1
    assert delivery.enqueue_due() == 0  # its job is waiting
    StorageGrant.objects.create(user=user, prefix=data.url("out/"), write=True, read=False)
    assert delivery.deliver_results(batch_id=batch.pk)
    assert Batch.objects.get(pk=batch.pk).delivery_status == "delivered"
    assert data.keys("out/") == [f"out/x/{batch.pk}_output.jsonl"]
    assert not delivery.deliver_results(batch_id=batch.pk)  # delivered: nothing to do

    # Out of attempts: the reconciler stops; an operator may ask once more.
    settings.BATCHWEB = {**settings.BATCHWEB, "DELIVERY_MAX_ATTEMPTS": 2}
    Batch.objects.filter(pk=batch.pk).update(delivery_status="failed", delivery_attempts=2,
                                             delivery_next_at=None)
    assert delivery.enqueue_due() == 0
    assert delivery.deliver_again(batch=Batch.objects.get(pk=batch.pk))
    assert delivery.deliver_results(batch_id=batch.pk)


@pytest.mark.django_db
def test_names_outside_the_grants_are_refused_naming_the_field(s3, data, user,
                                                               other_user):
    data.put("in/ok.jsonl", jsonl(lines(3)))
    data.put("secret/x.jsonl", jsonl(lines(3)))
    s3.client.put_object(Bucket=s3.bucket, Key="deploy-a/files/someone", Body=b"{}\n")

    def refused(source: str, code: str = "storage_not_granted") -> ServiceError:
        with pytest.raises(ServiceError) as caught:
            references.register_reference(owner=user, source=source, purpose="batch")
        assert caught.value.param == "source" and caught.value.code == code, caught.value
        assert caught.value.status == 400
        return caught.value

    refused(data.url("secret/x.jsonl"))  # the same bucket, no grant there
    refused("s3://another-bucket/in/ok.jsonl")
    refused(data.url("in/../secret/x.jsonl"), "invalid_storage_url")
    refused(data.url("in/./ok.jsonl"), "invalid_storage_url")
    refused(f"https://{data.bucket}.s3.amazonaws.com/in/ok.jsonl", "invalid_storage_url")
    refused(data.url("out/x.jsonl"))  # write only
    refused(data.url("in/missing.jsonl"), "source_not_found")
    # The service's own storage, even where a grant (made behind the admin's back) says so.
    StorageGrant.objects.create(user=user, prefix=f"s3://{s3.bucket}/", read=True)
    refused(f"s3://{s3.bucket}/deploy-a/files/someone")
    # Another user's grant is no grant.
    assert not references.register_reference(owner=user, source=data.url("in/ok.jsonl"),
                                             purpose="batch").source_credentials
    with pytest.raises(ServiceError, match="ask an operator"):
        references.register_reference(owner=other_user, source=data.url("in/ok.jsonl"),
                                      purpose="batch")
    # A group's grant serves its members.
    group = Group.objects.create(name="readers")
    StorageGrant.objects.create(group=group, prefix=data.url("in/"), read=True)
    other_user.groups.add(group)
    assert references.register_reference(owner=other_user, source=data.url("in/ok.jsonl"),
                                         purpose="batch").line_count == 3

    file = File.objects.filter(owner=user).first()
    for prefix, code in ((data.url("in/"), "storage_not_granted"),  # read only
                         (data.url("out"), "invalid_storage_url"),  # not a folder
                         (data.url("out/../in/"), "invalid_storage_url"),
                         ("s3://another-bucket/out/", "storage_not_granted"),
                         (f"s3://{s3.bucket}/deploy-a/", "storage_not_granted")):
        with pytest.raises(ServiceError) as caught:
            create_batch(owner=user, input_file_id=file.pk, endpoint="/v1/chat/completions",
                         completion_window="24h", output_prefix=prefix)
        assert (caught.value.param, caught.value.code) == ("output_prefix", code), prefix
    assert not Batch.objects.exists()

    # A revoked read grant stops new batches on a file registered under it.
    StorageGrant.objects.filter(user=user, read=True).delete()
    with pytest.raises(ServiceError) as caught:
        create_batch(owner=user, input_file_id=file.pk, endpoint="/v1/chat/completions",
                     completion_window="24h")
    assert caught.value.param == "input_file_id"


@pytest.mark.django_db
def test_a_named_credential_set_reaches_another_endpoint(s3, data, user, settings):
    """A grant's credential set from BATCHWEB_DATA_<NAME>_*: here moto itself, not the
    counting proxy the storage settings point at."""
    settings.DATA_CREDENTIALS = {**settings.DATA_CREDENTIALS, "USERDATA": {
        "endpoint_url": s3.server.url, "region_name": "us-east-1",
        "access_key": s3.server.ACCESS_KEY, "secret_key": s3.server.SECRET_KEY,
        "path_style": True}}
    StorageGrant.objects.filter(user=user).update(credentials="USERDATA")
    data.put("in/n.jsonl", jsonl(lines(4)))
    file = references.register_reference(owner=user, source=data.url("in/n.jsonl"),
                                         purpose="batch")
    assert file.source_credentials == "USERDATA" and file.line_count == 4
    assert s3.proxy.fetched("in/n.jsonl") == []


@pytest.mark.django_db
def test_references_take_no_stored_bytes_but_the_size_limit(data, user, settings):
    from jobs.models import Quota
    from jobs.services.quotas import stored_bytes

    content = jsonl(lines(20))
    data.put("in/q.jsonl", content)
    Quota.objects.create(user=user, max_stored_bytes=10)
    file = references.register_reference(owner=user, source=data.url("in/q.jsonl"),
                                         purpose="batch")
    assert stored_bytes(user) == 0 and file.bytes == len(content)
    settings.BATCHWEB = {**settings.BATCHWEB, "MAX_FILE_BYTES": len(content) - 1}
    with pytest.raises(ServiceError) as caught:
        references.register_reference(owner=user, source=data.url("in/q.jsonl"),
                                      purpose="batch")
    assert (caught.value.status, caught.value.param) == (413, "source")
    data.put("in/bad.jsonl", b'{"custom_id": "a"}\nnot json\n')
    with pytest.raises(ServiceError, match="Line 2") as caught:
        references.register_reference(owner=user, source=data.url("in/bad.jsonl"),
                                      purpose="batch")
    assert caught.value.param == "source"


# --- through the API and real workers (moto) ---

pytestmark_live = pytest.mark.django_db(transaction=True)


def register(client: Any, source: Any, **body: Any) -> Any:
    """The extension with the official openai client, unchanged."""
    from openai.types import FileObject

    return client.post("/files", body={"purpose": "batch", "source": source, **body},
                       cast_to=FileObject)


@pytestmark_live
def test_a_batch_by_reference_runs_end_to_end_and_delivers(s3, data, openai_client,
                                                           workers, live_server, api_key):
    content = jsonl(lines(200))
    data.put("in/big.jsonl", content)
    registered = register(openai_client, data.url("in/big.jsonl"))
    assert registered.bytes == len(content) and registered.filename == "big.jsonl"
    assert registered.model_extra["source"] == data.url("in/big.jsonl")
    assert openai_client.files.retrieve(registered.id).bytes == len(content)
    batch = openai_client.batches.create(
        input_file_id=registered.id, endpoint="/v1/chat/completions", completion_window="24h",
        extra_body={"output_prefix": data.url("out/nightly/")})
    assert batch.model_extra["output_prefix"] == data.url("out/nightly/")
    assert batch.model_extra["output_delivery"]["status"] == "pending"
    workers.start(env={**s3.worker_env, "BATCHWEB_SHARD_SIZE": "25"})
    batch = wait_status(openai_client, batch.id, {"completed"}, timeout=90)
    assert batch.request_counts.completed == 200
    delivery = wait_for(lambda: (d := openai_client.batches.retrieve(batch.id).model_extra[
        "output_delivery"])["status"] == "delivered" and d, timeout=30, message="delivered")
    assert delivery["output"] == data.url(f"out/nightly/{batch.id}_output.jsonl")
    assert delivery["errors"] is None
    output = openai_client.files.content(batch.output_file_id).read()
    assert data.get(f"out/nightly/{batch.id}_output.jsonl") == output
    assert len(output.splitlines()) == 200
    # Shards read the user's object by range, as they read a stored upload; nothing of it
    # was copied into the service's storage.
    shards = Shard.objects.filter(batch_id=batch.id)
    ranged = [c.range for c in s3.proxy.fetched("in/big.jsonl") if c.range != "bytes=0-"]
    assert sorted(ranged) == sorted(f"bytes={s.start_byte}-{s.end_byte - 1}" for s in shards)
    assert File.objects.get(pk=registered.id).storage_name == ""
    assert [k for k in s3.stored() if k.startswith(f"{s3.prefix}/files/")] == [
        s3.key(File.objects.get(pk=batch.output_file_id).storage_name)]
    # The input downloads as usual (streamed from the user's object), and its deletion
    # leaves the object.
    response = requests.get(f"{live_server.url}/v1/files/{registered.id}/content",
                            headers={"Authorization": f"Bearer {api_key}"}, timeout=30)
    assert response.content == content
    assert openai_client.files.delete(registered.id).deleted
    assert data.get("in/big.jsonl") == content


@pytestmark_live
def test_the_api_refuses_names_outside_the_grants_with_its_400(s3, data, openai_client):
    for source, code in ((data.url("elsewhere/x.jsonl"), "storage_not_granted"),
                         ("s3://another-bucket/in/x.jsonl", "storage_not_granted"),
                         (data.url("in/../x.jsonl"), "invalid_storage_url"),
                         ("http://example.com/in/x.jsonl", "invalid_storage_url")):
        with pytest.raises(openai.BadRequestError) as caught:
            register(openai_client, source)
        assert (caught.value.code, caught.value.param) == (code, "source"), source
        assert caught.value.body["type"] == "invalid_request_error"
    data.put("in/ok.jsonl", jsonl(lines(2)))
    file = register(openai_client, data.url("in/ok.jsonl"))
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                                     completion_window="24h",
                                     extra_body={"output_prefix": data.url("in/")})
    assert (caught.value.code, caught.value.param) == ("storage_not_granted",
                                                        "output_prefix")
    # Multipart uploads are untouched by the extension.
    plain = openai_client.files.create(file=("in.jsonl", jsonl(lines(2))), purpose="batch")
    assert "source" not in plain.model_extra


@pytestmark_live
def test_an_object_replaced_while_its_batch_runs_fails_it_without_mixing_data(
        s3, data, openai_client, workers):
    data.put("in/live.jsonl", jsonl(lines(80, prefix="old")))
    file = register(openai_client, data.url("in/live.jsonl"))
    batch = openai_client.batches.create(input_file_id=file.id,
                                         endpoint="/v1/chat/completions",
                                         completion_window="24h")
    workers.start(env={**s3.worker_env, "BATCHWEB_SHARD_SIZE": "10",
                       "BATCHWEB_ECHO_SECONDS": "0.1", "BATCHWEB_ECHO_MAX_IN_FLIGHT": "2"})
    wait_for(lambda: openai_client.batches.retrieve(batch.id).request_counts.completed >= 5,
             timeout=60, message="some results")
    data.put("in/live.jsonl", jsonl(lines(80, prefix="new")))
    failed = wait_status(openai_client, batch.id, {"failed"}, timeout=90)
    assert [e.code for e in failed.errors.data] == ["input_changed"]
    assert "replaced" in failed.errors.data[0].message
    results = [json.loads(line) for file_id in (failed.output_file_id, failed.error_file_id)
               if file_id
               for line in openai_client.files.content(file_id).text.splitlines()]
    assert failed.request_counts.completed >= 5 and results
    # Every answer is of the registered data: none of the new object's requests ran.
    assert all(r["custom_id"].startswith("old-") for r in results)
    assert {r["error"]["code"] for r in results if r.get("error")} <= {"input_changed"}
    assert Batch.objects.get(pk=batch.id).stop_code == "input_changed"
    # A shard's read found the new version and stopped the batch; the shards not yet
    # claimed were dropped, never read.
    shards = list(Shard.objects.filter(batch_id=batch.id))
    assert any("ObjectChanged" in s.last_error for s in shards)
    assert any(s.end_code == "input_changed" for s in shards)
    # Its failed requests cannot be rerun from the new object either: a 400 naming it.
    with pytest.raises(openai.BadRequestError) as refused:
        openai_client.post(f"/batches/{batch.id}/rerun", body={"requests": "failed"},
                           cast_to=openai.types.Batch)
    # (its error lines name requests of the old object, which is gone)
    expected = "input_changed" if any(r.get("error") for r in results) else "nothing_to_rerun"
    assert refused.value.code == expected


# --- the dashboard and the admin ---


@pytest.mark.django_db
def test_the_new_batch_form_reads_an_object_and_names_where_results_go(s3, data, site,
                                                                       user):
    from django.urls import reverse

    data.put("in/form.jsonl", jsonl(lines(4)))
    response = site.post(reverse("batch_new"), {
        "source": data.url("in/form.jsonl"), "output_prefix": data.url("out/form/"),
        "action": "submit", "completion_window": "24h", "priority": "default"})
    batch = Batch.objects.get(owner=user)
    assert response.status_code == 302 and response.url == reverse("batch_detail",
                                                                   args=[batch.pk])
    assert batch.input_file.source == data.url("in/form.jsonl")
    assert batch.input_file.line_count == 4 and batch.output_prefix == data.url("out/form/")
    page = site.get(reverse("batch_detail", args=[batch.pk])).content.decode()
    assert 'id="delivery"' in page and data.url("out/form/") in page

    refused = site.post(reverse("batch_new"), {
        "source": data.url("elsewhere/form.jsonl"), "action": "check",
        "completion_window": "24h", "priority": "default"}).content.decode()
    assert "not under a prefix you may read" in refused
    assert Batch.objects.count() == 1


@pytest.mark.django_db
def test_only_superusers_add_or_change_storage_grants(s3, admin_client, user,
                                                      django_user_model):
    from django.contrib.auth.models import Permission
    from django.urls import reverse

    add = reverse("admin:jobs_storagegrant_add")
    response = admin_client.post(add, {"user": user.pk, "prefix": "s3://team-data/in/",
                                       "read": "on", "credentials": ""})
    assert response.status_code == 302, response.content.decode()[:2000]
    assert StorageGrant.objects.get().prefix == "s3://team-data/in/"
    for prefix, problem in ((f"s3://{s3.bucket}/", "own storage"),
                            ("s3://team-data/in", "end it with"),
                            ("s3://team-data/../x/", "segment")):
        page = admin_client.post(add, {"user": user.pk, "prefix": prefix, "read": "on",
                                       "credentials": ""}).content.decode()
        assert problem in page, prefix
    page = admin_client.post(add, {"prefix": "s3://team-data/x/", "read": "on",
                                   "credentials": ""}).content.decode()
    assert "Choose a user or a group" in page
    assert StorageGrant.objects.count() == 1

    staff = django_user_model.objects.create_user("ops", password="pw-ops-123456",
                                                  is_staff=True)
    staff.user_permissions.set(Permission.objects.filter(codename__endswith="storagegrant"))
    admin_client.force_login(staff)
    assert admin_client.get(add).status_code == 403
    change = reverse("admin:jobs_storagegrant_change", args=[StorageGrant.objects.get().pk])
    assert admin_client.post(change, {"user": staff.pk, "prefix": "s3://team-data/",
                                      "read": "on"}).status_code == 403
    assert StorageGrant.objects.get().user == user


@pytest.mark.django_db
def test_a_grant_made_for_writing_opens_no_reading(s3, admin_client, user):
    """An operator who ticks only Write in the admin grants writing only: the prefix is
    neither readable nor listed among the prefixes a read refusal says the user may read."""
    from django.urls import reverse

    data = UserData(s3.client, f"data-{secrets.token_hex(5)}")
    data.client.create_bucket(Bucket=data.bucket)
    data.put("out/x.jsonl", jsonl(lines(2)))
    StorageGrant.objects.create(user=user, prefix=data.url("in/"), read=True, write=False)
    # The admin's form ticks neither box for the operator.
    form = admin_client.get(reverse("admin:jobs_storagegrant_add")).content.decode()
    boxes = re.findall(r'<input type="checkbox" name="(read|write)"[^>]*>', form)
    assert boxes == ["read", "write"] and "checked" not in "".join(
        re.findall(r'<input type="checkbox" name="(?:read|write)"[^>]*>', form))
    made = StorageGrant.objects.create(user=user, prefix=data.url("out/"), write=True)
    assert (made.read, made.write) == (False, True)
    with pytest.raises(ServiceError) as caught:
        references.register_reference(owner=user, source=data.url("out/x.jsonl"),
                                      purpose="batch")
    assert caught.value.code == "storage_not_granted"
    assert caught.value.message.endswith(f"(prefixes you may read: {data.url('in/')}).")
    with pytest.raises(ServiceError) as caught:
        grants.check_output_prefix(owner=user, value=data.url("in/"))
    assert caught.value.message.endswith(f"(prefixes you may write: {data.url('out/')}).")
