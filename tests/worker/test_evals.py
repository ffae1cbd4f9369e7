"""Eval sets and drift, in-process: a set attached to a batch runs beside it on the same
pipeline, never in its files or counts, and is scored against the baseline when both end.
The same engine twice gives no drift; another model version (the echo engine's `version`),
other sampling defaults, or another adapter each drift on exactly the items they change.
Provenance is recorded on every shard and on the batch."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from jobs.lib.errors import ServiceError
from jobs.models import Batch, EvalRun, EvalSet, Shard, UsageRecord, WebhookEvent
from jobs.services import evals
from jobs.services.batches import create_batch
from jobs.services.files import create_input_file
from jobs.services.finalize import finalize_batch
from jobs.services.validation import run_validation
from jobs.services.webhooks import set_webhook_url
from tests.factories import chat_line, finalized, jsonl, run_all_shards
from tests.lora import write_adapter_config

pytestmark = pytest.mark.django_db(transaction=True)

# Echo answers "echo: <the user's words>". Items with capitals change under another model
# version (it answers in lower case); items of more than two words change under a
# max_tokens default of 3.
ITEMS = {
    "short": "yes",
    "two": "two words",
    "caps": "Paris",
    "long-caps": "The Capital of France",
    "long": "one two three four",
}


def make_adapter(folder: Path) -> Path:
    """An adapter folder the echo engine loads (its weights are only hashed)."""
    folder.mkdir(parents=True)
    write_adapter_config(folder)
    (folder / "adapter_model.safetensors").write_bytes(folder.name.encode())
    return folder


def eval_items(rule: str = "exact") -> list[dict[str, Any]]:
    return [{"custom_id": cid, "body": {"messages": [{"role": "user", "content": text}]},
             "expected": f"echo: {text}"} for cid, text in ITEMS.items()]


@pytest.fixture
def eval_set(tmp_path: Path, storage: Path) -> EvalSet:
    path = tmp_path / "set.jsonl"
    path.write_bytes(jsonl(eval_items()))
    return evals.create_eval_set(name="capitals", path=path, rule="exact",
                                 drift_threshold=0.1)


@pytest.fixture
def run_with_eval(user: Any, tmp_path: Path, settings: Any, storage: Path):
    """Run a batch with the set attached on `pipeline`, then the run's requests, and end
    both: (the batch, its output lines, error lines, the run)."""
    def run(pipeline: Any, eval_set: EvalSet, *, lines: list[dict] | None = None,
            owner: Any = None) -> tuple[Batch, list[dict], list[dict], EvalRun]:
        settings.BATCHWEB = {**settings.BATCHWEB, "SHARD_SIZE": 4}
        lines = lines or [chat_line(f"u{i}", f"user question {i}") for i in range(6)]
        path = tmp_path / "in.jsonl"
        path.write_bytes(jsonl(lines))
        file = create_input_file(owner=owner or user, path=path, filename="in.jsonl",
                                 purpose="batch")
        created = create_batch(owner=owner or user, input_file_id=file.pk,
                               eval_set=eval_set.name,
                               endpoint="/v1/chat/completions", completion_window="24h")
        run_validation(batch_id=created.pk)
        batch = Batch.objects.get(pk=created.pk)
        run_all_shards(pipeline, batch)
        eval_run = EvalRun.objects.get(batch=batch)
        run_validation(batch_id=eval_run.run_batch_id)
        run_all_shards(pipeline, eval_run.run_batch)
        finalize_batch(batch_id=eval_run.run_batch_id)  # waits for the batch to end
        assert EvalRun.objects.get(pk=eval_run.pk).status == "running"
        done, out, err = finalized(batch)
        return done, out, err, EvalRun.objects.get(pk=eval_run.pk)
    return run


def test_the_same_engine_twice_shows_no_drift(make_pipeline, run_with_eval, eval_set, user):
    pipeline = make_pipeline()
    batch, out, err, first = run_with_eval(pipeline, eval_set)
    # Eval requests never appear in the user's files or counts.
    assert sorted(r["custom_id"] for r in out) == [f"u{i}" for i in range(6)] and err == []
    assert (batch.total, batch.completed, batch.failed) == (6, 6, 0)
    assert first.status == "scored" and (first.passed, first.items) == (5, 5)
    assert first.accepted_at is not None  # the first run on a model is its baseline
    assert batch.evaluations[0]["score"] == 1.0 and not batch.eval_drift
    api = batch.to_openai()
    assert api["evaluations"][0]["eval_set"] == "capitals"
    assert api["provenance"]["consistent"] is True
    assert api["provenance"]["workers"][0]["engine"]["engine"] == "echo"

    batch2, _, _, second = run_with_eval(pipeline, eval_set)
    assert second.baseline_id == first.pk
    assert (second.score, second.baseline_score, second.changed_count) == (1.0, 1.0, 0)
    assert not second.drifted and not batch2.eval_drift
    # The run's requests ran as a batch of the evals' service user (none in the user's
    # lists), charged to the user who attached the set, as an eval run's.
    assert not Batch.objects.filter(owner=user).exclude(pk__in=[batch.pk, batch2.pk]).exists()
    charges = UsageRecord.objects.filter(batch_id=second.run_batch_id)
    assert charges.exists() and {(c.owner_id, c.eval_run) for c in charges} == {(user.pk, True)}


def test_another_owners_run_is_never_a_baseline(make_pipeline, run_with_eval, eval_set,
                                                other_user, client):
    """Baselines are per owner: a user's first run of a shared set is their own baseline,
    whoever ran the set before, and their page names no other user's batch."""
    pipeline = make_pipeline()
    theirs = run_with_eval(pipeline, eval_set, owner=other_user)[3]
    assert theirs.accepted_at is not None and theirs.baseline_id is None
    batch, _, _, mine = run_with_eval(pipeline, eval_set)
    assert mine.baseline_id is None and mine.accepted_at is not None  # its own
    again = run_with_eval(pipeline, eval_set)[3]
    assert again.baseline_id == mine.pk
    client.force_login(batch.owner)
    page = client.get(f"/batches/{again.batch_id}/").content.decode()
    assert theirs.batch_id not in page and theirs.pk not in page


