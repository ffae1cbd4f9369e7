"""The authentication backend of passwords and sessions: Django's ModelBackend, whose
lookup of a session's user (on every request of a signed-in page, each poll of the batch
page among them) runs a query compiled once per process (jobs.lib.compiled).

It stays here, with the settings that name it: Django records this dotted path in every
signed-in session and signs out a session whose backend is no longer in
AUTHENTICATION_BACKENDS, so moving it would sign every user out at an upgrade."""

from __future__ import annotations

from typing import Any

from django.contrib.auth import backends, get_user_model

from jobs.lib.compiled import Compiled

_USER = Compiled(lambda user_id: get_user_model()._default_manager.filter(pk=user_id)[:1],
                 "user_id")


class ModelBackend(backends.ModelBackend):
    def get_user(self, user_id: Any) -> Any:
        found = _USER.rows(user_id=user_id)
        if found and self.user_can_authenticate(found[0]):
            return found[0]
        return None
