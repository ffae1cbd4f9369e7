from django.urls import path

from jobs.api import batches, eval_sets, files, message_batches, models, uploads, usage
from jobs.http import polls
from jobs.http.polls import polled

urlpatterns = [
    path("files", files.files),
    path("files/<str:file_id>", files.file_detail),
    path("files/<str:file_id>/content", files.content),
    path("uploads", uploads.upload_create),
    path("uploads/<str:upload_id>/parts", uploads.upload_parts),
    path("uploads/<str:upload_id>/complete", uploads.upload_complete),
    path("uploads/<str:upload_id>/cancel", uploads.upload_cancel),
    # Polled: a GET may be answered from Django's last answer (jobs/http/polls.py).
    path("batches", polled(batches.batch_list, polls.api_list)),
    path("batches/<str:batch_id>", polled(batches.batch_detail, polls.api_batch)),
    path("batches/<str:batch_id>/cancel", batches.batch_cancel),
    path("batches/<str:batch_id>/results", batches.batch_results),
    path("batches/<str:batch_id>/rerun", batches.batch_rerun),
    path("models", models.models),
    # OpenAI's Usage and Costs API, over the usage ledger.
    path("organization/usage/completions", usage.usage_completions),
    path("organization/usage/embeddings", usage.usage_embeddings),
    path("organization/usage/moderations", usage.usage_moderations),
    path("organization/costs", usage.organization_costs),
    # Anthropic's Message Batches API.
    path("messages/batches", message_batches.batch_list),
    path("messages/batches/<str:batch_id>", message_batches.batch_detail),
    path("messages/batches/<str:batch_id>/cancel", message_batches.batch_cancel),
    path("messages/batches/<str:batch_id>/results", message_batches.batch_results),
    path("messages/batches/<str:batch_id>/rerun", message_batches.batch_rerun),
    # Users' own eval sets (an extension).
    path("eval_sets", eval_sets.eval_set_list),
    path("eval_sets/<str:set_id>", eval_sets.eval_set_detail),
]
