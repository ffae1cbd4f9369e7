"""Per-user quotas: one check, used by every path that stores a file or creates a batch
(the API, the dashboard, reruns), so the rules cannot differ between them.

Limits come from the user's Quota row, falling back limit by limit to the site-wide default
row (see `Quota`). What counts:

- max_file_bytes, max_requests_per_batch: the file or batch being submitted (400: a smaller
  one is needed, waiting does not help).
- max_stored_bytes: the sum of `File.bytes` over all of the user's files (input, output and
  error files; not those registered by reference, read in place from the user's own
  bucket), plus the bytes of their own eval sets (each a stored copy of its JSONL, which
  outlives the file it was made from), plus the declared size of each pending upload (its
  parts are on their way to it, and completing it must not need more room), plus the parts
  left of uploads no longer pending until cleanup deletes them, plus the new file or set
  (429: delete files or sets, or wait for files to expire).
- open uploads: at most BATCHWEB_MAX_OPEN_UPLOADS pending uploads per user (a site-wide
  setting, 429), so reserving storage through uploads that are never completed is bounded.
- max_active_batches: the user's batches validating, in progress, finalizing or cancelling,
  and the requests of eval sets they attached while those run (a batch of their own), plus
  the new one (two, with an eval set attached) (429).
- tokens_per_day / tokens_per_month: input + output tokens of successful requests (what
  shards record: failed requests and deduplicated copies cost nothing), the requests of
  eval sets the user attached included, counted by the time their shard finished, in the
  current calendar day / month of TIME_ZONE (UTC). A batch is
  refused once the period's usage has reached the budget; a batch already accepted runs to
  the end even if it goes past (its tokens are not known in advance). The budget resets at
  midnight / on the 1st.

A batch's checks run under a lock on its owner's row (jobs.services.batches), so two of
one user's creates at the same instant cannot both take the last room; files are not
serialized (a quota on storage is a fair-use limit).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import F, Q, Sum
from django.utils import timezone

from jobs.lib.errors import ServiceError
from jobs.models import (
    Batch,
    EvalRun,
    EvalSet,
    File,
    Quota,
    Shard,
    Upload,
    UploadPart,
    UsageRecord,
)

LABELS = {
    "max_file_bytes": "file size",
    "max_requests_per_batch": "requests per batch",
    "max_active_batches": "active batches",
    "max_stored_bytes": "stored bytes",
    "tokens_per_day": "tokens today",
    "tokens_per_month": "tokens this month",
    "cost_per_month": "cost this month",
    "max_open_uploads": "open uploads",
}


def default_quota() -> Quota:
    """The site-wide default row, created (all limits blank) the first time it is needed."""
    quota = Quota.objects.filter(user__isnull=True).first()
    if quota is not None:
        return quota
    try:
        with transaction.atomic():
            return Quota.objects.create(user=None)
    except IntegrityError:  # created meanwhile by another request
        return Quota.objects.get(user__isnull=True)


def limits_for(owner: Any) -> dict[str, int | None]:
    """Each limit for this user: their own value, else the default's; None is no limit."""
    default = default_quota()
    own = Quota.objects.filter(user=owner).first()
    values: dict[str, int | None] = {}
    for name in Quota.LIMITS:
        value = getattr(own, name) if own is not None else None
        values[name] = value if value is not None else getattr(default, name)
    return values


def period_starts(now: datetime | None = None) -> tuple[datetime, datetime]:
    """Start of the current day and month in TIME_ZONE: when the token budgets reset."""
    local = timezone.localtime(now or timezone.now())
    day = local.replace(hour=0, minute=0, second=0, microsecond=0)
    return day, day.replace(day=1)


def tokens_since(owner: Any, start: datetime) -> int:
    # A shard finishes at most a completion window (plus retries of its last attempt)
    # after its batch was created: bounding the batches by creation time lets the query
    # use the (owner, created_at) index instead of scanning every batch of the user.
    oldest_batch = start - timedelta(hours=settings.BATCHWEB["MAX_WINDOW_HOURS"] + 24)
    total = Shard.objects.filter(
        _owned_or_attached(owner, "batch__"), batch__created_at__gte=oldest_batch,
        finished_at__gte=start,
    ).aggregate(total=Sum(F("input_tokens") + F("output_tokens")))["total"]
    return int(total or 0)


def _owned_or_attached(owner: Any, prefix: str = "") -> Q:
    """Batches of the owner's, and the runs of eval sets the owner attached to a batch
    (their requests are the owner's: charged to them, counted against their quotas)."""
    return (Q(**{f"{prefix}owner": owner})
            | Q(**{f"{prefix}eval_run_of__trigger": EvalRun.Trigger.BATCH,
                   f"{prefix}eval_run_of__batch__owner": owner}))


def cost_nanos_since(owner: Any, start: datetime) -> int:
    """What the usage ledger charged the user since `start`, in billionths of the
    currency (the budget, cost_per_month, is checked in jobs.services.budgets)."""
    total = UsageRecord.objects.filter(owner=owner, recorded_at__gte=start).order_by() \
        .aggregate(total=Sum("cost_nanos"))["total"]
    return int(total or 0)


def stored_bytes(owner: Any, *, but_upload: str | None = None) -> int:
    """What the user stores or has reserved (see max_stored_bytes above). `but_upload`: a
    pending upload being assembled, whose reservation becomes the new file."""
    def total(rows: Any) -> int:
        return int(rows.aggregate(total=Sum("bytes"))["total"] or 0)

    now = timezone.now()
    # An upload past its expiry is pending only until someone looks: its parts count, as
    # for any upload no longer open, until cleanup deletes them.
    pending = _open_uploads(owner, now=now)
    leftover_parts = UploadPart.objects.filter(upload__owner=owner).exclude(
        upload__status=Upload.Status.PENDING, upload__expires_at__gt=now)
    if but_upload is not None:
        pending = pending.exclude(pk=but_upload)
    # A file registered by reference is read in place: it takes no room here. An eval set
    # is a copy in the service's storage, whatever it was made from.
    return (total(File.objects.filter(owner=owner, source="")) + total(pending)
            + total(leftover_parts) + total(EvalSet.objects.filter(owner=owner)))


