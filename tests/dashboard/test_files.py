"""The files page: only mine listed, download and delete."""

from __future__ import annotations

import pytest
from django.urls import reverse

from jobs.models import File
from tests.factories import chat_lines, jsonl, make_batch, make_file, response_text, run_batch

pytestmark = pytest.mark.django_db


def test_files_page_download_delete(site, user, other_user, tmp_path,
                                    django_assert_max_num_queries):
    batch = run_batch(make_batch(user, chat_lines(3), tmp_path))
    theirs = make_file(other_user, chat_lines(1), tmp_path, name="secret.jsonl")
    spare = make_file(user, chat_lines(2), tmp_path, name="spare.jsonl")
    with django_assert_max_num_queries(6):
        page = site.get(reverse("file_list")).content.decode()
    assert "spare.jsonl" in page and f"{batch.pk}_output.jsonl" in page
    assert "secret.jsonl" not in page and theirs.pk not in page
    only = site.get(reverse("file_list"), {"purpose": "batch_output"}).content.decode()
    assert "spare.jsonl" not in only
    download = site.get(reverse("file_download", args=[spare.pk]))
    assert download["Content-Disposition"] == 'attachment; filename="spare.jsonl"'
    assert response_text(download).encode() == jsonl(chat_lines(2))
    assert site.post(reverse("file_delete", args=[spare.pk])).status_code == 302
    assert not File.objects.filter(pk=spare.pk).exists()
    assert site.get(reverse("file_download", args=[spare.pk])).status_code == 404
    running = make_batch(user, chat_lines(2, "x"), tmp_path)
    refused = site.post(reverse("file_delete", args=[running.input_file_id]), follow=True)
    assert b"still running" in refused.content
    assert File.objects.filter(pk=running.input_file_id).exists()
