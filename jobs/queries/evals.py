"""What the batch page shows of what ran a batch and of its eval runs: each distinct engine
record of its workers (provenance, `engines_of`), and each run's score beside its
baseline's, with the items whose answers changed side by side (`batch_record`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from jobs.models import Batch, EvalRun, without_hosts


@dataclass
class RunView:
    run: EvalRun
    baseline: EvalRun | None
    # The baseline's batch, when the viewer's own (an operator's watching set compares
    # runs beside other users' batches: their ids are not shown).
    baseline_batch: str | None = None
    changed: list[dict[str, Any]] = field(default_factory=list)
    may_accept: bool = False

    @property
    def drop(self) -> float | None:
        if self.run.score is None or self.run.baseline_score is None:
            return None
        return self.run.baseline_score - self.run.score


@dataclass
class BatchRecord:
    runs: list[RunView]


@dataclass
class Engines:
    """What ran a batch, as its page shows it: each distinct engine record of its workers
    (`consistent` when they agree). Part of the live block, which a worker's first claim
    changes (the batch's version counts its provenance)."""

    provenance: list[dict[str, Any]]

    @property
    def consistent(self) -> bool:
        return len(self.provenance) <= 1


def engines_of(batch: Batch, *, user: Any) -> Engines:
    # The workers' names and local paths are for staff: an owner sees the engine records.
    entries = batch.provenance or []
    return Engines(provenance=entries if user.is_staff else without_hosts(entries))


def batch_record(batch: Batch, *, user: Any) -> BatchRecord:
    runs = []
    for run in (EvalRun.objects.filter(batch=batch)
                .select_related("eval_set", "baseline", "baseline__batch", "run_batch")
                .order_by("created_at")):
        baseline = run.baseline
        runs.append(RunView(run=run, baseline=baseline, changed=run.changed,
                            baseline_batch=baseline.batch_id if baseline is not None and (
                                baseline.batch.owner_id == batch.owner_id or user.is_staff)
                            else None,
                            may_accept=(run.status == EvalRun.Status.SCORED
                                        and run.accepted_at is None
                                        and run.may_be_accepted_by(user))))
    return BatchRecord(runs=runs)
