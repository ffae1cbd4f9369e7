"""RQ entry points. Each takes ids only, looks the rows up and calls a service: a job's
payload never carries user data, and replaying a job is harmless."""

from __future__ import annotations

from jobs.services import batches
from jobs.services import reconcile as reconcile_service


def validate_batch(batch_id: str) -> None:
    batches.run_validation(batch_id=batch_id)


def finalize_batch(batch_id: str) -> None:
    batches.finalize_batch(batch_id=batch_id)


def run_shard(shard_id: str) -> None:
    """Hand a shard to this worker's engine pipeline. Only `batchworker` processes (which
    load an engine) listen on shard queues."""
    from jobs.worker.pipeline import current_pipeline

    current_pipeline().run_shard(shard_id)


def reconcile() -> dict[str, int]:
    return reconcile_service.reconcile()
