"""The limit of prefix caching (engine.prefix_limit): every distinct full block once."""

from __future__ import annotations

from engine.prefix_limit import PrefixLimit, block_keys


def test_each_distinct_full_block_is_computed_once_and_every_tail_always() -> None:
    shared = list(range(10))  # two full blocks of 4 and two tokens of a third
    limit = PrefixLimit()
    # The first computes everything; it holds the full blocks of its first len - 1 tokens.
    first = shared + [100, 101, 102]
    assert len(block_keys(first, 4).keys) == 3  # its first 12 tokens of 13: 3 blocks
    assert limit.add(len(first), block_keys(first, 4)) == 0
    # Another with the same 10 tokens first: its 2 whole shared blocks are cached, the
    # third block differs (its last two tokens), and its tail is its own.
    second = shared + [200, 201, 202]
    assert limit.add(len(second), block_keys(second, 4)) == 8
    # A prompt that is exactly a cached prompt still computes its last token: at most
    # len - 1 tokens, in whole blocks, come from the cache.
    assert limit.add(len(first), block_keys(first, 4)) == 12
    assert limit.add(8, block_keys(shared[:8], 4)) == 4
    assert (limit.prompt_tokens, limit.cacheable) == (13 + 13 + 13 + 8, 24)
    assert limit.computed == 47 - 24
    # Another salt never shares; a request without blocks (no prefix cache) computes all.
    assert limit.add(len(first), block_keys(first, 4, salt="other")) == 0
    assert limit.add(5, None) == 0
    # A worker counts each shard by itself.
    limit.forget()
    assert limit.add(len(first), block_keys(first, 4)) == 0
