"""Files page: uploaded and produced files, download and delete."""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.paginator import Paginator
from django.http import Http404, HttpResponse
from django.http.response import HttpResponseBase
from django.shortcuts import redirect, render
from django.views.decorators.http import require_GET, require_POST

from jobs.http.web import SignedInRequest, download_response
from jobs.lib.errors import ServiceError
from jobs.models import File
from jobs.services.files import delete_file, get_file_for_user

PAGE_SIZE = 25


def _get_file_for_user(request: SignedInRequest, file_id: str) -> File:
    try:
        return get_file_for_user(owner=request.user, file_id=file_id)
    except ServiceError:
        raise Http404("No such file.") from None


@login_required
@require_GET
def file_list(request: SignedInRequest) -> HttpResponse:
    files = File.objects.filter(owner=request.user)
    purpose = request.GET.get("purpose", "")
    if purpose in File.Purpose.values:
        files = files.filter(purpose=purpose)
    else:
        purpose = ""
    page = Paginator(files, PAGE_SIZE).get_page(request.GET.get("page"))
    return render(request, "jobs/file_list.html", {
        "page": page, "purpose": purpose, "purposes": File.Purpose.values})


@login_required
@require_GET
def file_download(request: SignedInRequest, file_id: str) -> HttpResponseBase:
    try:
        return download_response(_get_file_for_user(request, file_id))
    except ServiceError as exc:  # a file read in place whose object was replaced
        messages.error(request, exc.message)
        return redirect("file_list")


@login_required
@require_POST
def file_delete(request: SignedInRequest, file_id: str) -> HttpResponse:
    file = _get_file_for_user(request, file_id)
    try:
        delete_file(file=file)
        messages.success(request, f"Deleted {file.filename}.")
    except ServiceError as exc:
        messages.error(request, exc.message)
    return redirect("file_list")
