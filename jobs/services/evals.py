"""Evaluation sets: a fixed JSONL of requests with expected answers, run beside a batch on
its model and sampling and scored when it ends, so output quality cannot drift silently
when the model's files, its adapter, the engine or its defaults change (docs/eval-sets.md).

- A set is created once (`create_eval_set`): each line {"custom_id", "url"?, "body",
  "expected"}, checked and stored as it is.
- A run starts when a worker claims a shard of the batch (`start_runs`, from the worker's
  claim): for the set the batch's owner attached, and, once per set and serving key, for an
  operator's set watching the model whenever a worker first serves a new model hash or
  engine version. Its requests (the set's bodies with the batch's first request's model and
  sampling) become a batch of their own, owned by the evals' service user (`eval_user`):
  they run on the same model's queues and workers under every guarantee of any batch
  (claims fenced by attempt, checkpoints, exactly one line per request), yet never appear
  in the batch's files, counts, or its owner's lists and files. A run the owner attached
  is theirs all the same: its ceiling is in the batch's (`eval_ceiling`), it counts
  against their quotas and is charged to them (jobs.services.ledger, marked as an eval
  run); an operator's watching set's runs are the service user's.
- When both the batch and the run's batch have ended (`batch_ended`, from the finalizer),
  the run is scored by the set's rule and compared with the baseline: the last accepted
  run of the set on the same model by the same owner (`baselines`; the first such run is
  its own baseline until another is accepted, `accept_run`). A score below the
  baseline's by more than the set's threshold flags the batch (`Batch.eval_drift`) and
  sends its owner a signed `batchweb.eval.drift` webhook event.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.files.base import ContentFile
from django.core.files.storage import default_storage
from django.db import IntegrityError, transaction
from django.db.models import F, Q
from django.utils import timezone

from engine.endpoints import CHAT, EMBEDDINGS, REGISTRY, check_body
from jobs.formats.prompts import ceiling, room_for
from jobs.formats.wire import RequestLine
from jobs.lib import heavy, queues
from jobs.lib.errors import ServiceError, not_found, storable_id, wrong_state
from jobs.models import Batch, EvalRun, EvalSet, File
from jobs.policy import eval_rules
from jobs.policy.quality import output_texts
from jobs.services.budgets import Estimate, estimate, lock_owner
from jobs.services.files import get_file_for_user, store_file
from jobs.services.grants import check_source_readable
from jobs.services.quotas import check_quota
from jobs.storage.external import shown_reason
from jobs.storage.lines import iter_lines
from jobs.storage.objects import open_file, open_range, save_local
from jobs.storage.temp import local_temp

log = logging.getLogger(__name__)

# Items a set may hold: a run's answers are held in memory while it is scored.
MAX_ITEMS = 10_000
# Characters of an answer kept in a run's results (and compared with the baseline's).
ANSWER_CHARS = 4000
# Changed items a run keeps side by side for its batch page.
CHANGED_SHOWN = 50
# The endpoints whose answers are text, which the rules score.
TEXT_ENDPOINTS = tuple(url for url, endpoint in REGISTRY.items() if not endpoint.pooling)
# The fields of a batch's first request that make its sampling, copied onto the set's
# requests of the same endpoint (every one of them optional there).
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
                   "frequency_penalty", "repetition_penalty")
SERVICE_USER = "batchweb-evals"
# How long a run's own output and error files are kept after its requests end.
RUN_FILES_SECONDS = 30 * 86400
DRIFT_EVENT = "batchweb.eval.drift"
# The model name the set's bodies are checked with (each run puts the batch's there).
_PLACEHOLDER_MODEL = "model"
# A set's id as the API shows it ("evalset_12"); the bare number is taken too, as the
# `eval_set` field of a batch always has. A name cannot look like either.
_SET_ID = re.compile(r"(?:evalset_)?([0-9]{1,18})")
# Sets one user may own: each is a stored copy of its JSONL, outside the files quota.
MAX_OWN_SETS = 50


def eval_user() -> Any:
    """The service user that owns eval runs' batches and files: nobody signs in as it, its
    usage is the operator's, and nothing of it shows in any user's lists."""
    user, _ = get_user_model().objects.get_or_create(
        username=SERVICE_USER, defaults={"is_active": False, "password": "!"})
    return user


# --- sets ---


def _lines(stream: IO[bytes]) -> Iterator[tuple[int, Any]]:
    """(line number, object) of each non-blank line of a set's JSONL, streamed."""
    for line in iter_lines(stream, max_line_bytes=settings.BATCHWEB["MAX_LINE_BYTES"]):
        if line.content is None:  # longer than a line may be
            yield line.number, None
        elif line.content.strip():
            try:
                item = json.loads(line.content)
            except RecursionError:  # nested deeper than Python parses: as JSON that does not
                raise ValueError(f"line {line.number} is nested too deeply") from None
            yield line.number, item


