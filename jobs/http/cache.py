"""The cache backend (CACHES["default"]): Django's RedisCache, with one redis-py client per
connection pool instead of a new one for every call. Building a client (its ~170 response
callbacks) cost about as much CPU as the Redis round trip itself, on every API key lookup
and every cached live block; a client is safe to share between threads (each command takes
a connection from the pool)."""

from __future__ import annotations

from typing import Any

from django.core.cache.backends import redis


class RedisCacheClient(redis.RedisCacheClient):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._clients: dict[int, Any] = {}

    def get_client(self, key: Any = None, *, write: bool = False) -> Any:
        # (django-stubs do not list these attributes of Django's class.)
        pool = self._get_connection_pool(write)  # type: ignore[attr-defined]
        client = self._clients.get(id(pool))
        if client is None:
            client = self._client(connection_pool=pool)  # type: ignore[attr-defined]
            self._clients[id(pool)] = client
        return client


class RedisCache(redis.RedisCache):
    def __init__(self, server: str, params: dict[str, Any]) -> None:
        super().__init__(server, params)
        self._class = RedisCacheClient
