"""Users' own eval sets through the API (an extension): created from an uploaded file of
purpose batch, listed beside the operator's (marked), read and deleted by id or name;
another user's set is 404 everywhere, the operator's cannot be deleted, a set running
beside a batch is kept (409) until the batch ends; a deleted set's stored file is removed
whoever deletes it (the API, the admin, its owner's deletion), and its runs' results too."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from django.core.files.storage import default_storage

from jobs.models import Batch, EvalRun, EvalSet
from jobs.services import evals
from jobs.services.batches import create_batch
from tests.factories import (
    Api,
    assert_openai_error,
    chat_line,
    jsonl,
    make_batch,
    make_file,
    run_batch,
)

pytestmark = pytest.mark.django_db


def items(expected: Any = "echo: hi", count: int = 3) -> list[dict]:
    return [{"custom_id": f"q{i}", "body": {"messages": [{"role": "user", "content": "hi"}]},
             "expected": expected} for i in range(count)]


def uploaded(api: Api, lines: list[dict]) -> str:
    answer = api.upload(jsonl(lines), filename="set.jsonl")
    assert answer.status_code == 200, answer.content
    return answer.json()["id"]


def operators_set(tmp_path: Path, name: str = "smoke") -> EvalSet:
    path = tmp_path / f"{name}.jsonl"
    path.write_bytes(jsonl(items()))
    return evals.create_eval_set(name=name, path=path, rule="exact")


def test_a_user_creates_lists_reads_and_deletes_a_set(user, api_key, tmp_path,
                                                       django_capture_on_commit_callbacks):
    api = Api(api_key)
    operators = operators_set(tmp_path)
    file_id = uploaded(api, [{**item, "expected": 7} for item in items()])
    created = api.post_json("/v1/eval_sets", {
        "name": "mine", "file_id": file_id, "rule": "numeric", "tolerance": 0.5,
        "drift_threshold": 0.1})
    assert created.status_code == 200, created.content
    body = created.json()
    eval_set = EvalSet.objects.get(name="mine")
    assert body == {"id": f"evalset_{eval_set.pk}", "object": "eval_set", "name": "mine",
                    "owned_by": "user", "created_at": body["created_at"],
                    "url": "/v1/chat/completions", "items": 3, "bytes": eval_set.bytes,
                    "sha256": eval_set.sha256, "rule": "numeric", "tolerance": 0.5,
                    "embedding_model": None, "similarity": 0.9, "drift_threshold": 0.1}
    assert eval_set.owner == user and default_storage.exists(eval_set.storage_name)
    # The set is a copy: the uploaded file may go.
    assert api.delete(f"/v1/files/{file_id}").status_code == 200
    listed = api.get("/v1/eval_sets").json()
    assert listed["object"] == "list" and listed["has_more"] is False
    assert [(s["name"], s["owned_by"]) for s in listed["data"]] == [
        ("mine", "user"), ("smoke", "operator")]
    assert api.get(f"/v1/eval_sets/evalset_{operators.pk}").json()["owned_by"] == "operator"
    for key in ("mine", f"evalset_{eval_set.pk}", str(eval_set.pk)):
        assert api.get(f"/v1/eval_sets/{key}").json()["id"] == f"evalset_{eval_set.pk}"
    # Attached by its id as by its name.
    batch = make_batch(user, [chat_line("a", "hi")], tmp_path, eval_set=f"evalset_{eval_set.pk}")
    assert batch.eval_set_id == eval_set.pk
    run_batch(batch)
    with django_capture_on_commit_callbacks(execute=True):
        deleted = api.delete("/v1/eval_sets/mine")
    assert deleted.json() == {"id": f"evalset_{eval_set.pk}", "object": "eval_set",
                              "deleted": True}
    assert not EvalSet.objects.filter(pk=eval_set.pk).exists()
    assert not default_storage.exists(eval_set.storage_name)
    assert_openai_error(api.get("/v1/eval_sets/mine"), 404, code="not_found")
    assert Batch.objects.get(pk=batch.pk).eval_set_id is None  # the batch stays


def test_a_users_set_of_an_operators_name_is_theirs_first(user, api_key, tmp_path):
    api = Api(api_key)
    operators = operators_set(tmp_path)
    created = api.post_json("/v1/eval_sets", {"name": "smoke", "rule": "exact",
                                              "file_id": uploaded(api, items())})
    assert created.status_code == 200, created.content
    assert api.get("/v1/eval_sets/smoke").json()["owned_by"] == "user"
    assert api.get(f"/v1/eval_sets/evalset_{operators.pk}").json()["owned_by"] == "operator"
    assert evals.find_set_for_user(owner=user, value="smoke").owner == user


def test_create_refusals(user, other_user, api_key, tmp_path, monkeypatch):
    api = Api(api_key)
    good = uploaded(api, items())

    def refused(body: dict, status: int = 400, **expect: Any) -> None:
        assert_openai_error(api.post_json("/v1/eval_sets", {"name": "s", "rule": "exact",
                                                            "file_id": good, **body}),
                            status, **expect)

    refused({"file_id": None}, param="file_id")
    refused({"rule": "fuzzy"}, param="rule")
    refused({"rule": ["exact"]}, param="rule")
    refused({"name": ""}, param="name")
    refused({"name": 12}, param="name")
    refused({"name": "evalset_3"}, param="name", fragment="look like a set's id")
    refused({"name": "42"}, param="name")
    refused({"tolerance": "0.5"}, param="tolerance")
    refused({"tolerance": -1}, param="tolerance")
    refused({"similarity": 2}, param="similarity")
    refused({"drift_threshold": True}, param="drift_threshold")
    refused({"rule": "embedding", "embedding_model": "nope"}, param="embedding_model")
    refused({"rule": "embedding", "embedding_model": 3}, param="embedding_model")
    refused({"file_id": uploaded(api, [*items(), {**items()[0], "custom_id": "x",
                                                  "expected": 3}])},
            fragment="Line 4: expected must be a string")
    theirs = make_file(other_user, items(), tmp_path)
    refused({"file_id": theirs.pk}, 404, code="not_found")
    assert_openai_error(api.post_json("/v1/eval_sets", "[]"), 400)
    assert not EvalSet.objects.exists()
    assert api.post_json("/v1/eval_sets", {"name": "s", "rule": "exact",
                                           "file_id": good}).status_code == 200
    refused({}, fragment="exists already", param="name")
    monkeypatch.setattr(evals, "MAX_OWN_SETS", 1)
    refused({"name": "t"}, code="too_many_eval_sets")
    assert list(EvalSet.objects.values_list("name", flat=True)) == ["s"]


def test_another_users_set_is_404_everywhere(user, other_user, api_key, other_key, tmp_path):
    api, theirs_api = Api(api_key), Api(other_key)
    theirs = theirs_api.post_json("/v1/eval_sets", {
        "name": "private", "rule": "exact", "file_id": uploaded(theirs_api, items())}).json()
    for key in ("private", theirs["id"], theirs["id"].removeprefix("evalset_")):
        assert_openai_error(api.get(f"/v1/eval_sets/{key}"), 404, code="not_found")
        assert_openai_error(api.delete(f"/v1/eval_sets/{key}"), 404, code="not_found")
    assert [s["name"] for s in api.get("/v1/eval_sets").json()["data"]] == []
    file = make_file(user, [chat_line("a", "hi")], tmp_path)
    with pytest.raises(Exception, match="No such eval set") as caught:
        create_batch(owner=user, input_file_id=file.pk, endpoint="/v1/chat/completions",
                     completion_window="24h", eval_set=theirs["id"])
    assert caught.value.status == 404  # type: ignore[attr-defined]
    assert EvalSet.objects.filter(name="private").exists()


def test_the_operators_set_is_not_the_users_to_delete(api_key, tmp_path):
    api = Api(api_key)
    operators = operators_set(tmp_path)
    assert_openai_error(api.delete("/v1/eval_sets/smoke"), 403, code="permission_denied")
    assert EvalSet.objects.filter(pk=operators.pk).exists()


def test_a_set_running_beside_a_batch_is_kept_until_the_batch_ends(user, api_key, tmp_path):
    api = Api(api_key)
    api.post_json("/v1/eval_sets", {"name": "mine", "rule": "exact",
                                    "file_id": uploaded(api, items())})
    eval_set = EvalSet.objects.get(name="mine")
    batch = make_batch(user, [chat_line("a", "hi")], tmp_path, eval_set="mine")
    assert_openai_error(api.delete("/v1/eval_sets/mine"), 409, code="invalid_state",
                        fragment=batch.pk)
    run_batch(batch)
    # Its run still waits to be scored: the scorer reads the set's file.
    run = EvalRun.objects.create(eval_set=eval_set, batch=batch, trigger="batch",
                                 base_model="echo-test", model="echo-test")
    assert_openai_error(api.delete("/v1/eval_sets/mine"), 409, code="invalid_state")
    EvalRun.objects.filter(pk=run.pk).update(status=EvalRun.Status.SCORED)
    assert api.delete("/v1/eval_sets/mine").status_code == 200
    assert not EvalRun.objects.exists()


def test_the_stored_files_go_whoever_deletes_the_set(user, tmp_path, admin_client,
                                                     django_capture_on_commit_callbacks):
    def own_set(name: str) -> EvalSet:
        path = tmp_path / f"{name}.jsonl"
        path.write_bytes(jsonl(items()))
        return evals.create_eval_set(name=name, path=path, rule="exact", owner=user)

    # The admin's delete.
    first = own_set("first")
    with django_capture_on_commit_callbacks(execute=True):
        answer = admin_client.post(f"/admin/jobs/evalset/{first.pk}/delete/", {"post": "yes"})
    assert answer.status_code == 302 and not EvalSet.objects.filter(pk=first.pk).exists()
    assert not default_storage.exists(first.storage_name)
    # Its owner's deletion, with a scored run's results.
    second = own_set("second")
    batch = make_batch(user, [chat_line("a", "hi")], tmp_path)
    results = default_storage.save("evals/run.jsonl", _content(b"{}\n"))
    EvalRun.objects.create(eval_set=second, batch=batch, trigger="batch", base_model="m",
                           model="m", status="scored", results_name=results)
    with django_capture_on_commit_callbacks(execute=True):
        user.delete()
    assert not EvalSet.objects.exists() and not EvalRun.objects.exists()
    assert not default_storage.exists(second.storage_name)
    assert not default_storage.exists(results)


def _content(data: bytes) -> Any:
    from django.core.files.base import ContentFile

    return ContentFile(data)


@pytest.mark.django_db(transaction=True)
def test_through_the_openai_clients_generic_calls(openai_client, tmp_path):
    import io

    file = openai_client.files.create(file=("set.jsonl", io.BytesIO(jsonl(items()))),
                                      purpose="batch")
    created = openai_client.post("/eval_sets", body={"name": "mine", "file_id": file.id,
                                                     "rule": "normalized"},
                                 cast_to=httpx.Response).json()
    assert created["object"] == "eval_set" and created["rule"] == "normalized"
    listed = openai_client.get("/eval_sets", cast_to=httpx.Response).json()
    assert [s["id"] for s in listed["data"]] == [created["id"]]
    deleted = openai_client.delete(f"/eval_sets/{created['id']}",
                                   cast_to=httpx.Response).json()
    assert deleted["deleted"] is True
    assert openai_client.get("/eval_sets", cast_to=httpx.Response).json()["data"] == []
