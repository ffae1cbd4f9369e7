"""A user's slow webhook receiver cannot slow anyone else down: deliveries run on a queue
of their own (never the control queue that validates and finalizes batches), each attempt
ends at BATCHWEB_WEBHOOK_TIMEOUT_SECONDS in all, however slowly the receiver answers, and
only WEBHOOK_MAX_IN_FLIGHT_PER_USER attempts of one user's events run at once."""

from __future__ import annotations

import contextlib
import io
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from jobs.lib import queues, safehttp
from jobs.models import Batch, WebhookEvent
from jobs.services import webhooks
from tests.factories import chat_line, in_thread, jsonl, make_batch, run_batch, wait_for

pytestmark = pytest.mark.django_db(transaction=True)

RESPONSE = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok"


class DripServer:
    """An HTTP receiver on loopback that reads a request, then answers 200 one byte every
    `interval` seconds (0: at once), after `padding` bytes of an extra header line."""

    def __init__(self, *, interval: float, padding: int = 0) -> None:
        self.interval = interval
        self.response = RESPONSE.replace(b"\r\n", b"\r\nX-Drip: " + b"." * padding + b"\r\n",
                                         1) if padding else RESPONSE
        self.requests = 0
        self.stopping = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.2)
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}/hook"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.stopping.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            conn.settimeout(5)
            received = b""
            while b"\r\n\r\n" not in received:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                received += chunk
            self.requests += 1
            if not self.interval:
                conn.sendall(self.response)
                return
            for byte in self.response:
                if self.stopping.wait(self.interval):
                    return
                conn.sendall(bytes([byte]))

    def close(self) -> None:
        self.stopping.set()
        self.listener.close()


@pytest.fixture
def servers() -> Iterator[list[DripServer]]:
    started: list[DripServer] = []
    yield started
    for server in started:
        server.close()


def drip(servers: list[DripServer], **kwargs: Any) -> DripServer:
    server = DripServer(**kwargs)
    servers.append(server)
    return server


@pytest.fixture
def loopback(settings: Any) -> Any:
    settings.BATCHWEB = {**settings.BATCHWEB, "WEBHOOK_ALLOWED_NETWORKS": ["127.0.0.1/32"],
                         "WEBHOOK_ALLOWED_HOSTS": [], "WEBHOOK_TIMEOUT_SECONDS": 2,
                         "WEBHOOK_MAX_IN_FLIGHT_PER_USER": 1}
    return settings


def ended_with_event(owner: Any, tmp_path: Any) -> str:
    batch = run_batch(make_batch(owner, [chat_line("a", "x")], tmp_path))
    return WebhookEvent.objects.get(batch_id=batch.pk).pk


def test_an_attempt_ends_at_the_deadline_however_slowly_bytes_come(servers, loopback):
    # A byte a second: no single socket wait reaches the 2 s timeout.
    server = drip(servers, interval=1.0, padding=20)
    started = time.monotonic()
    outcome = safehttp.post(server.url, body=b"{}", headers={})
    elapsed = time.monotonic() - started
    assert 1.8 < elapsed < 3.5, elapsed
    assert not outcome.ok and outcome.status_code is None
    assert "timed out" in outcome.error
    # A prompt receiver is unaffected by the deadline's timer.
    quick = drip(servers, interval=0)
    outcome = safehttp.post(quick.url, body=b"{}", headers={})
    assert outcome.ok and outcome.status_code == 200 and outcome.excerpt == "ok"


def test_deliveries_are_on_the_webhook_queue_not_the_control_queue(user, servers, loopback,
                                                                   tmp_path):
    webhooks.set_webhook_url(user=user, url=drip(servers, interval=0).url)
    event_id = ended_with_event(user, tmp_path)
    assert queues.queue(queues.WEBHOOK_QUEUE).job_ids == [f"{event_id}-webhook"]
    assert f"{event_id}-webhook" not in queues.queue(queues.CONTROL_QUEUE).job_ids
    webhooks.enqueue_due()  # the reconciler's pass too
    assert queues.queue(queues.WEBHOOK_QUEUE).job_ids == [f"{event_id}-webhook"]
    assert not [j for j in queues.queue(queues.CONTROL_QUEUE).job_ids if "webhook" in j]


def test_one_users_attempts_in_flight_are_capped(user, other_user, servers, loopback,
                                                 tmp_path):
    slow = drip(servers, interval=1.0, padding=20)
    quick = drip(servers, interval=0)
    webhooks.set_webhook_url(user=user, url=slow.url)
    webhooks.set_webhook_url(user=other_user, url=quick.url)
    first, second = ended_with_event(user, tmp_path), ended_with_event(user, tmp_path)
    others = ended_with_event(other_user, tmp_path)

    in_flight = in_thread(lambda: webhooks.deliver_event(first))
    try:
        wait_for(lambda: slow.requests == 1, timeout=5, message="the first attempt")
        # The user's one place is taken: the second event waits, untouched and still due.
        started = time.monotonic()
        assert webhooks.deliver_event(second) == "pending"
        assert time.monotonic() - started < 0.5
        event = WebhookEvent.objects.get(pk=second)
        assert event.attempts == 0 and not event.deliveries.exists()
        assert slow.requests == 1
        assert webhooks.enqueue_due() >= 1  # the next pass enqueues it again
        # Another user's delivery does not wait for this one's.
        assert webhooks.deliver_event(others) == "delivered"
    finally:
        in_flight.join(timeout=10)
    assert WebhookEvent.objects.get(pk=first).attempts == 1
    # The place is free again once the first attempt ended (at its deadline).
    assert webhooks.deliver_event(second) == "pending"
    assert WebhookEvent.objects.get(pk=second).attempts == 1
    assert slow.requests == 2


def test_a_dripping_receiver_does_not_delay_other_users_batches(user, other_user,
                                                                other_client, servers,
                                                                loopback, workers, tmp_path):
    """Real batchworkers. One user's receiver drips a byte a second and that user has
    several events to deliver; another user's batch is validated, run and finalized
    meanwhile as fast as on idle workers."""
    slow = drip(servers, interval=1.0, padding=10_000)  # never finishes on its own
    webhooks.set_webhook_url(user=user, url=slow.url)
    for _ in range(4):
        ended_with_event(user, tmp_path)
    env = {"BATCHWEB_WEBHOOK_ALLOWED_NETWORKS": "127.0.0.1/32",
           "BATCHWEB_WEBHOOK_TIMEOUT_SECONDS": "60",
           "BATCHWEB_WEBHOOK_MAX_IN_FLIGHT_PER_USER": "1"}
    workers.start(env=env)
    workers.start(env=env)
    wait_for(lambda: slow.requests >= 1, timeout=90, message="a delivery to the slow receiver")
    time.sleep(2)  # long enough for the other worker to take (and give up) the next ones

    lines = [chat_line(f"r{i}", f"hi {i}") for i in range(3)]
    file_id = other_client.files.create(file=("in.jsonl", io.BytesIO(jsonl(lines))),
                                        purpose="batch").id
    started = time.monotonic()
    batch = other_client.batches.create(input_file_id=file_id,
                                        endpoint="/v1/chat/completions",
                                        completion_window="24h")
    wait_for(lambda: Batch.objects.get(pk=batch.id).status == Batch.Status.COMPLETED,
             timeout=60, message="the other user's batch to complete")
    elapsed = time.monotonic() - started
    assert elapsed < 20, elapsed
    # Only one of the slow user's attempts ran at a time, the others waited their turn.
    assert slow.requests == 1
    slow.close()  # lets the worker in the dripping attempt stop promptly
