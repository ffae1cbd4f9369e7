"""The budget's promise end to end on the real engine: batches of tool-heavy and
template-heavy requests (tests/engine/prompt_shapes.py), on both faces, through a model
served with a chat template that renders tools, tool calls and tool results and adds a
default system prompt (tests/engine/templates/tools_chatml.jinja). What the budget accepted
is never charged past it: each batch's input tokens stay within the bounds it counted, and
its charge within the ceiling it reserved."""

from __future__ import annotations

import io
import json
from decimal import Decimal
from pathlib import Path

import pytest

from engine.endpoints import CHAT, MESSAGES
from jobs.formats.wire import RequestLine
from tests.engine.prompt_shapes import corpus
from tests.factories import jsonl, wait_for

pytestmark = [pytest.mark.engine, pytest.mark.django_db(transaction=True)]

CHAT_MODEL = "SmolLM2-135M-Instruct"
TEMPLATE = Path(__file__).resolve().parents[1] / "engine" / "templates" / "tools_chatml.jinja"
ENGINE_ENV = {"BATCHWEB_DTYPE": "float32", "VLLM_CPU_KVCACHE_SPACE": "1",
              "BATCHWEB_ENGINE_MODE": "eager"}


def test_what_a_budget_accepts_is_never_charged_past_it(openai_client, anthropic_client,
                                                        workers, settings, user, tmp_path):
    from jobs.formats.prompts import prompt_bound, room_for
    from jobs.models import Batch, Price, Quota, UsageRecord

    models = [{**m, "options": {**m["options"], "chat_template": str(TEMPLATE),
                                "enable_auto_tool_choice": True, "tool_call_parser": "hermes"}}
              if m["name"] == CHAT_MODEL else m
              for m in settings.BATCHWEB_MODELS if m["backend"] != "echo"]
    settings.BATCHWEB_MODELS = [*models, *(m for m in settings.BATCHWEB_MODELS
                                           if m["backend"] == "echo")]
    models_file = tmp_path / "models.json"
    models_file.write_text(json.dumps(models))
    Price.objects.create(model="", input_per_million=2, output_per_million=10)
    Quota.objects.update_or_create(user=user, defaults={"cost_per_month": Decimal("1")})

    cases = corpus(seed=681, count=36, sizes=(8, 60, 200))
    chat = [{"custom_id": f"c{i}", "method": "POST", "url": CHAT,
             "body": {**body, "model": CHAT_MODEL, "max_tokens": 8, "temperature": 0}}
            for i, (url, body) in enumerate(cases) if url == CHAT]
    file_id = openai_client.files.create(file=("in.jsonl", io.BytesIO(jsonl(chat))),
                                         purpose="batch").id
    openai_batch = openai_client.batches.create(input_file_id=file_id, endpoint=CHAT,
                                                completion_window="24h")
    messages = [{"custom_id": f"m{i}", "params": {**body, "model": CHAT_MODEL, "max_tokens": 8}}
                for i, (url, body) in enumerate(cases) if url == MESSAGES]
    anthropic_batch = anthropic_client.messages.batches.create(requests=messages)

    workers.start(CHAT_MODEL, env={**ENGINE_ENV, "BATCHWEB_MODELS_FILE": str(models_file)})
    try:
        for batch_id in (openai_batch.id, anthropic_batch.id):
            wait_for(lambda b=batch_id: Batch.objects.get(pk=b).status in (
                "completed", "failed", "expired", "cancelled"), timeout=900, every=1,
                message=f"batch {batch_id} to end")
    finally:
        workers.stop_all()

    room = room_for(CHAT_MODEL)
    assert room.counter is not None  # bounded by the model's own tokenizer and template
    for batch_id, url, lines in ((openai_batch.id, CHAT, [(c["custom_id"], c["body"])
                                                          for c in chat]),
                                 (anthropic_batch.id, MESSAGES, [(m["custom_id"], m["params"])
                                                                 for m in messages])):
        batch = Batch.objects.get(pk=batch_id)
        assert batch.status == "completed", workers.logs()
        assert batch.completed >= 0.75 * len(lines)  # only prompts past the context fail
        bound = sum(prompt_bound(RequestLine(cid, url, body), room) for cid, body in lines)
        records = UsageRecord.objects.filter(batch_id=batch_id)
        used = sum(r.input_tokens for r in records)
        charged = sum(r.cost_nanos for r in records)
        print(f"\n{url}: {batch.completed} of {len(lines)} ran, input tokens {used} "
              f"of a bound of {bound}, charged {charged} of a ceiling of "
              f"{batch.cost_ceiling_nanos} nanos")
        assert 0 < used <= bound
        assert 0 < charged <= batch.cost_ceiling_nanos
