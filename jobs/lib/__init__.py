"""Shared helpers of every layer: compiled queries, digests, errors, heavy reads, Redis queues,
RE2 checks, safe outgoing HTTP."""
