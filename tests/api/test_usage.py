"""OpenAI's Usage and Costs API over the ledger (GET /v1/organization/usage/completions,
/usage/embeddings, /costs): OpenAI's shapes, buckets, group_by, filters, paging, and who sees
what (a key its owner's usage, a superuser's or a usage viewer's key everyone's, another
staff user's key its own)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from django.contrib.auth.models import Permission

from jobs.models import ApiKey, Price, UsageRecord
from jobs.services.keys import create_api_key
from jobs.services.ledger import add_to_days
from tests.factories import TLS_CONTEXT, lazy_import

openai = lazy_import("openai")

pytestmark = pytest.mark.django_db

DAY = 86400


@pytest.fixture
def ledger(user, other_user):
    """Charges over three days: two models of `user` (one through a key), an embeddings
    batch, and another user's charge."""
    Price.objects.create(model="", input_per_million=1, output_per_million=2)
    key, _ = create_api_key(owner=user, name="ci")
    day0 = datetime(2026, 11, 2, tzinfo=UTC)

    def record(owner, model, *, at, key=None, endpoint="/v1/chat/completions", n=1,
               tokens=(100, 10, 50), cost=1_000_000):
        # Written as the ledger writes a shard's charge: the row and its day's sums.
        add_to_days([UsageRecord.objects.create(
            owner=owner, api_key=key, batch_id=f"batch_{model}{at.day}{owner.pk}",
            shard_id=f"shard_{model}{int(at.timestamp())}{owner.pk}", model=model,
            base_model=model, endpoint=endpoint, requests_succeeded=n,
            input_tokens=tokens[0], cached_tokens=tokens[1], output_tokens=tokens[2],
            cost_nanos=cost, recorded_at=at)])

    record(user, "echo-test", at=day0 + timedelta(hours=1), key=key, n=3)
    record(user, "echo-test", at=day0 + timedelta(hours=5), n=2)
    record(user, "small", at=day0 + timedelta(days=1, hours=2), key=key, cost=2_500_000)
    record(user, "embed", at=day0 + timedelta(days=2), endpoint="/v1/embeddings",
           tokens=(40, 0, 0), cost=40_000)
    record(user, "embed", at=day0 + timedelta(days=2, hours=1), endpoint="/v1/moderations",
           n=4, tokens=(90, 0, 0), cost=90_000)
    record(other_user, "echo-test", at=day0 + timedelta(hours=3), n=7, cost=9_000_000)
    return {"start": int(day0.timestamp()), "key": key}


def get(client, key: str, path: str, **params):
    response = client.get(f"/v1/organization/{path}", params,
                          HTTP_AUTHORIZATION=f"Bearer {key}")
    return response.status_code, response.json()


def test_completions_usage_by_day_and_model_for_the_keys_owner(client, api_key, ledger):
    status, page = get(client, api_key, "usage/completions", start_time=ledger["start"],
                       end_time=ledger["start"] + 3 * DAY, group_by="model")
    assert status == 200 and page["object"] == "page" and page["has_more"] is False
    assert [b["start_time"] - ledger["start"] for b in page["data"]] == [0, DAY, 2 * DAY]
    first, second, third = page["data"]
    assert first["object"] == "bucket" and first["end_time"] == ledger["start"] + DAY
    # The other user's 7 requests are not this key's to see.
    assert first["results"] == [{
        "object": "organization.usage.completions.result", "input_tokens": 200,
        "output_tokens": 100, "input_cached_tokens": 20, "input_uncached_tokens": 180,
        "input_audio_tokens": 0, "output_audio_tokens": 0, "output_reasoning_tokens": 0,
        "num_model_requests": 5, "project_id": None, "user_id": None, "api_key_id": None,
        "model": "echo-test", "batch": None}]
    assert [r["model"] for r in second["results"]] == ["small"]
    assert third["results"] == []  # the embeddings batch is not a completion


def test_filters_and_groups(client, api_key, ledger):
    key_id = str(ledger["key"].pk)
    _, page = get(client, api_key, "usage/completions", start_time=ledger["start"],
                  end_time=ledger["start"] + 2 * DAY, api_key_ids=key_id,
                  group_by=["api_key_id", "batch"])
    assert [(r["api_key_id"], r["batch"], r["num_model_requests"])
            for b in page["data"] for r in b["results"]] == [(key_id, True, 3),
                                                            (key_id, True, 1)]
    _, page = get(client, api_key, "usage/completions", start_time=ledger["start"],
                  end_time=ledger["start"] + 2 * DAY, models="small")
    assert [r["num_model_requests"] for b in page["data"] for r in b["results"]] == [1]
    _, page = get(client, api_key, "usage/completions", start_time=ledger["start"],
                  end_time=ledger["start"] + 2 * DAY, batch="false")
    assert all(b["results"] == [] for b in page["data"])
    _, page = get(client, api_key, "usage/completions", start_time=ledger["start"],
                  end_time=ledger["start"] + DAY, bucket_width="1h", limit=24)
    hours = [b for b in page["data"] if b["results"]]
    assert [b["start_time"] - ledger["start"] for b in hours] == [3600, 5 * 3600]


