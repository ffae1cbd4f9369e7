"""/v1/files"""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.http.response import HttpResponseBase

from jobs.api.base import (
    api_view,
    check_upload_size,
    json_body,
    max_file_bytes,
    multipart_file,
    paginate,
)
from jobs.http.web import download_response, uploaded_path
from jobs.lib.errors import ServiceError
from jobs.models import File
from jobs.services.files import create_input_file, delete_file, get_file_for_user
from jobs.services.references import register_reference


def _expires_after(request: HttpRequest) -> Any:
    # The openai client sends nested form fields as expires_after[anchor] / [seconds].
    if "expires_after" in request.POST:
        return request.POST["expires_after"]
    anchor = request.POST.get("expires_after[anchor]")
    seconds = request.POST.get("expires_after[seconds]")
    if anchor is None and seconds is None:
        return None
    return {"anchor": anchor, "seconds": seconds}


def upload_file(request: HttpRequest, user: Any) -> HttpResponse:
    if (request.content_type or "") == "application/json":
        return register_file(request, user)
    check_upload_size(request, max_file_bytes())
    uploaded = multipart_file(request, "file")
    with uploaded_path(uploaded) as path:
        file = create_input_file(owner=user, path=path, filename=uploaded.name or "",
                                 purpose=request.POST.get("purpose"),
                                 expires_after=_expires_after(request))
    return JsonResponse(file.to_openai())


def register_file(request: HttpRequest, user: Any) -> HttpResponse:
    """An extension: `{"purpose": "batch", "source": "s3://bucket/key"}` as JSON registers
    an object of a prefix granted to the user as an input file, read in place (the openai
    client: `client.post("/files", body=..., cast_to=FileObject)`)."""
    body = json_body(request)
    if "source" not in body:
        raise ServiceError("Send the file as multipart/form-data, or name an object as "
                           "JSON {\"purpose\": \"batch\", \"source\": \"s3://bucket/key\"}.",
                           param="source")
    file = register_reference(owner=user, source=body["source"], purpose=body.get("purpose"),
                              expires_after=body.get("expires_after"))
    return JsonResponse(file.to_openai())


def list_files(request: HttpRequest, user: Any) -> HttpResponse:
    files = File.objects.filter(owner=user)
    purpose = request.GET.get("purpose")
    if purpose:
        if purpose not in File.Purpose.values:
            raise ServiceError("Unknown purpose.", param="purpose")
        # As the files are shown: batch_output lists the error files too.
        files = files.filter(purpose__in=File.stored_purposes(purpose))
    return paginate(request, files, default_limit=10000, max_limit=10000, allow_order=True)


def retrieve_file(request: HttpRequest, user: Any, file_id: str) -> HttpResponse:
    return JsonResponse(get_file_for_user(owner=user, file_id=file_id).to_openai())


def remove_file(request: HttpRequest, user: Any, file_id: str) -> HttpResponse:
    file = get_file_for_user(owner=user, file_id=file_id)
    delete_file(file=file)
    return JsonResponse({"id": file_id, "object": "file", "deleted": True})


def file_content(request: HttpRequest, user: Any, file_id: str) -> HttpResponseBase:
    file = get_file_for_user(owner=user, file_id=file_id)
    return download_response(file)


files = api_view({"GET": list_files, "POST": upload_file})
file_detail = api_view({"GET": retrieve_file, "DELETE": remove_file})
content = api_view({"GET": file_content})
