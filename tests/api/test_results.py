"""GET /v1/batches/{id}/results (an extension): the results finished so far, paged, while
the batch runs and after it ended; and the list's status and metadata filters."""

from __future__ import annotations

import base64
import json
import zlib
from typing import Any

import pytest

from jobs.models import Batch, Shard
from jobs.services.batches import create_batch
from jobs.services.finalize import finalize_batch
from tests.factories import (
    Api,
    assert_openai_error,
    chat_lines,
    make_batch,
    make_file,
    run_shard,
)

pytestmark = pytest.mark.django_db

FAILING = {"r3", "r12"}


def read_all(api: Api, batch_id: str, after: str | None = None, **query: Any
             ) -> tuple[list[dict], str, Any]:
    """Every page from `after` until no more is there now: (lines, next cursor, last
    response)."""
    lines: list[dict] = []
    while True:
        params = {**query, **({"after": after} if after else {})}
        response = api.get(f"/v1/batches/{batch_id}/results", data=params)
        assert response.status_code == 200, response.content
        assert response["Content-Type"] == "application/jsonl"
        body = b"".join(response.streaming_content)
        lines += [json.loads(line) for line in body.splitlines()]
        after = response["X-Next-After"]
        if response["X-Has-More"] == "false":
            return lines, after, response


def ids(lines: list[dict]) -> list[str]:
    return [line["custom_id"] for line in lines]


def run(shard: Shard) -> None:
    run_shard(shard, fails=lambda custom_id: custom_id in FAILING)


def test_results_are_read_while_running_each_once_whatever_order_shards_finish(
        user, api_key, tmp_path, settings):
    batch = make_batch(user, chat_lines(20), tmp_path, shard_size=5, settings=settings)
    shards = list(Shard.objects.filter(batch=batch).order_by("index"))
    api = Api(api_key)
    lines, after, response = read_all(api, batch.pk, limit=3)
    assert lines == [] and response["X-Batch-Ended"] == "false"

    run(shards[2])
    first, after, _ = read_all(api, batch.pk, after, limit=3)
    assert sorted(ids(first)) == [f"r{i}" for i in range(10, 15)]
    # A shard before the one last read finishes later: it is not skipped.
    run(shards[0])
    run(shards[3])
    second, after, _ = read_all(api, batch.pk, after, limit=3)
    assert sorted(ids(second)) == sorted([f"r{i}" for i in range(5)]
                                         + [f"r{i}" for i in range(15, 20)])
    again, after, _ = read_all(api, batch.pk, after, limit=3)
    assert again == []  # nothing new: the cursor holds
    run(shards[1])
    third, after, _ = read_all(api, batch.pk, after, limit=100)
    seen = ids(first + second + third)
    assert sorted(seen) == sorted(f"r{i}" for i in range(20)) and len(set(seen)) == 20
    # The lines are the output-file format: a failed request's line as in the error file.
    failed = [line for line in first + second + third if line["custom_id"] in FAILING]
    assert {line["response"]["status_code"] for line in failed} == {400}

    finalize_batch(batch_id=batch.pk)
    assert Batch.objects.get(pk=batch.pk).is_ended
    # A cursor from before the end starts again at the top of the final files.
    restarted, after, response = read_all(api, batch.pk, after, limit=7)
    assert response["X-Batch-Ended"] == "true"
    assert sorted(ids(restarted)) == sorted(f"r{i}" for i in range(20))
    assert read_all(api, batch.pk, after)[0] == []


def test_results_filter_by_status_and_custom_id(user, api_key, tmp_path, settings):
    batch = make_batch(user, chat_lines(20), tmp_path, shard_size=5, settings=settings)
    for shard in Shard.objects.filter(batch=batch).order_by("index")[:3]:
        run(shard)
    api = Api(api_key)
    failed, _, _ = read_all(api, batch.pk, status="failed")
    assert sorted(ids(failed)) == sorted(FAILING)
    succeeded, _, _ = read_all(api, batch.pk, status="succeeded", limit=4)
    assert len(succeeded) == 13 and not FAILING & set(ids(succeeded))
    one, _, _ = read_all(api, batch.pk, custom_id="r7")
    assert ids(one) == ["r7"] and one[0]["response"]["status_code"] == 200
    assert read_all(api, batch.pk, custom_id="r1")[0][0]["custom_id"] == "r1"  # not r10-r14
    assert read_all(api, batch.pk, custom_id="r19")[0] == []  # not finished yet

    run_shard(Shard.objects.get(batch=batch, index=3))
    finalize_batch(batch_id=batch.pk)
    failed, _, response = read_all(api, batch.pk, status="failed")
    assert sorted(ids(failed)) == sorted(FAILING) and response["X-Batch-Ended"] == "true"


