"""The fourth security round's findings that need no object storage (docs/security.md):
eval sets count in the stored-bytes quota and their limit holds under concurrent creates;
rerun and eval-set create answer 429 beside another heavy request of the same user (each
API face in its error shape, the dashboard with a message), and an attached set's ceiling
is computed once; deeply nested JSON in an eval set is a readable refusal; `/metrics`
labels eval series by set id, for active or recent sets only; a storage that cannot be
reached is never named to users (its address stays in the operator's log)."""

from __future__ import annotations

import contextlib
import io
import logging
import threading
from datetime import timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from django.core.files.storage import default_storage
from django.urls import reverse
from django.utils import timezone

from jobs.lib import heavy
from jobs.lib.errors import ServiceError
from jobs.models import Batch, EvalRun, EvalSet, Price, Quota, StorageGrant
from jobs.services import evals, quotas, references
from jobs.services.batches import create_batch
from jobs.services.validation import run_validation
from tests.api.test_rerun import stopped_batch
from tests.factories import (
    Api,
    assert_openai_error,
    chat_line,
    free_port,
    in_thread,
    jsonl,
    make_batch,
    make_file,
    run_batch,
)

CHAT = "/v1/chat/completions"


def set_items(count: int = 3, expected: Any = "echo: hi") -> list[dict]:
    return [{"custom_id": f"q{i}", "body": {"messages": [{"role": "user", "content": "hi"}]},
             "expected": expected} for i in range(count)]


def own_set(owner: Any, name: str, tmp_path: Path) -> EvalSet:
    path = tmp_path / f"{name}.jsonl"
    path.write_bytes(jsonl(set_items()))
    return evals.create_eval_set(name=name, path=path, rule="exact", owner=owner)


# --- eval sets in the stored-bytes quota ---


def stored_sets() -> list[str]:
    """The sets' objects in the service's storage."""
    return default_storage.listdir("evalsets")[1] if default_storage.exists("evalsets") \
        else []


@pytest.mark.django_db
def test_eval_sets_count_in_the_stored_bytes_quota(user, api_key):
    """The probe: upload, make a set of it, delete the file, again: each set a stored copy
    outside the quota (four copies held on a quota of two). Now a set's bytes are the
    owner's as a file's are."""
    api = Api(api_key)
    content = jsonl(set_items(12))
    quota = Quota.objects.create(user=user, max_stored_bytes=2 * len(content) - 1)

    def make_set(name: str) -> Any:
        file_id = api.upload(content, filename="set.jsonl").json()["id"]
        answer = api.post_json("/v1/eval_sets", {"name": name, "file_id": file_id,
                                                 "rule": "exact"})
        assert api.delete(f"/v1/files/{file_id}").status_code == 200
        return answer

    # The file and its copy do not both fit.
    assert_openai_error(make_set("a"), 429, code="max_stored_bytes_exceeded",
                        fragment="Delete files or eval sets")
    assert not EvalSet.objects.exists() and stored_sets() == []
    quota.max_stored_bytes = 2 * len(content)
    quota.save()
    assert make_set("a").status_code == 200
    assert quotas.stored_bytes(user) == len(content)  # the set, its file deleted
    assert_openai_error(make_set("b"), 429, code="max_stored_bytes_exceeded")
    assert EvalSet.objects.count() == 1 and len(stored_sets()) == 1
    # The dashboard's path (no file) is held to the same quota: one more set fits, exactly.
    evals.create_own_eval_set(owner=user, name="c", path=_written(content), rule="exact")
    with pytest.raises(ServiceError) as caught:
        evals.create_own_eval_set(owner=user, name="d", path=_written(content), rule="exact")
    assert caught.value.code == "max_stored_bytes_exceeded"
    assert EvalSet.objects.count() == 2 and len(stored_sets()) == 2
    for name in ("a", "c"):
        assert api.delete(f"/v1/eval_sets/{name}").status_code == 200
    assert quotas.stored_bytes(user) == 0


def _written(content: bytes) -> Path:
    import tempfile

    handle = tempfile.NamedTemporaryFile(suffix=".jsonl", delete=False)  # noqa: SIM115
    handle.write(content)
    handle.close()
    return Path(handle.name)


