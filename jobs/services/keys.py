"""API keys: random secrets shown once, stored only as a hash."""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
from typing import Any

from django.core.cache import cache
from django.utils import timezone

from jobs.models import ApiKey

log = logging.getLogger(__name__)

KEY_PREFIX = "sk-bw-"
PREFIX_CHARS = 12
# A client polling its batches authenticates on every request: its key (with the owner's
# few fields a request reads) is kept this long in the cache, by the secret's hash, so a
# poll reads the batch row and nothing else. Revoking deletes the entry at once; a deleted
# key or a deactivated owner is refused within this time.
KEY_CACHE_SECONDS = 10
_OWNER_FIELDS = ("owner__id", "owner__username", "owner__is_active", "owner__is_staff",
                 "owner__is_superuser")


def secret_hash(secret: str) -> str:
    """What a key's row keeps of its secret (and what a poll's is looked up by)."""
    return hashlib.sha256(secret.encode()).hexdigest()


def create_api_key(*, owner: Any, name: str) -> tuple[ApiKey, str]:
    """Create a key; returns the row and the secret, which is never retrievable again."""
    secret = KEY_PREFIX + secrets.token_urlsafe(32)
    key = ApiKey.objects.create(owner=owner, name=name.strip()[:100] or "default",
                                prefix=secret[:PREFIX_CHARS], secret_hash=secret_hash(secret))
    return key, secret


def authenticate_key(secret: str) -> ApiKey | None:
    """The active key for this secret, or None. Looks the row up by its public prefix and
    compares hashes in constant time."""
    if not secret.startswith(KEY_PREFIX) or len(secret) > 200 or not secret.isprintable():
        return None
    digest = secret_hash(secret)
    key = _cached(digest)
    if key is None:
        key = _lookup(secret, digest)
        if key is None:
            return None
        _remember(digest, key)
    # At most one write a minute per key: last_used_at is for humans, not billing.
    now = timezone.now()
    if key.last_used_at is None or (now - key.last_used_at).total_seconds() > 60:
        ApiKey.objects.filter(pk=key.pk).update(last_used_at=now)
        key.last_used_at = now
        _remember(digest, key)
    return key


def _lookup(secret: str, digest: str) -> ApiKey | None:
    # The owner's password hash and the like are not read (nor cached): a field a request
    # needs beyond these is loaded when it is read.
    for key in ApiKey.objects.select_related("owner").only(
            "id", "owner", "name", "prefix", "secret_hash", "last_used_at", "revoked_at",
            *_OWNER_FIELDS).filter(prefix=secret[:PREFIX_CHARS], revoked_at__isnull=True):
        if hmac.compare_digest(key.secret_hash, digest) and key.owner.is_active:
            return key
    return None


def _cache_key(digest: str) -> str:
    return f"api-key:{digest}"


def _cached(digest: str) -> ApiKey | None:
    try:
        return cache.get(_cache_key(digest))
    except Exception:  # Redis down: the database still answers
        log.warning("API key cache unavailable", exc_info=True)
        return None


def _remember(digest: str, key: ApiKey) -> None:
    try:
        cache.set(_cache_key(digest), key, KEY_CACHE_SECONDS)
    except Exception:
        log.warning("API key cache unavailable", exc_info=True)


def revoke_api_key(*, key: ApiKey) -> None:
    if key.revoked_at is None:
        key.revoked_at = timezone.now()
        key.save(update_fields=["revoked_at"])
    try:
        cache.delete(_cache_key(key.secret_hash))
    except Exception:
        log.warning("API key cache unavailable: the revoked key works for up to %d s",
                    KEY_CACHE_SECONDS, exc_info=True)
