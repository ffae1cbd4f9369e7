"""The dashboard's heavy views (the preflight of a stored file, the spot-check sample, the
error counts of a running batch) read whole files: their results are cached in the shared
cache by what decides them, and a user computes at most one at a time, so clicking cannot
keep the web workers busy. The API is not affected."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings as django_settings
from django.core.cache import caches
from django.core.cache.backends.redis import RedisCache
from django.core.files.base import ContentFile
from django.core.files.storage import default_storage
from django.urls import reverse

from jobs.formats import result_lines
from jobs.lib import heavy
from jobs.models import Batch, ContentRule, Shard
from jobs.queries import spot_samples
from jobs.services import preflight
from jobs.services.shard_input import shard_custom_ids
from jobs.storage.objects import new_storage_name
from tests.factories import Api, chat_line, make_batch, make_file, run_batch, run_shard

pytestmark = pytest.mark.django_db


def lines(n: int) -> list[dict]:
    return [chat_line(f"r{i}", f"question {i}", max_tokens=10) for i in range(n)]


@contextmanager
def counting(module: Any, name: str) -> Iterator[list[Any]]:
    """Record every call of `module.name` (the pass over a file a heavy view makes)."""
    original = getattr(module, name)
    calls: list[Any] = []

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        return original(*args, **kwargs)

    setattr(module, name, wrapper)
    try:
        yield calls
    finally:
        setattr(module, name, original)


def running_batch(user: Any, tmp_path: Path, settings: Any, *, run: int) -> Batch:
    """60 requests in 3 shards, `run` of them done, every 4th request failed."""
    batch = make_batch(user, lines(60), tmp_path, shard_size=20, settings=settings)
    for shard in Shard.objects.filter(batch=batch).order_by("index")[:run]:
        run_shard(shard, fails=lambda c: int(c[1:]) % 4 == 0)
    return Batch.objects.get(pk=batch.pk)


def run_next_shard(batch: Batch, **kwargs: Any) -> Batch:
    shard = Shard.objects.filter(batch=batch).exclude(status=Shard.Status.DONE) \
        .order_by("index").first()
    run_shard(shard, **kwargs)
    return Batch.objects.get(pk=batch.pk)


def test_the_cache_is_shared_by_every_web_process() -> None:
    # Django's default is per-process memory: each Granian worker would compute again.
    assert isinstance(caches["default"], RedisCache)
    assert django_settings.CACHES["default"]["LOCATION"] == django_settings.REDIS_URL


# --- cached by progress ---


def test_error_counts_of_a_running_batch_are_counted_once_per_progress(
        user: Any, tmp_path: Path, settings: Any) -> None:
    batch = running_batch(user, tmp_path, settings, run=1)
    with counting(result_lines, "_count_errors") as passes:
        first = result_lines.error_counts(batch)
        for _ in range(3):
            assert result_lines.error_counts(Batch.objects.get(pk=batch.pk)) == first
    assert len(passes) == 1
    assert first == [("http_400", 5)]
    # A finished shard is new progress: counted again, with its errors.
    batch = run_next_shard(batch, fails=lambda c: int(c[1:]) % 4 == 0)
    assert result_lines.error_counts(batch) == [("http_400", 10)]


def drawn_once(batch: Batch, draw: Callable[[Batch], list[spot_samples.SampleItem]],
               passes: list[Any]) -> list[str]:
    """The custom_ids `draw` samples, drawn 4 times: the same, and read from the files once
    (`passes` records the reads)."""
    first = [item.custom_id for item in draw(batch)]
    for _ in range(3):
        assert [item.custom_id for item in draw(Batch.objects.get(pk=batch.pk))] == first
    assert len(passes) == 1
    return first


def test_the_spot_sample_of_a_running_batch_is_drawn_once_per_progress(
        user: Any, tmp_path: Path, settings: Any) -> None:
    batch = running_batch(user, tmp_path, settings, run=1)
    with counting(spot_samples, "scan") as passes:
        first = drawn_once(batch, spot_samples.spot_sample, passes)
    assert set(first) <= {f"r{i}" for i in range(20)} and len(first) == 10
    batch = run_next_shard(batch)
    drawn = {item.custom_id for item in spot_samples.spot_sample(batch)}
    assert drawn - {f"r{i}" for i in range(20)}, "the new shard's results are sampled too"


def _flag_shard(shard: Shard) -> None:
    """A done shard's flags part: every 3rd request flagged as an empty output."""
    flagged = [c for c in shard_custom_ids(shard) if int(c[1:]) % 3 == 0]
    part = b"".join(json.dumps({"custom_id": c, "flags": ["empty_output"]}).encode() + b"\n"
                    for c in flagged)
    name = default_storage.save(new_storage_name(f"parts/{shard.batch_id}"),
                                ContentFile(part))
    Shard.objects.filter(pk=shard.pk).update(flags_part=name,
                                             flag_counts={"empty_output": len(flagged)})


def test_the_flagged_sample_is_drawn_once_per_progress(
        user: Any, tmp_path: Path, settings: Any) -> None:
    batch = running_batch(user, tmp_path, settings, run=1)
    _flag_shard(Shard.objects.get(batch=batch, index=0))
    with counting(spot_samples, "iter_flagged") as passes:
        first = drawn_once(batch, spot_samples.flagged_sample, passes)
    assert first == [f"r{i}" for i in range(0, 20, 3) if i % 4]  # failed ones have no output
    batch = run_next_shard(batch)
    _flag_shard(Shard.objects.get(batch=batch, index=1))
    assert len(spot_samples.flagged_sample(batch)) > len(first)