@pytest.mark.django_db(transaction=True)
def test_the_set_limit_holds_under_concurrent_creates(user, tmp_path, monkeypatch):
    """Two creates at the last place: each checks while the other has not yet created.
    The first to check holds its owner's lock until its set is in; the second then finds
    the limit reached (and leaves no stored object behind)."""
    monkeypatch.setattr(evals, "MAX_OWN_SETS", 2)
    own_set(user, "first", tmp_path)
    # Each create waits for the other just before its row is written, as far as the
    # owner's lock lets it: without the lock, both have counted one set by then.
    meet = threading.Barrier(2)
    manager = EvalSet.objects
    real_create = manager.create

    def create_row(**fields: Any) -> EvalSet:
        # Broken after 3 s when the other waits on the owner's lock: this one goes on.
        with contextlib.suppress(threading.BrokenBarrierError):
            meet.wait(timeout=3)
        return real_create(**fields)

    monkeypatch.setattr(manager, "create", create_row)
    outcomes: list[Any] = []

    def create(name: str) -> None:
        path = tmp_path / f"{name}.jsonl"
        path.write_bytes(jsonl(set_items()))
        try:
            outcomes.append(evals.create_eval_set(name=name, path=path, rule="exact",
                                                  owner=user))
        except ServiceError as exc:
            outcomes.append(exc)

    threads = [in_thread(lambda n=n: create(n)) for n in ("second", "third")]
    for thread in threads:
        thread.join(30)
    refused = [o for o in outcomes if isinstance(o, ServiceError)]
    assert len(outcomes) == 2 and len(refused) == 1, outcomes
    assert refused[0].code == "too_many_eval_sets"
    assert EvalSet.objects.filter(owner=user).count() == 2
    assert len(stored_sets()) == 2  # the refused set's object was deleted


# --- heavy work: one at a time per user ---


@pytest.mark.django_db
def test_rerun_and_set_creates_answer_429_beside_another_heavy_request(
        user, api_key, site, tmp_path, settings):
    api = Api(api_key)
    batch = stopped_batch(user, tmp_path, settings)
    message_batch = stopped_batch(user, tmp_path, settings, api=Batch.Api.ANTHROPIC)
    file_id = api.upload(jsonl(set_items()), filename="set.jsonl").json()["id"]
    upload = io.BytesIO(jsonl(set_items()))
    upload.name = "set.jsonl"
    with heavy.one_per_user(user.pk):  # another request of the user is reading a file
        assert_openai_error(api.post_json(f"/v1/batches/{batch.pk}/rerun", {}), 429,
                            code="rate_limit_exceeded", fragment="retry in a moment")
        anthropic = site.post(f"/v1/messages/batches/{message_batch.pk}/rerun", {},
                              content_type="application/json", HTTP_X_API_KEY=api_key)
        assert anthropic.status_code == 429
        assert anthropic.json()["type"] == "error"
        assert anthropic.json()["error"]["type"] == "rate_limit_error"
        assert_openai_error(api.post_json("/v1/eval_sets", {
            "name": "a", "file_id": file_id, "rule": "exact"}), 429,
            code="rate_limit_exceeded", fragment="creating an eval set")
        page = site.post(reverse("eval_set_list"), {"name": "b", "rule": "exact",
                                                    "upload": upload})
        assert page.status_code == 200
        assert "Another of your requests is creating an eval set" in page.content.decode()
        rerun_page = site.post(reverse("batch_rerun", args=[batch.pk]), follow=True)
        assert "retry in a moment" in rerun_page.content.decode()
    assert Batch.objects.filter(metadata__rerun_of=batch.pk).count() == 0
    assert not EvalSet.objects.exists()
    # Once it is done, each goes through.
    assert api.post_json(f"/v1/batches/{batch.pk}/rerun", {}).status_code == 200
    assert api.post_json("/v1/eval_sets", {"name": "a", "file_id": file_id,
                                           "rule": "exact"}).status_code == 200


