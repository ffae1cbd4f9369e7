"""The account page: usage against the quotas, and the webhook URL and its signing secret."""

from __future__ import annotations

import pytest
from django.urls import reverse
from django.utils import timezone

from jobs.models import File, UserSettings
from tests.factories import chat_line, make_file, set_quota, used_tokens


@pytest.mark.django_db
def test_account_page_shows_usage_and_limits(site, user, tmp_path):
    set_quota(user, max_stored_bytes=10_000, tokens_per_day=1000, max_active_batches=3)
    make_file(user, [chat_line("r", "x")], tmp_path)
    used_tokens(user, tmp_path, 250, finished_at=timezone.now())
    stored = sum(File.objects.filter(owner=user).values_list("bytes", flat=True))
    page = site.get(reverse("account")).content.decode()
    assert 'href="/account/"' in page  # the nav link
    assert "Usage and limits" in page
    row = page.split('id="quota-tokens_per_day"')[1].split("</tr>")[0]
    assert ">250<" in row and ">1,000<" in row
    row = page.split('id="quota-max_stored_bytes"')[1].split("</tr>")[0]
    assert f"{stored}\xa0bytes" in row and "9.8\xa0KB" in row
    row = page.split('id="quota-max_file_bytes"')[1].split("</tr>")[0]
    assert "no limit" in row


@pytest.mark.django_db(transaction=True)
def test_dashboard_sets_the_webhook_and_rotates_the_secret(client, user, receiver,
                                                           loopback_allowed, settings):
    client.force_login(user)
    page = client.get(reverse("account")).content.decode()
    secret = UserSettings.objects.get(user=user).webhook_secret
    assert secret.startswith("whsec_") and secret in page
    assert "webhook-signature" in page
    response = client.post(reverse("account"), {"webhook_url": receiver.url})
    assert response.status_code == 302
    assert UserSettings.objects.get(user=user).webhook_url == receiver.url

    settings.BATCHWEB = {**settings.BATCHWEB, "WEBHOOK_ALLOWED_NETWORKS": []}
    page = client.post(reverse("account"), {"webhook_url": "http://127.0.0.1:1/x"})
    assert "is not allowed by this service" in page.content.decode()
    assert UserSettings.objects.get(user=user).webhook_url == receiver.url

    client.post(reverse("rotate_webhook_secret"))
    assert UserSettings.objects.get(user=user).webhook_secret != secret
    client.post(reverse("account"), {"webhook_url": ""})
    assert UserSettings.objects.get(user=user).webhook_url == ""
