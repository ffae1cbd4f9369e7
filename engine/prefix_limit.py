"""The limit of prefix caching: the fewest prompt tokens an engine must compute for a set of
prompts, given its KV cache block size.

vLLM's prefix cache keys each *full* block of a prompt's tokens by the whole prefix up to
it (and the request's cache salt), and a request can reuse at most its prompt less one
token (the last must be computed for its logits), in whole blocks. So the limit is: every
distinct full block computed once, every other request that holds it finding it cached,
and every request's own tail (the rest of its tokens) computed. This is what a perfect
order and an unbounded cache would reach; the benchmarks and the batch page measure the
prefix cache's hits against it.

A `PrefixLimit` counts it incrementally, request by request, from each prompt's token ids;
`forget` drops the blocks seen so far (a worker measures each shard by itself: a shard may
run on another worker, whose cache the others never see).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PromptBlocks:
    """The full blocks of one request's prompt a later request could find cached, as an
    engine reports them with its result (`block_keys`)."""

    block_size: int
    keys: tuple[int, ...]


def block_keys(token_ids: Sequence[int], block_size: int, salt: str = "") -> PromptBlocks:
    """The full blocks of a prompt a request could find cached: those of its first
    len - 1 tokens, each keyed by everything before it (and the salt), as vLLM chains its
    block hashes. Keys are Python hashes: compared only within the process that made them."""
    key = hash(salt)
    keys = []
    for end in range(block_size, len(token_ids), block_size):
        key = hash((key, tuple(token_ids[end - block_size:end])))
        keys.append(key)
    return PromptBlocks(block_size, tuple(keys))


class PrefixLimit:
    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.cacheable = 0  # tokens of blocks another request computed first
        self._seen: set[int] = set()

    def add(self, prompt_tokens: int, blocks: PromptBlocks | None) -> int:
        """Count one request (its prompt tokens and blocks; None: an engine without a
        prefix cache); the tokens of it the limit serves from the cache."""
        self.prompt_tokens += prompt_tokens
        if blocks is None:
            return 0
        hits = 0
        for key in blocks.keys:
            if key in self._seen:
                hits += blocks.block_size
            else:
                self._seen.add(key)
        self.cacheable += hits
        return hits

    def forget(self) -> None:
        self._seen.clear()

    @property
    def computed(self) -> int:
        """The fewest prompt tokens the engine must compute for the requests counted."""
        return self.prompt_tokens - self.cacheable
