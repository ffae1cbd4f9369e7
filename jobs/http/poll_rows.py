"""The rows that decide the answer to a polled route (the poll memo, batchweb/polls.py):
read while the request's credential still lets the client see them, in one query each,
compiled once per process. A route names its reader where urls.py declares it
(`jobs.http.web.polled`).

Each reader takes the route's one path argument (the batch's id, or "") and the poll,
and gives the rows, or None where the memo does not take the request (no credential, a
query string it does not know)."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.contrib.sessions.models import Session
from django.db.models import Count, Exists, IntegerField, OuterRef, QuerySet, Subquery
from django.db.models.functions import Coalesce, Now

from jobs.http.web import LIST_LIMIT, LIST_MAX_LIMIT, LIST_PAGE_SIZE
from jobs.lib.compiled import Compiled
from jobs.models import Batch, SpotCheck


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
