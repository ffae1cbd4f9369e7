"""Every reader of a file registered by reference checks its owner's grant again (the
fourth security round, docs/security.md): once an operator revokes the grant, no download
(API, the files page, the batch page), rerun, eval set or check reads the object any more,
each refusal readable; with the grant back, they read it again. Registering is one heavy
read of a user's at a time. On moto's server, through the counting proxy, so every read of
the user's object is seen."""

from __future__ import annotations

from typing import Any

import pytest
from django.urls import reverse

from jobs.lib import heavy
from jobs.models import Batch, EvalSet, File, StorageGrant
from jobs.services import references
from jobs.services.batches import create_batch
from jobs.services.finalize import finalize_batch
from jobs.services.stopping import cancel_batch
from jobs.services.validation import run_validation
from tests.factories import Api, assert_openai_error, jsonl
from tests.s3.test_references import lines, user_data

pytestmark = pytest.mark.django_db

CHAT = "/v1/chat/completions"


@pytest.fixture
def data(s3: Any, user: Any) -> Any:
    return user_data(s3, user)


def set_lines(n: int) -> list[dict]:
    """Lines that are a batch's input and an eval set's items at once."""
    return [{**line, "expected": "x"} for line in lines(n)]


def test_a_revoked_grant_stops_every_read_of_the_object(s3, data, user, api_key, site):
    data.put("in/a.jsonl", jsonl(set_lines(6)))
    file = references.register_reference(owner=user, source=data.url("in/a.jsonl"),
                                         purpose="batch")
    batch = create_batch(owner=user, input_file_id=file.pk, endpoint=CHAT,
                         completion_window="24h")
    run_validation(batch_id=batch.pk)
    cancel_batch(batch=Batch.objects.get(pk=batch.pk))  # six cancelled requests to rerun
    finalize_batch(batch_id=batch.pk)
    api = Api(api_key)
    assert api.get(f"/v1/files/{file.pk}/content").status_code == 200

    StorageGrant.objects.filter(user=user, read=True).delete()  # the operator revokes it
    reads = len(s3.proxy.fetched("in/a.jsonl"))
    files_before = set(File.objects.values_list("pk", flat=True))

    assert_openai_error(api.get(f"/v1/files/{file.pk}/content"), 400,
                        code="storage_not_granted", param="file_id",
                        fragment="ask an operator for a storage grant")
    assert_openai_error(api.post_json(f"/v1/batches/{batch.pk}/rerun",
                                      {"requests": "cancelled"}), 400,
                        code="storage_not_granted", param="input_file_id")
    assert_openai_error(api.post_json("/v1/eval_sets", {"name": "s", "file_id": file.pk,
                                                        "rule": "exact"}), 400,
                        code="storage_not_granted", param="file_id")
    # The dashboard: both downloads and the rerun button say why, on a page.
    for url, back in ((reverse("file_download", args=[file.pk]), reverse("file_list")),
                      (reverse("batch_download", args=[batch.pk, "input"]),
                       reverse("batch_detail", args=[batch.pk]))):
        answer = site.get(url, follow=True)
        assert answer.redirect_chain[-1][0] == back
        assert "is not under a prefix you may read" in answer.content.decode()
    rerun = site.post(reverse("batch_rerun", args=[batch.pk]), {"requests": "cancelled"},
                      follow=True)
    assert "is not under a prefix you may read" in rerun.content.decode()
    # The new-batch form's check of the file, and its submit.
    for action in ("check", "submit"):
        answer = site.post(reverse("batch_new"), {
            "file_id": file.pk, "action": action, "completion_window": "24h",
            "priority": "default"})
        assert "is not under a prefix you may read" in answer.content.decode()

    assert len(s3.proxy.fetched("in/a.jsonl")) == reads  # nothing read the object
    assert set(File.objects.values_list("pk", flat=True)) == files_before
    assert not EvalSet.objects.exists() and Batch.objects.count() == 1

    # A grant again: the same reads go through.
    StorageGrant.objects.create(user=user, prefix=data.url("in/"), read=True)
    assert api.get(f"/v1/files/{file.pk}/content").status_code == 200
    assert api.post_json(f"/v1/batches/{batch.pk}/rerun",
                         {"requests": "cancelled"}).status_code == 200
    assert api.post_json("/v1/eval_sets", {"name": "s", "file_id": file.pk,
                                           "rule": "exact"}).status_code == 200


def test_registering_is_one_heavy_read_of_a_user_at_a_time(s3, data, user, api_key):
    data.put("in/b.jsonl", jsonl(lines(5)))
    api = Api(api_key)
    body = {"purpose": "batch", "source": data.url("in/b.jsonl")}
    with heavy.one_per_user(user.pk):  # another request of the user is reading a file
        assert_openai_error(api.post_json("/v1/files", body), 429,
                            code="rate_limit_exceeded", fragment="retry in a moment")
    assert not File.objects.exists()
    assert api.post_json("/v1/files", body).status_code == 200