def _item_problem(item: Any, *, rule: str, url: str | None,
                  seen: set[str]) -> tuple[str, str] | None:
    """(param, message) of what is wrong with one line of a set, or None."""
    if not isinstance(item, dict):
        return "line", "Each line must be a JSON object."
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > 512:
        return "custom_id", "custom_id must be a string of 1 to 512 characters."
    if custom_id in seen:
        return "custom_id", f"custom_id {custom_id[:100]!r} appears twice."
    item_url = item.get("url", url or CHAT)
    if item_url not in TEXT_ENDPOINTS or (url is not None and item_url != url):
        return "url", (f"url must be one of {', '.join(TEXT_ENDPOINTS)}, the same on every "
                       "line.")
    body = item.get("body")
    if not isinstance(body, dict):
        return "body", "body must be a JSON object."
    problem = check_body(item_url, {**body, "model": _PLACEHOLDER_MODEL},
                         max_tokens_cap=settings.BATCHWEB["MAX_TOKENS_CAP"])
    if problem is not None:
        return problem.param or "body", problem.message
    if "expected" not in item:
        return "expected", "expected is required."
    message = eval_rules.expected_problem(rule, item["expected"])
    return ("expected", message) if message else None


def create_eval_set(*, name: str, path: str | Path, rule: str, owner: Any = None,
                    tolerance: float = 0.0, embedding_model: str = "",
                    similarity: float = 0.9, drift_threshold: float = 0.05,
                    watch_models: list[str] | None = None) -> EvalSet:
    """Check a set's JSONL (a local file the caller owns: every line, streamed) and store
    it. ServiceError naming the first bad line; nothing is stored then."""
    from jobs.lib.model_registry import model_spec

    if rule not in eval_rules.RULES:
        raise ServiceError(f"rule must be one of {', '.join(eval_rules.RULES)}.", param="rule")
    if not isinstance(name, str) or not name or len(name) > 100 or "\x00" in name:
        raise ServiceError("name must be 1 to 100 characters.", param="name")
    if _SET_ID.fullmatch(name):
        raise ServiceError("name must not look like a set's id (a number, or evalset_ and "
                           "a number).", param="name")
    if rule == eval_rules.EMBEDDING:
        spec = model_spec(embedding_model)
        if spec is None or EMBEDDINGS not in spec.endpoints:
            raise ServiceError("The embedding rule needs a served embeddings model.",
                               param="embedding_model")
    if not 0 <= drift_threshold <= 1:
        raise ServiceError("drift_threshold is a fraction of items, from 0 to 1.",
                           param="drift_threshold")
    url, count = check_set_file(path=path, rule=rule)
    with open(path, "rb") as stream:
        digest = hashlib.file_digest(stream, "sha256").hexdigest()
    size = Path(path).stat().st_size
    storage_name = save_local(path, "evalsets")
    try:
        # A savepoint: a caller's transaction (the admin's) goes on after a refusal.
        with transaction.atomic():
            if owner is not None:
                _admit_own_set(owner=owner, size=size)
            return EvalSet.objects.create(
                name=name, owner=owner, url=url, storage_name=storage_name,
                bytes=size, item_count=count, sha256=digest, rule=rule,
                tolerance=tolerance, embedding_model=embedding_model, similarity=similarity,
                drift_threshold=drift_threshold, watch_models=list(watch_models or []))
    except IntegrityError:
        default_storage.delete(storage_name)
        raise ServiceError(f"An eval set named {name!r} exists already.", param="name") \
            from None
    except ServiceError:
        default_storage.delete(storage_name)
        raise


