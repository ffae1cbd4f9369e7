"""Polls of an unchanged batch, answered before Django.

Clients poll a running batch for hours: the `openai` client's `GET /v1/batches/{id}` (which
sends no If-None-Match, so it gets the whole batch every time) and first page of
`GET /v1/batches`, and the batch page's live block (which sends back its ETag). Most polls
find the batches as they were. Django's path costs such a poll 1-6 ms of CPU on the
project's 2-core machines (middlewares, URL resolution, the credential, the ORM, the
answer), while what decides the answer is a row or a page of rows.

So each web process remembers, per credential and URL, the last answer Django gave to a
poll, filed under the batch rows it was computed from: every column, read just before Django
ran and again just after (an answer whose rows changed meanwhile is not kept). A later poll
of the same URL by the same client (the same credential, and the same cookies and host as
the remembered answer's) runs one query, which finds the
rows only while that credential still lets the client see them; when every column is
unchanged (and the view's own checks still hold) the answer is replayed byte for byte, or
Django's 304 for it when the client sends back its ETag. Anything else goes to Django as
before, and its new answer is filed.

A client that revalidates sends back the ETag of the answer it got, and the first such poll
of each new version would otherwise need Django for its 304 (a revalidating API client; the
live block, whose whole answers set a cookie and are never replayed). So the memo learns,
once per polled URL pattern and shape of answer, how Django's 304 is made from its 200
(which headers it keeps, which it sets to a value of its own), and files a new version's
304 as soon as Django has given that version's 200.

Which routes are polled is said beside their paths in urls.py (`polled`, naming
the reader of their rows, below); a request is matched to its route by
Django's own resolver, and its credential read as the API and the session engine read them.
Only answers a view marks with `remember` are kept, with what else they depend on: how long
they stay good (the live block's time-derived figures) and checks of inputs that are not in
the row (why a batch cannot progress, from the queue).

The memo is bounded in bytes (MAX_BYTES), never keeps a large answer (MAX_ANSWER_BYTES) and
lets expired answers go as it files new ones. A client keeps one answer per URL whatever
headers it sends (a new Cookie or X-Forwarded-Host replaces its answer): headers the client
chooses never multiply what a web process holds.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

from django.conf import settings
from django.contrib.sessions.models import Session
from django.core.signals import request_started
from django.db.models import Count, Exists, IntegerField, OuterRef, QuerySet, Subquery
from django.db.models.functions import Coalesce, Now
from django.http import HttpResponseBase
from django.http.cookie import parse_cookie
from django.urls import Resolver404, resolve

from jobs.http.sessions import session_user
from jobs.http.web import LIST_LIMIT, LIST_MAX_LIMIT, LIST_PAGE_SIZE
from jobs.lib.compiled import Compiled
from jobs.models import Batch, SpotCheck
from jobs.services.keys import secret_hash

# A remembered answer is dropped after this long even if nothing changed, so a client's
# first poll after it goes through Django again (the API key's last-used time, a revoked
# staff right). Polls come every 2-30 s.
REMEMBER_SECONDS = 60.0

View = TypeVar("View", bound=Callable[..., Any])


def polled(view: View, rows: Callable[..., Any]) -> View:
    """Mark a route's view as polled (in urls.py, beside its path): a GET of it may be
    answered by the poll memo, from the answer Django last gave the same client, while
    `rows` (one of the readers below) finds the same rows. The view still says,
    answer by answer, whether it may be replayed (`remember`)."""
    view.poll_rows = rows  # type: ignore[attr-defined]
    return view


@dataclass(frozen=True)
class Validity:
    """What a view says of an answer it lets be remembered: until when it is good
    (time.monotonic()), and checks (a function, the value it gave) of inputs other than
    the batch row, each called again before the answer is replayed."""

    until: float
    checks: tuple[tuple[Callable[[], object], object], ...] = ()


def remember(response: HttpResponseBase, *, seconds: float = REMEMBER_SECONDS,
             checks: tuple[tuple[Callable[[], object], object], ...] = ()) -> None:
    """Let this answer to a poll be replayed while the batch row is unchanged."""
    response.poll_validity = Validity(  # type: ignore[attr-defined]
        time.monotonic() + min(seconds, REMEMBER_SECONDS), checks)



# The rows that decide the answer to a polled route (below):
# read while the request's credential still lets the client see them, in one query each,
# compiled once per process. A route names its reader where urls.py declares it
# (`polled`).
#
# Each reader takes the route's one path argument (the batch's id, or "") and the poll,
# and gives the rows, or None where the memo does not take the request (no credential, a
# query string it does not know).
@dataclass(frozen=True)
class PolledRequest:
    """What a reader needs of a poll: its query string, htmx's headers, and who asks: the
    API key's hash, or the session's key and user (as the session engine read them)."""

    query: str
    htmx: bool
    boosted: bool
    secret_hash: str | None
    session_key: str | None
    session_user: Callable[[], int | None]


Rows = Callable[[str, PolledRequest], list[Any] | None]

_COLUMNS = [f.attname for f in Batch._meta.concrete_fields]


def _api_batch(batch_id: str, secret_hash: str) -> QuerySet[Any, Any]:
    # The batch, while this key is live and its owner's (jobs.services.keys.authenticate_key).
    return Batch.objects.filter(
        pk=batch_id, api=Batch.Api.OPENAI, owner__is_active=True,
        owner__apikey__secret_hash=secret_hash, owner__apikey__revoked_at__isnull=True
    ).values_list(*_COLUMNS)


_API_BATCH = Compiled(_api_batch, "batch_id", "secret_hash")
# The first page of GET /v1/batches (jobs.api.batches.list_batches), one query for each
# page size (it is part of the SQL): the page's batches and the one after, while the key
# is live.
_API_LISTS: dict[int, Compiled] = {}


def _api_list(limit: int) -> Compiled:
    compiled = _API_LISTS.get(limit)
    if compiled is None:
        compiled = _API_LISTS[limit] = Compiled(lambda secret_hash: Batch.objects.filter(
            api=Batch.Api.OPENAI, owner__is_active=True, owner__apikey__secret_hash=secret_hash,
            owner__apikey__revoked_at__isnull=True).order_by("-created_at", "-pk")
            .values_list(*_COLUMNS)[:limit + 1], "secret_hash")
    return compiled


def _spot_count(**verdict: Any) -> Coalesce:
    marks = (SpotCheck.objects.filter(batch=OuterRef("pk"), **verdict).order_by()
             .values("batch").annotate(n=Count("pk")).values("n"))
    return Coalesce(Subquery(marks, output_field=IntegerField()), 0)


def _live_block(batch_id: str, session_key: str) -> QuerySet[Any, Any]:
    # The batch, while this session is signed in (its row exists and has not expired: a
    # session belongs to one user, sign-in gives a new key) and the owner is active; with
    # the spot-check counts the live block shows.
    signed_in = Session.objects.filter(session_key=session_key, expire_date__gt=Now())
    return (Batch.objects.filter(Exists(signed_in), pk=batch_id, owner__is_active=True)
            .annotate(spot_marked=_spot_count(), spot_good=_spot_count(verdict="good"))
            .values_list(*_COLUMNS, "spot_marked", "spot_good"))


_LIVE_BLOCK = Compiled(_live_block, "batch_id", "session_key")


def _batch_table(owner_id: int, session_key: str) -> QuerySet[Any, Any]:
    # The first page of the owner's batches, newest first (jobs.views.batches.batch_list),
    # each with the owner's count of batches (the pages the table offers), while this
    # session is signed in. The count names the owner rather than each row's, so that the
    # database counts once per poll, not once for each of the 20 rows (1-4 ms of a poll
    # on PostgreSQL on the Zen 3 of bench/RESULTS.md).
    signed_in = Session.objects.filter(session_key=session_key, expire_date__gt=Now())
    count = (Batch.objects.filter(owner_id=owner_id).order_by()
             .values("owner_id").annotate(n=Count("pk")).values("n"))
    return (Batch.objects.filter(Exists(signed_in), owner_id=owner_id, owner__is_active=True)
            .annotate(owner_batches=Subquery(count, output_field=IntegerField()))
            .order_by("-created_at", "-pk").values_list(*_COLUMNS, "owner_batches")
            [:LIST_PAGE_SIZE])


_BATCH_TABLE = Compiled(_batch_table, "owner_id", "session_key")


def api_batch(batch_id: str, poll: PolledRequest) -> list[Any] | None:
    """GET /v1/batches/{id}: the batch."""
    if poll.secret_hash is None:
        return None
    return _API_BATCH.raw_rows(batch_id=batch_id, secret_hash=poll.secret_hash)


def api_list(_: str, poll: PolledRequest) -> list[Any] | None:
    """GET /v1/batches: only the unfiltered first page, newest first (what clients poll)."""
    given = re.fullmatch(r"limit=([1-9][0-9]{0,2})", poll.query)
    limit = int(given[1]) if given else LIST_LIMIT if not poll.query else 0
    if not 1 <= limit <= LIST_MAX_LIMIT or poll.secret_hash is None:
        return None
    return _api_list(limit).raw_rows(secret_hash=poll.secret_hash)


def live_block(batch_id: str, poll: PolledRequest) -> list[Any] | None:
    """The batch page's live block: the batch and its spot-check counts."""
    if not poll.session_key:
        return None
    return _LIVE_BLOCK.raw_rows(batch_id=batch_id, session_key=poll.session_key)


