"""The Files and Uploads APIs, driven by the official openai client against a live server."""

from __future__ import annotations

import hashlib
import io

import pytest
import requests
from django.core.files.storage import default_storage

from jobs.models import File, Upload
from jobs.services.files import MAX_LINES_NAMED
from tests.factories import chat_line, chat_lines, jsonl, lazy_import, make_batch, run_batch

openai = lazy_import("openai")

pytestmark = pytest.mark.django_db(transaction=True)

GOOD = jsonl([chat_line(f"r{i}", f"hello {i}") for i in range(3)])


def chat_line_bytes(custom_id: str, text: str) -> bytes:
    return jsonl([chat_line(custom_id, text)])


def test_upload_retrieve_download_delete(openai_client):
    created = openai_client.files.create(file=("in.jsonl", io.BytesIO(GOOD)), purpose="batch")
    assert created.id.startswith("file-")
    assert created.bytes == len(GOOD)
    assert created.filename == "in.jsonl"
    assert created.purpose == "batch"
    assert created.status == "processed"
    assert created.expires_at > created.created_at  # batch input defaults to 30 days

    row = File.objects.get(pk=created.id)
    assert row.line_count == 3
    assert row.sha256 == hashlib.sha256(GOOD).hexdigest()
    assert "in.jsonl" not in row.storage_name  # random name, not the user's

    assert openai_client.files.retrieve(created.id).id == created.id
    assert openai_client.files.content(created.id).read() == GOOD

    deleted = openai_client.files.delete(created.id)
    assert deleted.deleted is True
    assert not File.objects.filter(pk=created.id).exists()
    assert not default_storage.exists(row.storage_name)
    with pytest.raises(openai.NotFoundError):
        openai_client.files.retrieve(created.id)


def test_expires_after_is_honoured(openai_client):
    created = openai_client.files.create(
        file=("in.jsonl", io.BytesIO(GOOD)), purpose="batch",
        expires_after={"anchor": "created_at", "seconds": 3600})
    assert created.expires_at - created.created_at == 3600


def test_list_files_paginates_and_filters(openai_client):
    ids = [openai_client.files.create(file=(f"f{i}.jsonl", io.BytesIO(GOOD)),
                                      purpose="batch").id for i in range(5)]
    first = openai_client.files.list(limit=2)
    assert [f.id for f in first.data] == ids[::-1][:2]
    assert first.has_more is True
    every = [f.id for f in openai_client.files.list(limit=2)]  # the client follows cursors
    assert every == ids[::-1]
    ascending = openai_client.files.list(order="asc", limit=10)
    assert [f.id for f in ascending.data] == ids
    assert openai_client.files.list(purpose="batch_output").data == []


def test_an_error_file_is_shown_as_a_batch_output_file(openai_client, user, tmp_path):
    batch = run_batch(make_batch(user, chat_lines(4), tmp_path), fails=lambda c: c == "r1")
    output, error = (openai_client.files.retrieve(batch.output_file_id),
                     openai_client.files.retrieve(batch.error_file_id))
    # OpenAI's file objects know batch_output for both: a strictly typed client reads them.
    assert output.purpose == error.purpose == "batch_output"
    listed = {f.id: f.purpose for f in openai_client.files.list(purpose="batch_output")}
    assert listed == {batch.output_file_id: "batch_output", batch.error_file_id: "batch_output"}
    assert [f.id for f in openai_client.files.list(purpose="batch_error")] == \
        [batch.error_file_id]  # the narrower filter still finds it
    assert openai_client.files.content(batch.error_file_id).read().count(b"\n") == 1
    # The row keeps what the file is: the dashboard and cleanup tell the two apart by it.
    assert File.objects.get(pk=batch.error_file_id).purpose == File.Purpose.BATCH_ERROR


@pytest.mark.parametrize("content, fragment", [
    (b"", "no requests"),
    (b"\n\n  \n", "no requests"),
    (b"\x1f\x8b\x08\x00binary", "not UTF-8"),
    (b'{"a": 1}\nnot json\n', "Line 2 is not valid JSON"),
    (b'[1, 2]\n', "not a JSON object"),
])
def test_not_jsonl_is_refused_at_once(openai_client, content, fragment):
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.files.create(file=("x.jsonl", io.BytesIO(content)), purpose="batch")
    assert fragment in caught.value.body["message"]
    assert File.objects.count() == 0


