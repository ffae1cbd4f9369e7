"""Monthly budgets and the ledger's reads: batches.create refused on the OpenAI API, on
Anthropic's Message Batches API (both with their official clients) and on the new-batch
form, naming the limit, what is left and the estimate; what is left shown on the
dashboard; the Usage page, its CSV and the admin's usage view; a LoRA adapter's requests
charged at its own price."""

from __future__ import annotations

import csv
import io
from datetime import timedelta
from decimal import Decimal

import pytest
from django.urls import reverse
from django.utils import timezone

from jobs.formats.checkpoint_record import Progress
from jobs.models import Batch, Price, Quota, Shard, UsageRecord
from jobs.services import shards as shard_service
from jobs.services.budgets import budget_for
from tests.factories import (
    chat_line,
    jsonl,
    lazy_import,
    make_batch,
    upload,
)

openai = lazy_import("openai")
anthropic = lazy_import("anthropic")

# 4 requests of max_tokens 1000 at $10 per million output tokens, half off: the ceiling is
# a little over $0.02 (4000 * 5 / 1e6, plus the input).
LINES = [chat_line(f"r{i}", f"hello {i}", max_tokens=1000) for i in range(4)]


@pytest.fixture
def prices():
    return Price.objects.create(model="", input_per_million=2, output_per_million=10)


def set_budget(user, amount: str) -> None:
    Quota.objects.update_or_create(user=user, defaults={"cost_per_month": Decimal(amount)})


def charge(batch: Batch, *, input_tokens: int, output_tokens: int) -> None:
    """Finish every shard of a running batch through the shard service (claim, finish):
    what a worker does, the ledger written in the finish's transaction."""
    for shard in Shard.objects.filter(batch=batch).order_by("index"):
        claimed = shard_service.claim_shard(shard_id=shard.pk, worker="w", top_up=False)
        assert claimed is not None
        assert shard_service.finish_shard(
            shard_id=shard.pk, attempt=claimed.attempt, output_part="", error_part="",
            progress=Progress(completed=shard.request_count, input_tokens=input_tokens,
                              output_tokens=output_tokens))


@pytest.mark.django_db(transaction=True)
def test_openai_batches_create_is_refused_over_budget(openai_client, user, prices):
    file = upload(openai_client, jsonl(LINES))
    set_budget(user, "0.01")
    with pytest.raises(openai.RateLimitError) as caught:
        openai_client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                                     completion_window="24h")
    error = caught.value.body
    assert caught.value.status_code == 429 and error["code"] == "cost_per_month_exceeded"
    assert error["type"] == "insufficient_quota"
    message = error["message"]
    assert "monthly budget of 0.010000 USD" in message and "0.010000 USD is left" in message
    assert "could cost up to 0.020" in message and "4,000 max output tokens" in message
    assert not Batch.objects.exists()
    set_budget(user, "1")
    created = openai_client.batches.create(input_file_id=file.id,
                                           endpoint="/v1/chat/completions",
                                           completion_window="24h")
    assert Batch.objects.get(pk=created.id).api_key is not None


@pytest.mark.django_db(transaction=True)
def test_anthropic_message_batches_create_is_refused_over_budget(anthropic_client, user,
                                                                 prices):
    set_budget(user, "0.01")
    requests = [{"custom_id": f"m{i}", "params": {
        "model": "echo-test", "max_tokens": 1000,
        "messages": [{"role": "user", "content": f"hi {i}"}]}} for i in range(4)]
    with pytest.raises(anthropic.RateLimitError) as caught:
        anthropic_client.messages.batches.create(requests=requests)
    assert caught.value.status_code == 429
    message = caught.value.body["error"]["message"]
    assert "Budget exceeded" in message and "0.010000 USD is left" in message
    assert "4,000 max output tokens" in message
    assert not Batch.objects.exists()
    # Nothing stored either: the input file written from the body went with the refusal.
    from jobs.models import File
    assert not File.objects.exists()


def test_the_form_refuses_over_budget_and_shows_what_is_left(site, user, prices, tmp_path):
    set_budget(user, "0.01")
    response = site.post(reverse("batch_new"), {
        "upload": upload_field(jsonl(LINES)), "action": "check", "completion_window": "24h",
        "priority": "default"})
    page = response.content.decode()
    assert 'id="cost-ceiling"' in page and "0.010000 USD left of this month" in page
    from jobs.models import File
    file = File.objects.get(owner=user)
    response = site.post(reverse("batch_new"), {
        "file_id": file.pk, "action": "submit", "completion_window": "24h",
        "priority": "default", "endpoint": "", "model": ""})
    page = response.content.decode()
    assert response.status_code == 200 and "Budget exceeded (cost per month)" in page
    assert "0.010000 USD is left" in page and not Batch.objects.exists()


