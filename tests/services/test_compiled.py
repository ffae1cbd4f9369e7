"""Queries compiled once (jobs.lib.compiled) answer exactly as the ORM does: the same
models with the same field values, the same tuples, one query each; and what is built on
them (the owner's batch, the spot-check summary, a session and its user) keeps its rules."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import psycopg
import pytest
from django.contrib.auth import SESSION_KEY
from django.contrib.sessions.models import Session
from django.db import connection, transaction
from django.db.models import Count
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from batchweb.auth import ModelBackend
from jobs.http.sessions import SessionStore
from jobs.lib.compiled import Compiled
from jobs.lib.errors import ServiceError
from jobs.models import Batch, SpotCheck
from jobs.queries.spot_samples import summary
from jobs.services.batches import get_batch_for_user
from tests.factories import claimed_batch, partly_run_batch

pytestmark = pytest.mark.django_db


def _fields(obj: Any) -> dict[str, Any]:
    return {f.attname: getattr(obj, f.attname) for f in type(obj)._meta.concrete_fields}


def test_models_are_the_orms(user, tmp_path, settings, django_assert_num_queries):
    batch = partly_run_batch(user, tmp_path, settings, requests=20, shard_size=5, done=2)
    Batch.objects.filter(pk=batch.pk).update(metadata={"k": "v"}, errors=[{"line": 1}])
    compiled = Compiled(lambda owner_id, batch_id: Batch.objects.filter(
        owner_id=owner_id, pk=batch_id)[:1], "owner_id", "batch_id")
    with django_assert_num_queries(1):
        [found] = compiled.rows(owner_id=user.pk, batch_id=batch.pk)
    orm = Batch.objects.get(pk=batch.pk)
    # Datetimes, JSON and the rest converted as the ORM does, and the row is not stale.
    assert _fields(found) == _fields(orm) and found.metadata == {"k": "v"}
    assert found.completed == 10 and found.in_progress_at is not None
    assert not found._state.adding and found._state.db == "default"
    assert compiled.rows(owner_id=user.pk + 1, batch_id=batch.pk) == []
    assert compiled.rows(owner_id=user.pk, batch_id="batch_none") == []


def test_annotations_order_and_values_lists(user, other_user, tmp_path, settings):
    mine = [partly_run_batch(user, tmp_path, settings, requests=4, shard_size=2, done=d,
                             prefix=f"m{d}") for d in (0, 1, 2)]
    partly_run_batch(other_user, tmp_path, settings, requests=4, shard_size=2, done=1)
    newest = Compiled(lambda owner_id: Batch.objects.filter(owner_id=owner_id)
                      .annotate(shard_count=Count("shards")).order_by("-created_at", "-pk")[:2],
                      "owner_id")
    found = newest.rows(owner_id=user.pk)
    assert [b.pk for b in found] == [b.pk for b in sorted(
        mine, key=lambda b: (b.created_at, b.pk), reverse=True)[:2]]
    assert [b.shard_count for b in found] == [2, 2]
    counts = Compiled(lambda owner_id: Batch.objects.filter(owner_id=owner_id).order_by("pk")
                      .values_list("pk", "completed"), "owner_id")
    assert counts.rows(owner_id=user.pk) == list(
        Batch.objects.filter(owner=user).order_by("pk").values_list("pk", "completed"))


def test_raw_rows_tell_every_change_apart(user, tmp_path, settings):
    # What the poll memo compares: the same row gives the same raw row (on PostgreSQL one
    # text value), and a change to any column, NULL against "" included, gives another.
    batch = partly_run_batch(user, tmp_path, settings, requests=4, shard_size=2, done=1)
    raw = Compiled(lambda batch_id: Batch.objects.filter(pk=batch_id).values_list(
        "pk", "completed", "metadata", "in_progress_at", "output_file_id", "stop_code"),
        "batch_id")
    seen = [raw.raw_rows(batch_id=batch.pk)]
    assert len(seen[0]) == 1 and raw.raw_rows(batch_id=batch.pk) == seen[0]
    rows = Batch.objects.filter(pk=batch.pk)
    for change in ({"completed": 3}, {"metadata": {"k": "v"}}, {"metadata": {"k": "w"}},
                   {"in_progress_at": batch.in_progress_at + timedelta(microseconds=1)},
                   {"in_progress_at": None}, {"output_file_id": ""},  # it was NULL
                   {"stop_code": "x,y"}, {"stop_code": 'x","y'}):
        rows.update(**change)
        seen.append(raw.raw_rows(batch_id=batch.pk))
        assert seen[-1] not in seen[:-1], change
    assert raw.raw_rows(batch_id="batch_none") == []


@pytest.mark.skipif(connection.vendor != "postgresql", reason="PostgreSQL's statements")
def test_postgresql_prepares_once_and_again_when_the_statement_is_lost(
        user, tmp_path, settings, monkeypatch):
    batch = partly_run_batch(user, tmp_path, settings, requests=4, shard_size=2, done=1)
    raw = Compiled(lambda batch_id: Batch.objects.filter(pk=batch_id).values_list(
        "pk", "completed"), "batch_id")

    def prepared() -> int:
        with connection.cursor() as cursor:
            cursor.execute("SELECT count(*) FROM pg_prepared_statements")
            return cursor.fetchone()[0]

    before = prepared()
    first = raw.raw_rows(batch_id=batch.pk)
    assert first == [(f"({batch.pk},2)".encode(),)]
    assert raw.raw_rows(batch_id=batch.pk) == first and prepared() == before + 1
    # A session that lost its statements (DISCARD ALL) fails that poll, then prepares again.
    with connection.cursor() as cursor:
        cursor.execute("DEALLOCATE ALL")
    with pytest.raises(psycopg.Error, match="does not exist"), transaction.atomic():
        raw.raw_rows(batch_id=batch.pk)
    assert raw.raw_rows(batch_id=batch.pk) == first and prepared() == 1
    # Behind a pooler in transaction mode nothing is prepared.
    monkeypatch.setitem(connection.settings_dict, "DISABLE_SERVER_SIDE_CURSORS", True)
    other = Compiled(lambda batch_id: Batch.objects.filter(pk=batch_id).values_list(
        "pk", "completed"), "batch_id")
    assert other.raw_rows(batch_id=batch.pk) == first and prepared() == 1


def test_every_value_must_be_a_parameter():
    unused = Compiled(lambda owner_id, other: Batch.objects.filter(owner_id=owner_id),
                      "owner_id", "other")
    with pytest.raises(ValueError, match="parameter"):
        unused.rows(owner_id=1, other=2)


def test_the_owners_batch_only(user, other_user, tmp_path, settings):
    batch, _ = claimed_batch(user, tmp_path, settings)
    assert get_batch_for_user(owner=user, batch_id=batch.pk).pk == batch.pk
    for owner, batch_id in ((other_user, batch.pk), (user, "batch_x"), (user, "a\x00b")):
        with pytest.raises(ServiceError) as error:
            get_batch_for_user(owner=owner, batch_id=batch_id)
        assert error.value.status == 404


def test_spot_summary_counts_marks(user, tmp_path, settings):
    batch, _ = claimed_batch(user, tmp_path, settings)
    assert (summary(batch).marked, summary(batch).good) == (0, 0)
    for i, verdict in enumerate(["good", "bad", "good"]):
        SpotCheck.objects.create(batch=batch, custom_id=f"r-{i}", verdict=verdict, note="")
    assert (summary(batch).marked, summary(batch).good) == (3, 2)


# --- sessions and their users ---


def test_a_session_and_its_user_as_before(client: Client, user: Any) -> None:
    client.force_login(user)
    assert client.get(reverse("batch_list")).status_code == 200
    key = client.cookies["sessionid"].value
    assert SessionStore(key).load()[SESSION_KEY] == str(user.pk)
    assert ModelBackend().get_user(user.pk).pk == user.pk
    assert ModelBackend().get_user(user.pk + 100) is None


def test_an_expired_session_signs_out(client: Client, user: Any) -> None:
    client.force_login(user)
    key = client.cookies["sessionid"].value
    Session.objects.filter(pk=key).update(expire_date=timezone.now() - timedelta(seconds=1))
    assert SessionStore(key).load() == {}
    assert client.get(reverse("batch_list")).status_code == 302


def test_a_deactivated_user_signs_out(client: Client, user: Any) -> None:
    client.force_login(user)
    user.is_active = False
    user.save()
    assert ModelBackend().get_user(user.pk) is None
    assert client.get(reverse("batch_list")).status_code == 302


def test_a_changed_password_ends_other_sessions(client: Client, user: Any) -> None:
    client.force_login(user)
    user.set_password("pw-changed-456")
    user.save()
    assert client.get(reverse("batch_list")).status_code == 302


# --- the cache's shared client ---


def test_the_cache_shares_one_client_and_works_across_threads() -> None:
    import threading

    from django.core.cache import cache

    backend = cache._cache  # type: ignore[attr-defined]
    assert backend.get_client() is backend.get_client(write=True)
    errors: list[BaseException] = []

    def work(n: int) -> None:
        try:
            for i in range(50):
                cache.set(f"shared-{n}-{i}", {"n": n, "i": i}, 30)
                assert cache.get(f"shared-{n}-{i}") == {"n": n, "i": i}
        except BaseException as exc:  # noqa: BLE001 - reported by the assert below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []


def test_the_first_page_of_batches_is_the_orms(user, other_user, tmp_path, settings):
    from jobs.services.keys import create_api_key
    from tests.factories import Api

    api = Api(create_api_key(owner=user, name="t")[1])
    batches = [partly_run_batch(user, tmp_path, settings, requests=2, shard_size=2, done=i % 2,
                                prefix=f"p{i}") for i in range(5)]
    partly_run_batch(other_user, tmp_path, settings, requests=2, shard_size=2, done=0)
    # Equal creation times are ordered by id, as the ORM's query orders them.
    Batch.objects.filter(pk__in=[b.pk for b in batches[:3]]).update(
        created_at=batches[0].created_at)
    orm = list(Batch.objects.filter(owner=user).order_by("-created_at", "-pk"))
    for limit in (1, 2, 5, 20):
        body = api.get(f"/v1/batches?limit={limit}").json()
        assert body["data"] == [b.to_openai() for b in orm[:limit]]
        assert body["has_more"] is (limit < 5)
    after = api.get(f"/v1/batches?limit=2&after={orm[1].pk}").json()
    assert [b["id"] for b in after["data"]] == [b.pk for b in orm[2:4]]


def test_the_dashboards_first_page_is_the_orms(client, user, other_user, tmp_path, settings):
    import re

    from jobs.http.web import LIST_PAGE_SIZE
    from tests.factories import chat_lines, make_batch

    client.force_login(user)
    for i in range(LIST_PAGE_SIZE + 2):
        make_batch(user, chat_lines(1, f"d{i}"), tmp_path, settings=settings)
    make_batch(other_user, chat_lines(1, "o"), tmp_path, settings=settings)
    # Ties of creation time are ordered by id, newest first, as the ORM's query does.
    first_two = list(Batch.objects.filter(owner=user).order_by("pk")[:2])
    Batch.objects.filter(pk__in=[b.pk for b in first_two]).update(
        created_at=first_two[0].created_at)
    orm = list(Batch.objects.filter(owner=user).order_by("-created_at", "-pk")
               .values_list("pk", flat=True))

    def shown(query: str) -> list[str]:
        page = client.get(reverse("batch_list") + query).content.decode()
        assert ("Page 1 of 2" if "page=2" not in query else "Page 2 of 2") in page
        return re.findall(r'<tr id="row-([^"]+)"', page)

    assert shown("") == shown("?page=1") == orm[:LIST_PAGE_SIZE]
    assert shown("?page=2") == orm[LIST_PAGE_SIZE:]


def test_one_batchs_shards_and_flags_as_for_several(user, tmp_path, settings):
    from jobs.models import Shard
    from jobs.queries.dashboard import shard_rows
    from jobs.queries.flags import flag_counts

    one = partly_run_batch(user, tmp_path, settings, requests=6, shard_size=2, done=2)
    two = partly_run_batch(user, tmp_path, settings, requests=4, shard_size=2, done=1,
                           prefix="q")
    Shard.objects.filter(batch=one, index=0).update(
        flag_counts={"empty_output": 2, "repetition": 1})
    Shard.objects.filter(batch=one, index=1).update(flag_counts={"empty_output": 1})
    # A running shard's counts are not the batch's yet.
    Shard.objects.filter(batch=one, index=2).update(flag_counts={"empty_output": 5})
    both = shard_rows([one.pk, two.pk])
    alone = shard_rows([one.pk])
    assert list(alone) == [one.pk] and len(both[one.pk]) == 3
    # In no particular order (the callers sum them), as from the query for several.
    assert sorted(alone[one.pk], key=repr) == sorted(both[one.pk], key=repr)
    assert shard_rows([]) == {}
    counts = {flag: n for flag, _, n in flag_counts(one)}
    assert counts["empty_output"] == 3 and counts["repetition"] == 1
    assert sum(n for _, _, n in flag_counts(two)) == 0
