from django.urls import path

from jobs.api import batches, files, message_batches, uploads

urlpatterns = [
    path("files", files.files),
    path("files/<str:file_id>", files.file_detail),
    path("files/<str:file_id>/content", files.content),
    path("uploads", uploads.upload_create),
    path("uploads/<str:upload_id>/parts", uploads.upload_parts),
    path("uploads/<str:upload_id>/complete", uploads.upload_complete),
    path("uploads/<str:upload_id>/cancel", uploads.upload_cancel),
    path("batches", batches.batch_list),
    path("batches/<str:batch_id>", batches.batch_detail),
    path("batches/<str:batch_id>/cancel", batches.batch_cancel),
    path("batches/<str:batch_id>/results", batches.batch_results),
    path("models", batches.models),
    # Anthropic's Message Batches API.
    path("messages/batches", message_batches.batch_list),
    path("messages/batches/<str:batch_id>", message_batches.batch_detail),
    path("messages/batches/<str:batch_id>/cancel", message_batches.batch_cancel),
    path("messages/batches/<str:batch_id>/results", message_batches.batch_results),
]
