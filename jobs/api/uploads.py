"""/v1/uploads"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse

from jobs.api.base import api_view, check_upload_size, json_body, multipart_file
from jobs.http.web import uploaded_path
from jobs.services import uploads


def create(request: HttpRequest, user: Any) -> HttpResponse:
    body = json_body(request)
    upload = uploads.create_upload(owner=user, filename=body.get("filename"),
                                   purpose=body.get("purpose"), bytes=body.get("bytes"),
                                   mime_type=body.get("mime_type"),
                                   expires_after=body.get("expires_after"))
    return JsonResponse(upload.to_openai())


def add_part(request: HttpRequest, user: Any, upload_id: str) -> HttpResponse:
    upload = uploads.get_upload_for_user(owner=user, upload_id=upload_id)
    check_upload_size(request, settings.BATCHWEB["MAX_UPLOAD_PART_BYTES"])
    data = multipart_file(request, "data")
    with uploaded_path(data) as path:
        part = uploads.add_upload_part(upload=upload, path=path)
    return JsonResponse(part.to_openai())


def complete(request: HttpRequest, user: Any, upload_id: str) -> HttpResponse:
    upload = uploads.get_upload_for_user(owner=user, upload_id=upload_id)
    body = json_body(request)
    upload = uploads.complete_upload(upload=upload, part_ids=body.get("part_ids"),
                                     md5=body.get("md5"))
    return JsonResponse(upload.to_openai())


def cancel(request: HttpRequest, user: Any, upload_id: str) -> HttpResponse:
    upload = uploads.get_upload_for_user(owner=user, upload_id=upload_id)
    return JsonResponse(uploads.cancel_upload(upload=upload).to_openai())


upload_create = api_view({"POST": create})
upload_parts = api_view({"POST": add_part})
upload_complete = api_view({"POST": complete})
upload_cancel = api_view({"POST": cancel})