def _admit_own_set(*, owner: Any, size: int, lock: bool = True) -> None:
    """Refuse a user's new set of `size` bytes past MAX_OWN_SETS or their stored-bytes
    quota (a set is a stored copy, counted as their files are: jobs.services.quotas).
    With `lock` (inside the transaction that creates the set), checked under the owner's
    lock, as a batch's quotas are, so that two creates at the same instant cannot both take
    the last room; without, an early refusal before the set's file is checked."""
    if lock:
        lock_owner(owner)
    if EvalSet.objects.filter(owner=owner).count() >= MAX_OWN_SETS:
        raise ServiceError(f"You have {MAX_OWN_SETS} eval sets, the most one user may keep; "
                           "delete one first.", code="too_many_eval_sets")
    check_quota(owner=owner, file_bytes=size)


def check_set_file(*, path: str | Path, rule: str) -> tuple[str, int]:
    """Every line of a set's JSONL checked (streamed): (its url, its item count), or a
    ServiceError naming the first bad line."""
    url: str | None = None
    seen: set[str] = set()
    with open(path, "rb") as stream:
        try:
            for number, item in _lines(stream):
                problem = _item_problem(item, rule=rule, url=url, seen=seen)
                if problem is not None:
                    raise ServiceError(f"Line {number}: {problem[1]}", param=problem[0])
                url = item.get("url", url) or CHAT
                seen.add(item["custom_id"])
                if len(seen) > MAX_ITEMS:
                    raise ServiceError(f"A set holds at most {MAX_ITEMS} items.", param="file")
        except ValueError as exc:  # not UTF-8, JSON that does not parse, or nested too deeply
            raise ServiceError(f"The file is not JSONL: {exc}", param="file") from None
    if not seen:
        raise ServiceError("The set holds no items.", param="file")
    return url or CHAT, len(seen)


def sets_for(owner: Any) -> Any:
    """The sets a user may attach: their own and the operator's."""
    return EvalSet.objects.filter(Q(owner__isnull=True) | Q(owner=owner))


def public_id(eval_set: EvalSet) -> str:
    return f"evalset_{eval_set.pk}"


def find_set_for_user(*, owner: Any, value: Any) -> EvalSet | None:
    """The set `value` names (its name, or its id) among the user's; None for none given."""
    if value in (None, ""):
        return None
    if not isinstance(value, str | int) or isinstance(value, bool):
        raise ServiceError("eval_set must be an eval set's name.", param="eval_set")
    return get_eval_set_for_user(owner=owner, id_or_name=str(value))


def get_eval_set_for_user(*, owner: Any, id_or_name: str) -> EvalSet:
    """One of the sets the user may see, by name (their own before the operator's of the
    same name) or id; another user's is not found, as one that does not exist."""
    found = None
    if storable_id(id_or_name):
        found = (sets_for(owner).filter(name=id_or_name)
                 .order_by(F("owner_id").asc(nulls_last=True)).first())
        if found is None and (match := _SET_ID.fullmatch(id_or_name)):
            found = sets_for(owner).filter(pk=int(match.group(1))).first()
    if found is None:
        raise not_found("eval set", id_or_name)
    return found


