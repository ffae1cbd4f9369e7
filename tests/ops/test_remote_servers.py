"""Remote servers in queue health, /metrics and a batch's blocker: what the remote engine
recorded in Redis while it ran against a real HTTP server of the tests' own."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from django.conf import settings as django_settings

from engine.base import EngineRequest, ModelSpec
from engine.endpoints import CHAT
from engine.remote import RemoteEngine
from jobs.queries import queue_health
from tests.factories import free_port, prometheus_values, register_worker
from tests.faultproxy import FaultProxy


def remote_model(name: str, url: str) -> dict[str, Any]:
    return {"name": name, "backend": "remote", "endpoints": [CHAT],
            "options": {"base_url": url, "max_concurrency": 6, "backoff_base": 0.01,
                        "max_retries": 1, "metrics_url": ""}}


def engine_for(entry: dict[str, Any]) -> RemoteEngine:
    return RemoteEngine(ModelSpec(name=entry["name"], backend="remote", options={
        **entry["options"], "redis_url": django_settings.REDIS_URL}))


def chat(request_id: str) -> EngineRequest:
    return EngineRequest(request_id=request_id, url=CHAT, body={
        "model": "remote-busy", "messages": [{"role": "user", "content": "hi"}]})


@pytest.mark.django_db
def test_busy_and_unreachable_servers_show_everywhere(admin_client, settings):
    proxy = FaultProxy()
    proxy.served = ["remote-busy"]
    proxy.faults.append(("fail_always", 503))
    down = f"http://127.0.0.1:{free_port()}/v1"
    busy, gone = remote_model("remote-busy", proxy.url), remote_model("remote-down", down)
    settings.BATCHWEB_MODELS = [*settings.BATCHWEB_MODELS, busy, gone]
    queue_health._blockers.clear()
    engine = engine_for(busy)
    try:
        [result] = list(engine.run([chat("x")]))
        assert result.status_code == 503
        assert result.body["error"]["message"] == "injected 503"
    finally:
        engine.close()
        proxy.close()
    unreachable = engine_for(gone)
    try:
        stream = unreachable.run([chat("y")])
        threading.Timer(1.0, unreachable.abort, args=(["y"],)).start()
        assert [r.aborted for r in stream] == [True]
    finally:
        unreachable.close()

    for model in ("remote-busy", "remote-down"):
        register_worker(f"w-{model}", "host-a", model=model)
    assert "is busy" in queue_health.progress_blocker("remote-busy")
    assert "cannot be reached" in queue_health.progress_blocker("remote-down")
    # The owner's page names neither the server nor what went wrong there.
    blocker = queue_health.progress_blocker("remote-down")
    assert down not in blocker and "127.0.0.1" not in blocker

    values = prometheus_values(admin_client.get("/metrics").content.decode())
    server = (("server", proxy.url),)
    assert values[("batchweb_remote_errors_total", server)] == 1
    assert values[("batchweb_remote_backoffs_total", server)] == 1
    assert values[("batchweb_remote_in_flight", server)] == 0
    assert values[("batchweb_remote_ceiling", server)] == 6
    assert values[("batchweb_remote_limit", server)] < 6
    assert values[("batchweb_remote_condition", (("condition", "busy"),
                                                 ("server", proxy.url)))] == 1
    assert values[("batchweb_remote_condition", (("condition", "unreachable"),
                                                 ("server", down)))] == 1

    page = admin_client.get("/admin/jobs/shard/health/").content.decode()
    assert 'id="remote-servers"' in page
    assert proxy.url in page and down in page
    assert "injected 503" in page


@pytest.mark.django_db
def test_a_server_heard_from_again_is_no_blocker(settings):
    proxy = FaultProxy()
    proxy.served = ["remote-busy"]
    entry = remote_model("remote-busy", proxy.url)
    settings.BATCHWEB_MODELS = [*settings.BATCHWEB_MODELS, entry]
    queue_health._blockers.clear()
    register_worker("w-ok", "host-a", model="remote-busy")
    engine = engine_for(entry)
    try:
        assert [r.status_code for r in engine.run([chat("x")])] == [200]
    finally:
        engine.close()
        proxy.close()
    time.sleep(0.01)
    assert queue_health.progress_blocker("remote-busy") == ""
