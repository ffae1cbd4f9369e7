"""A shard that fails on storage writes its reason in its users' error lines once it is
abandoned: the kind of failure, never the storage's address (botocore names the endpoint
it tried; the worker's log keeps it for the operator). The fourth security round,
docs/security.md."""

from __future__ import annotations

import logging

import pytest
from botocore.exceptions import EndpointConnectionError

from jobs.models import Shard
from jobs.worker import part_storage
from tests.factories import chat_line, finalized, wait_for

pytestmark = pytest.mark.django_db(transaction=True)

ADDRESS = "10.20.30.40:9000"


def test_a_shard_failed_on_storage_never_names_its_address(make_batch, make_pipeline,
                                                           monkeypatch, settings, caplog):
    settings.BATCHWEB = {**settings.BATCHWEB, "SHARD_MAX_ATTEMPTS": 1}
    batch = make_batch([chat_line(f"s{i}", f"store {i}") for i in range(3)], shard_size=3)
    shard = Shard.objects.get(batch=batch)
    storage = part_storage.backend()

    def unreachable(target, sources):
        raise EndpointConnectionError(endpoint_url=f"http://{ADDRESS}/batchweb/{target}")

    # The storage's gateway is down when the shard's parts are stored.
    monkeypatch.setattr(storage, "concatenate", unreachable)
    monkeypatch.setattr(part_storage, "backend", lambda: storage)
    pipeline = make_pipeline()
    with caplog.at_level(logging.WARNING):
        pipeline.intake.run_shard(shard.pk)
        wait_for(lambda: Shard.objects.filter(pk=shard.pk, status="abandoned").exists(),
                 timeout=20, message="the shard abandoned")
    shard.refresh_from_db()
    assert "EndpointConnectionError" in shard.last_error
    assert ADDRESS not in shard.last_error
    assert ADDRESS in caplog.text  # the operator's log has it
    monkeypatch.undo()
    done, out, err = finalized(batch)
    assert out == [] and len(err) == 3
    for line in err:
        message = line["error"]["message"]
        assert "EndpointConnectionError" in message and ADDRESS not in message