def _option(value: Any, *, param: str, default: float, low: float,
            high: float | None) -> float:
    if value is None:
        return default
    if not isinstance(value, int | float) or isinstance(value, bool) or not (
            math.isfinite(value) and low <= value <= (math.inf if high is None else high)):
        bounds = f"{low:g} or more" if high is None else f"from {low:g} to {high:g}"
        raise ServiceError(f"{param} must be a number, {bounds}.", param=param)
    return float(value)


def _heavy_turn(owner: Any) -> heavy.Guard:
    """A set is checked line by line and stored: one of a user's at a time (429)."""
    return heavy.one_per_user_or_refuse(owner.pk, doing="creating an eval set")


def create_own_eval_set(*, owner: Any, name: Any, path: str | Path, rule: Any,
                        **options: Any) -> EvalSet:
    """A user's own set (the dashboard), from a local JSONL the caller owns: the rule's
    options checked as a client may send them, at most MAX_OWN_SETS a user, its bytes in
    their stored-bytes quota. Only the operator's sets watch models (the admin)."""
    with _heavy_turn(owner):
        return _create_own(owner=owner, name=name, path=path, rule=rule, **options)


def _create_own(*, owner: Any, name: Any, path: str | Path, rule: Any,
                tolerance: Any = None, embedding_model: Any = None,
                similarity: Any = None, drift_threshold: Any = None) -> EvalSet:
    if not isinstance(rule, str):
        raise ServiceError(f"rule must be one of {', '.join(eval_rules.RULES)}.", param="rule")
    if embedding_model is not None and not isinstance(embedding_model, str):
        raise ServiceError("embedding_model must be a served embeddings model's name.",
                           param="embedding_model")
    checked_tolerance = _option(tolerance, param="tolerance", default=0.0, low=0, high=None)
    checked_similarity = _option(similarity, param="similarity", default=0.9, low=-1, high=1)
    checked_threshold = _option(drift_threshold, param="drift_threshold", default=0.05, low=0,
                                high=1)
    limit = settings.BATCHWEB["MAX_FILE_BYTES"]
    size = Path(path).stat().st_size
    if size > limit:
        raise ServiceError(f"The file is larger than {limit} bytes.", status=413,
                           code="file_too_large", param="file")
    _admit_own_set(owner=owner, size=size, lock=False)
    return create_eval_set(name=name, path=path, rule=rule, owner=owner,
                           tolerance=checked_tolerance, embedding_model=embedding_model or "",
                           similarity=checked_similarity, drift_threshold=checked_threshold)


def create_eval_set_from_file(*, owner: Any, file_id: Any, **fields: Any) -> EvalSet:
    """A user's own set from one of their uploaded files (purpose batch): its content is
    copied into the set, which then lives on whether the file is deleted or expires."""
    if not isinstance(file_id, str) or not file_id:
        raise ServiceError("file_id is required: upload the set's JSONL with purpose "
                           "'batch'.", param="file_id")
    file = get_file_for_user(owner=owner, file_id=file_id)
    if file.purpose != File.Purpose.BATCH:
        raise ServiceError("The file must be one you uploaded (purpose 'batch').",
                           param="file_id")
    check_source_readable(file=file, param="file_id")
    with _heavy_turn(owner), local_temp(".evalset") as path:
        with open(path, "wb") as target, open_file(file) as stream:
            shutil.copyfileobj(stream, target)
        return _create_own(owner=owner, path=path, **fields)


