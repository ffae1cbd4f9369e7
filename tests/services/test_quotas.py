"""Quotas: each limit on the API (official openai client, live server) and on the dashboard,
at the limit, just over it, and after its period resets; the site default and per-user
overrides (the account page showing usage is in tests/dashboard/test_account.py)."""

from __future__ import annotations

from datetime import UTC, timedelta

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.urls import reverse
from django.utils import timezone

from jobs.lib.errors import ServiceError
from jobs.models import Batch, File, Quota, Shard
from jobs.services import quotas
from tests.factories import (
    chat_line,
    jsonl,
    lazy_import,
    make_batch,
    make_file,
    new_batch,
    set_quota,
    upload,
    used_tokens,
)

openai = lazy_import("openai")

ONE = jsonl([chat_line("r0", "hello")])
THREE = jsonl([chat_line(f"r{i}", f"hello {i}") for i in range(3)])
FOUR = jsonl([chat_line(f"r{i}", f"hello {i}") for i in range(4)])


# --- the API ---


@pytest.mark.django_db(transaction=True)
class TestApi:
    def test_max_file_bytes(self, openai_client, user):
        set_quota(user, max_file_bytes=len(THREE))
        assert upload(openai_client, THREE).bytes == len(THREE)  # at the limit
        with pytest.raises(openai.BadRequestError) as caught:
            upload(openai_client, FOUR)  # just over
        error = caught.value.body
        assert caught.value.status_code == 400
        assert caught.value.code == "max_file_bytes_exceeded"
        assert f"this file is {len(FOUR):,} bytes" in error["message"]
        assert f"at most {len(THREE):,} bytes" in error["message"]
        assert File.objects.filter(owner=user).count() == 1  # nothing stored

    def test_max_stored_bytes_and_deleting_frees_room(self, openai_client, user):
        set_quota(user, max_stored_bytes=2 * len(THREE))
        first = upload(openai_client, THREE)
        upload(openai_client, THREE)  # exactly at the limit
        with pytest.raises(openai.RateLimitError) as caught:
            upload(openai_client, ONE)
        assert caught.value.status_code == 429
        assert caught.value.code == "max_stored_bytes_exceeded"
        assert caught.value.type == "insufficient_quota"
        assert f"you store {2 * len(THREE):,} of {2 * len(THREE):,} bytes" in \
            caught.value.body["message"]
        openai_client.files.delete(first.id)
        assert upload(openai_client, ONE).bytes == len(ONE)

    def test_max_requests_per_batch(self, openai_client, user):
        set_quota(user, max_requests_per_batch=3)
        assert new_batch(openai_client, upload(openai_client, THREE).id).status == "validating"
        four = upload(openai_client, FOUR).id
        with pytest.raises(openai.BadRequestError) as caught:
            new_batch(openai_client, four)
        assert caught.value.code == "max_requests_per_batch_exceeded"
        assert "this batch has 4 requests; a batch may have at most 3" in \
            caught.value.body["message"]

    def test_max_active_batches_until_one_ends(self, openai_client, user):
        set_quota(user, max_active_batches=2)
        file_id = upload(openai_client, ONE).id
        first = new_batch(openai_client, file_id)
        new_batch(openai_client, file_id)  # reaches the limit
        with pytest.raises(openai.RateLimitError) as caught:
            new_batch(openai_client, file_id)
        assert caught.value.code == "max_active_batches_exceeded"
        assert "2 of your batches are active and at most 2 may be" in \
            caught.value.body["message"]
        Batch.objects.filter(pk=first.id).update(status=Batch.Status.COMPLETED)
        assert new_batch(openai_client, file_id).status == "validating"

    def test_tokens_per_day_at_over_and_reset(self, openai_client, user, tmp_path):
        set_quota(user, tokens_per_day=100)
        file_id = upload(openai_client, ONE).id
        day_start, _ = quotas.period_starts()
        # Yesterday's usage does not count today: the period has reset.
        used_tokens(user, tmp_path, 500, finished_at=day_start - timedelta(seconds=1))
        used_tokens(user, tmp_path, 99, finished_at=timezone.now())
        new_batch(openai_client, file_id)  # 99 < 100: accepted
        used_tokens(user, tmp_path, 1, finished_at=timezone.now())
        with pytest.raises(openai.RateLimitError) as caught:
            new_batch(openai_client, file_id)
        assert caught.value.code == "tokens_per_day_exceeded"
        assert "you have used 100 of 100 tokens today" in caught.value.body["message"]

    def test_tokens_per_month_at_over_and_reset(self, openai_client, user, tmp_path):
        set_quota(user, tokens_per_month=1000)
        file_id = upload(openai_client, ONE).id
        _, month_start = quotas.period_starts()
        used_tokens(user, tmp_path, 5000, finished_at=month_start - timedelta(seconds=1))
        used_tokens(user, tmp_path, 999, finished_at=timezone.now())
        new_batch(openai_client, file_id)
        used_tokens(user, tmp_path, 1, finished_at=timezone.now())
        with pytest.raises(openai.RateLimitError) as caught:
            new_batch(openai_client, file_id)
        assert caught.value.code == "tokens_per_month_exceeded"
        assert "used 1,000 of 1,000 tokens this month" in caught.value.body["message"]


# --- the rules, without HTTP ---


