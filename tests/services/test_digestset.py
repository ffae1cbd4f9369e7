"""DigestSet behaves like a set of 64-bit ints across folds."""

import random

from jobs.lib import digestset
from jobs.lib.digestset import DigestSet


def test_membership_matches_a_python_set_across_folds(monkeypatch) -> None:
    monkeypatch.setattr(digestset, "FOLD_AT", 100)  # many folds with few entries
    rng = random.Random(7)
    digests = DigestSet()
    reference: set[int] = set()
    for _ in range(5_000):
        value = rng.choice([rng.getrandbits(64), rng.getrandbits(8), 2**64 - 1, 0])
        assert (value in digests) == (value in reference)
        if value not in reference:
            digests.add(value)
            reference.add(value)
        assert len(digests) == len(reference)
    for value in list(reference)[:500]:
        assert value in digests
    missing = [v for v in (rng.getrandbits(64) for _ in range(500)) if v not in reference]
    assert not any(v in digests for v in missing)