def delete_eval_set(*, eval_set: EvalSet, user: Any) -> None:
    """Delete one of the user's own sets; its runs go with it (a batch object keeps their
    summaries), and its stored file and the runs' results are removed once the deletion
    commits (jobs.models' post_delete receivers, whoever deletes). Refused (409) while a
    batch that has not ended has it attached, or a run of it is not scored yet: that run
    reads the set's file when it starts and when it is scored."""
    if eval_set.owner_id is None or eval_set.owner_id != user.pk:
        raise ServiceError("Only the operator deletes the operator's eval sets.",
                           status=403, code="permission_denied")
    with transaction.atomic():
        # Held until the deletion commits: a batch attaching the set waits for it.
        locked = EvalSet.objects.select_for_update().filter(pk=eval_set.pk).first()
        if locked is None:
            return
        busy = (Batch.objects.active().filter(eval_set=locked).values_list("pk", flat=True)
                .first()) or (EvalRun.objects.filter(
                    eval_set=locked, status__in=(EvalRun.Status.RUNNING,
                                                 EvalRun.Status.SCORING))
                    .values_list("batch_id", flat=True).first())
        if busy:
            raise wrong_state(f"The eval set {locked.name!r} runs beside {busy}, which has "
                              "not ended: delete it once the batch ends.")
        locked.delete()


def eval_ceiling(*, eval_set: EvalSet, model: str, first_model: str | None,
                 guard: heavy.Guard | None = None) -> Estimate:
    """The most a run of the set beside a batch of `model` could cost: its requests as the
    run sends them (named `first_model`, the batch's first request's model), priced as
    that model's (jobs.services.budgets). A pass over the set (streamed: it holds at most
    MAX_ITEMS) made under `guard` only the first time: a stored set never changes, so its
    tokens are cached by its content, the model as served and this deployment's limits;
    the price is applied to them at every call."""
    from jobs.lib.model_registry import model_spec

    named = first_model or model

    def count() -> list[int]:
        room = room_for(model)
        tokens = [0, 0]
        with open_range(eval_set.storage_name, 0) as stream:
            for _, item in _lines(stream):
                line = RequestLine(item["custom_id"], eval_set.url,
                                   {**item["body"], "model": named})
                tokens = [a + b for a, b in zip(tokens, ceiling(line, room), strict=True)]
        return tokens

    depends = heavy.version(eval_set.sha256, named, model_spec(model),
                            sorted(settings.BATCHWEB.items()))
    tokens = heavy.cached(f"evalceiling:{eval_set.pk}:{depends}", count, guard=guard)
    return estimate(model=model, ceilings={named: tokens})


# --- runs ---


def batch_sampling(batch: Batch) -> tuple[str, dict[str, Any]]:
    """The model the batch's first request names (the batch's model or one of its adapters)
    and its sampling fields: what the set's requests run with."""
    with open_file(batch.input_file) as stream:
        for _, request in _lines(stream):
            body = request.get("body") if isinstance(request, dict) else None
            if isinstance(body, dict) and isinstance(body.get("model"), str):
                return body["model"], {k: body[k] for k in SAMPLING_FIELDS if k in body}
    return batch.model, {}


def start_runs(*, batch: Batch, serving_key: str, watch: bool) -> list[str] | None:
    """The runs a claim of one of the batch's shards starts: for the set its owner attached
    (once per batch), and with `watch`, for every operator's set watching the batch's model
    that has not run for this serving key yet (once per set and key). Returns their ids;
    None for a batch that starts none (a run's own batch, one being stopped)."""
    if batch.owner_id == eval_user().pk or batch.is_ended or batch.stop_code:
        return None
    wanted: list[tuple[EvalSet, str]] = []
    if batch.eval_set is not None and not EvalRun.objects.filter(
            batch=batch, eval_set_id=batch.eval_set_id,
            trigger=EvalRun.Trigger.BATCH).exists():
        wanted.append((batch.eval_set, EvalRun.Trigger.BATCH))
    if watch:
        # An operator's sets are few: their lists are read here rather than queried.
        for eval_set in EvalSet.objects.filter(owner__isnull=True):
            if batch.model in (eval_set.watch_models or ()) and not EvalRun.objects.filter(
                    eval_set=eval_set, serving_key=serving_key).exists():
                wanted.append((eval_set, EvalRun.Trigger.MODEL))
    started = []
    for eval_set, trigger in wanted:
        run = _start_run(eval_set=eval_set, batch=batch, trigger=trigger,
                         serving_key=serving_key if trigger == EvalRun.Trigger.MODEL else "")
        if run is not None:
            started.append(run.pk)
    return started


