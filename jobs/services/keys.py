"""API keys: random secrets shown once, stored only as a hash."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from typing import Any

from django.utils import timezone

from jobs.models import ApiKey

KEY_PREFIX = "sk-bw-"
PREFIX_CHARS = 12


def _hash(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def create_api_key(*, owner: Any, name: str) -> tuple[ApiKey, str]:
    """Create a key; returns the row and the secret, which is never retrievable again."""
    secret = KEY_PREFIX + secrets.token_urlsafe(32)
    key = ApiKey.objects.create(owner=owner, name=name.strip()[:100] or "default",
                                prefix=secret[:PREFIX_CHARS], secret_hash=_hash(secret))
    return key, secret


def authenticate_key(secret: str) -> ApiKey | None:
    """The active key for this secret, or None. Looks the row up by its public prefix and
    compares hashes in constant time."""
    if not secret.startswith(KEY_PREFIX) or len(secret) > 200 or not secret.isprintable():
        return None
    digest = _hash(secret)
    for key in ApiKey.objects.select_related("owner").filter(
            prefix=secret[:PREFIX_CHARS], revoked_at__isnull=True):
        if hmac.compare_digest(key.secret_hash, digest) and key.owner.is_active:
            # At most one write a minute per key: last_used_at is for humans, not billing.
            now = timezone.now()
            if key.last_used_at is None or (now - key.last_used_at).total_seconds() > 60:
                ApiKey.objects.filter(pk=key.pk).update(last_used_at=now)
            return key
    return None


def revoke_api_key(*, key: ApiKey) -> None:
    if key.revoked_at is None:
        key.revoked_at = timezone.now()
        key.save(update_fields=["revoked_at"])