def batch_table(_: str, poll: PolledRequest) -> list[Any] | None:
    """The batch list's table partial (htmx, not boosted) of its first page."""
    if not poll.htmx or poll.boosted or poll.query or not poll.session_key:
        return None
    owner_id = poll.session_user()
    if owner_id is None:
        return None
    return _BATCH_TABLE.raw_rows(owner_id=owner_id, session_key=poll.session_key)


log = logging.getLogger(__name__)

# Answers kept per web process (a few kB each): one per credential and URL being polled.
MAX_ANSWERS = 10_000
# What the answers kept per web process may hold in all (bodies, headers and the rows they
# were computed from, about); the least recently filed go first.
MAX_BYTES = 32 << 20
# An answer larger than this is never kept (a poll of it goes to Django): a poll's answer
# is a few kB, a first page of 100 batches some 100 kB.
MAX_ANSWER_BYTES = 512 << 10
# The credentials a poll is made with: an API key (OpenAI's bearer, Anthropic's x-api-key)
# or, for the dashboard, the session cookie (read from the Cookie header). An answer is
# filed under the URL and these.
_CREDENTIALS = ("HTTP_AUTHORIZATION", "HTTP_X_API_KEY")
# What else in a request can change Django's answer to a poll: the host (allowed hosts,
# redirects), the scheme as the proxy tells it, the cookies and htmx's headers. An answer is
# replayed only to a request that sends the same; one that sends others replaces it.
_CLIENT = ("HTTP_HOST", "wsgi.url_scheme", "HTTP_X_FORWARDED_PROTO", "HTTP_X_FORWARDED_HOST",
           "HTTP_COOKIE", "HTTP_HX_REQUEST", "HTTP_HX_BOOSTED")