def upload_field(content: bytes):
    from django.core.files.uploadedfile import SimpleUploadedFile

    return SimpleUploadedFile("in.jsonl", content, content_type="application/jsonl")


def test_charges_count_against_the_budget_and_a_run_past_it_finishes(user, prices,
                                                                     tmp_path, settings):
    set_budget(user, "0.05")
    batch = make_batch(user, LINES, tmp_path, shard_size=2, settings=settings)
    assert batch.cost_ceiling_nanos > 0
    # The run costs more than estimated (longer inputs): both shards are charged anyway.
    charge(batch, input_tokens=10_000, output_tokens=2000)
    assert UsageRecord.objects.filter(batch_id=batch.pk).count() == 2
    budget = budget_for(user)
    assert budget.charged_nanos == 2 * (10_000 * 1 + 2000 * 5) * 1000  # half off
    assert budget.charged_nanos == 40_000_000 and budget.left_nanos == 10_000_000
    # Last month's charges do not count.
    UsageRecord.objects.filter(batch_id=batch.pk).update(
        recorded_at=timezone.now() - timedelta(days=40))
    assert budget_for(user).charged_nanos == 0


def test_usage_page_csv_and_account_show_usage_and_what_is_left(site, user, other_user,
                                                                 prices, tmp_path, settings):
    set_budget(user, "1")
    batch = make_batch(user, LINES, tmp_path, shard_size=2, settings=settings)
    charge(batch, input_tokens=1000, output_tokens=100)
    theirs = make_batch(other_user, LINES, tmp_path, shard_size=4, settings=settings)
    charge(theirs, input_tokens=5, output_tokens=5)
    page = site.get(reverse("usage")).content.decode()
    # 2 shards x (1000 x 1 + 100 x 5) / 1e6 = 0.003 USD
    assert "0.003000 USD" in page and "0.997000 USD" in page  # the cost and what is left
    assert "<rect" in page and "echo-test" in page
    assert site.get(reverse("usage"), {"model": "other-model"}).status_code == 200
    response = site.get(reverse("usage_csv"), {"days": "7"})
    rows = list(csv.DictReader(io.StringIO(b"".join(response.streaming_content).decode())))
    assert [(r["model"], r["requests_succeeded"], r["cost"]) for r in rows] == [
        ("echo-test", "4", "0.003")]
    account = site.get(reverse("account")).content.decode()
    # The account's money as the Usage page's: with its currency.
    row = account.split('id="quota-cost_per_month"')[1].split("</tr>")[0]
    assert "0.003000 USD" in row and "(0.997000 USD left)" in row and "1.00 USD" in row


def test_the_admin_sums_usage_by_user_and_model_and_exports_it(admin_client, user, prices,
                                                                tmp_path, settings):
    batch = make_batch(user, LINES, tmp_path, shard_size=2, settings=settings)
    charge(batch, input_tokens=1000, output_tokens=100)
    page = admin_client.get("/admin/jobs/usagerecord/").content.decode()
    assert 'id="usage-summary"' in page and "0.003000 USD" in page
    ids = list(UsageRecord.objects.values_list("pk", flat=True))
    response = admin_client.post("/admin/jobs/usagerecord/", {
        "action": "export_by_user_and_model", "_selected_action": ids})
    rows = list(csv.DictReader(io.StringIO(b"".join(response.streaming_content).decode())))
    assert rows == [{"owner__username": user.username, "model": "echo-test",
                     "requests_succeeded": "4", "requests_failed": "0",
                     "input_tokens": "2000", "cached_tokens": "0", "output_tokens": "200",
                     "cost": "0.003", "currency": "usd", "engine_seconds": "0.0"}]
    # Charges are read-only; budgets are edited beside the quotas.
    assert admin_client.get(f"/admin/jobs/usagerecord/{ids[0]}/change/").status_code in (
        200, 403)
    default = admin_client.get("/admin/jobs/quota/")
    assert "cost_per_month" in default.content.decode() or "Cost per month" in \
        default.content.decode()