def _changed(run: EvalRun) -> set[str]:
    return {item["custom_id"] for item in run.changed}


def test_another_model_version_drifts_on_the_items_it_changes(make_pipeline, run_with_eval,
                                                              eval_set, user, receiver,
                                                              loopback_allowed):
    set_webhook_url(user=user, url=receiver.url)
    _, _, _, baseline = run_with_eval(make_pipeline(), eval_set)
    batch, _, _, run = run_with_eval(make_pipeline(version="2"), eval_set)
    assert _changed(run) == {"caps", "long-caps"} and run.changed_count == 2
    assert (run.baseline_score, run.score) == (1.0, 0.6) and run.drifted
    side = next(item for item in run.changed if item["custom_id"] == "caps")
    assert (side["before"], side["after"]) == ("echo: Paris", "echo: paris")
    assert batch.eval_drift and batch.evaluations[0]["drifted"]
    # Provenance says which model files ran it.
    hashes = {entry["engine"]["model_sha256"] for entry in batch.provenance}
    assert hashes == {run.run_batch.provenance[0]["engine"]["model_sha256"]}
    assert hashes != {e["engine"]["model_sha256"] for e in baseline.batch.provenance}
    event = WebhookEvent.objects.get(batch_id=batch.pk, type="batchweb.eval.drift")
    assert event.owner_id == user.pk


def test_other_sampling_defaults_drift_on_the_items_they_cut(make_pipeline, run_with_eval,
                                                              eval_set):
    run_with_eval(make_pipeline(), eval_set)
    batch, _, _, run = run_with_eval(make_pipeline(sampling_defaults={"max_tokens": 3}),
                                     eval_set)
    assert _changed(run) == {"long-caps", "long"} and run.drifted
    assert batch.provenance[0]["engine"]["sampling_defaults"] == {"max_tokens": 3}