def _start_run(*, eval_set: EvalSet, batch: Batch, trigger: str,
               serving_key: str) -> EvalRun | None:
    """Create the run (None when another worker did) and its batch, whose validation is
    enqueued; a run that cannot start is recorded with its error."""
    model, sampling = batch_sampling(batch)
    if eval_set.url != batch.endpoint:
        sampling = {}  # another endpoint's fields may mean other things there
    try:
        with transaction.atomic():
            run = EvalRun.objects.create(
                eval_set=eval_set, batch=batch, trigger=trigger, serving_key=serving_key,
                base_model=batch.model, model=model, sampling=sampling,
                items=eval_set.item_count)
    except IntegrityError:
        return None
    try:
        run_batch = _run_batch(run, eval_set, batch)
    except Exception as exc:
        log.exception("eval run %s could not start", run.pk)
        # Shown on the batch page: never the storage's address (the log has it).
        EvalRun.objects.filter(pk=run.pk).update(status=EvalRun.Status.ERROR,
                                                 error=shown_reason(exc))
        refresh_batch(batch_id=batch.pk)
        return run
    EvalRun.objects.filter(pk=run.pk).update(run_batch=run_batch)
    refresh_batch(batch_id=batch.pk)
    run_batch_id = run_batch.pk
    transaction.on_commit(lambda: queues.enqueue_control(
        "jobs.tasks.validate_batch", run_batch_id, suffix="validate"), robust=True)
    return run


def _run_batch(run: EvalRun, eval_set: EvalSet, batch: Batch) -> Batch:
    """The run's requests as a batch input (streamed through a local file) and its batch."""
    owner = eval_user()
    with local_temp(".jsonl") as path:
        with open(path, "wb") as out, open_range(eval_set.storage_name, 0) as stream:
            for _, item in _lines(stream):
                body = {**item["body"], "model": run.model, **run.sampling}
                out.write(json.dumps({"custom_id": item["custom_id"], "method": "POST",
                                      "url": eval_set.url, "body": body}).encode() + b"\n")
        file = store_file(owner=owner, source_path=path, filename=f"{run.pk}.jsonl",
                          purpose=File.Purpose.BATCH, expires_at=batch.expires_at)
    return Batch.objects.create(
        owner=owner, endpoint=eval_set.url, input_file=file, priority=batch.priority,
        completion_window=batch.completion_window, expires_at=batch.expires_at,
        metadata={"eval_run": run.pk, "batch": batch.pk},
        # Read once, when the run is scored (its rows are then kept with the run).
        output_expires_after=RUN_FILES_SECONDS)


def batch_ended(*, batch_id: str) -> None:
    """A batch ended (the finalizer, or validation failing it): score the eval runs that
    were waiting for it, or stop those it no longer needs."""
    run = EvalRun.objects.filter(run_batch_id=batch_id).first()
    runs = [run] if run is not None else list(EvalRun.objects.filter(
        batch_id=batch_id, status=EvalRun.Status.RUNNING))
    for run in runs:
        try:
            settle(run_id=run.pk)
        except Exception:
            log.exception("eval run %s: scoring failed", run.pk)
            EvalRun.objects.filter(pk=run.pk, status=EvalRun.Status.SCORING).update(
                status=EvalRun.Status.ERROR, error="scoring failed; see the worker's log")
            refresh_batch(batch_id=run.batch_id)


def settle_due() -> int:
    """The reconciler's pass: settle the running runs whose batch has ended (the
    finalizer's own call failed, or the run's batch ended first). Returns how many changed."""
    changed = 0
    for run_id in EvalRun.objects.filter(status=EvalRun.Status.RUNNING,
                                         batch__status__in=Batch.ENDED).values_list(
            "pk", flat=True):
        changed += settle(run_id=run_id).status != EvalRun.Status.RUNNING
    return changed