@pytest.mark.django_db
def test_an_attached_sets_ceiling_is_counted_once(user, tmp_path):
    """The ceiling of a set attached at every batch create was a pass over the whole set
    each time. A stored set never changes: counted once, the next create reads none of
    it (here: its object gone, the create still answers, with the same ceiling)."""
    Price.objects.create(model="", input_per_million=1000, output_per_million=1000,
                         batch_discount_percent=0)
    Quota.objects.create(user=user, cost_per_month=Decimal("100"))
    eval_set = own_set(user, "mine", tmp_path)
    file = make_file(user, [chat_line("r", "hi", max_tokens=5)], tmp_path)

    def create() -> Batch:
        return create_batch(owner=user, input_file_id=file.pk, endpoint=CHAT,
                            completion_window="24h", eval_set="mine")

    first = create()
    default_storage.delete(eval_set.storage_name)
    second = create()
    assert second.cost_ceiling_nanos == first.cost_ceiling_nanos > 0
    # Its price applies at every create: a new price, a new ceiling, from the same count.
    Price.objects.filter(model="").update(input_per_million=2000, output_per_million=2000)
    assert create().cost_ceiling_nanos == 2 * first.cost_ceiling_nanos


# --- deeply nested JSON ---


@pytest.mark.django_db
@pytest.mark.parametrize("depth", [100_000, 950])
def test_a_deeply_nested_set_is_a_readable_refusal(site, user, api_key, depth):
    """The dashboard's upload answered 500 (a RecursionError escaped); the API's path is
    refused too, wherever the nesting is (the upload's own check, or the set's)."""
    deep = "[" * depth + "]" * depth
    line = ('{"custom_id": "q0", "body": {"messages": [{"role": "user", "content": "hi"}]}, '
            f'"expected": {deep}}}').encode() + b"\n"
    upload = io.BytesIO(line)
    upload.name = "deep.jsonl"
    page = site.post(reverse("eval_set_list"), {"name": "deep", "rule": "exact",
                                                "upload": upload})
    assert page.status_code == 200
    text = page.content.decode()
    assert "nested too deeply" in text or "expected must be" in text, text[-2000:]
    assert not EvalSet.objects.exists()
    api = Api(api_key)
    uploaded = api.upload(line, filename="deep.jsonl")
    if uploaded.status_code == 200:
        answer = api.post_json("/v1/eval_sets", {"name": "deep", "rule": "exact",
                                                 "file_id": uploaded.json()["id"]})
        assert_openai_error(answer, 400)
    else:
        assert_openai_error(uploaded, 400, fragment="Line 1")
    assert not EvalSet.objects.exists()


@pytest.mark.django_db
def test_a_line_nested_too_deeply_is_named(tmp_path):
    """Where the set's check runs deep in a request's stack, a line Python cannot parse
    there is refused by its number, as JSON that does not parse."""
    deep = "[" * 900 + "]" * 900
    bad = (b'{"custom_id": "q9", "body": {"messages": [{"role": "user", "content": "hi"}]}, '
           b'"expected": ' + deep.encode() + b'}\n')
    path = tmp_path / "deep.jsonl"
    path.write_bytes(jsonl(set_items(2)) + bad)
    with pytest.raises(ServiceError) as caught:
        _check_in_a_deep_stack(path, 200)
    assert caught.value.param == "file"
    assert caught.value.message == "The file is not JSONL: line 3 is nested too deeply"


def _check_in_a_deep_stack(path: Path, depth: int) -> Any:
    """check_set_file called `depth` frames down, as a web request's stack is."""
    if depth:
        return _check_in_a_deep_stack(path, depth - 1)
    return evals.check_set_file(path=path, rule="exact")


# --- /metrics ---