# Conditions other than If-None-Match, and a body, are Django's to answer.
_NOT_A_POLL = ("HTTP_IF_MODIFIED_SINCE", "HTTP_IF_MATCH", "HTTP_IF_UNMODIFIED_SINCE",
               "HTTP_RANGE", "HTTP_TRANSFER_ENCODING")

# Set in the WSGI environ of a request answered from the memo (for bench/timed_wsgi.py).
REMEMBERED = "batchweb.poll_remembered"


def _polled(environ: dict[str, Any]) -> PolledRequest:
    scheme, _, secret = environ.get("HTTP_AUTHORIZATION", "").partition(" ")
    bearer = secret.strip() if scheme.lower() == "bearer" else ""
    cookie = environ.get("HTTP_COOKIE")
    session_key = parse_cookie(cookie).get(settings.SESSION_COOKIE_NAME) if cookie else None
    return PolledRequest(
        query=environ.get("QUERY_STRING", ""),
        htmx=environ.get("HTTP_HX_REQUEST") == "true",
        boosted="HTTP_HX_BOOSTED" in environ,
        secret_hash=secret_hash(bearer) if bearer else None,
        session_key=session_key or None,
        session_user=partial(session_user, session_key) if session_key else lambda: None)


@dataclass
class Poll:
    """A request to a polled URL: who asks for what, and its rows as they were before
    Django answered."""

    key: tuple[Any, ...]
    client: tuple[Any, ...]
    state: tuple[Any, ...] | None
    rows: Rows
    name: str
    request: PolledRequest


