"""The lifecycle of a batch (OpenAI's): validating -> failed | in_progress -> finalizing ->
completed; in_progress -> expired; validating/in_progress -> cancelling -> cancelled.

Each transition is one conditional UPDATE on the state it leaves, so two workers (or a
worker and a user pressing cancel) can never both perform it. This module creates and
looks up batches; each later step has its module in `jobs/services/`: `validation`
(stream the input once, plan the shards), `scheduling` (shards to RQ, fair share), `shards`
(claim, progress, retry), `stopping` (cancel, expiry), `finalize` (merge, end), `progress`
(the batch row's counters) and `reconcile` (the periodic repair pass).
"""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Count
from django.utils import timezone

from engine.endpoints import ENDPOINTS
from jobs.lib import heavy, queues
from jobs.lib.compiled import Compiled
from jobs.lib.errors import ServiceError, not_found, storable_id
from jobs.models import Batch, EvalSet, File, new_batch_id, new_message_batch_id
from jobs.services import budgets, preflight
from jobs.services.evals import eval_ceiling, find_set_for_user
from jobs.services.files import get_file_for_user, parse_expires_after
from jobs.services.grants import check_output_prefix, check_source_readable
from jobs.services.quotas import check_quota

WINDOW_PATTERN = re.compile(r"^([1-9][0-9]{0,3})h$")
MAX_METADATA_PAIRS = 16


def parse_completion_window(value: Any) -> timedelta:
    """'24h' as OpenAI; other whole hours within the configured bounds ('1h', '72h')."""
    conf = settings.BATCHWEB
    match = WINDOW_PATTERN.fullmatch(value) if isinstance(value, str) else None
    hours = int(match.group(1)) if match else 0
    if not conf["MIN_WINDOW_HOURS"] <= hours <= conf["MAX_WINDOW_HOURS"]:
        raise ServiceError(
            f"completion_window must be whole hours like '24h', from "
            f"{conf['MIN_WINDOW_HOURS']}h to {conf['MAX_WINDOW_HOURS']}h.",
            param="completion_window")
    return timedelta(hours=hours)


def check_metadata(value: Any) -> dict[str, str]:
    """OpenAI's metadata: at most 16 string pairs, keys <= 64 and values <= 512 chars."""
    if value in (None, ""):
        return {}
    if not isinstance(value, dict):
        raise ServiceError("metadata must be an object of strings.", param="metadata")
    if len(value) > MAX_METADATA_PAIRS:
        raise ServiceError("metadata takes at most 16 pairs.", param="metadata")
    for key, item in value.items():
        if not isinstance(key, str) or not key or len(key) > 64 or "\x00" in key:
            raise ServiceError("metadata keys must be strings of 1 to 64 characters.",
                               param="metadata")
        if not isinstance(item, str) or len(item) > 512 or "\x00" in item:
            raise ServiceError("metadata values must be strings of at most 512 characters.",
                               param=f"metadata.{key}"[:100])
    return value


def check_priority(value: Any) -> str:
    if value in (None, ""):
        return Batch.Priority.DEFAULT
    if value not in Batch.Priority.values:
        raise ServiceError("priority must be one of high, default, low.", param="priority")
    return value


