from django.contrib.auth import views as auth_views
from django.urls import path

from jobs.http import polls
from jobs.http.polls import polled
from jobs.views import batches, evals, files, keys, usage

urlpatterns = [
    path("accounts/login/", auth_views.LoginView.as_view(redirect_authenticated_user=True),
         name="login"),
    path("accounts/logout/", auth_views.LogoutView.as_view(), name="logout"),
    # Polled (the table and the live block): a GET may be answered from Django's last
    # answer (jobs/http/polls.py).
    path("", polled(batches.batch_list, polls.batch_table), name="batch_list"),
    path("batches/new", batches.batch_new, name="batch_new"),
    path("batches/<str:batch_id>/", batches.batch_detail, name="batch_detail"),
    path("batches/<str:batch_id>/live", polled(batches.batch_live, polls.live_block),
         name="batch_live"),
    path("batches/<str:batch_id>/row", batches.batch_row, name="batch_row"),
    path("batches/<str:batch_id>/cancel", batches.batch_cancel, name="batch_cancel"),
    path("batches/<str:batch_id>/rerun", batches.batch_rerun, name="batch_rerun"),
    path("batches/<str:batch_id>/lines-to-fix", batches.batch_lines_to_fix,
         name="batch_lines_to_fix"),
    path("batches/<str:batch_id>/download/<str:kind>", batches.batch_download,
         name="batch_download"),
    path("batches/<str:batch_id>/errors", batches.batch_errors, name="batch_errors"),
    path("batches/<str:batch_id>/results", batches.batch_results, name="batch_results"),
    path("batches/<str:batch_id>/flags", batches.batch_flags, name="batch_flags"),
    path("batches/<str:batch_id>/spot-check", batches.batch_spot_check,
         name="batch_spot_check"),
    path("batches/<str:batch_id>/evals/<str:run_id>/accept", evals.eval_run_accept,
         name="eval_run_accept"),
    path("eval-sets/", evals.eval_set_list, name="eval_set_list"),
    path("eval-sets/<int:set_id>/delete", evals.eval_set_delete, name="eval_set_delete"),
    path("files/", files.file_list, name="file_list"),
    path("files/<str:file_id>/download", files.file_download, name="file_download"),
    path("files/<str:file_id>/delete", files.file_delete, name="file_delete"),
    path("keys/", keys.key_list, name="key_list"),
    path("keys/<int:key_id>/revoke", keys.key_revoke, name="key_revoke"),
    path("usage/", usage.usage_page, name="usage"),
    path("usage/export.csv", usage.usage_csv, name="usage_csv"),
]