Headers = list[tuple[str, str]]
Replay = tuple[str, Headers, bytes]  # status line, headers, body
# How Django's 304 is made from its 200, header by header in the 304's order: a name and
# None where the 304 has the 200's value, or the name and the 304's own value.
Shape = tuple[tuple[str, str | None], ...]
NOT_MODIFIED = "304 Not Modified"


def _shape(whole: Headers, not_modified: Headers) -> Shape:
    given = dict(whole)
    return tuple((name, None if given.get(name) == value else value)
                 for name, value in not_modified)


def _not_modified(shape: Shape, whole: Headers) -> Replay | None:
    # The 304 Django would give for this 200, or None if the 200 lacks a header it keeps.
    given = dict(whole)
    headers = []
    for name, value in shape:
        if value is None:
            if name not in given:
                return None
            value = given[name]
        headers.append((name, value))
    return NOT_MODIFIED, headers, b""


def _size(value: Any) -> int:
    """About the bytes `value` holds: its strings' lengths, 16 for anything else, through
    tuples and lists (an answer's rows, headers and replays)."""
    if isinstance(value, str | bytes):
        return 16 + len(value)
    if isinstance(value, tuple | list):
        return 16 + sum(_size(item) for item in value)
    return 16


@dataclass
class _Answer:
    state: tuple[Any, ...]
    validity: Validity
    # The request's _CLIENT headers: replayed only to the same.
    client: tuple[Any, ...]
    etag: str | None = None
    # Django's answer to a plain poll and to one that sent back the ETag, each once Django
    # has given it for this row (the 304 also once made from the 200 by a learned shape).
    whole: Replay | None = None
    not_modified: Replay | None = None
    # The 200's headers, kept even when the 200 itself cannot be replayed (it sets a
    # cookie), so that Django's 304 for it teaches the memo the shape of its 304s.
    whole_headers: Headers | None = None