# Three bad lines of different kinds among good ones, and the refusal's words for them.
BAD_THREE = GOOD + b'not json\n[1, 2]\n\n' + chat_line_bytes("r9", "ok") + b'{"a": 1,\n'
NAMED_THREE = ("3 lines are not one JSON object each (each named here); fix them and upload "
               "the file again. Line 4 is not valid JSON. Line 5 is not a JSON object. "
               "Line 8 is not valid JSON.")


def test_every_bad_line_is_named_up_to_the_limit(openai_client, settings):
    """files.create refuses a file that is not JSONL before storing it, as every path that
    makes a File does, naming each bad line (not only the first), at most MAX_LINES_NAMED."""
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.files.create(file=("x.jsonl", io.BytesIO(BAD_THREE)), purpose="batch")
    assert caught.value.body["message"] == NAMED_THREE
    assert (caught.value.body["code"], caught.value.body["param"]) == ("invalid_file", "file")
    many = GOOD + b"nope\n" * (MAX_LINES_NAMED + 5)
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.files.create(file=("x.jsonl", io.BytesIO(many)), purpose="batch")
    message = caught.value.body["message"]
    assert message.startswith(f"{MAX_LINES_NAMED + 5} lines are not one JSON object each "
                              f"(the first {MAX_LINES_NAMED} named here)")
    assert message.count("is not valid JSON") == MAX_LINES_NAMED
    assert f"Line {3 + MAX_LINES_NAMED} is" in message
    assert f"Line {4 + MAX_LINES_NAMED} is" not in message
    # The Uploads API's assembly refuses it with the same words.
    upload = openai_client.uploads.create(bytes=len(BAD_THREE), filename="x.jsonl",
                                          mime_type="application/jsonl", purpose="batch")
    part = openai_client.uploads.parts.create(upload.id, data=BAD_THREE)
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.uploads.complete(upload.id, part_ids=[part.id],
                                       md5=hashlib.md5(BAD_THREE).hexdigest())
    assert caught.value.body["message"] == NAMED_THREE
    assert File.objects.count() == 0


def test_bad_purpose_is_refused(openai_client):
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.files.create(file=("x.jsonl", io.BytesIO(GOOD)), purpose="fine-tune")
    assert caught.value.body["param"] == "purpose"


def test_too_large_is_413_before_reading(live_server, api_key, settings):
    settings.BATCHWEB = {**settings.BATCHWEB, "MAX_FILE_BYTES": 1000}
    response = requests.post(f"{live_server.url}/v1/files",
                             headers={"Authorization": f"Bearer {api_key}"},
                             files={"file": ("x.jsonl", GOOD * 200)}, data={"purpose": "batch"})
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "file_too_large"
    assert File.objects.count() == 0


def test_uploads_api_assembles_parts_in_the_given_order(openai_client):
    half = len(GOOD) // 2
    first, second = GOOD[:half], GOOD[half:]
    upload = openai_client.uploads.create(bytes=len(GOOD), filename="big.jsonl",
                                          mime_type="application/jsonl", purpose="batch")
    assert upload.status == "pending"
    # Sent out of order; the order of part_ids decides.
    part2 = openai_client.uploads.parts.create(upload.id, data=second)
    part1 = openai_client.uploads.parts.create(upload.id, data=first)
    done = openai_client.uploads.complete(upload.id, part_ids=[part1.id, part2.id],
                                          md5=hashlib.md5(GOOD).hexdigest())
    assert done.status == "completed"
    assert done.file.bytes == len(GOOD)
    assert openai_client.files.content(done.file.id).read() == GOOD
    assert not default_storage.exists(f"uploads/{upload.id}") or \
        default_storage.listdir(f"uploads/{upload.id}")[1] == []
    with pytest.raises(openai.ConflictError):
        openai_client.uploads.complete(upload.id, part_ids=[part1.id, part2.id])