def settle(*, run_id: str) -> EvalRun:
    """Score a running run once both batches have ended; stop it when either ended without
    completing (cancelling the run's batch if the batch is gone). Idempotent: only one
    caller takes a run from running."""
    from jobs.services.stopping import cancel_batch

    run = EvalRun.objects.select_related("batch", "run_batch", "eval_set").get(pk=run_id)
    if run.status != EvalRun.Status.RUNNING:
        return run
    batch, run_batch = run.batch, run.run_batch
    if run_batch is None:  # its worker died between the run's row and its batch
        if batch.is_ended:
            EvalRun.objects.filter(pk=run.pk, status=EvalRun.Status.RUNNING).update(
                status=EvalRun.Status.ERROR, error="its requests never started")
            refresh_batch(batch_id=batch.pk)
        return run
    if batch.is_ended and batch.status != Batch.Status.COMPLETED and not run_batch.is_ended:
        with contextlib.suppress(ServiceError):  # it ended meanwhile
            cancel_batch(batch=run_batch)
        return run
    if not (batch.is_ended and run_batch.is_ended):
        return run
    if batch.status != Batch.Status.COMPLETED or run_batch.status != Batch.Status.COMPLETED:
        EvalRun.objects.filter(pk=run.pk, status=EvalRun.Status.RUNNING).update(
            status=EvalRun.Status.STOPPED,
            error=f"the batch ended {batch.status}, its eval requests {run_batch.status}")
        refresh_batch(batch_id=batch.pk)
        return EvalRun.objects.get(pk=run.pk)
    if not EvalRun.objects.filter(pk=run.pk, status=EvalRun.Status.RUNNING).update(
            status=EvalRun.Status.SCORING):
        return run
    _score(run)
    return EvalRun.objects.get(pk=run.pk)


# --- scoring ---


def _answers(run_batch: Batch, url: str) -> dict[str, str | None]:
    """custom_id -> the answer's text (None for a request that failed), streamed from the
    run's output and error files."""
    answers: dict[str, str | None] = {}
    for file, ok in ((run_batch.output_file, True), (run_batch.error_file, False)):
        if file is None:
            continue
        with open_file(file) as stream:
            for _, line in _lines(stream):
                body = (line.get("response") or {}).get("body") or {}
                texts = output_texts(url, body) if ok else []
                answers[line["custom_id"]] = texts[0][0][:ANSWER_CHARS] if texts else None
    return answers


def _score(run: EvalRun) -> None:
    eval_set = run.eval_set
    assert run.run_batch is not None  # settled only once it ended
    answers = _answers(run.run_batch, eval_set.url)
    items: list[tuple[str, Any, str | None]] = []
    with open_range(eval_set.storage_name, 0) as stream:
        for _, item in _lines(stream):
            items.append((item["custom_id"], item["expected"], answers.get(item["custom_id"])))
    if eval_set.rule == eval_rules.EMBEDDING:
        verdicts = _similar(eval_set, items)
    else:
        verdicts = [answer is not None and eval_rules.passes(
            eval_set.rule, answer, expected, tolerance=eval_set.tolerance)
            for _, expected, answer in items]
    results_name = default_storage.save(f"evals/{run.pk}.jsonl", ContentFile(b"".join(
        json.dumps({"custom_id": cid, "answer": answer, "passed": ok}).encode() + b"\n"
        for (cid, _, answer), ok in zip(items, verdicts, strict=True))))
    passed = sum(verdicts)
    score = passed / len(items) if items else 0.0
    baseline = (baselines(run).filter(status=EvalRun.Status.SCORED, accepted_at__isnull=False)
                .exclude(pk=run.pk).order_by("-accepted_at").first())
    changed: list[dict[str, Any]] = []
    changed_count = 0
    if baseline is not None:
        before = _results(baseline)
        for (cid, _, answer), ok in zip(items, verdicts, strict=True):
            old = before.get(cid)
            if old is None or old["answer"] != answer:
                changed_count += 1
                if len(changed) < CHANGED_SHOWN:
                    changed.append({"custom_id": cid, "before": old and old["answer"],
                                    "after": answer, "passed_before": old and old["passed"],
                                    "passed_after": ok})
    drifted = baseline is not None and (
        (baseline.score or 0.0) - score > eval_set.drift_threshold + 1e-9)
    now = timezone.now()
    EvalRun.objects.filter(pk=run.pk).update(
        status=EvalRun.Status.SCORED, passed=passed, items=len(items), score=score,
        results_name=results_name, baseline=baseline,
        baseline_score=baseline.score if baseline else None, changed=changed,
        changed_count=changed_count, drifted=drifted, scored_at=now,
        # The first run of a set on a model is its baseline until another is accepted.
        accepted_at=None if baseline else now)
    refresh_batch(batch_id=run.batch_id)
    if drifted:
        from jobs.services.webhooks import batch_event

        batch_event(batch_id=run.batch_id, type=DRIFT_EVENT)