def test_another_adapter_drifts_on_every_item(make_pipeline, run_with_eval, eval_set,
                                              tmp_path):
    from jobs.models import LoraAdapter

    for name in ("tone-a", "tone-b"):
        folder = make_adapter(tmp_path / name)
        LoraAdapter.objects.create(name=name, base_model="echo-test", source=str(folder))
    pipeline = make_pipeline(enable_lora=True)
    lines_a = [chat_line(f"u{i}", f"question {i}", model="tone-a") for i in range(3)]
    lines_b = [chat_line(f"u{i}", f"question {i}", model="tone-b") for i in range(3)]
    _, _, _, first = run_with_eval(pipeline, eval_set, lines=lines_a)
    assert first.model == "tone-a" and first.score == 0.0  # "echo+tone-a: ..."
    EvalRun.objects.filter(pk=first.pk).update(accepted_at=first.scored_at)
    batch, _, _, run = run_with_eval(pipeline, eval_set, lines=lines_b)
    assert run.model == "tone-b" and run.changed_count == len(ITEMS)
    assert run.changed[0]["after"].startswith("echo+tone-b:")
    adapters = batch.provenance[0]["adapters"]
    assert [a["name"] for a in adapters] == ["tone-b"] and len(adapters[0]["sha256"]) == 64


def test_eval_requests_run_exactly_once_whatever_the_retries(make_pipeline, run_with_eval,
                                                             eval_set, settings, tmp_path):
    """An eval run's requests are a batch's shards: a taken-over attempt writes nothing,
    and the run's results hold each item once."""
    from jobs.services import shards as shard_service

    pipeline = make_pipeline()
    batch, _, _, run = run_with_eval(pipeline, eval_set)
    rows = list(evals.run_results(run))
    assert sorted(r["custom_id"] for r in rows) == sorted(ITEMS)
    shards = list(Shard.objects.filter(batch=run.run_batch))
    assert len(shards) == 2  # five items, four to a shard
    for shard in shards:
        assert shard.attempt == 1 and shard.provenance["engine"] == "echo"
        # A finish under a stale attempt is refused (the fence every shard has).
        assert not shard_service.finish_shard(shard_id=shard.pk, attempt=0, output_part="x",
                                              error_part="",
                                              progress=shard_service.Progress())
    # Charged once per shard, to the owner who attached the set, as an eval run's.
    charges = UsageRecord.objects.filter(batch_id=run.run_batch_id)
    assert charges.count() == 2 and {c.owner_id for c in charges} == {run.batch.owner_id}
    assert all(c.eval_run for c in charges)
    assert sum(c.requests_succeeded for c in charges) == len(ITEMS)


def test_a_set_is_checked_line_by_line(tmp_path, storage):
    path = tmp_path / "bad.jsonl"
    items = eval_items()
    items[2] = {**items[2], "expected": 42}
    path.write_bytes(jsonl(items))
    with pytest.raises(ServiceError, match="Line 3: expected must be a string"):
        evals.create_eval_set(name="bad", path=path, rule="exact")
    path.write_bytes(jsonl([{**items[0], "body": {"messages": "x"}}]))
    with pytest.raises(ServiceError, match="Line 1"):
        evals.create_eval_set(name="bad", path=path, rule="exact")
    path.write_bytes(b'{"custom_id": "a"\n')
    with pytest.raises(ServiceError, match="not JSONL"):
        evals.create_eval_set(name="bad", path=path, rule="exact")
    assert not EvalSet.objects.exists()