def create_batch(*, owner: Any, input_file_id: Any, endpoint: Any, completion_window: Any,
                 metadata: Any = None, priority: Any = None,
                 output_expires_after: Any = None, api: str = Batch.Api.OPENAI,
                 api_key: Any = None, strict: Any = False, eval_set: Any = None,
                 output_prefix: Any = None) -> Batch:
    """Create a batch in `validating` and, after commit, enqueue its validation. `api` is
    the API it was created through: only its id and the shape it is shown in differ.
    `api_key`: the key it was created with (its usage is charged under it). `strict`: any
    problem of any line fails the batch before anything runs (else a request problem fails
    that request only). `eval_set`: the name of an eval set the owner may attach
    (jobs.services.evals), run beside the batch and scored when it ends. `output_prefix`:
    a granted s3://bucket/prefix/ its results are delivered to as well, once it ends
    (jobs.services.delivery)."""
    if endpoint not in ENDPOINTS:
        raise ServiceError(f"endpoint must be one of {', '.join(ENDPOINTS)}.", param="endpoint")
    window = parse_completion_window(completion_window)
    metadata = check_metadata(metadata)
    priority = check_priority(priority)
    if not isinstance(strict, bool):
        raise ServiceError("strict must be true or false.", param="strict")
    output_lifetime = parse_expires_after(output_expires_after)
    attached = find_set_for_user(owner=owner, value=eval_set)
    output_prefix = check_output_prefix(owner=owner, value=output_prefix)
    if not isinstance(input_file_id, str) or not input_file_id:
        raise ServiceError("input_file_id is required.", param="input_file_id")
    input_file = get_file_for_user(owner=owner, file_id=input_file_id)
    if input_file.purpose != File.Purpose.BATCH:
        raise ServiceError("The input file must have purpose 'batch'.", param="input_file_id")
    check_source_readable(file=input_file, param="input_file_id")
    # The most it could cost, before the owner's lock is taken (a pass over the file,
    # cached): only where a budget applies.
    ceiling = (_ceiling(owner=owner, input_file=input_file, endpoint=endpoint,
                        eval_set=attached) if budgets.applies(owner) else None)
    with transaction.atomic():
        # One owner's creations one at a time, so that two of them cannot both pass a
        # quota or the budget on the same room (each sees the other's row).
        budgets.lock_owner(owner)
        check_quota(owner=owner, batch_requests=input_file.line_count,
                    eval_requests=attached.item_count if attached else 0)
        budgets.check_budget(owner=owner, ceiling=ceiling)
        now = timezone.now()
        batch = Batch.objects.create(
            id=new_message_batch_id() if api == Batch.Api.ANTHROPIC else new_batch_id(),
            api=api, owner=owner, api_key=api_key, endpoint=endpoint, input_file=input_file,
            completion_window=completion_window, metadata=metadata, priority=priority,
            strict=strict, eval_set=attached, output_prefix=output_prefix,
            delivery_status=Batch.DeliveryStatus.PENDING if output_prefix else "",
            output_expires_after=(int(output_lifetime.total_seconds()) if output_lifetime
                                  else None),
            expires_at=now + window,
            # Reserved from now on; validation sets it again from the same pass.
            cost_ceiling_nanos=ceiling.ceiling_nanos if ceiling is not None else None,
        )
    batch_id = batch.id
    # robust: if Redis is down the batch is still created; the reconciler enqueues it later.
    transaction.on_commit(
        lambda: queues.enqueue_control("jobs.tasks.validate_batch", batch_id, suffix="validate"),
        robust=True)
    return batch


def _ceiling(*, owner: Any, input_file: File, endpoint: str,
             eval_set: EvalSet | None) -> budgets.Estimate:
    """The batch's cost ceiling (its input's preflight, plus the attached set's requests),
    each cached and computed under the per-user guard of heavy work: one user's creates
    cannot keep every web process reading files."""
    def guard() -> heavy.Guard:
        return heavy.one_per_user_or_refuse(owner.pk, doing="checking a file")

    report = preflight.check_file(input_file, endpoint=endpoint, guard=guard()).report
    cost = report.cost
    if eval_set is not None and report.model:
        cost = cost.plus(eval_ceiling(eval_set=eval_set, model=report.model,
                                      first_model=report.first_model, guard=guard()))
    return cost


# Every poll of a batch (the API's and the dashboard's) starts here: compiled once.
_BATCH_OF_OWNER = Compiled(lambda owner_id, batch_id: Batch.objects.filter(
    owner_id=owner_id, pk=batch_id)[:1], "owner_id", "batch_id")



# The newest batches of an owner (the first page of both lists, which clients and open
# dashboards poll), compiled once for each page size (the size is part of the SQL), and
# their count.
_NEWEST: dict[tuple[int, str | None], Compiled] = {}
_COUNT = Compiled(lambda owner_id: Batch.objects.filter(owner_id=owner_id).order_by()
                  .values("owner_id").annotate(count=Count("pk")).values_list("count"),
                  "owner_id")


def newest_batches(*, owner: Any, count: int, api: str | None = None) -> list[Batch]:
    """The owner's `count` newest batches (of one `api`, if given), newest first (ties by
    id, newest first)."""
    compiled = _NEWEST.get((count, api))
    if compiled is None:
        wanted = {"api": api} if api else {}
        compiled = _NEWEST[count, api] = Compiled(
            lambda owner_id: Batch.objects.filter(owner_id=owner_id, **wanted).order_by(
                "-created_at", "-pk")[:count], "owner_id")
    return compiled.rows(owner_id=owner.pk)


def count_batches(*, owner: Any) -> int:
    return next(iter(_COUNT.rows(owner_id=owner.pk)), (0,))[0]


def get_batch_for_user(*, owner: Any, batch_id: str) -> Batch:
    found = _BATCH_OF_OWNER.rows(owner_id=owner.pk, batch_id=batch_id) \
        if storable_id(batch_id) else []
    if not found:
        raise not_found("batch", batch_id)
    return found[0]


def get_openai_batch_for_user(*, owner: Any, batch_id: str) -> Batch:
    """A batch created through OpenAI's API: each API shows only its own batches (the
    dashboard shows both)."""
    batch = get_batch_for_user(owner=owner, batch_id=batch_id)
    if batch.api != Batch.Api.OPENAI:
        raise not_found("batch", batch_id)
    return batch


def get_message_batch_for_user(*, owner: Any, batch_id: str) -> Batch:
    """A batch created through Anthropic's API; any other id is not one (404)."""
    batch = get_batch_for_user(owner=owner, batch_id=batch_id)
    if batch.api != Batch.Api.ANTHROPIC:
        raise not_found("message batch", batch_id)
    return batch
