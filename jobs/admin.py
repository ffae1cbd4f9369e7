"""The operators' view. Rows whose fields carry invariants (ids, states, byte ranges) are
read-only here: state changes go through the same services the API uses, as actions."""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils import timezone

from jobs.models import ApiKey, Batch, File, Shard, Upload
from jobs.services import ServiceError
from jobs.services.batches import cancel_batch, enqueue_next_shards, with_progress
from jobs.services.keys import create_api_key, revoke_api_key


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    list_display = ["name", "owner", "prefix", "created_at", "last_used_at", "revoked_at"]
    list_filter = [("revoked_at", admin.EmptyFieldListFilter)]
    search_fields = ["name", "prefix", "owner__username"]
    readonly_fields = ["prefix", "created_at", "last_used_at", "revoked_at"]
    fields = ["owner", "name", "prefix", "created_at", "last_used_at", "revoked_at"]
    actions = ["revoke"]

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        # A key's owner and name are set once, when it is created.
        return [*self.readonly_fields, "owner", "name"] if obj else self.readonly_fields

    def save_model(self, request: HttpRequest, obj: ApiKey, form: Any, change: bool) -> None:
        if change:
            return
        key, secret = create_api_key(owner=obj.owner, name=obj.name)
        obj.pk = key.pk
        messages.warning(request, f"The new key is {secret} — copy it now, it is not shown "
                                  "again.")

    @admin.action(description="Revoke selected keys")
    def revoke(self, request: HttpRequest, queryset: QuerySet[ApiKey]) -> None:
        for key in queryset:
            revoke_api_key(key=key)
        self.message_user(request, f"Revoked {queryset.count()} key(s).")


@admin.register(File)
class FileAdmin(admin.ModelAdmin):
    list_display = ["id", "owner", "purpose", "filename", "bytes", "line_count", "created_at",
                    "expires_at"]
    list_filter = ["purpose", "created_at"]
    search_fields = ["id", "filename", "owner__username", "sha256"]
    readonly_fields = [f.name for f in File._meta.fields]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False


@admin.register(Upload)
class UploadAdmin(admin.ModelAdmin):
    list_display = ["id", "owner", "filename", "bytes", "status", "created_at", "expires_at"]
    list_filter = ["status"]
    search_fields = ["id", "filename", "owner__username"]
    readonly_fields = [f.name for f in Upload._meta.fields]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False


class ShardInline(admin.TabularInline):
    model = Shard
    fields = ["index", "status", "attempt", "failures", "worker", "completed", "failed",
              "started_at", "finished_at", "last_error"]
    readonly_fields = fields
    extra = 0
    can_delete = False
    show_change_link = True

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(Batch)
class BatchAdmin(admin.ModelAdmin):
    list_display = ["id", "owner", "model", "endpoint", "status", "priority", "total",
                    "completed", "failed", "created_at"]
    list_filter = ["status", "priority", "endpoint", "model"]
    search_fields = ["id", "owner__username", "input_file__id"]
    readonly_fields = [f.name for f in Batch._meta.fields if f.name != "priority"]
    inlines = [ShardInline]
    actions = ["cancel", "requeue_shards"]

    def get_queryset(self, request: HttpRequest) -> QuerySet[Batch]:
        return with_progress(super().get_queryset(request).select_related("owner"))

    @admin.display(description="completed")
    def completed(self, obj: Batch) -> int:
        return obj.progress()["completed"]

    @admin.display(description="failed")
    def failed(self, obj: Batch) -> int:
        return obj.progress()["failed"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    @admin.action(description="Cancel selected batches")
    def cancel(self, request: HttpRequest, queryset: QuerySet[Batch]) -> None:
        done = 0
        for batch in queryset:
            try:
                cancel_batch(batch=batch)
                done += 1
            except ServiceError as exc:
                self.message_user(request, f"{batch.pk}: {exc.message}", messages.WARNING)
        self.message_user(request, f"Cancelling {done} batch(es).")

    @admin.action(description="Requeue stuck or failed shards now")
    def requeue_shards(self, request: HttpRequest, queryset: QuerySet[Batch]) -> None:
        """Shards waiting for a retry run now; shards whose job was lost get a new one."""
        count = 0
        for batch in queryset.filter(status=Batch.Status.IN_PROGRESS):
            count += Shard.objects.filter(batch=batch, status=Shard.Status.QUEUED).update(
                not_before=None, enqueued_at=None)
            enqueue_next_shards(batch_id=batch.pk)
        self.message_user(request, f"Requeued {count} shard(s) at {timezone.now():%H:%M:%S}.")


@admin.register(Shard)
class ShardAdmin(admin.ModelAdmin):
    list_display = ["__str__", "status", "attempt", "failures", "worker", "completed", "failed",
                    "heartbeat_at", "started_at", "finished_at"]
    list_filter = ["status"]
    search_fields = ["id", "batch__id", "worker"]
    readonly_fields = [f.name for f in Shard._meta.fields]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False
