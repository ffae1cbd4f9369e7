"""The dashboard's pages (thin: every rule lives in jobs.services)."""

from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

from jobs.models import Batch
from jobs.services.batches import with_progress


@login_required
def batch_list(request: HttpRequest) -> HttpResponse:
    batches = with_progress(Batch.objects.filter(owner=request.user))[:50]
    return render(request, "jobs/batch_list.html", {"batches": batches})
