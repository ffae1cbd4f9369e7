"""The session engine (SESSION_ENGINE): Django's database sessions, read with a query
compiled once per process (jobs.compiled). Every request of a signed-in page reads
its session, and each poll of the batch page is one such request; the rows, their expiry and
everything that writes sessions are Django's own."""

from __future__ import annotations

from typing import Any

from django.contrib.sessions.backends.db import SessionStore as DatabaseSessionStore
from django.contrib.sessions.models import Session
from django.utils import timezone

from jobs.compiled import Compiled

_SESSION = Compiled(lambda key: Session.objects.filter(session_key=key)[:1], "key")


class SessionStore(DatabaseSessionStore):
    def _get_session_from_db(self) -> Any:
        found = _SESSION.rows(key=self.session_key) if self.session_key else []
        if found and found[0].expire_date > timezone.now():
            return found[0]
        self._session_key = None
        return None
