"""The worker salts the engine's prefix cache per batch owner: every request it hands the
engine (and a request's JSON retry) carries its owner's salt, the same for all of one
owner's batches and different between owners, so vLLM shares cached prompt prefixes only
inside one user's work (tests/engine/test_vllm.py shows vLLM keeping salts apart)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import pytest

from engine.base import EngineRequest, EngineResult, ModelSpec
from engine.echo import EchoEngine
from jobs.services.shard_input import prefix_cache_salt
from jobs.worker.pipeline import Pipeline
from tests.factories import chat_line, finalized, make_batch, run_all_shards, use_private_storage

pytestmark = pytest.mark.django_db(transaction=True)


class SaltSeeingEcho(EchoEngine):
    """The echo engine, noting the salt of every request it is handed."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__(spec)
        self.salts: dict[str, str] = {}

    def run(self, requests: Iterable[EngineRequest]) -> Iterator[EngineResult]:
        def noted() -> Iterator[EngineRequest]:
            for request in requests:
                self.salts[request.request_id] = request.cache_salt
                yield request
        return super().run(noted())


@pytest.fixture
def pipeline() -> Iterator[Pipeline]:
    engine = SaltSeeingEcho(ModelSpec(name="echo-test", backend="echo"))
    started = Pipeline(engine, worker_name="test-worker", reconcile_every=0)
    started.start()
    yield started
    started.close()


def test_each_owners_requests_carry_the_owners_own_salt(pipeline, user, django_user_model,
                                                         tmp_path, settings):
    use_private_storage(settings, tmp_path)
    bob = django_user_model.objects.create_user("bob", password="pw-bob-123")
    lines = [chat_line("a", "one"), chat_line("b", "two"),
             # Not JSON: run once more, with the same salt.
             chat_line("j", "not json", response_format={"type": "json_object"})]
    uploads = tmp_path / "uploads"
    uploads.mkdir()
    batches = {(owner.username, n): make_batch(owner, lines, uploads)
               for owner in (user, bob) for n in (1, 2)}
    salts: dict[tuple[str, int], set[str]] = {}
    for key, batch in batches.items():
        before = set(pipeline.state.engine.salts)
        run_all_shards(pipeline, batch)
        assert finalized(batch)[0].status == "completed"
        handed = set(pipeline.state.engine.salts) - before
        assert len(handed) == 4  # three lines and one JSON retry
        salts[key] = {pipeline.state.engine.salts[rid] for rid in handed}
    alice = prefix_cache_salt(user.pk)
    assert salts[("alice", 1)] == salts[("alice", 2)] == {alice}
    assert salts[("bob", 1)] == salts[("bob", 2)] == {prefix_cache_salt(bob.pk)}
    assert alice != prefix_cache_salt(bob.pk)
    # What vLLM accepts as a salt: at most 128 characters, none of '@', '/', '\' or NUL.
    assert len(alice) <= 128 and not set(alice) & set("@/\\\x00")
