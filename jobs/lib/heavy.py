"""The dashboard's heavy computations (the preflight of a stored file, spot-check samples,
error counts), each a pass over a whole file: cached in the shared cache (Redis, every web
process and host alike) under a key that changes whenever the result would, and computed
at most one at a time per user, so a signed-in user clicking cannot keep the web workers
busy."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext, suppress
from typing import Any, TypeVar

from django.core.cache import cache
from redis.exceptions import LockError

from jobs.lib import queues
from jobs.lib.errors import ServiceError

T = TypeVar("T")

# A result stays cached this long; its key changes when the result would, so this bounds
# only the space that results of old versions hold.
CACHE_SECONDS = 3600
# A user's computation holds its lock at most this long: the lock of a process killed in
# the middle expires by itself.
LOCK_SECONDS = 60

Guard = AbstractContextManager[None]


class Busy(Exception):
    """Another heavy computation of the same user is running: retry in a moment."""


def version(*parts: Any) -> str:
    """A short digest of what a result depends on, for its cache key."""
    return hashlib.blake2b(repr(parts).encode(), digest_size=12).hexdigest()


def cached(key: str, compute: Callable[[], T], *, guard: Guard | None = None) -> T:
    """The cached value of `key`, or `compute()` under `guard` (entered only on a miss, so
    repeated clicks on an unchanged result cost one cache read and never wait or fail)."""
    value = cache.get(key)
    if value is not None:
        return value
    with guard or nullcontext():
        # Another request may have computed it while this one waited for the lock.
        value = cache.get(key)
        if value is None:
            value = compute()
            cache.set(key, value, CACHE_SECONDS)
    return value


@contextmanager
def one_per_user(user_id: Any) -> Iterator[None]:
    """At most one heavy computation per user at a time, across web processes and hosts
    (a Redis lock); a second one raises Busy at once instead of waiting for a thread."""
    with _held(user_id, Busy()):
        yield


@contextmanager
def one_per_user_or_refuse(user_id: Any, *, doing: str) -> Iterator[None]:
    """`one_per_user` for the services' heavy work (a batch's ceiling, a rerun, a
    registration by reference, an eval set): a second one of the same user is refused at
    once as a ServiceError 429 in the API's rate-limit shape (a message on a page), saying
    what the first is `doing`. Not reentrant: a service that holds it lets it go before it
    calls another that takes it."""
    with _held(user_id, ServiceError(f"Another of your requests is {doing}; retry in a "
                                     "moment.", status=429, code="rate_limit_exceeded")):
        yield


@contextmanager
def _held(user_id: Any, refusal: Exception) -> Iterator[None]:
    """The user's lock of heavy work (a Redis lock), or `refusal` raised when it is taken."""
    lock = queues.connection().lock(f"batchweb:heavy:{user_id}", timeout=LOCK_SECONDS,
                                    blocking=False)
    if not lock.acquire():
        raise refusal
    try:
        yield
    finally:
        with suppress(LockError):  # expired meanwhile: someone else's now, or nobody's
            lock.release()
