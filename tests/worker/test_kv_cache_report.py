"""Workers report their engine's KV cache; prefix planning assumes what the model's live
workers have (jobs.capacity.fleet, jobs.services.validation.planning_cache_tokens)."""

from __future__ import annotations

import time

import pytest

from jobs.capacity.fleet import KV_CACHE_KEY, report_kv_cache
from jobs.lib import queues
from jobs.services.validation import planning_cache_tokens

# It talks to Redis.
pytestmark = pytest.mark.redis


def test_planning_assumes_the_smallest_cache_the_live_workers_report(settings) -> None:
    settings.BATCHWEB = {**settings.BATCHWEB, "PREFIX_CACHE_TOKENS": 0}
    default = settings.BATCHWEB["PREFIX_CACHE_TOKENS_DEFAULT"]
    assert planning_cache_tokens("smol") == default  # no worker reported yet
    connection = queues.connection()
    for name, model, tokens in (("w1", "smol", 93_184), ("w2", "smol", 46_592),
                                ("w3", "other", 1_000)):
        report_kv_cache(connection, name, model, tokens, 5)
    # A shard may run on any worker of the model: the smallest cache of its own workers.
    assert planning_cache_tokens("smol") == 46_592
    assert planning_cache_tokens("other") == 1_000
    # A worker that stopped reporting (its machine gone) counts no more, and is forgotten.
    key = KV_CACHE_KEY.format(model="smol")
    connection.hset(key, "w2", f"46592 {time.time() - 3600:.0f}")
    assert planning_cache_tokens("smol") == 93_184
    assert connection.hkeys(key) == [b"w1"]
    # The setting, when given, overrides what workers report.
    settings.BATCHWEB = {**settings.BATCHWEB, "PREFIX_CACHE_TOKENS": 400}
    assert planning_cache_tokens("smol") == 400
