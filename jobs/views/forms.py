"""Dashboard forms: they parse and present input; every rule they enforce beyond types is
the services' (the same checks the API applies)."""

from __future__ import annotations

from typing import Any

from django import forms

from engine.endpoints import EMBEDDINGS, ENDPOINTS
from jobs.lib.model_registry import served_endpoints
from jobs.models import Batch, EvalSet, File, LoraAdapter, SpotCheck
from jobs.services.evals import public_id, sets_for
from jobs.services.grants import granted

PRIORITY_CHOICES = [(p.value, p.label) for p in Batch.Priority]


def parse_metadata(text: str) -> dict[str, str]:
    """`key=value`, one pair a line (blank lines ignored). Limits are checked by the
    service (batches.check_metadata)."""
    pairs: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line:
            continue
        key, sep, value = line.partition("=")
        if not sep or not key.strip():
            raise forms.ValidationError(f"Line {number}: write metadata as key=value.")
        pairs[key.strip()] = value.strip()
    return pairs


class NewBatchForm(forms.Form):
    """Step one uploads or picks a file and checks it; step two (the same form, with the
    checked file's id) creates the batch."""

    upload = forms.FileField(required=False, label="Upload a JSONL file",
                             widget=forms.ClearableFileInput(attrs={"accept": ".jsonl,.json,.txt"}))
    # A free value shown as a select: any of the user's files may be named (the service
    # looks it up for this user), not only the recent ones listed.
    file_id = forms.CharField(required=False, max_length=40, label="…or use an uploaded file",
                              widget=forms.Select)
    # Data by reference (jobs.services.references): an object of a granted bucket prefix,
    # registered as a file and read in place.
    source = forms.CharField(
        required=False, max_length=1100, label="…or read an object in place",
        widget=forms.TextInput(attrs={"placeholder": "s3://bucket/key.jsonl"}),
        help_text="An object under a bucket prefix an operator granted you: registered as "
                  "a file, read where it is, never copied.")
    endpoint = forms.ChoiceField(required=False, label="Endpoint")
    model = forms.ChoiceField(required=False, label="Model")
    completion_window = forms.CharField(initial="24h", max_length=10,
                                        help_text="Whole hours, e.g. 24h.")
    priority = forms.ChoiceField(choices=PRIORITY_CHOICES, initial="default")
    metadata = forms.CharField(required=False, widget=forms.Textarea(attrs={"rows": 3}),
                               help_text="Optional, one key=value a line (at most 16).")
    strict = forms.BooleanField(
        required=False, label="Strict",
        help_text="Fail the whole batch on any problem of any line, before anything runs "
                  "(otherwise a request the endpoint refuses fails alone).")
    output_prefix = forms.CharField(
        required=False, max_length=1100, label="Deliver results to",
        widget=forms.TextInput(attrs={"placeholder": "s3://bucket/results/"}),
        help_text="Optional: a folder under a bucket prefix you may write to; the output "
                  "and error files are written there as <batch id>_output.jsonl and "
                  "_errors.jsonl when the batch ends (and stay here too).")
    eval_set = forms.ChoiceField(
        required=False, label="Eval set",
        help_text="Run a fixed evaluation set beside the batch, on its model and sampling, "
                  "and compare its score with the set's baseline.")

    def __init__(self, *args: Any, owner: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        recent = File.objects.filter(owner=owner, purpose=File.Purpose.BATCH).only(
            "id", "filename", "line_count")[:50]
        choices = [("", "—")] + [
            (f.pk, f"{f.filename[:60]} ({f.line_count} lines, {f.pk})") for f in recent]
        chosen = self.data.get("file_id") if self.is_bound else self.initial.get("file_id")
        if chosen and chosen not in {value for value, _ in choices}:
            choices.append((chosen, chosen))
        self.fields["file_id"].widget.choices = choices
        endpoint = self.fields["endpoint"]
        model = self.fields["model"]
        assert isinstance(endpoint, forms.ChoiceField) and isinstance(model, forms.ChoiceField)
        endpoint.choices = [("", "from the file")] + [(e, e) for e in ENDPOINTS]
        model.choices = [("", "from the file")] + [
            (name, f"{name} ({', '.join(eps)})") for name, eps in served_endpoints().items()] + [
            (name, f"{name} (LoRA adapter of {base})")
            for name, base in sorted(LoraAdapter.objects.usable().items())]
        # The storage fields only for a user with a grant to use them (jobs.services.grants):
        # to anyone else they offer nothing but a refusal.
        if not granted(owner=owner, access="read"):
            del self.fields["source"]
        if not granted(owner=owner, access="write"):
            del self.fields["output_prefix"]
        eval_set = self.fields["eval_set"]
        assert isinstance(eval_set, forms.ChoiceField)
        # By id: a user's set may share its name with one of the operator's.
        eval_set.choices = [("", "none")] + [
            (public_id(s), f"{s.name} ({s.item_count} items, {s.get_rule_display().lower()}"
                           f"{', yours' if s.owner_id else ''})")
            for s in sets_for(owner)]

    def clean_metadata(self) -> dict[str, str]:
        return parse_metadata(self.cleaned_data.get("metadata") or "")


class EvalSetForm(forms.Form):
    """A user's own eval set: its JSONL and rule (the options are checked by the service,
    as the API's are)."""

    name = forms.CharField(max_length=100)
    upload = forms.FileField(label="JSONL file", widget=forms.ClearableFileInput(
        attrs={"accept": ".jsonl,.json,.txt"}), help_text=(
        'One item a line: {"custom_id", "url" (optional), "body" (without model), '
        '"expected"}.'))
    rule = forms.ChoiceField(choices=EvalSet.Rule.choices, initial=EvalSet.Rule.EXACT)
    tolerance = forms.FloatField(required=False, min_value=0,
                                 help_text="Numeric: the largest difference that passes.")
    embedding_model = forms.ChoiceField(required=False, label="Embeddings model",
                                        help_text="Embedding similarity: the model that "
                                                  "embeds both texts.")
    similarity = forms.FloatField(required=False, initial=0.9, help_text=(
        "Embedding similarity: the cosine similarity an answer needs."))
    drift_threshold = forms.FloatField(required=False, initial=0.05, help_text=(
        "A score this far (a fraction of items) below the baseline flags the batch."))

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        embedding_model = self.fields["embedding_model"]
        assert isinstance(embedding_model, forms.ChoiceField)
        embedding_model.choices = [("", "—")] + [
            (name, name) for name, endpoints in served_endpoints().items()
            if EMBEDDINGS in endpoints]


class ApiKeyForm(forms.Form):
    name = forms.CharField(max_length=100, initial="default")


class SpotCheckForm(forms.Form):
    custom_id = forms.CharField(max_length=512, widget=forms.HiddenInput)
    verdict = forms.ChoiceField(choices=SpotCheck.Verdict.choices)
    note = forms.CharField(required=False, max_length=2000)


class ResultFilterForm(forms.Form):
    """The error and result tabs' filters (GET)."""

    q = forms.CharField(required=False, max_length=512, label="custom_id contains")
    code = forms.CharField(required=False, max_length=100)
    cursor = forms.CharField(required=False, max_length=40, widget=forms.HiddenInput)


class UsageFilterForm(forms.Form):
    """The Usage page's filters (GET): an API key of the user's, a model, the last N days."""

    PERIODS = [(7, "last 7 days"), (30, "last 30 days"), (90, "last 90 days"),
               (365, "last 365 days")]

    key = forms.TypedChoiceField(required=False, coerce=int, empty_value=None, label="API key")
    model = forms.ChoiceField(required=False)
    days = forms.TypedChoiceField(choices=PERIODS, coerce=int, required=False,
                                  empty_value=None, initial=30, label="Period")

    def __init__(self, *args: Any, keys: list[tuple[int, str]], models: list[str],
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        key = self.fields["key"]
        model = self.fields["model"]
        assert isinstance(key, forms.ChoiceField) and isinstance(model, forms.ChoiceField)
        key.choices = [("", "all keys and the dashboard"), *keys]
        model.choices = [("", "all models"), *((m, m) for m in models)]
