"""What ran a batch: each worker's engine record (engine.provenance), on the shards it claims
and summed up on the batch.

A shard holds the record of its current attempt, written under that attempt only (a worker
whose attempt was taken over changes nothing); the LoRA adapters its requests load are
added as they are first used, before any of their requests goes in. The batch holds one
entry per distinct engine record among the workers that claimed its shards, with their
names and the adapters they loaded: more than one entry means they disagreed (the batch
object's `provenance.consistent`).

Owners see what ran their batches without what names the machines (`without_hosts`): a
worker's name is its host, its PID and the models it serves, and a model or adapter
folder is a path on a worker. Staff see everything (the admin, and the dashboard).
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


# Keys of a record (a batch's entries, a shard's record, an engine's) that name a machine:
# the workers' names (batchworker: "<host>.<pid>.<models>") and what an engine may add (a
# remote engine's server).
HOST_KEYS = frozenset({"worker", "workers", "host", "hostname", "pid", "path", "url",
                       "base_url", "metrics_url"})
# Keys that say where the files came from: shown, unless a path or URL on the workers'
# network (`pypi:...`, `pypi-package:...` and `echo` have no slash; a folder has one).
SOURCE_KEYS = frozenset({"model_source", "source"})
LOCAL_SOURCE = "local folder"


def without_hosts(record: Any) -> Any:
    """A provenance record (a batch's list of entries, or a shard's record) as any user may
    see it: the engine records, the adapters and their hashes, without HOST_KEYS and with
    a source that is a local path (or a URL) shown as LOCAL_SOURCE."""
    if isinstance(record, list):
        return [without_hosts(item) for item in record]
    if not isinstance(record, dict):
        return record
    return {key: (LOCAL_SOURCE if key in SOURCE_KEYS and _local(value)
                  else without_hosts(value))
            for key, value in record.items() if key not in HOST_KEYS}


def _local(source: Any) -> bool:
    return isinstance(source, str) and ("/" in source or "\\" in source)


def public_fields(batch: Batch) -> dict[str, Any]:
    """The batch object's extension fields (Batch.extension_fields) as the API shows them
    to every key: its provenance without_hosts."""
    fields = batch.extension_fields()
    if fields["provenance"]:
        # The API calls the list of entries "workers" (one per engine record).
        fields["provenance"] = {**fields["provenance"],
                                "workers": without_hosts(batch.provenance)}
    return fields
