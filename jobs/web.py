"""Web helpers both faces share, the `/v1` API (`jobs/api/`) and the dashboard
(`jobs/views/`): an upload as a local path, and a stored file as a download."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from django.core.files.uploadedfile import UploadedFile
from django.http import FileResponse

from jobs.models import File
from jobs.services.files import local_temp, open_file


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


def download_response(file: File) -> FileResponse:
    """The file's content, streamed in chunks, always as an attachment."""
    return FileResponse(open_file(file), as_attachment=True, filename=file.filename,
                        content_type="application/jsonl")
