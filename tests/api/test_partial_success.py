"""Partial success, as OpenAI's and Anthropic's batches have it: a request problem fails that
request only (the endpoint's 400 in the error file, never sent to the engine), a file problem
fails the batch, and `strict` fails it on any problem; every terminal path of both faces
answers every custom_id once; results are read while a shard still runs."""

from __future__ import annotations

import json
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from django.urls import reverse
from django.utils import timezone

from jobs.models import Batch, Shard
from jobs.services.finalize import finalize_batch
from jobs.services.stopping import expire_due_batches
from jobs.tasks import validate_batch
from tests.factories import (
    chat_line,
    jsonl,
    lazy_import,
    new_batch,
    responses_line,
    submit,
    upload,
    wait_status,
)

anthropic = lazy_import("anthropic")

pytestmark = pytest.mark.django_db(transaction=True)


def files_of(client: Any, batch: Any) -> tuple[list[dict], list[dict]]:
    """The batch's output and error lines, downloaded through the openai client."""
    found = []
    for file_id in (batch.output_file_id, batch.error_file_id):
        text = client.files.content(file_id).text if file_id else ""
        found.append([json.loads(line) for line in text.splitlines()])
    return found[0], found[1]


def assert_answered_once(client: Any, batch: Any, expected: set[str]) -> tuple[list, list]:
    """Every expected custom_id once across the output and error files, and the batch's
    counts are what the files hold."""
    out, err = files_of(client, batch)
    ids = [line["custom_id"] for line in out + err]
    assert len(ids) == len(set(ids)) and set(ids) == expected
    counts = batch.request_counts
    assert (counts.total, counts.completed, counts.failed) == (len(ids), len(out), len(err))
    return out, err


def engine_log(tmp_path: Path) -> Path:
    return tmp_path / "engine-requests.log"


def computed(tmp_path: Path) -> int:
    """Requests the echo engine computed (its own log)."""
    path = engine_log(tmp_path)
    return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.mark.parametrize("shape", ["chat", "responses"])
def test_a_refused_body_fails_its_request_and_the_rest_runs(openai_client, workers, tmp_path,
                                                             shape):
    if shape == "chat":
        lines = [chat_line("r0", "one"), chat_line("r1", "two", max_tokens=-5),
                 chat_line("r2", "three"), chat_line("r3", "four", temperature=7),
                 chat_line("r4", "five")]
        endpoint, refused = "/v1/chat/completions", {"r1": "body.max_tokens",
                                                     "r3": "body.temperature"}
    else:
        lines = [responses_line("r0", "one"), responses_line("r1", "two", max_output_tokens=-5),
                 responses_line("r2", "three")]
        endpoint, refused = "/v1/responses", {"r1": "body.max_output_tokens"}
    file_id = upload(openai_client, jsonl(lines)).id
    batch = openai_client.batches.create(input_file_id=file_id, endpoint=endpoint,
                                         completion_window="24h")
    workers.start(env={"BATCHWEB_ECHO_REQUEST_LOG": str(engine_log(tmp_path))})
    batch = wait_status(openai_client, batch.id, {"completed", "failed"})
    assert batch.status == "completed" and batch.errors is None
    out, err = assert_answered_once(openai_client, batch, {line["custom_id"] for line in lines})
    assert len(out) == len(lines) - len(refused)
    assert {line["custom_id"]: line["response"]["body"]["error"]["param"] for line in err} == \
        refused
    for line in err:  # OpenAI's shape of a request its endpoint refused
        assert set(line) == {"id", "custom_id", "response", "error"} and line["error"] is None
        assert line["id"].startswith("batch_req_") and line["response"]["request_id"]
        assert line["response"]["status_code"] == 400
        error = line["response"]["body"]["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_parameter")
        assert error["message"].startswith(error["param"])
    # Never sent to the engine: it computed the others only.
    assert computed(tmp_path) == len(out)


