"""The session engine (SESSION_ENGINE): Django's database sessions, read with a query
compiled once per process (jobs.lib.compiled), and the user of a session as the poll memo reads
it. Every request of a signed-in page reads
its session, and each poll of the batch page is one such request; the rows, their expiry and
everything that writes sessions are Django's own."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from django.contrib.auth import SESSION_KEY
from django.contrib.sessions.backends.db import SessionStore as DatabaseSessionStore
from django.contrib.sessions.models import Session
from django.utils import timezone

from jobs.lib.compiled import Compiled

_SESSION = Compiled(lambda key: Session.objects.filter(session_key=key)[:1], "key")


class SessionStore(DatabaseSessionStore):
    def _get_session_from_db(self) -> Any:
        found = _SESSION.rows(key=self.session_key) if self.session_key else []
        if found and found[0].expire_date > timezone.now():
            return found[0]
        self._session_key = None
        return None


# Each session's user, as the session engine read it once (a session key belongs to one
# user: signing in gives a new key), for the poll memo (jobs/http/polls.py): a poll of the
# batch table needs no session read of its own; its rows' query still checks that the
# session is signed in.
_USERS: OrderedDict[str, int] = OrderedDict()
# Sessions remembered per web process (as many as the poll memo's answers).
MAX_USERS = 10_000


def session_user(session_key: str) -> int | None:
    """The id of the user signed in with `session_key`, or None."""
    user_id = _USERS.get(session_key)
    if user_id is None:
        found = SessionStore(session_key).get(SESSION_KEY)
        if found is None:
            return None
        user_id = _USERS[session_key] = int(found)
        while len(_USERS) > MAX_USERS:
            _USERS.popitem(last=False)
    return user_id
