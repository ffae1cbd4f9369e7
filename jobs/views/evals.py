"""The eval runs of the batch page: accepting one as its set's baseline on its model."""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpResponse
from django.shortcuts import redirect
from django.views.decorators.http import require_POST

from jobs.errors import ServiceError
from jobs.models import EvalRun
from jobs.services import evals
from jobs.services.batches import get_batch_for_user
from jobs.web import SignedInRequest


@login_required
@require_POST
def eval_run_accept(request: SignedInRequest, batch_id: str, run_id: str) -> HttpResponse:
    """Make the run the baseline later runs of its set on its model are compared with."""
    try:
        batch = get_batch_for_user(owner=request.user, batch_id=batch_id)
    except ServiceError:
        raise Http404("No such batch.") from None
    run = EvalRun.objects.select_related("eval_set").filter(pk=run_id, batch=batch).first()
    if run is None:
        raise Http404("No such eval run.")
    try:
        evals.accept_run(run=run, user=request.user)
        messages.success(request, f"Run {run.pk} is now the baseline of "
                                  f"{run.eval_set.name} on {run.base_model}.")
    except ServiceError as exc:
        messages.error(request, exc.message)
    return redirect("batch_detail", batch_id=batch.pk)
