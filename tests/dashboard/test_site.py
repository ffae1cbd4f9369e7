"""The dashboard as a whole: sign in and out, every page behind it, local static files
(htmx included) and a CSRF token in every form."""

from __future__ import annotations

import re

import pytest
from django.urls import reverse

from tests.factories import chat_lines, make_batch, run_batch

pytestmark = pytest.mark.django_db


def test_pages_need_sign_in(client):
    for url in (reverse("batch_list"), reverse("batch_new"), reverse("file_list"),
                reverse("key_list")):
        response = client.get(url)
        assert response.status_code == 302
        assert response.url.startswith(reverse("login"))


def test_sign_in_and_out(client, user):
    page = client.get(reverse("login"))
    assert page.status_code == 200 and b"csrfmiddlewaretoken" in page.content
    response = client.post(reverse("login"), {"username": "alice", "password": "pw-alice-123"})
    assert response.status_code == 302 and response.url == reverse("batch_list")
    assert client.get(reverse("batch_list")).status_code == 200
    assert client.post(reverse("logout")).status_code == 302
    assert client.get(reverse("batch_list")).status_code == 302


def test_static_and_htmx_are_local(site):
    page = site.get(reverse("batch_list")).content.decode()
    # Every script, style sheet and link points at this site (a random token in the page,
    # such as the CSRF token, may spell anything, so the page's text is not searched).
    addresses = re.findall(r'(?:src|href)="([^"]*)"', page)
    assert addresses and all(a.startswith(("/", "#", "?")) for a in addresses), addresses
    assert "django_htmx/htmx" in page


def test_every_form_has_csrf(site, user, tmp_path):
    batch = run_batch(make_batch(user, chat_lines(12), tmp_path), fails=lambda c: c == "r1")
    running = make_batch(user, chat_lines(2, "x"), tmp_path)
    for url in (reverse("batch_new"), reverse("key_list"), reverse("file_list"),
                reverse("batch_detail", args=[batch.pk]),
                reverse("batch_detail", args=[running.pk]),
                reverse("batch_cancel", args=[running.pk]),
                reverse("batch_spot_check", args=[batch.pk])):
        page = site.get(url).content.decode()
        posts = page.count('method="post"')
        assert posts and page.count("csrfmiddlewaretoken") >= posts, url
