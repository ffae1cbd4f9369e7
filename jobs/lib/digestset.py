"""A set of 64-bit digests in ~8 bytes each, for remembering every custom_id of a batch.

A Python set of ints costs ~60 bytes an entry (60 MB at a million custom_ids); this keeps
the recent entries in a small set and folds them into one sorted numpy array when it
fills, so memory stays near 8 bytes an entry and a lookup is a set probe plus one binary
search. Folding is a merge of sorted arrays: linear, and rare (every FOLD_AT additions).
"""

from __future__ import annotations

import hashlib

import numpy as np

FOLD_AT = 1 << 16


def digest(text: str) -> int:
    """The 64-bit digest a DigestSet remembers `text` by."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest())


class DigestSet:
    def __init__(self) -> None:
        self._sorted = np.empty(0, dtype=np.uint64)
        self._recent: set[int] = set()

    def __len__(self) -> int:
        return len(self._sorted) + len(self._recent)

    def __contains__(self, digest: int) -> bool:
        if digest in self._recent:
            return True
        if not len(self._sorted):
            return False
        # As a uint64: a plain int below 2**63 would make numpy compare in float64 and
        # convert the whole array on every lookup (measured: 580 us at 600k entries).
        index = int(self._sorted.searchsorted(np.uint64(digest)))
        return index < len(self._sorted) and int(self._sorted[index]) == digest

    def add_new(self, text: str) -> bool:
        """Remember `text`; False when it was remembered already."""
        value = digest(text)
        if value in self:
            return False
        self.add(value)
        return True

    def add(self, digest: int) -> None:
        self._recent.add(digest)
        if len(self._recent) >= FOLD_AT:
            recent = np.fromiter(self._recent, dtype=np.uint64, count=len(self._recent))
            self._sorted = np.sort(np.concatenate((self._sorted, recent)))
            self._recent.clear()
