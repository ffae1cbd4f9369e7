"""The API keys page: a key shown once, listed by prefix, revoked."""

from __future__ import annotations

import pytest
from django.urls import reverse

from jobs.models import ApiKey

pytestmark = pytest.mark.django_db


def test_keys_create_once_list_revoke(site, user):
    response = site.post(reverse("key_list"), {"name": "laptop"})
    page = response.content.decode()
    assert "no-cache" in response["Cache-Control"] or "max-age=0" in response["Cache-Control"]
    key = ApiKey.objects.get(owner=user, name="laptop")
    secret = page.split('<pre class="key" id="new-key">')[1].split("</pre>")[0]
    assert secret.startswith("sk-bw-") and secret[:12] == key.prefix
    listing = site.get(reverse("key_list")).content.decode()
    assert "laptop" in listing and secret not in listing and key.prefix in listing
    assert site.post(reverse("key_revoke", args=[key.pk])).status_code == 302
    assert ApiKey.objects.get(pk=key.pk).revoked_at is not None
    assert "revoked" in site.get(reverse("key_list")).content.decode()
