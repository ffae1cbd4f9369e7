"""Content policy at validation: each rule type under `reject` and `skip`."""

from __future__ import annotations

import io
import json

import pytest

from jobs.models import Batch, ContentRule, ScreenedLine
from jobs.services.batches import create_batch, run_validation
from jobs.services.files import create_input_file
from tests.helpers import chat_line, jsonl, wait_for

LINES = [
    chat_line("ok-1", "Translate 'good morning' to French."),
    chat_line("term", "How do I make a Molotov cocktail?"),
    chat_line("regex", "My card is 4111 1111 1111 1111, remember it."),
    chat_line("big", "word " * 400),
    chat_line("ok-2", "Summarise the plot of Hamlet."),
]


def validate(user, tmp_path, lines=LINES) -> Batch:
    path = tmp_path / "in.jsonl"
    path.write_bytes(jsonl(lines))
    file = create_input_file(owner=user, path=path, filename="in.jsonl", purpose="batch")
    batch = create_batch(owner=user, input_file_id=file.pk, endpoint="/v1/chat/completions",
                         completion_window="24h")
    run_validation(batch_id=batch.pk)
    return Batch.objects.get(pk=batch.pk)


def rules(action: str) -> None:
    ContentRule.objects.create(name="weapons", kind="term", pattern="molotov cocktail",
                               action=action, reason="no weapons")
    ContentRule.objects.create(name="card-numbers", kind="regex",
                               pattern=r"\b(?:\d{4}[ -]?){3}\d{4}\b", action=action,
                               reason="no payment card numbers")
    ContentRule.objects.create(name="prompt-size", kind="max_prompt_tokens", max_tokens=200,
                               action=action)
    ContentRule.objects.create(name="disabled", kind="term", pattern="Hamlet", enabled=False)


@pytest.mark.django_db
def test_reject_fails_validation_naming_line_and_rule(user, tmp_path):
    rules("reject")
    batch = validate(user, tmp_path)
    assert batch.status == "failed"
    assert [(e["line"], e["code"]) for e in batch.errors] == [
        (2, "content_policy_violation"), (3, "content_policy_violation"),
        (4, "content_policy_violation")]
    messages = [e["message"] for e in batch.errors]
    assert "'weapons'" in messages[0] and "no weapons" in messages[0]
    assert "'card-numbers'" in messages[1]
    assert "'prompt-size'" in messages[2]


@pytest.mark.django_db
def test_no_rules_no_screening(user, tmp_path):
    assert validate(user, tmp_path).status == "in_progress"


@pytest.mark.django_db
def test_moderation_rule_uses_the_embeddings_engine(user, tmp_path):
    # The echo engine's vectors are hashes: only the very same text is similar, which is
    # enough to show the path (engine, examples, threshold); the real-model test is below.
    ContentRule.objects.create(name="mod", kind="moderation", model="echo-test",
                               threshold=0.99, action="reject",
                               pattern="How do I make a Molotov cocktail?\nsomething else")
    batch = validate(user, tmp_path)
    assert batch.status == "failed"
    assert [(e["line"], e["code"]) for e in batch.errors] == [(2, "content_policy_violation")]


@pytest.mark.django_db(transaction=True)
def test_skip_runs_the_rest_and_writes_flagged_lines_to_errors(openai_client, workers):
    rules("skip")
    file_id = openai_client.files.create(file=("in.jsonl", io.BytesIO(jsonl(LINES))),
                                         purpose="batch").id
    batch = openai_client.batches.create(input_file_id=file_id,
                                         endpoint="/v1/chat/completions",
                                         completion_window="24h")
    workers.start()
    batch = wait_for(lambda: (b := openai_client.batches.retrieve(batch.id)).status ==
                     "completed" and b, timeout=60, message="completion")
    assert (batch.request_counts.completed, batch.request_counts.failed) == (2, 3)
    assert ScreenedLine.objects.filter(batch_id=batch.id).count() == 3
    out = [json.loads(x) for x in
           openai_client.files.content(batch.output_file_id).text.splitlines()]
    errors = {(r := json.loads(x))["custom_id"]: r for x in
              openai_client.files.content(batch.error_file_id).text.splitlines()}
    assert {r["custom_id"] for r in out} == {"ok-1", "ok-2"}
    assert set(errors) == {"term", "regex", "big"}
    assert errors["term"]["error"]["code"] == "content_policy_violation"
    assert "'weapons'" in errors["term"]["error"]["message"]
    assert errors["term"]["response"] is None
