"""The reconciler's periodic share: due webhooks and the cleanup enqueued."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from jobs.lib import queues
from jobs.models import WebhookEvent
from jobs.services.upkeep import periodic_operations


@pytest.mark.django_db
def test_periodic_operations_enqueue_due_webhooks_and_cleanup(user, settings):
    settings.BATCHWEB = {**settings.BATCHWEB, "CLEANUP_INTERVAL_SECONDS": 3600}
    due = WebhookEvent.objects.create(owner=user, type="batch.completed", batch_id="batch_a",
                                      next_attempt_at=timezone.now())
    WebhookEvent.objects.create(owner=user, type="batch.failed", batch_id="batch_b",
                                next_attempt_at=timezone.now() + timedelta(minutes=5))
    assert periodic_operations() == {"webhooks": 1, "deliveries": 0, "cleanup": 1}
    assert queues.queue(queues.CONTROL_QUEUE).job_ids == ["batchweb-cleanup"]
    assert queues.queue(queues.WEBHOOK_QUEUE).job_ids == [f"{due.pk}-webhook"]
    assert periodic_operations() == {"webhooks": 1, "deliveries": 0, "cleanup": 0}


@pytest.mark.django_db
def test_the_reconciler_runs_the_periodic_operations(user):
    """Needs the two-line hook in jobs/services/reconcile.py (see the report)."""
    from jobs.services.reconcile import reconcile

    due = WebhookEvent.objects.create(owner=user, type="batch.completed", batch_id="batch_a",
                                      next_attempt_at=timezone.now())
    done = reconcile()
    assert done["webhooks"] == 1 and done["cleanup"] == 1
    assert f"{due.pk}-webhook" in queues.queue(queues.WEBHOOK_QUEUE).job_ids


@pytest.mark.django_db
def test_one_reconcile_pass_per_interval_serves_every_worker(monkeypatch):
    """Every worker runs the reconciler; within an interval only the first one's call
    passes, and the next interval passes again."""
    import time

    from jobs.services import reconcile as reconcile_service

    passes = []
    monkeypatch.setattr(reconcile_service, "reconcile", lambda: passes.append(1) or {})
    assert reconcile_service.reconcile_if_due(every=1) == {}
    assert reconcile_service.reconcile_if_due(every=1) is None  # another worker, same interval
    assert reconcile_service.reconcile_if_due(every=1) is None
    assert 0 < queues.connection().pttl(reconcile_service.PASS_KEY) <= 900
    time.sleep(1.0)  # a worker alone, one interval later: the key lived 90% of it
    assert reconcile_service.reconcile_if_due(every=1) == {}
    assert len(passes) == 2