@pytest.mark.parametrize(("rule", "answer", "expected", "passed"), [
    ("exact", "echo: Paris", "echo: Paris", True),
    ("exact", "echo: paris", "echo: Paris", False),
    ("normalized", "  Echo:   PARIS. ", "echo: paris", True),
    ("regex", "The answer is 42.", r"\b42\b", True),
    ("regex", "The answer is 421.", r"\b42\b", False),
    ("json_fields", json.dumps({"a": 1, "b": "x", "c": 3}), {"a": 1, "b": "x"}, True),
    ("json_fields", json.dumps({"a": 2}), {"a": 1}, False),
    ("json_fields", "not json", {"a": 1}, False),
    ("numeric", "about 3.14159 or so", 3.14, True),
    ("numeric", "1,204 items", 1204, True),
    ("numeric", "3.2", 3.14, False),
])
def test_scoring_rules(rule, answer, expected, passed):
    from jobs.policy import eval_rules

    assert eval_rules.passes(rule, answer, expected, tolerance=0.01) is passed


def test_drift_shows_on_the_page_the_list_the_api_and_metrics(make_pipeline, run_with_eval,
                                                              eval_set, site, api_key,
                                                              settings):
    from jobs.formats.anthropic import message_batch

    run_with_eval(make_pipeline(), eval_set)
    batch, _, _, run = run_with_eval(make_pipeline(version="2"), eval_set)
    page = site.get(f"/batches/{batch.pk}/").content.decode()
    assert 'id="provenance"' in page and "echo 2" in page
    assert f'id="eval-{run.pk}"' in page and "a drop beyond the set" in page
    # The changed items side by side: the baseline's answer, then this run's.
    assert page.index("echo: Paris") < page.index("echo: paris")
    assert "echo: one two three four" not in page  # unchanged items are not listed
    listing = site.get("/").content.decode()
    assert listing.count('class="badge st-failed drift"') == 1
    body = site.get(f"/v1/batches/{batch.pk}",
                    HTTP_AUTHORIZATION=f"Bearer {api_key}").json()
    assert body["eval_drift"] is True and body["evaluations"][0]["changed"] == 2
    assert body["provenance"]["workers"][0]["engine"]["engine_version"] == "2"
    listed = site.get("/v1/batches", HTTP_AUTHORIZATION=f"Bearer {api_key}").json()
    assert {b["id"] for b in listed["data"]} == {batch.pk, run.baseline.batch_id}
    shape = message_batch(batch, base_url="http://testserver")
    assert shape["eval_drift"] is True and shape["provenance"]["consistent"] is True
    settings.BATCHWEB = {**settings.BATCHWEB, "METRICS_TOKEN": "scrape"}
    metrics = site.get("/metrics", HTTP_AUTHORIZATION="Bearer scrape").content.decode()
    assert "batchweb_batches_eval_drift 1.0" in metrics
    assert (f'batchweb_eval_score{{eval_set="evalset_{eval_set.pk}",model="echo-test"}} 0.6'
            in metrics)


def test_a_run_is_accepted_as_the_baseline_by_the_sets_owner(make_pipeline, run_with_eval,
                                                             tmp_path, storage, user, site):
    path = tmp_path / "mine.jsonl"
    path.write_bytes(jsonl(eval_items()))
    mine = evals.create_eval_set(name="mine", path=path, rule="exact", owner=user)
    run_with_eval(make_pipeline(), mine)
    batch, _, _, run = run_with_eval(make_pipeline(version="2"), mine)
    assert run.drifted and run.accepted_at is None
    answer = site.post(f"/batches/{batch.pk}/evals/{run.pk}/accept")
    assert answer.status_code == 302
    _, _, _, later = run_with_eval(make_pipeline(version="2"), mine)
    # Compared with the accepted run now: the new version is the baseline, no drift.
    assert later.baseline_id == run.pk and not later.drifted and later.changed_count == 0