@dataclass
class PollMemo:
    """One web process's remembered answers (see the module's docstring)."""

    answers: OrderedDict[tuple[Any, ...], _Answer] = field(default_factory=OrderedDict)
    # The shapes of Django's 304s, by polled URL pattern and the header names of the 200
    # (a few: one per view and kind of client).
    shapes: dict[tuple[Rows, tuple[str, ...]], Shape] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    hits: int = 0
    # About the bytes the answers hold (`_size` of each, kept by key).
    bytes: int = 0
    sizes: dict[tuple[Any, ...], int] = field(default_factory=dict)

    def _match(self, environ: dict[str, Any]
               ) -> tuple[Rows, str, tuple[Any, ...], PolledRequest] | None:
        if environ.get("REQUEST_METHOD") != "GET" or environ.get("CONTENT_LENGTH") not in (
                None, "", "0") or any(name in environ for name in _NOT_A_POLL):
            return None
        path = environ.get("PATH_INFO", "")
        try:
            route = resolve(path)
        except Resolver404:
            return None
        rows = getattr(route.func, "poll_rows", None)
        if rows is None:
            return None
        request = _polled(environ)
        key = (path, request.query, *(environ.get(name) for name in _CREDENTIALS),
               request.session_key)
        return rows, next(iter(route.kwargs.values()), ""), key, request

    @staticmethod
    def _client(environ: dict[str, Any]) -> tuple[Any, ...]:
        return tuple(environ.get(name) for name in _CLIENT)

    def _drop(self, key: tuple[Any, ...]) -> None:
        """Forget the answer filed under `key` (with the lock held)."""
        self.answers.pop(key, None)
        self.bytes -= self.sizes.pop(key, 0)

    @staticmethod
    def _state(rows: Rows, name: str, request: PolledRequest) -> tuple[Any, ...] | None:
        found = rows(name, request)
        return tuple(tuple(row) for row in found) if found else None

    def answer(self, environ: dict[str, Any]) -> Replay | None:
        """The remembered answer to this request, if it is a poll of an unchanged batch
        that this client may still see; None sends it to Django."""
        matched = self._match(environ)
        if matched is None:
            return None
        rows, name, key, request = matched
        remembered = self.answers.get(key)
        if remembered is None:
            return None
        if time.monotonic() > remembered.validity.until:
            with self.lock:
                if self.answers.get(key) is remembered:
                    self._drop(key)
            return None
        sent = environ.get("HTTP_IF_NONE_MATCH")
        replay = (remembered.not_modified if sent is not None and sent == remembered.etag
                  else remembered.whole)
        if replay is None or remembered.client != self._client(environ):
            return None
        # Sent as Django sends it when a request starts: its receivers reset the query log
        # and close a connection older than DB_CONN_MAX_AGE or broken by an error (the
        # database restarted), which a web thread answering only from the memo would
        # otherwise keep for good.
        request_started.send(sender=type(self), environ=environ)
        try:
            state = self._state(rows, name, request)
        except Exception:  # the database: Django's path (which runs next) reports it
            log.warning("poll state unavailable", exc_info=True)
            return None
        if state != remembered.state or any(
                check() != value for check, value in remembered.validity.checks):
            return None
        self.hits += 1
        environ[REMEMBERED] = True
        status, headers, body = replay
        return status, list(headers), body  # a server may add to the list it is given

    def poll_of(self, environ: dict[str, Any]) -> Poll | None:
        """Before Django answers a request: if it is a poll, the row its answer will be
        filed under."""
        matched = self._match(environ)
        if matched is None:
            return None
        rows, name, key, request = matched
        try:
            return Poll(key, self._client(environ), self._state(rows, name, request), rows,
                        name, request)
        except Exception:
            log.warning("poll state unavailable", exc_info=True)
            return None

    def file(self, poll: Poll, response: HttpResponseBase) -> None:
        """After Django answered `poll`: keep the answer if its view let it be remembered,
        it is whole (not streamed), sets no cookie, the client could see the batches, and
        they were the same after Django answered as before. Otherwise an answer computed
        from a change could be filed under the rows before it, and be replayed once the
        change is undone (a batch created and deleted on a list page).

        A 200 that sets a cookie is not kept, but the 304 made from it is: Django's 304
        for the same row sets none (the cookie comes from rendering the answer)."""
        validity: Validity | None = getattr(response, "poll_validity", None)
        if (validity is None or poll.state is None or response.streaming
                or response.status_code not in (200, 304)
                or (response.cookies and response.status_code != 200)):
            return
        try:
            if self._state(poll.rows, poll.name, poll.request) != poll.state:
                return
        except Exception:
            log.warning("poll state unavailable", exc_info=True)
            return
        headers = list(response.items())
        content: bytes = response.content  # type: ignore[attr-defined]
        etag = response.get("ETag")
        with self.lock:
            remembered = self.answers.get(poll.key)
            if (remembered is None or remembered.state != poll.state
                    or remembered.etag != etag or remembered.client != poll.client):
                remembered = _Answer(poll.state, validity, poll.client, etag)
            remembered.validity = validity
            if response.status_code == 200:
                if not response.cookies:
                    remembered.whole = (f"200 {response.reason_phrase}", headers, content)
                # An empty 200 could not tell the 304's Content-Length from its own.
                if etag is not None and content:
                    remembered.whole_headers = headers
                    shape = self.shapes.get((poll.rows, tuple(name for name, _ in headers)))
                    if shape is not None and remembered.not_modified is None:
                        remembered.not_modified = _not_modified(shape, headers)
            else:
                remembered.not_modified = (NOT_MODIFIED, headers, content)
                if remembered.whole_headers is not None:
                    whole_names = tuple(name for name, _ in remembered.whole_headers)
                    self.shapes[(poll.rows, whole_names)] = _shape(remembered.whole_headers,
                                                                   headers)
            self._drop(poll.key)
            size = _size((poll.key, remembered.state, remembered.client, remembered.whole,
                          remembered.not_modified, remembered.whole_headers))
            if size > MAX_ANSWER_BYTES:
                return
            self.answers[poll.key] = remembered
            self.sizes[poll.key] = size
            self.bytes += size
            # Filed last, so the oldest filings come first: those that expired go, then
            # the oldest of the rest while the memo is over its bounds.
            now = time.monotonic()
            while self.answers:
                oldest, answer = next(iter(self.answers.items()))
                if (answer.validity.until >= now and len(self.answers) <= MAX_ANSWERS
                        and self.bytes <= MAX_BYTES):
                    break
                self._drop(oldest)
