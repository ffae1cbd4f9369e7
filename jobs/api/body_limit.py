"""Refuse request bodies larger than anything the service accepts, before any of the body
is read: the CSRF check and Django's multipart parser would otherwise stream a multi-GB
upload to disk first (the API views check their own, smaller limits the same way)."""

from __future__ import annotations

from collections.abc import Callable

from django.conf import settings
from django.http import HttpRequest, HttpResponse

from jobs.api.base import dialect_of
from jobs.http.web import declared_length
from jobs.lib.errors import ServiceError

# Multipart framing and form fields around the file.
SLACK = 1024 * 1024


def max_body_bytes() -> int:
    conf = settings.BATCHWEB
    return max(conf["MAX_FILE_BYTES"], conf["MAX_UPLOAD_PART_BYTES"],
               conf["MESSAGE_BATCH_MAX_BYTES"]) + SLACK


class BodySizeLimitMiddleware:
    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        limit = max_body_bytes()
        if declared_length(request) > limit:
            message = f"The request body is larger than {limit} bytes."
            dialect = dialect_of(request.path)
            if dialect is not None:  # the API's own error shape, OpenAI's or Anthropic's
                return dialect.render(ServiceError(message, status=413,
                                                   code="file_too_large"))
            return HttpResponse(message, status=413, content_type="text/plain")
        return self.get_response(request)