def test_embeddings_usage(client, api_key, ledger):
    """Moderations run on the same model are not embeddings' requests or tokens."""
    _, page = get(client, api_key, "usage/embeddings", start_time=ledger["start"],
                  end_time=ledger["start"] + 3 * DAY, group_by="model")
    results = [r for b in page["data"] for r in b["results"]]
    assert results == [{"object": "organization.usage.embeddings.result", "input_tokens": 40,
                        "num_model_requests": 1, "project_id": None, "user_id": None,
                        "api_key_id": None, "model": "embed"}]


def test_moderations_usage_is_a_kind_of_its_own(client, api_key, ledger):
    """As OpenAI's /v1/organization/usage/moderations: input tokens and requests."""
    _, page = get(client, api_key, "usage/moderations", start_time=ledger["start"],
                  end_time=ledger["start"] + 3 * DAY, group_by="model")
    results = [r for b in page["data"] for r in b["results"]]
    assert results == [{"object": "organization.usage.moderations.result", "input_tokens": 90,
                        "num_model_requests": 4, "project_id": None, "user_id": None,
                        "api_key_id": None, "model": "embed"}]
    _, page = get(client, api_key, "usage/completions", start_time=ledger["start"],
                  end_time=ledger["start"] + 3 * DAY)
    assert [r["num_model_requests"] for b in page["data"] for r in b["results"]] == [5, 1]


def test_costs_by_day_and_line_item_with_paging(client, api_key, ledger):
    _, page = get(client, api_key, "costs", start_time=ledger["start"],
                  end_time=ledger["start"] + 3 * DAY, limit=2, group_by="line_item")
    assert page["has_more"] is True and len(page["data"]) == 2
    assert page["data"][0]["results"] == [{
        "object": "organization.costs.result", "amount": {"value": 0.002, "currency": "usd"},
        "line_item": "echo-test", "project_id": None, "api_key_id": None, "user_id": None}]
    assert page["data"][1]["results"][0]["amount"]["value"] == 0.0025
    _, rest = get(client, api_key, "costs", start_time=ledger["start"],
                  end_time=ledger["start"] + 3 * DAY, limit=2, group_by="line_item",
                  page=page["next_page"])
    assert rest["has_more"] is False and rest["next_page"] is None
    assert [b["start_time"] for b in rest["data"]] == [ledger["start"] + 2 * DAY]
    # The embeddings model's line: its embeddings and its moderations, priced alike.
    assert rest["data"][0]["results"][0]["amount"]["value"] == pytest.approx(0.00013)


@pytest.mark.django_db(transaction=True)
def test_the_openai_client_reads_uncached_tokens_and_costs_by_key(live_server, api_key,
                                                                 ledger, user):
    # A shard that reasoned: counted apart from the output tokens it is part of.
    add_to_days([UsageRecord.objects.create(
        owner=user, batch_id="batch_think", shard_id="shard_think", model="echo-test",
        base_model="echo-test", endpoint="/v1/chat/completions", requests_succeeded=1,
        input_tokens=30, cached_tokens=0, output_tokens=20, reasoning_tokens=12,
        cost_nanos=500_000, recorded_at=datetime.fromtimestamp(ledger["start"] + 7200,
                                                               tz=UTC))])
    client = openai.OpenAI(base_url=live_server.url + "/v1", api_key=api_key,
                           admin_api_key=api_key, max_retries=0,
                           http_client=openai.DefaultHttpxClient(verify=TLS_CONTEXT))
    usage = client.admin.organization.usage
    page = usage.completions(start_time=ledger["start"], end_time=ledger["start"] + DAY,
                             group_by=["model"])
    (result,) = page.data[0].results
    assert (result.input_tokens, result.input_cached_tokens, result.input_uncached_tokens,
            result.output_tokens) == (230, 20, 210, 120)
    assert result.model_extra == {"output_reasoning_tokens": 12}  # the one extension
    key_id = str(ledger["key"].pk)
    costs = usage.costs(start_time=ledger["start"], end_time=ledger["start"] + 2 * DAY,
                        group_by=["api_key_id"])
    by_key = [[(r.api_key_id, r.amount.value) for r in bucket.results]
              for bucket in costs.data]
    # The dashboard's charges (no key) apart from the key's.
    assert [sorted(day, key=str) for day in by_key] == [
        sorted([(key_id, 0.001), (None, 0.0015)], key=str), [(key_id, 0.0025)]]
    only_key = usage.costs(start_time=ledger["start"], end_time=ledger["start"] + 2 * DAY,
                           group_by=["api_key_id", "line_item"], api_key_ids=[key_id])
    assert [(r.api_key_id, r.line_item) for b in only_key.data for r in b.results] == [
        (key_id, "echo-test"), (key_id, "small")]


