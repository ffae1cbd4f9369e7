"""The eval sets page: a user's own sets beside the operator's (marked), uploading one
(checked line by line: a bad line is shown with its number and nothing is stored) and
deleting one's own; sign-in and CSRF required, another user's set is 404; linked from the
nav and the new-batch form, whose select names sets by id."""

from __future__ import annotations

import io
from typing import Any

import pytest
from django.core.files.storage import default_storage
from django.test import Client
from django.urls import reverse

from jobs.models import EvalSet
from jobs.services import evals
from jobs.views.forms import NewBatchForm
from tests.factories import chat_line, jsonl, make_batch

pytestmark = pytest.mark.django_db


def set_file(expected: Any = "echo: hi", name: str = "set.jsonl") -> io.BytesIO:
    stream = io.BytesIO(jsonl([
        {"custom_id": f"q{i}", "body": {"messages": [{"role": "user", "content": "hi"}]},
         "expected": expected} for i in range(3)]))
    stream.name = name
    return stream


def own_set(owner: Any, name: str, tmp_path: Any) -> EvalSet:
    path = tmp_path / f"{name}.jsonl"
    path.write_bytes(set_file().getvalue())
    return evals.create_eval_set(name=name, path=path, rule="exact", owner=owner)


def test_the_page_lists_creates_and_deletes_own_sets(site, user, tmp_path,
                                                     django_capture_on_commit_callbacks):
    path = tmp_path / "op.jsonl"
    path.write_bytes(set_file().getvalue())
    evals.create_eval_set(name="smoke", path=path, rule="exact")
    page = site.get(reverse("eval_set_list")).content.decode()
    assert "smoke" in page and '<span class="tag">operator</span>' in page
    assert f'href="{reverse("eval_set_list")}" aria-current="page"' in page  # the nav
    assert "Delete" not in page  # the operator's set is not the user's to delete

    refused = site.post(reverse("eval_set_list"), {
        "name": "mine", "rule": "exact", "upload": set_file(expected=3)})
    assert refused.status_code == 200
    assert "Line 1: expected must be a string." in refused.content.decode()
    assert not EvalSet.objects.filter(owner=user).exists()

    created = site.post(reverse("eval_set_list"), {
        "name": "mine", "rule": "numeric", "tolerance": "0.5", "drift_threshold": "0.1",
        "upload": set_file(expected=7)}, follow=True)
    mine = EvalSet.objects.get(owner=user)
    assert (mine.name, mine.rule, mine.tolerance, mine.drift_threshold, mine.item_count) == (
        "mine", "numeric", 0.5, 0.1, 3)
    html = created.content.decode()
    assert "Created the eval set mine (3 items)." in html and f'id="eval-set-{mine.pk}"' in html
    assert reverse("eval_set_delete", args=[mine.pk]) in html

    again = site.post(reverse("eval_set_list"), {"name": "mine", "rule": "exact",
                                                 "upload": set_file()})
    assert "exists already" in again.content.decode()
    with django_capture_on_commit_callbacks(execute=True):
        deleted = site.post(reverse("eval_set_delete", args=[mine.pk]), follow=True)
    assert "Deleted the eval set mine." in deleted.content.decode()
    assert not EvalSet.objects.filter(pk=mine.pk).exists()
    assert not default_storage.exists(mine.storage_name)


def test_a_set_running_beside_a_batch_is_not_deleted(site, user, tmp_path):
    mine = own_set(user, "mine", tmp_path)
    batch = make_batch(user, [chat_line("a", "hi")], tmp_path, eval_set="mine")
    answer = site.post(reverse("eval_set_delete", args=[mine.pk]), follow=True)
    assert f"runs beside {batch.pk}, which has not ended" in answer.content.decode()
    assert EvalSet.objects.filter(pk=mine.pk).exists()


def test_another_users_and_the_operators_sets_are_404_to_delete(site, other_user, tmp_path):
    theirs = own_set(other_user, "theirs", tmp_path)
    path = tmp_path / "op.jsonl"
    path.write_bytes(set_file().getvalue())
    operators = evals.create_eval_set(name="smoke", path=path, rule="exact")
    for eval_set in (theirs, operators):
        assert site.post(reverse("eval_set_delete", args=[eval_set.pk])).status_code == 404
    assert EvalSet.objects.count() == 2
    assert "theirs" not in site.get(reverse("eval_set_list")).content.decode()


def test_sign_in_and_csrf_are_required(client, user, tmp_path):
    mine = own_set(user, "mine", tmp_path)
    answer = client.get(reverse("eval_set_list"))
    assert answer.status_code == 302 and reverse("login") in answer.url
    assert client.post(reverse("eval_set_delete", args=[mine.pk])).status_code == 302
    checked = Client(enforce_csrf_checks=True)
    checked.force_login(user)
    assert checked.post(reverse("eval_set_delete", args=[mine.pk])).status_code == 403
    assert checked.post(reverse("eval_set_list"), {"name": "x", "rule": "exact",
                                                   "upload": set_file()}).status_code == 403
    assert checked.get(reverse("eval_set_delete", args=[mine.pk])).status_code == 405
    assert EvalSet.objects.filter(pk=mine.pk).exists()


def test_the_new_batch_form_names_sets_by_id_and_links_the_page(site, user, tmp_path):
    path = tmp_path / "op.jsonl"
    path.write_bytes(set_file().getvalue())
    operators = evals.create_eval_set(name="smoke", path=path, rule="exact")
    mine = own_set(user, "smoke", tmp_path)  # the operator's name: both stay choosable
    choices = dict(NewBatchForm(owner=user).fields["eval_set"].choices)
    assert choices[f"evalset_{mine.pk}"].endswith("yours)")
    assert f"evalset_{operators.pk}" in choices
    page = site.get(reverse("batch_new")).content.decode()
    assert f'href="{reverse("eval_set_list")}" id="manage-eval-sets"' in page
    batch = make_batch(user, [chat_line("a", "hi")], tmp_path,
                       eval_set=f"evalset_{operators.pk}")
    assert batch.eval_set_id == operators.pk