def test_an_operators_set_runs_when_a_worker_first_serves_a_new_model_version(
        make_pipeline, tmp_path, storage, user, settings):
    from jobs.services.validation import run_validation as validate

    path = tmp_path / "watch.jsonl"
    path.write_bytes(jsonl(eval_items()))
    watching = evals.create_eval_set(name="watch", path=path, rule="exact",
                                     watch_models=["echo-test"])
    settings.BATCHWEB = {**settings.BATCHWEB, "SHARD_SIZE": 4}

    def batch_on(pipeline: Any) -> Batch:
        source = tmp_path / "in.jsonl"
        source.write_bytes(jsonl([chat_line(f"u{i}", f"q {i}") for i in range(3)]))
        file = create_input_file(owner=user, path=source, filename="in.jsonl",
                                 purpose="batch")
        created = create_batch(owner=user, input_file_id=file.pk,
                               endpoint="/v1/chat/completions", completion_window="24h")
        validate(batch_id=created.pk)
        batch = Batch.objects.get(pk=created.pk)
        run_all_shards(pipeline, batch)
        return batch

    first = make_pipeline()
    one = batch_on(first)
    assert EvalRun.objects.get(batch=one).trigger == "model"
    two = batch_on(first)
    restarted = batch_on(make_pipeline())  # another worker, the same model files
    assert not EvalRun.objects.filter(batch__in=[two, restarted]).exists()
    upgraded = batch_on(make_pipeline(version="2"))
    run = EvalRun.objects.get(batch=upgraded)
    assert run.eval_set == watching and run.serving_key.endswith("|echo|2")
    assert EvalRun.objects.count() == 2


def test_a_set_the_user_may_not_see_is_refused(tmp_path, storage, user, other_user):
    path = tmp_path / "theirs.jsonl"
    path.write_bytes(jsonl(eval_items()))
    evals.create_eval_set(name="theirs", path=path, rule="exact", owner=other_user)
    with pytest.raises(ServiceError, match="No such eval set") as caught:
        evals.find_set_for_user(owner=user, value="theirs")
    assert caught.value.status == 404


def test_an_eval_run_handed_back_half_way_resumes_computing_nothing_twice(
        make_pipeline, user, tmp_path, storage, settings):
    """Its requests are an ordinary batch's: a worker stopping half-way hands their shard
    back with a checkpoint, the next worker computes only the rest, each item is scored
    once and charged once."""
    from tests.factories import computed_twice, engine_request_log, start_shard, wait_for

    settings.BATCHWEB = {**settings.BATCHWEB, "SHARD_SIZE": 40, "CHECKPOINT_SECONDS": 0.5,
                         "CHECKPOINT_REQUESTS": 3}
    path = tmp_path / "many.jsonl"
    path.write_bytes(jsonl([{"custom_id": f"i{i}", "body": {"messages": [
        {"role": "user", "content": f"item {i}"}]}, "expected": f"echo: item {i}"}
        for i in range(30)]))
    many = evals.create_eval_set(name="many", path=path, rule="exact")
    source = tmp_path / "in.jsonl"
    source.write_bytes(jsonl([chat_line("u0", "hello")]))
    file = create_input_file(owner=user, path=source, filename="in.jsonl", purpose="batch")
    created = create_batch(owner=user, input_file_id=file.pk, eval_set="many",
                           endpoint="/v1/chat/completions", completion_window="24h")
    run_validation(batch_id=created.pk)
    batch = Batch.objects.get(pk=created.pk)
    log = tmp_path / "requests.log"
    first = make_pipeline(seconds_per_request=0.3, max_in_flight=2, inbox_size=2,
                          request_log=str(log))
    run_all_shards(first, batch)
    run = EvalRun.objects.get(batch=batch, eval_set=many)
    run_validation(batch_id=run.run_batch_id)
    shard = Shard.objects.get(batch_id=run.run_batch_id)
    start_shard(first, shard.pk)
    wait_for(lambda: len(engine_request_log(log)) >= 13, timeout=30, message="half the set")
    first.hand_back_all()
    first.close()
    shard.refresh_from_db()
    assert (shard.status, shard.attempt) == ("queued", 1) and shard.checkpoint

    second = make_pipeline(request_log=str(log))
    run_all_shards(second, run.run_batch)
    finalize_batch(batch_id=run.run_batch_id)
    finalized(batch)
    assert computed_twice(log) == 0
    run.refresh_from_db()
    rows = list(evals.run_results(run))
    assert [r["custom_id"] for r in rows] == [f"i{i}" for i in range(30)]
    assert run.status == "scored" and run.passed == 30
    charged = UsageRecord.objects.filter(batch_id=run.run_batch_id)
    assert [c.requests_succeeded for c in charged] == [30]
    assert Batch.objects.get(pk=batch.pk).total == 1  # the user's one request only


