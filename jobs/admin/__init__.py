"""The operators' view. Rows whose fields carry invariants (ids, states, byte ranges) are
read-only here: state changes go through the same services the API uses, as actions."""

from __future__ import annotations

from typing import Any

from django import forms
from django.conf import settings
from django.contrib import admin, messages
from django.contrib.auth import get_user_model
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import URLPattern, path
from django.utils import timezone
from django.utils.cache import add_never_cache_headers

from jobs.lib.errors import ServiceError
from jobs.lib.model_registry import model_specs, serves_adapters
from jobs.models import (
    ApiKey,
    Batch,
    ContentRule,
    File,
    LoraAdapter,
    Price,
    Quota,
    Shard,
    StorageGrant,
    Upload,
    UsageRecord,
    UserSettings,
    WebhookDelivery,
    WebhookEvent,
)
from jobs.queries.queue_health import queue_health
from jobs.services.cleanup import delete_expired_files
from jobs.services.delivery import deliver_again
from jobs.services.keys import create_api_key, revoke_api_key
from jobs.services.stopping import cancel_batch
from jobs.services.upkeep import requeue_shards
from jobs.services.webhooks import enqueue_delivery, retry_now


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

    def formfield_for_foreignkey(self, db_field: Any, request: HttpRequest,
                                 **kwargs: Any) -> Any:
        # A key acts as its owner: only a superuser may mint one for somebody else.
        if db_field.name == "owner" and not request.user.is_superuser:
            kwargs["queryset"] = get_user_model().objects.filter(
                username=request.user.get_username())
        return super().formfield_for_foreignkey(db_field, request, **kwargs)

    def save_model(self, request: HttpRequest, obj: ApiKey, form: Any, change: bool) -> None:
        if change:
            return
        key, secret = create_api_key(owner=obj.owner, name=obj.name)
        obj.pk = key.pk
        request.new_api_key_secret = secret  # type: ignore[attr-defined]  # for response_add

    def response_add(self, request: HttpRequest, obj: ApiKey,
                     post_url_continue: str | None = None) -> HttpResponse:
        # The secret is shown on this response alone: not in a messages cookie or the session,
        # which outlive the page, and never cached.
        context = {**self.admin_site.each_context(request), "title": "New API key",
                   "opts": self.model._meta, "key": obj,
                   "secret": getattr(request, "new_api_key_secret", "")}
        response = TemplateResponse(request, "admin/jobs/apikey/created.html", context)
        add_never_cache_headers(response)
        return response

    @admin.action(description="Revoke selected keys", permissions=["change"])
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
    actions = ["delete_expired"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    @admin.action(description="Delete selected files that have expired", permissions=["delete"])
    def delete_expired(self, request: HttpRequest, queryset: QuerySet[File]) -> None:
        """What `manage.py cleanup` does to expired files, for the selected rows only:
        rows not yet expired, and the input of an active batch, are kept."""
        selected = queryset.count()
        report = delete_expired_files(files=queryset)
        self.message_user(request, f"Deleted {len(report.expired_files)} expired file(s) "
                                   f"({report.expired_bytes:,} bytes).")
        not_expired = selected - len(report.expired_files) - len(report.kept_in_use)
        if report.kept_in_use:
            self.message_user(request, f"Kept {len(report.kept_in_use)} file(s) an active "
                                       f"batch still reads: {', '.join(report.kept_in_use)}",
                              messages.WARNING)
        if not_expired > 0:
            self.message_user(request, f"Kept {not_expired} file(s) that have not expired.",
                              messages.INFO)


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
    fields = readonly_fields = ("index", "status", "attempt", "failures", "worker", "completed",
                                "failed", "started_at", "finished_at", "last_error")
    extra = 0
    can_delete = False
    show_change_link = True

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(Batch)
class BatchAdmin(admin.ModelAdmin):
    list_display = ["id", "owner", "model", "endpoint", "api", "status", "priority", "total",
                    "completed", "failed", "eval_drift", "created_at"]
    list_filter = ["status", "priority", "endpoint", "api", "model", "eval_drift"]
    search_fields = ["id", "owner__username", "input_file__id"]
    readonly_fields = [f.name for f in Batch._meta.fields if f.name != "priority"]
    inlines = [ShardInline]
    actions = ["cancel", "requeue_shards", "deliver_results_again"]

    def get_queryset(self, request: HttpRequest) -> QuerySet[Batch]:
        return super().get_queryset(request).select_related("owner")

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    @admin.action(description="Cancel selected batches", permissions=["change"])
    def cancel(self, request: HttpRequest, queryset: QuerySet[Batch]) -> None:
        done = 0
        for batch in queryset:
            try:
                cancel_batch(batch=batch)
                done += 1
            except ServiceError as exc:
                self.message_user(request, f"{batch.pk}: {exc.message}", messages.WARNING)
        self.message_user(request, f"Cancelling {done} batch(es).")

    @admin.action(description="Requeue stuck or failed shards now", permissions=["change"])
    def requeue_shards(self, request: HttpRequest, queryset: QuerySet[Batch]) -> None:
        """Shards waiting for a retry run now, shards whose job was lost get a new one,
        running shards of a silent worker are retried, and shards out of retries get
        fresh ones (see `upkeep.requeue_shards`)."""
        count = 0
        for batch in queryset.filter(status=Batch.Status.IN_PROGRESS):
            count += requeue_shards(batch=batch)
        self.message_user(request, f"Requeued {count} shard(s) at {timezone.now():%H:%M:%S}.")

    @admin.action(description="Deliver results to their output prefix again",
                  permissions=["change"])
    def deliver_results_again(self, request: HttpRequest, queryset: QuerySet[Batch]) -> None:
        """A failed delivery to the owner's bucket (its automatic retries spent, or not
        yet due) is tried once more now, with its attempts counted afresh."""
        count = sum(deliver_again(batch=batch) for batch in queryset)
        self.message_user(request, f"Delivering the results of {count} batch(es) again.")


@admin.register(Shard)
class ShardAdmin(admin.ModelAdmin):
    list_display = ["__str__", "status", "attempt", "failures", "worker", "completed", "failed",
                    "heartbeat_at", "started_at", "finished_at"]
    list_filter = ["status"]
    search_fields = ["id", "batch__id", "worker"]
    readonly_fields = [f.name for f in Shard._meta.fields]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def get_urls(self) -> list[URLPattern]:
        # The queue-health page lives beside the shards it is about: /admin/jobs/shard/health/
        return [path("health/", self.admin_site.admin_view(self.queue_health_view),
                     name="jobs_queue_health"), *super().get_urls()]

    def queue_health_view(self, request: HttpRequest) -> HttpResponse:
        context = {**self.admin_site.each_context(request), "title": "Queue health",
                   "health": queue_health(), "opts": self.model._meta,
                   "heartbeat_timeout": settings.BATCHWEB["HEARTBEAT_TIMEOUT_SECONDS"]}
        return TemplateResponse(request, "admin/jobs/queue_health.html", context)


# --- operations: quotas, user settings, webhooks ---


@admin.register(Quota)
class QuotaAdmin(admin.ModelAdmin):
    list_display = ["__str__", *Quota.LIMITS, "updated_at"]
    search_fields = ["user__username", "user__email"]
    autocomplete_fields = ["user"]
    readonly_fields = ["updated_at"]

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        # Which user a row belongs to (or that it is the default) is fixed once created.
        return [*self.readonly_fields, "user"] if obj else self.readonly_fields

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        # The default row is the fallback of every user: edit it, do not delete it.
        if obj is not None and obj.user_id is None:
            return False
        return super().has_delete_permission(request, obj)

    def changelist_view(self, request: HttpRequest, extra_context: Any = None) -> HttpResponse:
        from jobs.services.quotas import default_quota

        default_quota()  # so the default row is always there to edit
        return super().changelist_view(request, extra_context)


# --- usage and cost: prices, the ledger ---


@admin.register(Price)
class PriceAdmin(admin.ModelAdmin):
    list_display = ["__str__", "input_per_million", "cached_input_per_million",
                    "output_per_million", "currency", "batch_discount_percent", "updated_at"]
    search_fields = ["model"]
    readonly_fields = ["updated_at"]


@admin.register(UsageRecord)
class UsageRecordAdmin(admin.ModelAdmin):
    """The ledger, read-only: charges are never edited (a price change applies to what is
    charged next). Above the rows, their sums by user and model for the filters chosen;
    both exported as CSV."""

    list_display = ["recorded_at", "owner", "api_key", "model", "endpoint", "batch_id",
                    "requests_succeeded", "requests_failed", "input_tokens", "cached_tokens",
                    "output_tokens", "cost_display", "engine_seconds"]
    list_filter = ["model", "endpoint", "currency", ("recorded_at", admin.DateFieldListFilter),
                   ("owner", admin.RelatedOnlyFieldListFilter)]
    search_fields = ["owner__username", "batch_id", "shard_id", "model"]
    date_hierarchy = "recorded_at"
    list_select_related = ["owner", "api_key"]
    actions = ["export_rows", "export_by_user_and_model"]
    change_list_template = "admin/jobs/usagerecord/change_list.html"

    @admin.display(description="cost", ordering="cost_nanos")
    def cost_display(self, obj: UsageRecord) -> str:
        from jobs.services.pricing import format_cost

        # The prices it was charged at: none of them set is "not priced", as on every page.
        return format_cost(obj.cost_nanos, obj.currency, priced=any(
            (obj.input_price, obj.cached_price, obj.output_price)))

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def changelist_view(self, request: HttpRequest, extra_context: Any = None) -> HttpResponse:
        response = super().changelist_view(request, extra_context)
        changelist = getattr(response, "context_data", {}).get("cl")
        if changelist is not None:
            response.context_data["usage_summary"] = _by_user_and_model(  # type: ignore[attr-defined]
                changelist.queryset)[:50]
        return response

    @admin.action(description="Export selected rows as CSV")
    def export_rows(self, request: HttpRequest, queryset: QuerySet[UsageRecord]
                    ) -> HttpResponse:
        from jobs.queries.usage import SUMS, csv_lines

        keys = ["recorded_at", "owner__username", "api_key_id", "batch_id", "shard_id",
                "model", "endpoint"]
        rows = queryset.order_by("recorded_at").values(*keys, *SUMS, "currency")
        return _csv_response("usage.csv", csv_lines(rows.iterator(), keys))

    @admin.action(description="Export selected rows' sums by user and model as CSV")
    def export_by_user_and_model(self, request: HttpRequest,
                                 queryset: QuerySet[UsageRecord]) -> HttpResponse:
        from jobs.queries.usage import csv_lines

        return _csv_response("usage-by-user-and-model.csv", csv_lines(
            _by_user_and_model(queryset), ["owner__username", "model"]))


def _by_user_and_model(queryset: QuerySet[UsageRecord]) -> list[dict[str, Any]]:
    from django.db.models import Sum

    from jobs.queries.usage import SUMS
    from jobs.services.pricing import format_cost, priced_models

    sums = (queryset.order_by().values("owner__username", "model", "currency")
            .annotate(**{name: Sum(name) for name in SUMS}).order_by("-cost_nanos"))
    rows: list[dict[str, Any]] = [dict(row) for row in sums]
    # As the Usage page: priced if charged, or if its model has a price now.
    priced = priced_models({row["model"] for row in rows})
    for row in rows:
        row["cost"] = format_cost(row["cost_nanos"] or 0, row["currency"],
                                  priced=bool(row["cost_nanos"]) or row["model"] in priced)
    return rows


def _csv_response(filename: str, lines: Any) -> HttpResponse:
    from django.http import StreamingHttpResponse

    response = StreamingHttpResponse(lines, content_type="text/csv; charset=utf-8")
    response["Content-Disposition"] = f'attachment; filename="{filename}"'
    return response  # type: ignore[return-value]


@admin.register(UserSettings)
class UserSettingsAdmin(admin.ModelAdmin):
    list_display = ["user", "webhook_url", "updated_at"]
    search_fields = ["user__username", "webhook_url"]
    autocomplete_fields = ["user"]
    # The signing secret is the user's to see (dashboard); the admin never shows it.
    fields = ["user", "webhook_url", "updated_at"]
    readonly_fields = ["updated_at"]


class WebhookDeliveryInline(admin.TabularInline):
    model = WebhookDelivery
    fields = readonly_fields = ("attempt", "started_at", "url", "status_code", "ok",
                                "duration_ms", "error", "response_excerpt")
    extra = 0
    can_delete = False

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(WebhookEvent)
class WebhookEventAdmin(admin.ModelAdmin):
    list_display = ["id", "owner", "type", "batch_id", "status", "attempts", "created_at",
                    "next_attempt_at", "delivered_at", "last_error"]
    list_filter = ["status", "type"]
    search_fields = ["id", "batch_id", "owner__username"]
    readonly_fields = [f.name for f in WebhookEvent._meta.fields]
    inlines = [WebhookDeliveryInline]
    actions = ["retry"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    @admin.action(description="Retry delivery now", permissions=["change"])
    def retry(self, request: HttpRequest, queryset: QuerySet[WebhookEvent]) -> None:
        ids = list(queryset.exclude(status=WebhookEvent.Status.DELIVERED).values_list(
            "pk", flat=True))
        retry_now(events=WebhookEvent.objects.filter(pk__in=ids))
        for event_id in ids:
            enqueue_delivery(event_id)
        self.message_user(request, f"Retrying {len(ids)} event(s).")


@admin.register(WebhookDelivery)
class WebhookDeliveryAdmin(admin.ModelAdmin):
    list_display = ["event", "attempt", "started_at", "url", "status_code", "ok",
                    "duration_ms", "error"]
    list_filter = ["ok"]
    search_fields = ["event__id", "event__batch_id", "url"]
    readonly_fields = [f.name for f in WebhookDelivery._meta.fields]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False


@admin.register(ContentRule)
class ContentRuleAdmin(admin.ModelAdmin):
    list_display = ["name", "kind", "action", "enabled", "reason", "created_at"]
    list_filter = ["kind", "action", "enabled"]
    search_fields = ["name", "pattern", "reason"]
    list_editable = ["enabled"]


class LoraAdapterForm(forms.ModelForm):
    # Offered: the served models whose engine loads adapters (enable_lora in its options).
    base_model = forms.ChoiceField(choices=())

    class Meta:
        model = LoraAdapter
        fields = ["name", "base_model", "source"]
        # The rules engine/prepare.py holds them to (the model's help texts predate them).
        help_texts = {
            "name": "What requests put in their model field: letters, digits, '.', '_' and "
                    "'-', starting with a letter or digit; not the name of a served model.",
            # No angle brackets: the admin shows help texts as HTML.
            "source": "An absolute path to a PEFT adapter folder (holding adapter_config.json) "
                      "on every worker host, or pypi:NAME==VERSION, optionally followed by "
                      "--hash=sha256:HEX, for a wheel carrying such a folder (each worker "
                      "downloads it on first use).",
        }

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        field = self.fields.get("base_model")
        if not isinstance(field, forms.ChoiceField):  # read-only once the adapter exists
            return
        field.choices = [(spec.name, spec.name) for spec in model_specs()
                         if serves_adapters(spec)]
        field.help_text = LoraAdapter._meta.get_field("base_model").help_text


@admin.register(LoraAdapter)
class LoraAdapterAdmin(admin.ModelAdmin):
    form = LoraAdapterForm
    list_display = ["name", "base_model", "source", "created_at"]
    list_filter = ["base_model"]
    search_fields = ["name", "source"]

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        # Workers keep an adapter loaded under its name: new weights need a new name.
        return ["name", "base_model", "source", "created_at"] if obj else ["created_at"]

    # Every worker downloads and loads what an adapter's source names, with its own
    # environment (database URL, secret key, storage keys): only superusers, who hold
    # those already, add or change adapters, whatever permissions a staff user was given.
    def has_add_permission(self, request: HttpRequest) -> bool:
        return request.user.is_superuser and super().has_add_permission(request)

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return request.user.is_superuser and super().has_change_permission(request, obj)


@admin.register(StorageGrant)
class StorageGrantAdmin(admin.ModelAdmin):
    list_display = ["prefix", "user", "group", "read", "write", "credentials", "created_at"]
    list_filter = ["read", "write", "credentials"]
    search_fields = ["prefix", "user__username", "group__name"]
    readonly_fields = ["created_at"]

    # A grant has the service read and write where it names, with the service's own keys
    # (jobs/services/grants.py): as with LoRA adapters, only superusers, who hold those
    # keys already, add or change grants, whatever permissions a staff user was given.
    def has_add_permission(self, request: HttpRequest) -> bool:
        return request.user.is_superuser and super().has_add_permission(request)

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return request.user.is_superuser and super().has_change_permission(request, obj)


# Eval sets and their runs (jobs/admin/evals.py registers them).
from jobs.admin import evals  # noqa: E402, F401
