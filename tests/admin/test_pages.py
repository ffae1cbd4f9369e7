"""The Django admin's pages: every model's render (the site default quota made on the
way, its secret fields hidden), and only staff opens them."""

from __future__ import annotations

import pytest
from django.contrib.admin.utils import quote  # ids in admin URLs are quoted
from django.urls import reverse

from jobs.models import Quota, Shard, UserSettings, WebhookDelivery, WebhookEvent
from tests.factories import chat_lines, make_batch, run_batch

pytestmark = pytest.mark.django_db


def test_every_admin_page_renders(staff, running_batch):
    shard = Shard.objects.filter(batch=running_batch).first()
    for url in ["/admin/jobs/batch/", f"/admin/jobs/batch/{quote(running_batch.pk)}/change/",
                "/admin/jobs/shard/", f"/admin/jobs/shard/{quote(shard.pk)}/change/",
                "/admin/jobs/file/",
                f"/admin/jobs/file/{quote(running_batch.input_file_id)}/change/",
                "/admin/jobs/upload/", "/admin/jobs/apikey/", "/admin/jobs/apikey/add/"]:
        assert staff.get(url).status_code == 200, url


def test_plain_users_cannot_open_the_admin(client, user):
    client.force_login(user)
    response = client.get("/admin/jobs/batch/")
    assert response.status_code == 302
    assert "/admin/login/" in response["Location"]


@pytest.mark.django_db
def test_new_admin_pages_render(admin_client, user, tmp_path):
    batch = run_batch(make_batch(user, chat_lines(1), tmp_path))
    event = WebhookEvent.objects.create(owner=user, type="batch.completed", batch_id=batch.pk)
    WebhookDelivery.objects.create(event=event, attempt=1, url="http://x/", status_code=500,
                                   error="HTTP 500")
    UserSettings.objects.create(user=user, webhook_url="https://example.com/hook")
    quota = Quota.objects.create(user=user, max_active_batches=2)
    for url in ["/admin/", "/admin/jobs/quota/", "/admin/jobs/quota/add/",
                f"/admin/jobs/quota/{quota.pk}/change/", "/admin/jobs/usersettings/",
                "/admin/jobs/webhookevent/", f"/admin/jobs/webhookevent/{quote(event.pk)}/change/",
                "/admin/jobs/webhookdelivery/", "/admin/jobs/shard/health/",
                "/admin/jobs/shard/"]:
        response = admin_client.get(url)
        assert response.status_code == 200, url
    # The changelist creates the site default row for the operator to edit.
    assert Quota.objects.filter(user__isnull=True).exists()
    default = Quota.objects.get(user__isnull=True)
    assert admin_client.get(f"/admin/jobs/quota/{default.pk}/delete/").status_code == 403
    index = admin_client.get("/admin/").content.decode()
    assert reverse("admin:jobs_queue_health") in index and "/admin/rq/" in index
    # The signing secret is the user's; the admin page does not show it.
    settings_row = UserSettings.objects.get(user=user)
    page = admin_client.get(f"/admin/jobs/usersettings/{settings_row.pk}/change/")
    assert settings_row.webhook_secret not in page.content.decode()