def test_adapter_requests_are_charged_at_the_adapters_price(user, tmp_path, settings):
    """A shard whose requests named a LoRA adapter: one ledger row for the adapter at its
    price, one for the base model's rest at the default price; the base model's row takes
    the failures; a late finish writes nothing more."""
    from jobs.formats.checkpoint_record import ShardUsage

    Price.objects.create(model="", input_per_million=1, output_per_million=1,
                         batch_discount_percent=0)
    Price.objects.create(model="my-lora", input_per_million=10, output_per_million=100,
                         currency="eur", batch_discount_percent=0)
    batch = make_batch(user, LINES, tmp_path, shard_size=4, settings=settings)
    shard = Shard.objects.get(batch=batch)
    claimed = shard_service.claim_shard(shard_id=shard.pk, worker="w", top_up=False)
    usage = ShardUsage(adapters={"my-lora": [1, 1000, 0, 100]}, engine_seconds=4.0)
    progress = Progress(completed=3, failed=1, input_tokens=3000, output_tokens=300)
    assert shard_service.finish_shard(shard_id=shard.pk, attempt=claimed.attempt,
                                      output_part="", error_part="", progress=progress,
                                      usage=usage)
    assert not shard_service.finish_shard(shard_id=shard.pk, attempt=claimed.attempt,
                                          output_part="", error_part="", progress=progress,
                                          usage=usage)
    rows = {r.model: r for r in UsageRecord.objects.filter(batch_id=batch.pk)}
    assert set(rows) == {"my-lora", "echo-test"}
    lora, base = rows["my-lora"], rows["echo-test"]
    assert (lora.requests_succeeded, lora.input_tokens, lora.output_tokens) == (1, 1000, 100)
    assert (lora.cost_nanos, lora.currency, lora.base_model) == (20_000_000, "eur", "echo-test")
    assert (base.requests_succeeded, base.requests_failed, base.input_tokens) == (2, 1, 2000)
    assert base.cost_nanos == 2_200_000 and base.currency == "usd"
    assert lora.engine_seconds + base.engine_seconds == pytest.approx(4.0)


# 240,000 bytes each way a prompt carries them: as message text, as tool descriptions, as a
# tool result. Each is rendered into the prompt, so each counts in the budget's bound.
BULK = "tool description words " * 10_000


def tool_heavy_chat(i: int) -> dict:
    return chat_line(f"t{i}", "hi", max_tokens=1, tools=[{"type": "function", "function": {
        "name": "lookup", "description": BULK, "parameters": {"type": "object"}}}])


@pytest.mark.django_db(transaction=True)
def test_tools_count_in_the_budget_as_text_does(openai_client, user, prices):
    """Twenty lines of 240 kB of tool descriptions and max_tokens 1 were accepted on a $1
    budget with a ceiling of $0.0002: tools were not counted. At $1 per million input
    tokens (half of $2), 4.8 MB of tools is more than the budget, as 4.8 MB of text is."""
    set_budget(user, "1")
    for lines in ([tool_heavy_chat(i) for i in range(20)],
                  [chat_line(f"x{i}", BULK, max_tokens=1) for i in range(20)]):
        file = upload(openai_client, jsonl(lines))
        with pytest.raises(openai.RateLimitError) as caught:
            openai_client.batches.create(input_file_id=file.id,
                                         endpoint="/v1/chat/completions",
                                         completion_window="24h")
        assert caught.value.body["code"] == "cost_per_month_exceeded"
    assert not Batch.objects.exists()
    file = upload(openai_client, jsonl([tool_heavy_chat(0)]))  # one fits
    openai_client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                                 completion_window="24h")


@pytest.mark.django_db(transaction=True)
def test_anthropic_tools_and_tool_results_count_in_the_budget(anthropic_client, user, prices):
    set_budget(user, "1")
    tools = [{"name": "lookup", "description": BULK, "input_schema": {"type": "object"}}]
    result = [{"role": "user", "content": "hi"},
              {"role": "assistant", "content": [
                  {"type": "tool_use", "id": "toolu_1", "name": "lookup", "input": {"q": "x"}}]},
              {"role": "user", "content": [
                  {"type": "tool_result", "tool_use_id": "toolu_1", "content": BULK}]}]
    for params in ({"tools": tools, "messages": [{"role": "user", "content": "hi"}]},
                   {"messages": result}):
        with pytest.raises(anthropic.RateLimitError) as caught:
            anthropic_client.messages.batches.create(requests=[
                {"custom_id": f"m{i}", "params": {"model": "echo-test", "max_tokens": 1,
                                                  **params}} for i in range(20)])
        assert caught.value.status_code == 429
    assert not Batch.objects.exists()


def test_a_media_part_counts_at_what_its_model_may_make_of_it():
    """An image costs what the model makes of it, not its URL's bytes: each media part
    counts at the room's `media_tokens` (the registry's max_tokens_per_media, else the
    model's whole context), nested ones (an Anthropic tool result's) included."""
    from engine.endpoints import CHAT, MESSAGES
    from jobs.formats.prompts import Room, prompt_bound
    from jobs.formats.wire import RequestLine

    room = Room(context=4096, cap=4096, media_tokens=1000)
    image = {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
    text_only = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    with_images = {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi"}, image, image]}]}
    assert (prompt_bound(RequestLine("a", CHAT, with_images), room)
            >= prompt_bound(RequestLine("a", CHAT, text_only), room) + 2000)
    block = {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}
    nested = {"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": [block]}]}]}
    assert prompt_bound(RequestLine("m", MESSAGES, nested), room) >= 1000
