"""What ran a batch: each worker's engine record (engine.provenance), on the shards it claims
and summed up on the batch.

A shard holds the record of its current attempt, written under that attempt only (a worker
whose attempt was taken over changes nothing); the LoRA adapters its requests load are
added as they are first used, before any of their requests goes in. The batch holds one
entry per distinct engine record among the workers that claimed its shards, with their
names and the adapters they loaded: more than one entry means they disagreed (the batch
object's `provenance.consistent`).

Owners see what ran their batches without what names the machines
(`jobs.models.without_hosts`): a worker's name is its host, its PID and the models it
serves, and a model or adapter folder is a path on a worker. Staff see everything (the
admin, and the dashboard).
"""

from __future__ import annotations

from typing import Any

from django.db import transaction

from jobs.models import Batch, Shard


def record_claim(*, shard: Shard, worker: str, engine: dict[str, Any]) -> bool:
    """Record the engine that runs the shard's claimed attempt; False when the attempt is
    no longer the shard's."""
    if not Shard.objects.filter(pk=shard.pk, attempt=shard.attempt).update(
            provenance={**engine, "worker": worker, "adapters": []}):
        return False
    if not _holds(shard.batch.provenance, engine, worker, None):
        _add_to_batch(shard.batch_id, engine, worker, None)
    return True


def record_adapter(*, shard: Shard, worker: str, engine: dict[str, Any],
                   adapter: dict[str, str]) -> bool:
    """Add a LoRA adapter the attempt's requests load (engine.provenance.adapter_record) to
    the shard's record and the batch's; False when the attempt is no longer the shard's."""
    with transaction.atomic():
        current = (Shard.objects.select_for_update().filter(pk=shard.pk, attempt=shard.attempt)
                   .values_list("provenance", flat=True).first())
        if current is None:
            return False
        adapters = list(current.get("adapters", []))
        if adapter not in adapters:
            Shard.objects.filter(pk=shard.pk, attempt=shard.attempt).update(
                provenance={**current, "adapters": [*adapters, adapter]})
    _add_to_batch(shard.batch_id, engine, worker, adapter)
    return True


def _holds(entries: list[dict[str, Any]], engine: dict[str, Any], worker: str,
           adapter: dict[str, str] | None) -> bool:
    entry = next((e for e in entries or () if e.get("engine") == engine), None)
    return entry is not None and worker in entry["workers"] and (
        adapter is None or adapter in entry["adapters"])


def _add_to_batch(batch_id: str, engine: dict[str, Any], worker: str,
                  adapter: dict[str, str] | None) -> None:
    # The batch row locked: workers claiming its shards at once each add to what the
    # others wrote.
    with transaction.atomic():
        entries = (Batch.objects.select_for_update().filter(pk=batch_id)
                   .values_list("provenance", flat=True).first())
        if entries is None or _holds(entries, engine, worker, adapter):
            return
        entries = list(entries)
        entry = next((e for e in entries if e.get("engine") == engine), None)
        if entry is None:
            entry = {"engine": engine, "workers": [], "adapters": []}
            entries.append(entry)
        if worker not in entry["workers"]:
            entry["workers"].append(worker)
        if adapter is not None and adapter not in entry["adapters"]:
            entry["adapters"].append(adapter)
        Batch.objects.filter(pk=batch_id).update(provenance=entries)