@pytest.mark.django_db
def test_site_default_applies_and_user_rows_override(user, other_user):
    default = quotas.default_quota()
    default.max_active_batches = 5
    default.tokens_per_day = 10
    default.save()
    set_quota(user, max_active_batches=1)  # tokens_per_day blank: the default's
    assert quotas.limits_for(user)["max_active_batches"] == 1
    assert quotas.limits_for(user)["tokens_per_day"] == 10
    assert quotas.limits_for(other_user)["max_active_batches"] == 5
    assert quotas.limits_for(other_user)["max_file_bytes"] is None  # no limit


@pytest.mark.django_db
def test_only_one_default_row():
    from django.db import IntegrityError, transaction

    quotas.default_quota()
    with pytest.raises(IntegrityError), transaction.atomic():
        Quota.objects.create(user=None)
    assert quotas.default_quota() == Quota.objects.get(user__isnull=True)


@pytest.mark.django_db
def test_periods_reset_at_midnight_and_on_the_first():
    from datetime import datetime

    day, month = quotas.period_starts(datetime(2025, 3, 17, 13, 5, tzinfo=UTC))
    assert day == datetime(2025, 3, 17, tzinfo=UTC)
    assert month == datetime(2025, 3, 1, tzinfo=UTC)


@pytest.mark.django_db
def test_tokens_of_other_users_and_running_shards_do_not_count(user, other_user, tmp_path):
    set_quota(user, tokens_per_day=10)
    used_tokens(other_user, tmp_path, 50, finished_at=timezone.now())
    running = make_batch(user, [chat_line("t", "x")], tmp_path)
    Shard.objects.filter(batch=running).update(status=Shard.Status.RUNNING, input_tokens=40,
                                               finished_at=None)
    assert quotas.usage_for(user)["tokens_per_day"] == 0
    quotas.check_quota(owner=user, batch_requests=1)


# --- the dashboard: the same service, the same messages ---


def dashboard_upload(site, content: bytes):
    return site.post(reverse("batch_new"), {
        "upload": SimpleUploadedFile("in.jsonl", content, content_type="application/jsonl"),
        "action": "check", "completion_window": "24h", "priority": "default"})


def dashboard_submit(site, file: File):
    return site.post(reverse("batch_new"), {
        "file_id": file.pk, "action": "submit", "completion_window": "24h",
        "priority": "default", "endpoint": "", "model": ""})


@pytest.mark.django_db
class TestDashboard:
    def test_file_size_and_stored_bytes(self, site, user):
        set_quota(user, max_file_bytes=len(THREE), max_stored_bytes=len(THREE) + len(ONE))
        page = dashboard_upload(site, FOUR).content.decode()
        assert "Quota exceeded (file size)" in page
        assert f"this file is {len(FOUR):,} bytes" in page
        assert not File.objects.filter(owner=user).exists()
        dashboard_upload(site, THREE)  # at the file-size limit
        dashboard_upload(site, ONE)  # reaches the stored-bytes limit
        assert File.objects.filter(owner=user).count() == 2
        page = dashboard_upload(site, ONE).content.decode()
        assert "Quota exceeded (stored bytes)" in page
        assert f"you store {len(THREE) + len(ONE):,} of" in page

    def test_requests_per_batch(self, site, user, tmp_path):
        set_quota(user, max_requests_per_batch=3)
        response = dashboard_submit(site, make_file(user, [chat_line(f"r{i}", "x")
                                                           for i in range(3)], tmp_path))
        assert response.status_code == 302
        page = dashboard_submit(site, make_file(user, [chat_line(f"r{i}", "x")
                                                       for i in range(4)], tmp_path))
        assert "Quota exceeded (requests per batch)" in page.content.decode()
        assert Batch.objects.filter(owner=user).count() == 1

    def test_active_batches(self, site, user, tmp_path):
        set_quota(user, max_active_batches=1)
        file = make_file(user, [chat_line("r", "x")], tmp_path)
        assert dashboard_submit(site, file).status_code == 302
        page = dashboard_submit(site, file).content.decode()
        assert "Quota exceeded (active batches)" in page
        assert "1 of your batches are active" in page
        Batch.objects.filter(owner=user).update(status=Batch.Status.CANCELLED)
        assert dashboard_submit(site, file).status_code == 302

    def test_token_budgets_at_over_and_reset(self, site, user, tmp_path):
        set_quota(user, tokens_per_day=100, tokens_per_month=1000)
        file = make_file(user, [chat_line("r", "x")], tmp_path)
        day_start, _ = quotas.period_starts()
        old = used_tokens(user, tmp_path, 100, finished_at=day_start - timedelta(seconds=1))
        # Yesterday reached the daily budget; today it is reset (the month still counts).
        assert dashboard_submit(site, file).status_code == 302
        Batch.objects.filter(owner=user).exclude(pk=old.pk).update(
            status=Batch.Status.COMPLETED)
        used_tokens(user, tmp_path, 100, finished_at=timezone.now())
        page = dashboard_submit(site, file).content.decode()
        assert "Quota exceeded (tokens today)" in page
        assert "you have used 100 of 100 tokens today" in page


@pytest.mark.django_db
def test_check_quota_error_shape(user):
    set_quota(user, max_file_bytes=10)
    with pytest.raises(ServiceError) as caught:
        quotas.check_quota(owner=user, file_bytes=11)
    assert (caught.value.status, caught.value.code) == (400, "max_file_bytes_exceeded")