def _open_uploads(owner: Any, *, now: datetime) -> Any:
    return Upload.objects.filter(owner=owner, status=Upload.Status.PENDING,
                                 expires_at__gt=now)


def usage_for(owner: Any, *, now: datetime | None = None,
              but_upload: str | None = None) -> dict[str, Any]:
    day, month = period_starts(now)
    return {
        "max_stored_bytes": stored_bytes(owner, but_upload=but_upload),
        "max_active_batches": Batch.objects.active().filter(
            _owned_or_attached(owner)).count(),
        "tokens_per_day": tokens_since(owner, day),
        "tokens_per_month": tokens_since(owner, month),
        "cost_per_month": Decimal(cost_nanos_since(owner, month)) / 10**9,
    }


def _refuse(limit: str, message: str) -> ServiceError:
    usage_limit = limit in ("max_stored_bytes", "max_active_batches", "tokens_per_day",
                            "tokens_per_month", "max_open_uploads")
    # Limits on the submission itself are a 400 (waiting does not help); limits on what the
    # user has or has used are a 429 in OpenAI's quota shape.
    return ServiceError(f"Quota exceeded ({LABELS[limit]}): {message}",
                        status=429 if usage_limit else 400, code=f"{limit}_exceeded",
                        type="insufficient_quota" if usage_limit else "invalid_request_error")


def check_quota(*, owner: Any, file_bytes: int | None = None,
                batch_requests: int | None = None, eval_requests: int = 0,
                from_upload: str | None = None, stored: bool = True) -> None:
    """Refuse (ServiceError 400 or 429, saying which limit and the current usage) a new
    file of `file_bytes` or a new batch of `batch_requests` requests (and `eval_requests`
    of an eval set attached to it, run as a batch of their own) beyond the user's quota.
    Nothing else is checked: pass what is being submitted, and `from_upload` when the file
    is a pending upload being assembled (its reservation is not counted twice), and
    `stored` False for a file read in place (registered by reference: no stored bytes)."""
    limits = limits_for(owner)
    if not any(v is not None for v in limits.values()):
        return
    usage = usage_for(owner, but_upload=from_upload)
    if file_bytes is not None:
        limit = limits["max_file_bytes"]
        if limit is not None and file_bytes > limit:
            raise _refuse("max_file_bytes", f"this file is {file_bytes:,} bytes; files may "
                                            f"be at most {limit:,} bytes.")
        limit = limits["max_stored_bytes"]
        held = usage["max_stored_bytes"]
        if limit is not None and stored and held + file_bytes > limit:
            raise _refuse("max_stored_bytes", f"you store {held:,} of {limit:,} bytes "
                                              f"allowed; this file adds {file_bytes:,}. "
                                              "Delete files or eval sets, or wait for "
                                              "files to expire.")
    if batch_requests is not None:
        limit = limits["max_requests_per_batch"]
        with_set = f" (with {eval_requests:,} of its eval set)" if eval_requests else ""
        if limit is not None and batch_requests + eval_requests > limit:
            raise _refuse("max_requests_per_batch",
                          f"this batch has {batch_requests + eval_requests:,} requests"
                          f"{with_set}; a batch may have at most {limit:,}.")
        limit = limits["max_active_batches"]
        active = usage["max_active_batches"]
        new = 2 if eval_requests else 1  # an eval set's requests run as a batch of their own
        if limit is not None and active + new > limit:
            raise _refuse("max_active_batches",
                          f"{active:,} of your batches are active and at most {limit:,} may "
                          "be" + ("; this one and its eval set's requests would make "
                                  f"{active + new:,}" if new > 1 else "")
                          + "; wait for one to end.")
        for name, period in (("tokens_per_day", "today (UTC)"),
                             ("tokens_per_month", "this month")):
            limit = limits[name]
            used = usage[name]
            if limit is not None and used >= limit:
                raise _refuse(name, f"you have used {used:,} of {limit:,} tokens {period}; "
                                    "new batches are accepted again when the period resets.")


def check_open_uploads(*, owner: Any) -> None:
    """Refuse (429) a new upload while the user has BATCHWEB_MAX_OPEN_UPLOADS pending."""
    limit = settings.BATCHWEB["MAX_OPEN_UPLOADS"]
    open_uploads = _open_uploads(owner, now=timezone.now()).count()
    if open_uploads >= limit:
        raise _refuse("max_open_uploads",
                      f"you have {open_uploads:,} uploads pending and at most {limit:,} "
                      "may be; complete or cancel one, or wait for it to expire.")


@dataclass
class QuotaRow:
    name: str
    label: str
    used: int | Decimal | None  # None: a per-submission limit, nothing accumulates
    limit: int | Decimal | None

    @property
    def percent(self) -> float | None:
        if self.used is None or not self.limit:
            return None
        return min(100.0, round(100.0 * float(self.used) / float(self.limit), 1))

    @property
    def left(self) -> int | Decimal | None:
        if self.used is None or self.limit is None:
            return None
        return max(self.limit - self.used, 0)


def summary(owner: Any) -> list[QuotaRow]:
    """Usage and limits for the dashboard's account page."""
    limits = limits_for(owner)
    usage = usage_for(owner)
    return [QuotaRow(name, LABELS[name], usage.get(name), limits[name])
            for name in Quota.LIMITS]
