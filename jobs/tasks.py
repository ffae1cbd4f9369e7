"""RQ entry points: every job batchweb enqueues names a function here. Each takes ids only,
looks the rows up and calls a service: a job's payload never carries user data, and
replaying a job is harmless.

The reconciler is not one of them: every worker's heartbeat thread runs it in-process
every few seconds (`jobs.worker`), so no job ever needs to start it."""

from __future__ import annotations

from typing import Any

from jobs.services import cleanup, delivery, finalize, validation, webhooks


def validate_batch(batch_id: str) -> None:
    validation.run_validation(batch_id=batch_id)


def finalize_batch(batch_id: str) -> None:
    finalize.finalize_batch(batch_id=batch_id)


def deliver_results(batch_id: str) -> bool:
    """One attempt to deliver an ended batch's results to its output_prefix (the
    reconciler's retries, an operator's)."""
    return delivery.deliver_results(batch_id=batch_id)


def run_shard(shard_id: str) -> None:
    """Hand a shard to this worker's engine pipeline. Only `batchworker` processes (which
    load an engine) listen on shard queues."""
    from jobs.worker.intake import current_intake

    current_intake().run_shard(shard_id)


def deliver_webhook(event_id: str) -> str:
    """One delivery attempt of a webhook event; returns the event's status."""
    return webhooks.deliver_event(event_id)


def scheduled_cleanup() -> dict[str, Any]:
    """The cleanup pass the reconciler's schedule enqueues (`cleanup.enqueue_if_due`)."""
    return cleanup.run_cleanup().counts()
