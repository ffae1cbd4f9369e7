"""The Content-Security-Policy in a real browser (Debian's Chromium through Playwright, as
tests/dashboard/test_browser.py): the main pages of the dashboard, the admin and django-rq
load with no violation reported, and what they do still works under the policy (signing in,
htmx's polling, forms and their confirmations, the progress bars, the admin's actions)."""

from __future__ import annotations

import re
import time
from typing import Any

import pytest
from django.urls import reverse

from jobs.formats.checkpoint_record import Progress
from jobs.http.csp import HEADER, policy
from tests.dashboard.test_browser import CHROMIUM, browser, sign_in  # noqa: F401
from tests.factories import claimed_batch, heartbeat

pytestmark = [
    pytest.mark.browser,
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(not CHROMIUM.exists(),
                       reason="needs Debian's chromium at /usr/bin/chromium"),
]

# Every violation the page sees, reported to the test as it happens: the event a policy's
# refusal fires on the document (what it refused and why).
REPORT_VIOLATIONS = """
document.addEventListener("securitypolicyviolation", (event) => {
  window.reportViolation([location.pathname, event.violatedDirective, event.blockedURI,
                          event.sample || "", event.sourceFile || "", event.lineNumber]);
});
"""


class Watched:
    """A browser context whose pages report CSP violations and console errors."""

    def __init__(self, chromium: Any) -> None:
        self.violations: list[Any] = []
        self.console: list[str] = []
        self.context = chromium.new_context(viewport={"width": 1280, "height": 900})
        self.context.expose_function("reportViolation",
                                     lambda violation: self.violations.append(violation))
        self.context.add_init_script(REPORT_VIOLATIONS)
        self.page = self.context.new_page()
        self.page.on("console", lambda message: message.type in ("error", "warning")
                     and self.console.append(message.text))
        self.page.on("dialog", lambda dialog: dialog.accept())

    def visit(self, url: str) -> None:
        response = self.page.goto(url)
        assert response is not None and response.ok, (url, response and response.status)
        assert response.headers[HEADER.lower()] == policy(), url
        self.page.wait_for_load_state("networkidle")

    def assert_clean(self) -> None:
        # A violation reported late (a style applied by a script) is still caught.
        self.page.wait_for_timeout(300)
        assert self.violations == [], self.violations
        refused = [text for text in self.console if "Content Security Policy" in text]
        assert refused == [], refused


def test_the_dashboards_pages_run_under_the_policy_without_a_violation(
        live_server, user, browser, tmp_path, settings):  # noqa: F811
    base = live_server.url
    batch, shard = claimed_batch(user, tmp_path, settings)
    watched = Watched(browser)
    page = watched.page
    sign_in(page, base)  # the login form posts under form-action 'self'
    for path in ("/", "/batches/new", "/files/", "/eval-sets/", "/keys/", "/usage/",
                 "/account/", f"/batches/{batch.pk}/results"):
        watched.visit(base + path)
    watched.assert_clean()

    # The batch page polls its live block with htmx, and the answer is swapped in: a
    # progress bar's width is a class, not a style attribute, and takes effect.
    heartbeat(shard_id=shard.pk, attempt=shard.attempt, progress=Progress(completed=3))
    watched.visit(f"{base}/batches/{batch.pk}/")
    with page.expect_response(lambda response: "/live" in response.url,
                              timeout=15_000) as polled:
        pass
    assert polled.value.status in (200, 304)
    bar = page.locator("#live .bar").first
    done = page.locator("#live .bar-ok").first
    deadline = time.monotonic() + 10
    while done.bounding_box()["width"] == 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    share = done.bounding_box()["width"] / bar.bounding_box()["width"]
    assert 0.25 < share < 0.35, share  # 3 of 10 requests
    # A form with a confirmation (app.js asks; the dialog is accepted) posts and the page
    # shows the result.
    page.click("#cancel")
    page.wait_for_load_state("networkidle")
    batch.refresh_from_db()
    assert batch.status in ("cancelling", "cancelled"), batch.status

    # A plain form: a new API key is created and shown once.
    watched.visit(base + "/keys/")
    page.fill("input[name=name]", "csp")
    page.click("text=Create key")
    assert page.locator("#new-key").inner_text().startswith("sk-bw-")
    watched.assert_clean()
    watched.context.close()


def test_the_admins_and_django_rqs_pages_run_under_the_policy_without_a_violation(
        live_server, django_user_model, browser, tmp_path, settings):  # noqa: F811
    admin = django_user_model.objects.create_superuser("root", password="pw-root-123")
    claimed_batch(admin, tmp_path, settings)  # something in the lists and queues
    base = live_server.url
    watched = Watched(browser)
    page = watched.page
    page.goto(base + "/admin/login/")
    page.fill("input[name=username]", "root")
    page.fill("input[name=password]", "pw-root-123")
    page.click("input[type=submit]")
    page.wait_for_url(base + "/admin/")
    for path in ("/admin/", "/admin/jobs/batch/", "/admin/jobs/shard/", "/admin/auth/user/",
                 f"/admin/auth/user/{admin.pk}/change/", reverse("admin:jobs_queue_health"),
                 reverse("django_rq:home"), reverse("django_rq:jobs", args=[0]),
                 reverse("django_rq:workers", args=[0]),
                 reverse("django_rq:finished_jobs", args=[0])):
        watched.visit(base + path)
    watched.assert_clean()

    # The admin's actions (its static scripts) still work: selecting every row shows how
    # many are selected.
    watched.visit(base + "/admin/jobs/batch/")
    page.check("#action-toggle")
    assert re.search(r"\b1 of 1 selected", page.locator(".action-counter").inner_text())
    watched.assert_clean()
    watched.context.close()
