"""The WSGI application the web server (Granian) serves.

Django's handler, except that requests to the API (/v1/) go through API_MIDDLEWARE (see
settings): an API request carries its key and no cookie, and the middlewares only pages need
(sessions, CSRF, the signed-in user, messages, htmx, login throttling, static files) cost a
quarter of a light request such as a poll of a batch.

Before either, a poll of a batch that has not changed since Django last answered the same
client is answered from that answer (batchweb.polls)."""

import logging
import os
from collections.abc import Callable
from typing import Any

import django
from django.conf import settings
from django.core.handlers.base import BaseHandler
from django.core.handlers.wsgi import WSGIHandler
from django.http import HttpRequest
from django.urls import get_resolver

from batchweb.embedded import redis_in_use

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "batchweb.settings")

API_PREFIX = "/v1/"
# What a request's environ holds besides its headers (HTTP_*) and the server's wsgi.* keys
# (PEP 3333 and CGI).
REQUEST_VARIABLES = frozenset((
    "REQUEST_METHOD", "SCRIPT_NAME", "PATH_INFO", "QUERY_STRING", "CONTENT_TYPE",
    "CONTENT_LENGTH", "SERVER_NAME", "SERVER_PORT", "SERVER_PROTOCOL", "SERVER_SOFTWARE",
    "GATEWAY_INTERFACE", "REMOTE_ADDR", "REMOTE_HOST", "REMOTE_PORT", "REMOTE_USER", "HTTPS"))


class Handler(WSGIHandler):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        from batchweb.polls import PollMemo  # models: only once Django is set up

        self.polls = PollMemo()
        # Granian copies the process's environment into every request's environ, as CGI did
        # (PEP 3333 allows it): SECRET_KEY, DATABASE_URL and the storage keys would be in
        # request.META, which error reports show. Settings are read by now; requests get
        # none of it.
        self.inherited = frozenset(name for name in os.environ if name not in REQUEST_VARIABLES
                                   and not name.startswith("HTTP_"))
        self.api = BaseHandler()
        # Django builds a chain from settings.MIDDLEWARE only: it is set to the API's list
        # while this one chain is built (once, at start), then put back.
        pages = settings.MIDDLEWARE
        settings.MIDDLEWARE = settings.API_MIDDLEWARE
        try:
            self.api.load_middleware()
        finally:
            settings.MIDDLEWARE = pages
        # The URLconf and the views it imports, loaded at start rather than by the first
        # request (~0.15 s of CPU on the machines of bench/RESULTS.md, which that request,
        # and an engine sharing the cores, would wait for).
        self.routes = get_resolver().url_patterns

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]
                 ) -> Any:  # what WSGIHandler returns: an iterable of bytes
        for name in self.inherited:
            environ.pop(name, None)
        remembered = self.polls.answer(environ)
        if remembered is None:
            return super().__call__(environ, start_response)
        status, headers, body = remembered
        start_response(status, headers)
        return [body]

    def get_response(self, request: HttpRequest) -> Any:
        poll = self.polls.poll_of(request.META)
        if request.path_info.startswith(API_PREFIX):
            response = self.api.get_response(request)
        else:
            response = super().get_response(request)
        if poll is not None:
            self.polls.file(poll, response)
        return response


django.setup(set_prefix=False)
application = Handler()
# A web server started by hand names the Redis it uses (the queues and the dashboard's
# cache): without REDIS_URL it is the default, not the private Redis of `make run`.
logging.getLogger("batchweb.wsgi").info("web process %d: Redis %s", os.getpid(),
                                        redis_in_use(settings.REDIS_URL))