def test_a_thousand_requests_with_three_problems(openai_client, workers, tmp_path):
    bad = {117: {"max_tokens": 0}, 502: {"top_p": 3}, 988: {"stream": True}}
    lines = [chat_line(f"r{i}", f"question {i}", **bad.get(i, {})) for i in range(1000)]
    batch = submit(openai_client, lines)
    workers.start(env={"BATCHWEB_ECHO_REQUEST_LOG": str(engine_log(tmp_path)),
                       "BATCHWEB_SHARD_SIZE": "250"})
    batch = wait_status(openai_client, batch.id, {"completed", "failed"}, timeout=120)
    assert batch.status == "completed"
    out, err = assert_answered_once(openai_client, batch, {f"r{i}" for i in range(1000)})
    assert (len(out), len(err)) == (997, 3)
    assert sorted(line["custom_id"] for line in err) == ["r117", "r502", "r988"]
    assert computed(tmp_path) == 997  # the request problems cost no engine time


def test_strict_fails_the_batch_on_a_request_problem(openai_client):
    lines = [chat_line("a", "x"), chat_line("b", "y", max_tokens=-5)]
    file_id = upload(openai_client, jsonl(lines)).id
    strict = new_batch(openai_client, file_id, extra_body={"strict": True})
    assert strict.model_extra["strict"] is True
    validate_batch(strict.id)
    strict = openai_client.batches.retrieve(strict.id)
    assert strict.status == "failed" and strict.output_file_id is None
    assert [(e.line, e.code, e.param) for e in strict.errors.data] == [
        (2, "invalid_parameter", "body.max_tokens")]
    lenient = new_batch(openai_client, file_id)
    assert lenient.model_extra["strict"] is False
    validate_batch(lenient.id)
    lenient = openai_client.batches.retrieve(lenient.id)
    assert lenient.status == "in_progress" and lenient.request_counts.total == 2
    with pytest.raises(lazy_import("openai").BadRequestError):
        new_batch(openai_client, file_id, extra_body={"strict": "yes"})


def test_strict_on_the_new_batch_form(site, user, tmp_path):
    from django.core.files.uploadedfile import SimpleUploadedFile

    content = jsonl([chat_line("a", "x"), chat_line("b", "y", temperature=9),
                     chat_line("c", "z")])

    def post(**extra: Any) -> Any:
        return site.post(reverse("batch_new"), {
            "upload": SimpleUploadedFile("in.jsonl", content), "completion_window": "24h",
            "priority": "default", "action": "submit", **extra})

    page = post(strict="on")
    text = page.content.decode()
    assert page.status_code == 200 and not Batch.objects.exists()
    assert "1 line to fix" in text and "body.temperature" in text
    checked = site.post(reverse("batch_new"), {
        "upload": SimpleUploadedFile("in.jsonl", content), "completion_window": "24h",
        "priority": "default", "action": "check"}).content.decode()
    assert "1 request will fail; the other 2 will run" in checked
    assert "body.temperature" in checked and "line to fix" not in checked
    assert post().status_code == 302
    batch = Batch.objects.get()
    assert not batch.strict
    validate_batch(batch.pk)
    batch.refresh_from_db()
    assert batch.status == "in_progress" and batch.total == 3


# --- every terminal path answers every custom_id once (in-process; the running paths on
# real workers are in tests/worker/test_execution.py and tests/api/test_message_batches.py)


def _stop_openai(client: Any, batch_id: str, how: str) -> None:
    if how == "cancel":
        client.batches.cancel(batch_id)
    else:
        Batch.objects.filter(pk=batch_id).update(expires_at=timezone.now() - timedelta(1))
        assert expire_due_batches() == [batch_id]


