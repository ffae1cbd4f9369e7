"""Stored objects that go with their rows, whoever deletes them (the API, the dashboard,
the admin, or a user's deletion cascading to what they own): an eval set's JSONL and an
eval run's scored results, removed from storage once the deletion commits. Cleanup's
orphan sweep does not list their folders (`evalsets/`, `evals/`), so nothing else would."""

from __future__ import annotations

from typing import Any

from django.core.files.storage import default_storage
from django.db import transaction
from django.db.models.signals import post_delete
from django.dispatch import receiver

from jobs.models import EvalRun, EvalSet


def _remove_after_commit(name: str, using: str) -> None:
    if name:
        # robust: a storage error is logged by Django and never undoes the deletion.
        transaction.on_commit(lambda: default_storage.delete(name), using=using, robust=True)


@receiver(post_delete, sender=EvalSet, dispatch_uid="batchweb-eval-set-file")
def eval_set_deleted(sender: Any, instance: EvalSet, using: str, **kwargs: Any) -> None:
    _remove_after_commit(instance.storage_name, using)


@receiver(post_delete, sender=EvalRun, dispatch_uid="batchweb-eval-run-results")
def eval_run_deleted(sender: Any, instance: EvalRun, using: str, **kwargs: Any) -> None:
    _remove_after_commit(instance.results_name, using)