def _staff(django_user_model, name: str, *, permission: bool = False):
    staff = django_user_model.objects.create_user(name, password=f"pw-{name}-123456",
                                                  is_staff=True)
    if permission:
        staff.user_permissions.add(Permission.objects.get(
            content_type__app_label="jobs", codename="view_usagerecord"))
    return staff


def test_a_usage_viewers_key_sees_everyone_and_filters_by_user(client, ledger, user,
                                                               other_user, django_user_model):
    _, secret = create_api_key(owner=_staff(django_user_model, "ops", permission=True),
                               name="ops")
    _, page = get(client, secret, "usage/completions", start_time=ledger["start"],
                  end_time=ledger["start"] + DAY, group_by="user_id")
    assert sorted((r["user_id"], r["num_model_requests"]) for r in page["data"][0]["results"]) \
        == sorted([(str(user.pk), 5), (str(other_user.pk), 7)])
    _, page = get(client, secret, "costs", start_time=ledger["start"],
                  end_time=ledger["start"] + DAY, user_ids=str(other_user.pk))
    assert page["data"][0]["results"][0]["amount"]["value"] == 0.009
    assert ApiKey.objects.count() == 2


def test_a_superusers_key_sees_everyone(client, ledger, user, other_user, django_user_model):
    root = django_user_model.objects.create_superuser("root", password="pw-root-123456")
    _, secret = create_api_key(owner=root, name="root")
    _, page = get(client, secret, "usage/completions", start_time=ledger["start"],
                  end_time=ledger["start"] + DAY, group_by="user_id")
    assert sorted((r["user_id"], r["num_model_requests"]) for r in page["data"][0]["results"]) \
        == sorted([(str(user.pk), 5), (str(other_user.pk), 7)])


def test_a_staff_key_without_the_permission_sees_only_its_owners_usage(client, ledger,
                                                                       other_user,
                                                                       django_user_model):
    # Staff is an admin login, not OpenAI's admin key: other users' usage and costs stay
    # theirs, whatever the filters ask for.
    staff = _staff(django_user_model, "desk")
    _, secret = create_api_key(owner=staff, name="desk")
    for path in ("usage/completions", "costs"):
        for extra in ({}, {"user_ids": str(other_user.pk)}):
            status, page = get(client, secret, path, start_time=ledger["start"],
                               end_time=ledger["start"] + 3 * DAY, **extra)
            assert status == 200
            assert all(b["results"] == [] for b in page["data"]), (path, extra)


def test_a_period_that_is_not_whole_days_reads_the_rows_at_its_edges(client, api_key,
                                                                     ledger):
    # From 02:00 on the first day to 03:00 on the second: the 01:00 row is out, the 05:00
    # row in; the second day's 02:00 row in (its whole day is not in the period).
    _, page = get(client, api_key, "usage/completions", start_time=ledger["start"] + 7200,
                  end_time=ledger["start"] + DAY + 3 * 3600)
    assert [[r["num_model_requests"] for r in b["results"]] for b in page["data"]] == [
        [2], [1]]
    _, page = get(client, api_key, "costs", start_time=ledger["start"],
                  end_time=ledger["start"] + DAY + 3600)
    assert [[r["amount"]["value"] for r in b["results"]] for b in page["data"]] == [
        [0.002], []]


def test_bad_parameters_get_openai_errors(client, api_key, ledger):
    status, body = get(client, api_key, "usage/completions")
    assert status == 400 and body["error"]["param"] == "start_time"
    status, body = get(client, api_key, "costs", start_time=ledger["start"],
                       bucket_width="1h")
    assert status == 400 and body["error"]["param"] == "bucket_width"
    status, body = get(client, api_key, "usage/completions", start_time=ledger["start"],
                       group_by="line_item")
    assert status == 400 and body["error"]["param"] == "group_by"
    status, body = get(client, api_key, "costs", start_time=ledger["start"], limit=181)
    assert status == 400 and body["error"]["param"] == "limit"
    assert client.get("/v1/organization/costs", {"start_time": 0}).status_code == 401