def test_uploads_create_honours_expires_after_for_the_upload_and_its_file(openai_client,
                                                                         settings):
    settings.BATCHWEB = {**settings.BATCHWEB, "UPLOAD_TTL_HOURS": 5}
    upload = openai_client.uploads.create(
        bytes=len(GOOD), filename="big.jsonl", mime_type="application/jsonl", purpose="batch",
        expires_after={"anchor": "created_at", "seconds": 7200})
    # Pending, it never outlives the file it is for (two hours, not the five allowed).
    assert upload.expires_at - upload.created_at == 7200
    part = openai_client.uploads.parts.create(upload.id, data=GOOD)
    done = openai_client.uploads.complete(upload.id, part_ids=[part.id])
    # The file lives two hours from its own creation (anchor created_at), not 30 days.
    assert done.file.expires_at - done.file.created_at == 7200
    assert openai_client.files.retrieve(done.file.id).expires_at == done.file.expires_at

    # Without it: the upload's own hours, the input files' 30 days.
    plain = openai_client.uploads.create(bytes=len(GOOD), filename="big.jsonl",
                                         mime_type="application/jsonl", purpose="batch")
    assert plain.expires_at - plain.created_at == 5 * 3600
    part = openai_client.uploads.parts.create(plain.id, data=GOOD)
    file = openai_client.uploads.complete(plain.id, part_ids=[part.id]).file
    assert file.expires_at - file.created_at == 30 * 86400


@pytest.mark.parametrize(("expires_after", "param"), [
    ({"anchor": "last_active_at", "seconds": 3600}, "expires_after.anchor"),
    ({"anchor": "created_at", "seconds": 3599}, "expires_after.seconds"),
    ({"anchor": "created_at", "seconds": 2592001}, "expires_after.seconds"),
    ({"anchor": "created_at"}, "expires_after.seconds"),
    ("never", "expires_after"),
])
def test_uploads_create_refuses_a_bad_expires_after(openai_client, expires_after, param):
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.uploads.create(bytes=len(GOOD), filename="big.jsonl",
                                     mime_type="application/jsonl", purpose="batch",
                                     expires_after=expires_after)
    assert caught.value.status_code == 400
    assert caught.value.body["type"] == "invalid_request_error"
    assert caught.value.body["param"] == param
    assert not Upload.objects.exists()


def test_uploads_api_refuses_wrong_total_md5_and_cancel(openai_client):
    upload = openai_client.uploads.create(bytes=len(GOOD), filename="big.jsonl",
                                          mime_type="application/jsonl", purpose="batch")
    part = openai_client.uploads.parts.create(upload.id, data=GOOD[:10])
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.uploads.complete(upload.id, part_ids=[part.id])
    assert "bytes" in caught.value.body["message"]
    rest = openai_client.uploads.parts.create(upload.id, data=GOOD[10:])
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.uploads.complete(upload.id, part_ids=[part.id, rest.id], md5="0" * 32)
    assert caught.value.body["param"] == "md5"
    with pytest.raises(openai.BadRequestError):  # more than the declared bytes
        openai_client.uploads.parts.create(upload.id, data=b"x")
    cancelled = openai_client.uploads.cancel(upload.id)
    assert cancelled.status == "cancelled"
    assert Upload.objects.get(pk=upload.id).parts.count() == 0
    assert File.objects.count() == 0
    with pytest.raises(openai.ConflictError):
        openai_client.uploads.parts.create(upload.id, data=GOOD)


def test_missing_and_bad_keys_are_401(live_server, api_key):
    for header in (None, "Bearer nope", "Bearer sk-bw-" + "x" * 43, f"Basic {api_key}"):
        headers = {"Authorization": header} if header else {}
        response = requests.get(f"{live_server.url}/v1/files", headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"


def test_revoked_key_is_401(live_server, user):
    from jobs.services.keys import create_api_key, revoke_api_key

    key, secret = create_api_key(owner=user, name="old")
    headers = {"Authorization": f"Bearer {secret}"}
    assert requests.get(f"{live_server.url}/v1/files", headers=headers).status_code == 200
    revoke_api_key(key=key)
    assert requests.get(f"{live_server.url}/v1/files", headers=headers).status_code == 401


def test_another_users_files_and_uploads_are_404(openai_client, other_client):
    mine = openai_client.files.create(file=("in.jsonl", io.BytesIO(GOOD)), purpose="batch")
    upload = openai_client.uploads.create(bytes=len(GOOD), filename="a.jsonl",
                                          mime_type="application/jsonl", purpose="batch")
    part = openai_client.uploads.parts.create(upload.id, data=GOOD)
    for call in (
        lambda: other_client.files.retrieve(mine.id),
        lambda: other_client.files.content(mine.id),
        lambda: other_client.files.delete(mine.id),
        lambda: other_client.uploads.parts.create(upload.id, data=GOOD),
        lambda: other_client.uploads.complete(upload.id, part_ids=[part.id]),
        lambda: other_client.uploads.cancel(upload.id),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert other_client.files.list().data == []
    assert File.objects.filter(pk=mine.id).exists()