@pytest.mark.parametrize("how", ["cancel", "expire"])
@pytest.mark.parametrize("when", ["validating", "queued"])
def test_openai_stopped_before_running(openai_client, how, when):
    lines = [chat_line(f"r{i}", "x", **({"max_tokens": -1} if i == 2 else {}))
             for i in range(5)]
    batch = submit(openai_client, lines)
    if when == "queued":
        validate_batch(batch.id)
    _stop_openai(openai_client, batch.id, how)
    validate_batch(batch.id)  # validation that runs after the stop changes nothing
    finalize_batch(batch_id=batch.id)
    batch = openai_client.batches.retrieve(batch.id)
    assert batch.status == {"cancel": "cancelled", "expire": "expired"}[how]
    out, err = assert_answered_once(openai_client, batch, {f"r{i}" for i in range(5)})
    # Nothing ran (the refused line's shard was dropped with the rest).
    code = {"cancel": "batch_cancelled", "expire": "batch_expired"}[how]
    assert out == [] and {line["error"]["code"] for line in err} == {code}


def test_openai_file_problem_fails_the_batch_with_no_files(openai_client):
    lines = [chat_line("a", "x"), chat_line("b", "y", max_tokens=-1),
             {"custom_id": "c", "method": "GET", "url": "/v1/chat/completions", "body": {}}]
    failed = submit(openai_client, lines)
    validate_batch(failed.id)
    failed = openai_client.batches.retrieve(failed.id)
    assert failed.status == "failed" and failed.output_file_id is failed.error_file_id is None
    assert [(e.line, e.code) for e in failed.errors.data] == [(3, "invalid_method")]


@pytest.mark.parametrize("how", ["cancel", "expire"])
def test_anthropic_stopped_while_validating(anthropic_client, how):
    batch = anthropic_client.messages.batches.create(requests=[
        {"custom_id": f"m{i}", "params": {"model": "echo-test", "max_tokens": 8,
                                          "messages": [{"role": "user", "content": "hi"}],
                                          **({"top_k": -1} if i == 7 else {})}}
        for i in range(300)])
    counts = anthropic_client.messages.batches.retrieve(batch.id).request_counts
    assert counts.processing == 300  # while validating too
    if how == "cancel":
        assert anthropic_client.messages.batches.cancel(batch.id).request_counts.processing \
            == 300
    else:
        Batch.objects.filter(pk=batch.id).update(expires_at=timezone.now() - timedelta(1))
        assert expire_due_batches() == [batch.id]
    validate_batch(batch.id)
    finalize_batch(batch_id=batch.id)
    batch = anthropic_client.messages.batches.retrieve(batch.id)
    assert batch.processing_status == "ended"
    kind = {"cancel": "canceled", "expire": "expired"}[how]
    counts = batch.request_counts.model_dump()
    assert counts == {"processing": 0, "succeeded": 0, "errored": 0, "canceled": 0,
                      "expired": 0, kind: 300}
    results = {r.custom_id: r.result.type for r in
               anthropic_client.messages.batches.results(batch.id)}
    assert results == {f"m{i}": kind for i in range(300)}


# --- results while a shard runs: its checkpoints ---


def test_results_of_a_running_one_shard_batch_come_before_it_ends(openai_client, workers,
                                                                   live_server, api_key):
    lines = [chat_line(f"r{i}", f"question {i}") for i in range(200)]
    batch = submit(openai_client, lines)
    workers.start(env={"BATCHWEB_ECHO_SECONDS": "0.05", "BATCHWEB_ECHO_MAX_IN_FLIGHT": "2",
                       "BATCHWEB_CHECKPOINT_SECONDS": "0.5"})
    seen: list[str] = []
    after = None
    early = 0
    while True:
        response = httpx.get(f"{live_server.url}/v1/batches/{batch.id}/results",
                             params={"limit": 1000, **({"after": after} if after else {})},
                             headers={"Authorization": f"Bearer {api_key}"}, timeout=10)
        assert response.status_code == 200, response.text
        ids = [json.loads(line)["custom_id"] for line in response.text.splitlines()]
        if response.headers["X-Batch-Ended"] == "true":
            break
        assert Shard.objects.filter(batch_id=batch.id).count() <= 1  # one shard, or none yet
        early += len(ids)
        seen += ids
        after = response.headers["X-Next-After"]
        time.sleep(0.3)
    assert early > 0, "no result before the batch ended"
    assert len(seen) == len(set(seen)), "a result answered twice while running"
    assert set(seen) <= {f"r{i}" for i in range(200)}
