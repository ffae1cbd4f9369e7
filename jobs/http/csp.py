"""The Content-Security-Policy of every page: the dashboard's, the admin's, django-rq's.

Scripts and styles come from this site's own static files only; nothing inline runs, no
`eval`, no plugins, no other site's frames, forms or requests. The dashboard's templates
carry no inline code (its one script is static/js/app.js; htmx is configured by a <meta>
tag, without its injected indicator styles or eval), so they need neither `unsafe-inline`
nor a nonce. Django's admin, its error pages (the CSRF failure's page) and django-rq's
pages carry a few fixed inline blocks (django-rq's `actions()` call, a few <style> blocks,
two style attributes and one onclick): each is allowed by its hash, read once per process
from the installed packages' templates, so an upgrade that changes one keeps it working
and nothing else inline runs. A block that holds template code differs per page and cannot
be hashed: it stays refused (django-rq's clickable rows of a job's results, whose link still
works; the DEBUG page's frame toggles).
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import re
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path

from django.conf import settings
from django.http import HttpRequest, HttpResponseBase

from jobs.http.web import API_PREFIX

HEADER = "Content-Security-Policy"
# Where the pages served but not written here come from: the admin's templates, the CSRF
# failure's page, django-rq's; with DEBUG, Django's error pages too.
TEMPLATES = (("django", "contrib/admin/templates/**/*.html"),
             ("django", "views/templates/csrf_403.html"), ("django_rq", "templates/**/*.html"))
DEBUG_TEMPLATES = (("django", "views/templates/technical_*.html"),)
_BLOCK = re.compile(r"<(script|style)\b([^>]*)>(.*?)</\1\s*>", re.S | re.I)
_ATTRIBUTE = re.compile(r"""\s(style|on[a-z]+)\s*=\s*(?:"([^"]*)"|'([^']*)')""", re.I)
_TEMPLATE_CODE = re.compile(r"\{[{%#]")


def hash_source(value: str) -> str:
    digest = hashlib.sha256(value.encode()).digest()
    return f"'sha256-{base64.b64encode(digest).decode()}'"


def inline_code(text: str) -> Iterator[tuple[str, str]]:
    """(kind, code) of each piece of inline code in an HTML text: kind "script" or "style"
    for a block (a <script> without src), "script-attr" or "style-attr" for an event
    handler or a style attribute."""
    for match in _BLOCK.finditer(text):
        tag, attributes, body = match.group(1).lower(), match.group(2), match.group(3)
        if tag == "script" and re.search(r"\bsrc\s*=", attributes, re.I):
            continue
        yield tag, body
    for match in _ATTRIBUTE.finditer(text):
        name = match.group(1).lower()
        value = match.group(2) if match.group(2) is not None else match.group(3)
        yield ("style-attr" if name == "style" else "script-attr"), value


def template_files() -> Iterator[Path]:
    for package, pattern in (*TEMPLATES, *(DEBUG_TEMPLATES if settings.DEBUG else ())):
        spec = importlib.util.find_spec(package)
        assert spec is not None and spec.submodule_search_locations
        yield from sorted(Path(spec.submodule_search_locations[0]).glob(pattern))


@cache
def allowed_hashes() -> dict[str, tuple[str, ...]]:
    """The hashes of the installed templates' fixed inline code, by kind."""
    found: dict[str, set[str]] = {"script": set(), "style": set(), "script-attr": set(),
                                  "style-attr": set()}
    for path in template_files():
        for kind, code in inline_code(path.read_text()):
            if not _TEMPLATE_CODE.search(code):
                found[kind].add(hash_source(code))
    return {kind: tuple(sorted(hashes)) for kind, hashes in found.items()}


@cache
def policy() -> str:
    hashes = allowed_hashes()
    # 'unsafe-hashes' extends the hashes to attributes (handlers, style=): only the listed
    # ones, never inline code in general.
    scripts = ["'self'", *hashes["script"]]
    if hashes["script-attr"]:
        scripts += ["'unsafe-hashes'", *hashes["script-attr"]]
    styles = ["'self'", *hashes["style"]]
    if hashes["style-attr"]:
        styles += ["'unsafe-hashes'", *hashes["style-attr"]]
    directives = {
        "default-src": ["'self'"],
        "script-src": scripts,
        "style-src": styles,
        "img-src": ["'self'"],
        # htmx's requests: this site only.
        "connect-src": ["'self'"],
        "object-src": ["'none'"],
        "base-uri": ["'none'"],
        "form-action": ["'self'"],
        # As X-Frame-Options DENY: no page is framed, by anyone.
        "frame-ancestors": ["'none'"],
    }
    return "; ".join(f"{name} {' '.join(sources)}" for name, sources in directives.items())


class ContentSecurityPolicyMiddleware:
    """Sets the policy on every page's answer. Not on the API's (under /v1/: JSON read by
    clients, never rendered), which batchweb/wsgi.py serves through a chain without this
    middleware: a chain with it must answer them alike. An answer that set its own policy
    keeps it."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponseBase]) -> None:
        self.get_response = get_response
        self.header = policy()

    def __call__(self, request: HttpRequest) -> HttpResponseBase:
        response = self.get_response(request)
        if HEADER not in response.headers and not request.path_info.startswith(API_PREFIX):
            response.headers[HEADER] = self.header
        return response
