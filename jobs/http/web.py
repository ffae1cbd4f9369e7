"""Web helpers both faces share, the `/v1` API (`jobs/api/`) and the dashboard
(`jobs/views/`): the sizes of their lists' pages, a request's declared size, an upload as a
local path, a stored file as a download, and the marks of a polled route and of an answer
the poll memo may replay (jobs/http/polls.py)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from django.contrib.auth.models import User
from django.core.files.uploadedfile import UploadedFile
from django.http import FileResponse, HttpRequest, HttpResponseRedirect
from django.http.response import HttpResponseBase
from django_htmx.middleware import HtmxDetails

from jobs.lib.errors import ServiceError
from jobs.models import File
from jobs.services.grants import check_source_readable
from jobs.storage.external import ObjectChanged
from jobs.storage.objects import download_url, open_file
from jobs.storage.temp import local_temp

# The API's paths (the /v1 views, and what pages alone need skips them).
API_PREFIX = "/v1/"
# The first page of GET /v1/batches: its default size, and the largest a client may ask for.
LIST_LIMIT = 20
LIST_MAX_LIMIT = 100
# Batches a page of the dashboard's list shows.
LIST_PAGE_SIZE = 20

class SignedInRequest(HttpRequest):
    """What a dashboard view behind `login_required` gets, for the type checker: a real
    user, and django-htmx's `htmx` details (its middleware sets them on every request)."""

    user: User
    htmx: HtmxDetails


def declared_length(request: HttpRequest) -> int:
    """The body size the client declared (Content-Length); 0 when absent or malformed, in
    which case Django's own limits apply as the body is read."""
    try:
        return max(0, int(request.META.get("CONTENT_LENGTH") or 0))
    except ValueError:
        return 0


@contextmanager
def uploaded_path(uploaded: UploadedFile) -> Iterator[Path]:
    """A local path holding the upload: Django's own temporary file when it spilled to disk,
    else a copy of the small in-memory upload."""
    if hasattr(uploaded, "temporary_file_path"):
        yield Path(uploaded.temporary_file_path())
        return
    with local_temp() as path:
        with open(path, "wb") as handle:
            for chunk in uploaded.chunks():
                handle.write(chunk)
        yield path


def download_response(file: File) -> HttpResponseBase:
    """The file's content, streamed in chunks, always as an attachment; or, with
    DOWNLOAD_REDIRECT on object storage, a redirect to a presigned URL of a few seconds
    (callers have checked the owner). A file registered by reference only while its
    owner's grant still lets them read it (jobs.services.grants)."""
    check_source_readable(file=file, param="file_id")
    url = download_url(file)
    if url:
        return HttpResponseRedirect(url)
    try:
        stream = open_file(file)
    except ObjectChanged as exc:  # a file registered by reference, replaced since
        raise ServiceError(f"{exc} It cannot be downloaded as this file any more.",
                           status=409, code="source_changed") from None
    response = FileResponse(stream, as_attachment=True, filename=file.filename,
                            content_type="application/jsonl")
    if "Content-Length" not in response:  # a stream from object storage has no size
        response["Content-Length"] = str(file.bytes)
    return response
