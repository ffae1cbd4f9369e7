"""The Content-Security-Policy (jobs/http/csp.py): on every page, the dashboard's, the admin's
and django-rq's, with nothing inline allowed but the fixed blocks of the packages' own
templates, each by its hash; the dashboard's templates and static files carry no inline
code at all. tests/dashboard/test_csp_browser.py shows Chromium finds no violation."""

from __future__ import annotations

import re

import pytest
from django.test import Client
from django.urls import reverse

from batchweb.wsgi import application
from jobs.http.csp import HEADER, allowed_hashes, hash_source, inline_code, policy
from tests.factories import ROOT, wsgi_call

pytestmark = pytest.mark.django_db

DASHBOARD_PAGES = ["/", "/batches/new", "/files/", "/eval-sets/", "/keys/", "/usage/",
                   "/account/"]


def directives(header: str) -> dict[str, list[str]]:
    return {name: sources for name, *sources in (part.split() for part in header.split(";"))}


def test_the_policy_allows_nothing_inline_but_by_hash() -> None:
    policy_ = directives(policy())
    for name in ("script-src", "style-src"):
        sources = policy_[name]
        assert sources[0] == "'self'"
        assert not {"'unsafe-inline'", "'unsafe-eval'", "data:", "*", "https:"} & set(sources)
        assert all(s == "'unsafe-hashes'" or s.startswith("'sha256-") for s in sources[1:])
    assert policy_["default-src"] == ["'self'"]
    assert policy_["object-src"] == policy_["base-uri"] == policy_["frame-ancestors"] == [
        "'none'"]
    assert policy_["form-action"] == policy_["connect-src"] == ["'self'"]


def test_the_dashboards_templates_and_static_files_carry_no_inline_code() -> None:
    templates = sorted((ROOT / "templates").rglob("*.html"))
    assert len(templates) > 20
    for path in templates:
        text = path.read_text()
        assert list(inline_code(text)) == [], path
        # htmx's inline handlers and javascript: URLs would need eval or unsafe-inline.
        assert not re.search(r"\shx-on[:-]|javascript:", text, re.I), path
    for path in (ROOT / "static").rglob("*.js"):
        assert not re.search(r"\beval\(|new Function\(|setTimeout\(\s*['\"]", path.read_text())
    # What base.html tells htmx: no <style> of its own, no eval.
    base = (ROOT / "templates" / "base.html").read_text()
    assert '"includeIndicatorStyles": false' in base and '"allowEval": false' in base


def test_the_inline_code_finder_finds_each_kind() -> None:
    html = ('<script>a()</script><script src="/x.js"></script><style>p{}</style>'
            '<p style="color: red" onclick="b()">')
    assert list(inline_code(html)) == [("script", "a()"), ("style", "p{}"),
                                       ("style-attr", "color: red"), ("script-attr", "b()")]


def assert_inline_code_hashed(body: str, where: str) -> None:
    hashes = allowed_hashes()
    for kind, code in inline_code(body):
        assert hash_source(code) in hashes[kind], f"{where}: {kind} {code[:80]!r} is not allowed"


def test_every_dashboard_page_has_the_policy_and_no_inline_code(site: Client) -> None:
    for path in DASHBOARD_PAGES:
        response = site.get(path)
        assert response.status_code == 200, path
        assert response[HEADER] == policy(), path
        assert list(inline_code(response.content.decode())) == [], path


def test_the_login_page_error_pages_and_the_csrf_page_have_it(client: Client, user) -> None:
    for path, status in (("/accounts/login/", 200), ("/no-such-page/", 404)):
        response = client.get(path)
        assert response.status_code == status and response[HEADER] == policy(), path
    # Django's CSRF failure page has a <style> block: allowed by its hash.
    strict = Client(enforce_csrf_checks=True)
    refused = strict.post("/accounts/login/", {"username": "alice", "password": "x"})
    assert refused.status_code == 403 and refused[HEADER] == policy()
    assert [kind for kind, _ in inline_code(refused.content.decode())] == ["style"]
    assert_inline_code_hashed(refused.content.decode(), "CSRF failure page")


def test_the_admins_and_django_rqs_pages_have_it_and_only_hashed_inline_code(
        admin_client: Client) -> None:
    pages = ["/admin/", "/admin/jobs/batch/", "/admin/jobs/file/",
             reverse("admin:jobs_queue_health"), "/admin/auth/user/",
             reverse("django_rq:home"), reverse("django_rq:jobs", args=[0]),
             reverse("django_rq:finished_jobs", args=[0]),
             reverse("django_rq:workers", args=[0]), reverse("django_rq:clear", args=[0])]
    seen = set()
    for path in pages:
        response = admin_client.get(path)
        assert response.status_code == 200, path
        assert response[HEADER] == policy(), path
        body = response.content.decode()
        assert_inline_code_hashed(body, path)
        seen |= {kind for kind, _ in inline_code(body)}
    # django-rq's inline script and <style> blocks were among them.
    assert {"script", "style"} <= seen


def test_the_apis_answers_are_read_not_rendered_and_go_without() -> None:
    status, headers, _ = wsgi_call(application, "GET", "/v1/models")
    assert status.startswith("401") and headers["Content-Type"] == "application/json"
    assert HEADER not in headers