def test_workers_that_disagree_say_so(make_batch, make_pipeline):
    batch = make_batch([chat_line(f"u{i}", f"q {i}") for i in range(8)], shard_size=4)
    first, second = Shard.objects.filter(batch=batch).order_by("index")
    make_pipeline().intake.run_shard(first.pk)
    make_pipeline(version="2").intake.run_shard(second.pk)
    batch.refresh_from_db()
    assert [e["engine"]["engine_version"] for e in batch.provenance] == ["1", "2"]
    assert batch.to_openai()["provenance"]["consistent"] is False
    first.refresh_from_db()
    assert first.provenance["engine_version"] == "1" and first.provenance["worker"]


def test_the_set_runs_with_the_batchs_model_and_sampling(make_pipeline, run_with_eval,
                                                         eval_set):
    lines = [chat_line(f"u{i}", f"q {i}", temperature=0.3, seed=7, top_p=0.9)
             for i in range(2)]
    _, _, _, run = run_with_eval(make_pipeline(), eval_set, lines=lines)
    assert run.sampling == {"temperature": 0.3, "top_p": 0.9, "seed": 7}
    from jobs.storage.objects import open_file

    with open_file(run.run_batch.input_file) as stream:
        bodies = [json.loads(line)["body"] for line in stream]
    assert len(bodies) == len(ITEMS)
    assert all((b["model"], b["temperature"], b["seed"]) == ("echo-test", 0.3, 7)
               for b in bodies)


def test_the_new_batch_form_offers_the_users_sets(site, eval_set, tmp_path, user,
                                                  other_user):
    path = tmp_path / "theirs.jsonl"
    path.write_bytes(jsonl(eval_items()))
    evals.create_eval_set(name="not-yours", path=path, rule="exact", owner=other_user)
    page = site.get("/batches/new").content.decode()
    assert f'value="evalset_{eval_set.pk}"' in page and "not-yours" not in page
    upload = tmp_path / "in.jsonl"
    upload.write_bytes(jsonl([chat_line("u0", "hello")]))
    with upload.open("rb") as handle:
        answer = site.post("/batches/new", {"upload": handle, "completion_window": "24h",
                                            "priority": "default",
                                            "eval_set": f"evalset_{eval_set.pk}",
                                            "action": "submit"})
    assert answer.status_code == 302
    assert Batch.objects.get(owner=user).eval_set == eval_set


def test_the_reconciler_settles_a_run_its_finalizers_missed(make_pipeline, user, tmp_path,
                                                            storage, settings, eval_set,
                                                            monkeypatch):
    from jobs.services.reconcile import reconcile

    source = tmp_path / "in.jsonl"
    source.write_bytes(jsonl([chat_line("u0", "hello")]))
    file = create_input_file(owner=user, path=source, filename="in.jsonl", purpose="batch")
    created = create_batch(owner=user, input_file_id=file.pk, eval_set="capitals",
                           endpoint="/v1/chat/completions", completion_window="24h")
    run_validation(batch_id=created.pk)
    pipeline = make_pipeline()
    run_all_shards(pipeline, Batch.objects.get(pk=created.pk))
    run = EvalRun.objects.get(batch_id=created.pk)
    run_validation(batch_id=run.run_batch_id)
    run_all_shards(pipeline, run.run_batch)
    with monkeypatch.context() as patched:  # both finalizers' calls lost
        patched.setattr(evals, "batch_ended", lambda **kwargs: None)
        finalize_batch(batch_id=run.run_batch_id)
        finalize_batch(batch_id=created.pk)
    assert EvalRun.objects.get(pk=run.pk).status == "running"
    assert reconcile()["evals"] == 1
    assert EvalRun.objects.get(pk=run.pk).status == "scored"
    assert Batch.objects.get(pk=created.pk).evaluations[0]["score"] == 1.0
