"""RQ entry points: every job batchweb enqueues names a function here. Each takes ids only
and hands them to one call: a service, which looks the rows up, or for `run_shard` the
engine pipeline of the `batchworker` process that took the job (its intake, which claims
the shard through the worker's ShardStore). A job's payload never carries user data, and
replaying a job is harmless.

The reconciler is not one of them: every worker's periodic thread runs it in-process
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
    load an engine) listen on shard queues; RQ runs the job in that process (a
    SimpleWorker), beside the pipeline, whose intake is the process's one while it runs."""
    from jobs.worker.intake import current_intake

    current_intake().run_shard(shard_id)


def deliver_webhook(event_id: str) -> str:
    """One delivery attempt of a webhook event; returns the event's status."""
    return webhooks.deliver_event(event_id)


def scheduled_cleanup() -> dict[str, Any]:
    """The cleanup pass the reconciler's schedule enqueues (`cleanup.enqueue_if_due`)."""
    return cleanup.run_cleanup().counts()