@pytest.mark.django_db
def test_metrics_label_eval_series_by_set_id_for_recent_sets_only(
        user, other_user, tmp_path, settings, client):
    """Two owners' sets named alike were one series, and every set any user ever ran was a
    label value. Now a set's id, and only sets whose runs are active or recent."""
    mine, theirs = own_set(user, "same", tmp_path), own_set(other_user, "same", tmp_path)
    old = own_set(user, "old", tmp_path)
    for eval_set, owner, score in ((mine, user, 0.25), (theirs, other_user, 0.75),
                                   (old, user, 0.5)):
        batch = run_batch(make_batch(owner, [chat_line("a", "hi")], tmp_path))
        EvalRun.objects.create(eval_set=eval_set, batch=batch, trigger="batch",
                               base_model="echo-test", model="echo-test", status="scored",
                               score=score, scored_at=timezone.now())
    long_ago = timezone.now() - timedelta(days=3)
    EvalRun.objects.filter(eval_set=old).update(created_at=long_ago, scored_at=long_ago)
    settings.BATCHWEB = {**settings.BATCHWEB, "METRICS_TOKEN": "scrape"}
    text = client.get("/metrics", HTTP_AUTHORIZATION="Bearer scrape").content.decode()
    assert 'eval_set="same"' not in text and 'eval_set="old"' not in text
    for eval_set, score in ((mine, 0.25), (theirs, 0.75)):
        label = f'eval_set="{evals.public_id(eval_set)}",model="echo-test"'
        assert f"batchweb_eval_score{{{label}}} {score}" in text, text
        assert f'batchweb_eval_runs{{{label},status="scored"}} 1.0' in text
    assert f'"{evals.public_id(old)}"' not in text
    # A set attached to a batch still running is shown, however old its run.
    EvalRun.objects.filter(eval_set=old).update(batch=make_batch(user, [chat_line("b", "x")],
                                                                 tmp_path))
    text = client.get("/metrics", HTTP_AUTHORIZATION="Bearer scrape").content.decode()
    assert f'batchweb_eval_score{{eval_set="{evals.public_id(old)}",model="echo-test"}} 0.5' \
        in text


# --- the storage's address in error text ---


@pytest.fixture
def unreachable(settings: Any, user: Any) -> str:
    """A credential set whose endpoint refuses connections, granted to the user for
    reading `s3://data/in/` and writing `s3://data/out/`; returns its address."""
    address = f"127.0.0.1:{free_port()}"
    settings.DATA_CREDENTIALS = {**settings.DATA_CREDENTIALS, "DOWN": {
        "endpoint_url": f"http://{address}", "region_name": "us-east-1",
        "access_key": "k", "secret_key": "s", "path_style": True}}
    StorageGrant.objects.create(user=user, prefix="s3://data-bucket/in/", read=True,
                                credentials="DOWN")
    StorageGrant.objects.create(user=user, prefix="s3://data-bucket/out/", write=True,
                                read=False, credentials="DOWN")
    return address


@pytest.mark.django_db
def test_a_registration_never_names_the_storages_address(user, api_key, unreachable, caplog):
    port = unreachable.rpartition(":")[2]
    with caplog.at_level(logging.WARNING):
        answer = Api(api_key).post_json("/v1/files", {
            "purpose": "batch", "source": "s3://data-bucket/in/a.jsonl"})
    error = assert_openai_error(answer, 400, code="source_unreadable", param="source")
    assert "s3://data-bucket/in/a.jsonl" in error["message"]
    assert "EndpointConnectionError" in error["message"]
    assert unreachable not in error["message"] and port not in error["message"]
    assert "Could not connect" not in error["message"]
    with pytest.raises(ServiceError) as caught:
        references.register_reference(owner=user, source="s3://data-bucket/in/a.jsonl",
                                      purpose="batch")
    assert unreachable not in caught.value.message
    # The operator's log keeps the detail.
    assert unreachable in caplog.text


@pytest.mark.django_db
def test_a_failed_delivery_never_names_the_storages_address(user, site, tmp_path,
                                                            unreachable, caplog):
    file = make_file(user, [chat_line("a", "hi")], tmp_path)
    batch = create_batch(owner=user, input_file_id=file.pk, endpoint=CHAT,
                         completion_window="24h", output_prefix="s3://data-bucket/out/")
    run_validation(batch_id=batch.pk)
    with caplog.at_level(logging.WARNING):
        done = run_batch(Batch.objects.get(pk=batch.pk))
    assert done.status == "completed" and done.delivery_status == "failed"
    shown = done.to_openai()["output_delivery"]["error"]
    assert "EndpointConnectionError" in shown and unreachable not in shown
    page = site.get(reverse("batch_detail", args=[batch.pk])).content.decode()
    assert "EndpointConnectionError" in page and unreachable not in page
    assert unreachable in caplog.text