def test_an_ended_batch_keeps_its_cached_results(user: Any, tmp_path: Path,
                                                 settings: Any) -> None:
    batch = run_batch(running_batch(user, tmp_path, settings, run=0),
                      fails=lambda c: int(c[1:]) % 4 == 0)
    with counting(spot_samples, "scan") as passes:
        for _ in range(3):
            spot_samples.spot_sample(Batch.objects.get(pk=batch.pk))
            result_lines.error_counts(Batch.objects.get(pk=batch.pk))
    assert result_lines.error_counts(batch) == [("http_400", 15)]
    assert len(passes) == 1


def test_the_errors_tab_counts_once_while_the_batch_is_unchanged(
        site: Any, user: Any, tmp_path: Path, settings: Any) -> None:
    batch = running_batch(user, tmp_path, settings, run=2)
    url = reverse("batch_errors", args=[batch.pk])
    error_parts = set(Shard.objects.filter(batch=batch).exclude(error_part="")
                      .values_list("error_part", flat=True))
    with counting(result_lines, "open_range") as opened:
        for _ in range(4):
            page = site.get(url)
            assert page.status_code == 200 and "http_400" in page.content.decode()
    # Each view reads its page of error lines (every part: 10 lines fill no page of 25);
    # the count over every part happens on the first view only.
    reads = [args[0] for args in opened if args[0] in error_parts]
    assert len(reads) == 4 * len(error_parts) + len(error_parts), reads


# --- the preflight of a stored file ---


def test_the_preflight_of_a_stored_file_is_cached_by_file_rules_and_endpoint(
        site: Any, user: Any, tmp_path: Path) -> None:
    file = make_file(user, lines(5), tmp_path)
    twin = make_file(user, lines(5), tmp_path)
    with counting(preflight, "check_batch_input") as checks:
        for _ in range(3):
            assert preflight.check_file(file).ok
        assert len(checks) == 1
        # Through the new-batch page (picking the uploaded file), still the cached check.
        page = site.post(reverse("batch_new"), {"file_id": file.pk, "action": "check",
                                                "completion_window": "24h",
                                                "priority": "default"})
        assert page.status_code == 200 and len(checks) == 1
        # Another file, another endpoint: each checked on its own.
        assert preflight.check_file(twin).ok
        assert not preflight.check_file(file, endpoint="/v1/embeddings").ok
        assert len(checks) == 3
        # A content rule added, changed or disabled decides anew.
        rule = ContentRule.objects.create(name="no questions", kind=ContentRule.Kind.TERM,
                                          pattern="question",
                                          action=ContentRule.Action.REJECT_BATCH)
        assert not preflight.check_file(file).ok
        ContentRule.objects.filter(pk=rule.pk).update(pattern="answer")
        assert preflight.check_file(file).ok
        assert len(checks) == 5
        ContentRule.objects.filter(pk=rule.pk).update(enabled=False)
        assert preflight.check_file(file).ok
        assert len(checks) == 5  # the same rules as the very first check
        assert preflight.check_file(file, strict=True).ok  # strict decides anew
        assert len(checks) == 6


# --- one heavy computation per user at a time ---


def _busy(response: Any) -> None:
    assert response.status_code == 429
    assert response["Retry-After"]
    text = response.content.decode()
    assert "already being computed" in text.lower() and "retry in a moment" in text.lower()


@pytest.mark.parametrize("view", ["errors", "spot_check", "spot_check_flagged", "preflight"])
def test_a_second_heavy_computation_of_a_user_gets_a_readable_429(
        view: str, site: Any, user: Any, other_user: Any, client: Any, tmp_path: Path,
        settings: Any, api_key: str) -> None:
    batch = running_batch(user, tmp_path, settings, run=2)
    _flag_shard(Shard.objects.get(batch=batch, index=0))
    file = make_file(user, lines(5), tmp_path)
    request: dict[str, Callable[[], Any]] = {
        "errors": lambda: site.get(reverse("batch_errors", args=[batch.pk])),
        "spot_check": lambda: site.get(reverse("batch_spot_check", args=[batch.pk])),
        "spot_check_flagged": lambda: site.get(reverse("batch_spot_check", args=[batch.pk]),
                                               {"flagged": "1"}),
        "preflight": lambda: site.post(reverse("batch_new"), {
            "file_id": file.pk, "action": "check", "completion_window": "24h",
            "priority": "default"}),
    }
    with heavy.one_per_user(user.pk):  # another request of the same user is computing
        _busy(request[view]())
        # The API is not behind the guard.
        assert Api(api_key).get(f"/v1/batches/{batch.pk}").status_code == 200
        # Another user's heavy computation is not held up.
        with heavy.one_per_user(other_user.pk):
            pass
    # Once it is done, the view computes; a cached result is served even while the user
    # computes something else.
    assert request[view]().status_code == 200
    with heavy.one_per_user(user.pk):
        assert request[view]().status_code == 200


def test_the_lock_of_a_killed_computation_expires() -> None:
    from jobs.lib import queues

    with heavy.one_per_user("u1"):
        ttl = queues.connection().pttl("batchweb:heavy:u1")
        assert 0 < ttl <= heavy.LOCK_SECONDS * 1000
        with pytest.raises(heavy.Busy), heavy.one_per_user("u1"):
            pass
    with heavy.one_per_user("u1"):  # released
        pass
