"""Logins are throttled per (username, IP) and per IP on the dashboard and the admin alike,
and no one can lock a user out from elsewhere; passwords must not be common or personal."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.conf import settings
from django.contrib.auth.password_validation import validate_password
from django.core.exceptions import ValidationError
from django.test import Client, RequestFactory
from django.urls import reverse

pytestmark = pytest.mark.django_db

DASHBOARD = "/accounts/login/"
ADMIN = "/admin/login/"


@pytest.fixture
def people(django_user_model: Any) -> dict[str, Any]:
    return {"alice": django_user_model.objects.create_user("alice", password="alice-pw",
                                                          is_staff=True),
            "bob": django_user_model.objects.create_user("bob", password="bob-pw")}


def _login(ip: str, username: str, password: str, url: str = DASHBOARD) -> int:
    """The status of one sign-in from `ip`: 302 signed in, 200 refused, 429 locked out."""
    response = Client(REMOTE_ADDR=ip).post(url, {"username": username, "password": password})
    return response.status_code


def _fail(ip: str, username: str, times: int, url: str = DASHBOARD) -> None:
    """`times` wrong passwords; the one that reaches a limit is answered with the lockout."""
    statuses = [_login(ip, username, "wrong", url) for _ in range(times)]
    assert set(statuses[:-1]) <= {200}, statuses


def test_a_pair_is_locked_after_a_few_failures_but_not_the_user_elsewhere(people: dict) -> None:
    attacker, home = "203.0.113.9", "198.51.100.7"
    _fail(attacker, "alice", settings.LOGIN_FAILURES_PER_USER - 1)
    assert _login(attacker, "alice", "alice-pw") == 302  # below the limit: still allowed
    # A success does not wipe the count (an attacker could sign in to their own account
    # between guesses): the next failure reaches the limit.
    assert _login(attacker, "alice", "wrong") == 429
    # The right password no longer helps from there, on either login page.
    assert _login(attacker, "alice", "alice-pw") == 429
    assert _login(attacker, "alice", "alice-pw", ADMIN) == 429
    # Alice, from home, is not locked out by the attacker's guesses.
    assert _login(home, "alice", "alice-pw") == 302
    assert _login(home, "alice", "alice-pw", ADMIN) == 302
    # Nor is another account at the attacker's address (the address is below its own limit).
    assert _login(attacker, "bob", "bob-pw") == 302


def test_an_address_is_locked_after_more_failures_across_accounts(people: dict) -> None:
    stuffing, other = "203.0.113.50", "203.0.113.51"
    names = [f"user{i}" for i in range(settings.LOGIN_FAILURES_PER_IP)]
    for name in names:  # one guess per account: no pair reaches its limit
        _fail(stuffing, name, 1, ADMIN if name.endswith("1") else DASHBOARD)
    assert _login(stuffing, "bob", "bob-pw") == 429
    assert _login(other, "bob", "bob-pw") == 302
    assert settings.LOGIN_FAILURES_PER_USER < settings.LOGIN_FAILURES_PER_IP


def test_the_admin_login_counts_too(people: dict) -> None:
    ip = "203.0.113.77"
    _fail(ip, "alice", settings.LOGIN_FAILURES_PER_USER, ADMIN)
    assert _login(ip, "alice", "alice-pw") == 429


def test_a_lock_lifts_after_the_cool_off(people: dict) -> None:
    from axes.models import AccessAttempt

    ip = "203.0.113.88"
    _fail(ip, "alice", settings.LOGIN_FAILURES_PER_USER)
    assert _login(ip, "alice", "alice-pw") == 429
    AccessAttempt.objects.update(
        attempt_time=AccessAttempt.objects.first().attempt_time  # type: ignore[union-attr]
        - settings.AXES_COOLOFF_TIME - timedelta(seconds=1))
    assert _login(ip, "alice", "alice-pw") == 302


def test_the_client_address_behind_proxies_is_the_one_they_saw(settings: Any) -> None:
    from jobs.http.throttle import client_ip

    factory = RequestFactory()
    spoofed = factory.get("/", REMOTE_ADDR="10.0.0.2",
                          HTTP_X_FORWARDED_FOR="198.51.100.7, 203.0.113.9")
    settings.BATCHWEB_PROXY_COUNT = 0  # no proxy: the header is the client's own words
    assert client_ip(spoofed) == "10.0.0.2"
    settings.BATCHWEB_PROXY_COUNT = 1  # one proxy appended what it saw; the rest is made up
    assert client_ip(spoofed) == "203.0.113.9"
    settings.BATCHWEB_PROXY_COUNT = 2
    assert client_ip(spoofed) == "198.51.100.7"
    assert client_ip(factory.get("/", REMOTE_ADDR="10.0.0.2")) == "10.0.0.2"


@pytest.mark.parametrize("password", ["password123", "qwertyuiop", "alice-example-com"])
def test_common_and_personal_passwords_are_refused(django_user_model: Any,
                                                    password: str) -> None:
    user = django_user_model(username="alice", email="alice@example.com")
    with pytest.raises(ValidationError):
        validate_password(password, user)
    validate_password("violet-anchor-91-orbit", user)


def test_the_password_change_form_uses_the_validators(people: dict) -> None:
    alice = people["alice"]
    client = Client()
    client.force_login(alice)
    response = client.post(reverse("admin:password_change"), {
        "old_password": "alice-pw", "new_password1": "password123",
        "new_password2": "password123"})
    assert response.status_code == 200
    assert "too common" in response.content.decode()
    alice.refresh_from_db()
    assert alice.check_password("alice-pw")