def test_results_errors(user, api_key, other_key, tmp_path, settings):
    batch = make_batch(user, chat_lines(4), tmp_path, settings=settings)
    api = Api(api_key)
    url = f"/v1/batches/{batch.pk}/results"
    assert_openai_error(Api(other_key).get(url), 404)
    assert_openai_error(api.get(url, data={"status": "done"}), 400, param="status")
    assert_openai_error(api.get(url, data={"after": "r~!!~"}), 400, param="after")
    assert_openai_error(api.get(url, data={"after": "x~y~z"}), 400, param="after")
    assert_openai_error(api.get(url, data={"limit": "0"}), 400, param="limit")


def test_list_filters_by_status_and_metadata(user, api_key, tmp_path, settings):
    running = make_batch(user, chat_lines(2), tmp_path, settings=settings,
                         metadata={"project": "eval", "run": "7"})
    other = make_batch(user, chat_lines(2, "o"), tmp_path, settings=settings,
                       metadata={"project": "labels"})
    Batch.objects.filter(pk=other.pk).update(status=Batch.Status.CANCELLED)
    api = Api(api_key)

    def listed(**query: str) -> list[str]:
        response = api.get("/v1/batches", data=query)
        assert response.status_code == 200, response.content
        return [b["id"] for b in response.json()["data"]]

    assert listed(status="in_progress") == [running.pk]
    assert sorted(listed(status="in_progress,cancelled")) == sorted([running.pk, other.pk])
    assert listed(**{"metadata[project]": "labels"}) == [other.pk]
    assert listed(**{"metadata[project]": "eval", "metadata[run]": "7"}) == [running.pk]
    assert listed(**{"metadata[project]": "eval", "metadata[run]": "8"}) == []
    assert listed(**{"metadata[project__x]": "eval"}) == []  # a key, never a lookup path
    assert_openai_error(api.get("/v1/batches", data={"status": "running"}), 400,
                        param="status")


@pytest.mark.django_db(transaction=True)
def test_the_openai_client_reads_results_as_the_readme_says(openai_client, user, tmp_path,
                                                             settings):
    import httpx

    batch = make_batch(user, chat_lines(10), tmp_path, shard_size=5, settings=settings)
    run(Shard.objects.get(batch=batch, index=0))
    response = openai_client.get(f"/batches/{batch.pk}/results", cast_to=httpx.Response,
                                 options={"params": {"status": "failed"}})
    assert [json.loads(line)["custom_id"] for line in response.text.splitlines()] == ["r3"]
    assert response.headers["X-Batch-Ended"] == "false"


def test_a_cursor_naming_more_shards_than_the_batch_has_is_refused(user, api_key, tmp_path,
                                                                    settings):
    """A cursor is expanded only as far as the batch's shards: ~1 KB naming 8M shards would
    otherwise be a set of 8M integers (half a gigabyte) per request."""
    batch = make_batch(user, chat_lines(4), tmp_path, shard_size=2, settings=settings)
    run(Shard.objects.get(batch=batch, index=0))
    api = Api(api_key)
    url = f"/v1/batches/{batch.pk}/results"
    huge = base64.urlsafe_b64encode(zlib.compress(b"\xff" * (1 << 20))).decode().rstrip("=")
    assert len(huge) < 2000
    assert_openai_error(api.get(url, data={"after": f"r~{huge}~"}), 400, param="after")
    assert_openai_error(api.get(url, data={"after": "r~eJwDAAAAAAE~2.0.0"}), 400, param="after")
    lines, after, _ = read_all(api, batch.pk)
    assert sorted(ids(lines)) == ["r0", "r1"]
    assert read_all(api, batch.pk, after)[0] == []  # the cursor it gave is accepted


def test_a_cursor_for_a_batch_with_no_shards_is_expanded_no_further(user, api_key, tmp_path):
    """A validating batch has no shards yet: its cursor's bitmap is empty, and a zlib bomb
    in its place is refused after a byte, not inflated whole (the bound is never zlib's
    0, "unlimited")."""
    file = make_file(user, chat_lines(4), tmp_path)
    batch = create_batch(owner=user, input_file_id=file.pk, endpoint="/v1/chat/completions",
                         completion_window="24h")
    assert batch.status == Batch.Status.VALIDATING and not batch.shards.exists()
    api = Api(api_key)
    url = f"/v1/batches/{batch.pk}/results"
    bomb = base64.urlsafe_b64encode(zlib.compress(b"\0" * (64 << 20), 9)).decode().rstrip("=")
    for packed in (bomb, base64.urlsafe_b64encode(zlib.compress(b"\0")).decode().rstrip("=")):
        assert_openai_error(api.get(url, data={"after": f"r~{packed}~"}), 400, param="after")
    empty = base64.urlsafe_b64encode(zlib.compress(b"")).decode().rstrip("=")
    response = api.get(url, data={"after": f"r~{empty}~"})
    assert response.status_code == 200 and response["X-Has-More"] == "false"
