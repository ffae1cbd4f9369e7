"""The WSGI application the web server (Granian) serves.

A poll's answer, in the order it is made: a poll of a batch that has not changed since
Django last answered the same client is answered from that answer (jobs/http/polls.py);
any other request goes to Django, to the view its URL names, and a polled route's answer is
filed for the next poll. Requests to the API (/v1/) go through API_MIDDLEWARE (see
settings): an API request carries its key and no cookie, and the middlewares only pages
need (sessions, CSRF, the signed-in user, messages, htmx, login throttling, static files)
cost a quarter of a light request such as a poll of a batch."""

import logging
import os
from collections.abc import Callable
from typing import Any

import django
from django.conf import settings
from django.core.exceptions import MiddlewareNotUsed
from django.core.handlers.base import BaseHandler
from django.core.handlers.exception import convert_exception_to_response
from django.core.handlers.wsgi import WSGIHandler
from django.http import HttpRequest
from django.urls import get_resolver
from django.utils.module_loading import import_string

from jobs.storage.embedded import redis_in_use

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "batchweb.settings")

# What a request's environ holds besides its headers (HTTP_*) and the server's wsgi.* keys
# (PEP 3333 and CGI).
REQUEST_VARIABLES = frozenset((
    "REQUEST_METHOD", "SCRIPT_NAME", "PATH_INFO", "QUERY_STRING", "CONTENT_TYPE",
    "CONTENT_LENGTH", "SERVER_NAME", "SERVER_PORT", "SERVER_PROTOCOL", "SERVER_SOFTWARE",
    "GATEWAY_INTERFACE", "REMOTE_ADDR", "REMOTE_HOST", "REMOTE_PORT", "REMOTE_USER", "HTTPS"))


class ApiHandler(BaseHandler):
    """Django's handler over settings.API_MIDDLEWARE rather than MIDDLEWARE: the same chain
    as BaseHandler.load_middleware builds (each middleware's hooks registered, in order),
    for a synchronous server; WSGI is one."""

    def load_middleware(self, is_async: bool = False) -> None:
        self._view_middleware: list[Any] = []
        self._template_response_middleware: list[Any] = []
        self._exception_middleware: list[Any] = []
        # The view step Django's own load_middleware wraps (not in the type stubs).
        handler = convert_exception_to_response(self._get_response)  # type: ignore[attr-defined]
        for path in reversed(settings.API_MIDDLEWARE):
            try:
                middleware = import_string(path)(handler)
            except MiddlewareNotUsed:
                continue
            if hasattr(middleware, "process_view"):
                self._view_middleware.insert(0, middleware.process_view)
            if hasattr(middleware, "process_template_response"):
                self._template_response_middleware.append(
                    middleware.process_template_response)
            if hasattr(middleware, "process_exception"):
                self._exception_middleware.append(middleware.process_exception)
            handler = convert_exception_to_response(middleware)
        self._middleware_chain = handler


class Handler(WSGIHandler):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Models and the views' helpers: only once Django is set up.
        from jobs.http.polls import PollMemo
        from jobs.http.web import API_PREFIX

        self.polls = PollMemo()
        self.api_prefix = API_PREFIX
        # Granian copies the process's environment into every request's environ, as CGI did
        # (PEP 3333 allows it): SECRET_KEY, DATABASE_URL and the storage keys would be in
        # request.META, which error reports show. Settings are read by now; requests get
        # none of it.
        self.inherited = frozenset(name for name in os.environ if name not in REQUEST_VARIABLES
                                   and not name.startswith("HTTP_"))
        self.api = ApiHandler()
        self.api.load_middleware()
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
        if request.path_info.startswith(self.api_prefix):
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