def baselines(run: EvalRun) -> Any:
    """The runs `run` may be compared with: of its set and model, and of its owner (a run
    the user attached compares only with that user's runs, whose answers they may see; an
    operator's watching set, only with the watching runs)."""
    runs = EvalRun.objects.filter(eval_set_id=run.eval_set_id, base_model=run.base_model,
                                  trigger=run.trigger)
    if run.trigger == EvalRun.Trigger.BATCH:
        runs = runs.filter(batch__owner_id=run.batch.owner_id)
    return runs


def _similar(eval_set: EvalSet, items: list[tuple[str, Any, str | None]]) -> list[bool]:
    """The embedding rule: each answer and its expected text embedded with the set's
    embeddings model (loaded in this process, as moderation rules are)."""
    from jobs.policy.embedding_rule import embed

    verdicts = []
    chunk = 128
    for start in range(0, len(items), chunk):
        part = items[start:start + chunk]
        texts = [text for _, expected, answer in part for text in (answer or "", expected)]
        vectors = embed(eval_set.embedding_model, texts)
        for index, (_, _, answer) in enumerate(part):
            verdicts.append(answer is not None and eval_rules.similar(
                vectors[2 * index], vectors[2 * index + 1], threshold=eval_set.similarity))
    return verdicts


def _results(run: EvalRun) -> dict[str, dict[str, Any]]:
    """A scored run's answers and verdicts by custom_id."""
    if not run.results_name:
        return {}
    with open_range(run.results_name, 0) as stream:
        return {row["custom_id"]: row for _, row in _lines(stream)}


def run_results(run: EvalRun) -> Iterator[dict[str, Any]]:
    """A scored run's rows ({"custom_id", "answer", "passed"}), in the set's order."""
    if not run.results_name:
        return
    with open_range(run.results_name, 0) as stream:
        for _, row in _lines(stream):
            yield row


def refresh_batch(*, batch_id: str) -> None:
    """Copy the batch's runs' summaries onto its row (what its API object and pages show)."""
    runs = list(EvalRun.objects.filter(batch_id=batch_id).select_related("eval_set")
                .order_by("created_at"))
    Batch.objects.filter(pk=batch_id).update(
        evaluations=[run.summary() for run in runs],
        eval_drift=any(run.drifted for run in runs))


def accept_run(*, run: EvalRun, user: Any) -> EvalRun:
    """Make a scored run the baseline of its set on its model (later runs compare with it)."""
    if not run.may_be_accepted_by(user):
        raise ServiceError("Only an operator or the set's owner may accept a run.",
                           status=403, code="permission_denied")
    if run.status != EvalRun.Status.SCORED:
        raise ServiceError("Only a scored run can be accepted.", status=409,
                           code="invalid_state")
    EvalRun.objects.filter(pk=run.pk).update(accepted_at=timezone.now(), accepted_by=user)
    refresh_batch(batch_id=run.batch_id)
    return EvalRun.objects.get(pk=run.pk)
