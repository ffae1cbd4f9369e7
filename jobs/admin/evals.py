"""The admin of eval sets (an operator uploads a set's JSONL, checked line by line, and
names the models it watches) and of their runs (accepting one as its set's baseline)."""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest

from jobs.http.web import uploaded_path
from jobs.lib.errors import ServiceError
from jobs.models import EvalRun, EvalSet
from jobs.policy import eval_rules
from jobs.services import evals


class EvalSetForm(forms.ModelForm):
    upload = forms.FileField(required=False, help_text=(
        "JSONL, one item a line: {\"custom_id\", \"url\" (optional, the same on every line; "
        "chat completions by default), \"body\" (without model), \"expected\"}. See "
        "docs/eval-sets.md."))

    class Meta:
        model = EvalSet
        fields = ["name", "owner", "rule", "tolerance", "embedding_model", "similarity",
                  "drift_threshold", "watch_models"]

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        if self.instance.pk is None and not data.get("upload"):
            raise forms.ValidationError({"upload": "A new set needs its JSONL file."})
        upload = data.get("upload")
        if upload is not None:
            with uploaded_path(upload) as path:
                try:
                    evals.check_set_file(path=path, rule=data.get("rule") or eval_rules.EXACT)
                except ServiceError as exc:  # the file's (a line's)
                    raise forms.ValidationError({"upload": exc.message}) from None
        return data

    def create(self) -> EvalSet:
        """The new set, stored by the service (its checks again, the file, the row)."""
        data = self.cleaned_data
        with uploaded_path(data["upload"]) as path:
            try:
                return evals.create_eval_set(
                    name=data["name"], path=path, rule=data["rule"], owner=data.get("owner"),
                    tolerance=data.get("tolerance") or 0.0,
                    embedding_model=data.get("embedding_model") or "",
                    similarity=data.get("similarity") or 0.9,
                    drift_threshold=data.get("drift_threshold") or 0.0,
                    watch_models=data.get("watch_models") or [])
            except ServiceError as exc:
                raise forms.ValidationError(exc.message) from None


@admin.register(EvalSet)
class EvalSetAdmin(admin.ModelAdmin):
    form = EvalSetForm
    list_display = ["name", "owner", "rule", "item_count", "url", "drift_threshold",
                    "watch_models", "created_at"]
    search_fields = ["name", "owner__username"]
    readonly_fields = ["url", "item_count", "bytes", "sha256", "storage_name", "created_at"]

    def get_fields(self, request: HttpRequest, obj: Any = None) -> Any:
        editable = ["name", "owner", "rule", "tolerance", "embedding_model", "similarity",
                    "drift_threshold", "watch_models"]
        return [*editable, "upload"] if obj is None else [*editable, *self.readonly_fields]

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        # A set's items and rule are fixed once runs compare with each other.
        return [*self.readonly_fields, "rule", "owner"] if obj else []

    def save_model(self, request: HttpRequest, obj: EvalSet, form: Any, change: bool) -> None:
        if change:
            super().save_model(request, obj, form, change)
            return
        created = form.create()  # the service stores the file and makes the row
        for column in EvalSet._meta.concrete_fields:
            setattr(obj, column.attname, getattr(created, column.attname))
        obj._state.adding = False


@admin.register(EvalRun)
class EvalRunAdmin(admin.ModelAdmin):
    list_display = ["id", "eval_set", "batch", "trigger", "base_model", "model", "status",
                    "score", "baseline_score", "changed_count", "drifted", "accepted_at",
                    "created_at"]
    list_filter = ["status", "drifted", "trigger", "base_model"]
    search_fields = ["id", "batch__id", "eval_set__name"]
    readonly_fields = [f.name for f in EvalRun._meta.fields]
    actions = ["accept"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    @admin.action(description="Accept as the baseline of its set on its model",
                  permissions=["change"])
    def accept(self, request: HttpRequest, queryset: QuerySet[EvalRun]) -> None:
        for run in queryset.select_related("eval_set"):
            try:
                evals.accept_run(run=run, user=request.user)
            except ServiceError as exc:
                self.message_user(request, f"{run.pk}: {exc.message}", messages.WARNING)
            else:
                self.message_user(request, f"{run.pk} is the baseline of {run.eval_set} on "
                                           f"{run.base_model}.")
