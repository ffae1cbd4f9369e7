"""What the worker's threads share (`jobs.worker.state.WorkerState`): the shards in flight,
the bounded inbox, and dropping a shard's attempt, whose requests the echo engine then
aborts and whose results are thrown away."""

from __future__ import annotations

import queue
import threading

import pytest

from engine.base import EngineRequest, EngineResult, ModelSpec
from engine.echo import EchoEngine
from jobs.formats.prompts import Room
from jobs.formats.wire import RequestLine
from jobs.worker.state import WorkerState
from jobs.worker.work import ShardWork

URL = "/v1/chat/completions"


def make_work(shard_id: str) -> ShardWork:
    return ShardWork(shard_id=shard_id, attempt=1, batch_id="b", copies={}, skip=set(),
                     screened={}, room=Room(context=None, cap=64), model="echo-test")


def test_the_shards_in_flight_are_registered_by_id():
    state = WorkerState(EchoEngine(ModelSpec(name="echo-test", backend="echo")),
                        inbox_size=2)
    first, second = make_work("s1"), make_work("s2")
    state.register(first)
    state.register(second)
    assert state.current_works() == [first, second]
    state.unregister(first)
    state.unregister(first)  # twice is harmless
    assert state.current_works() == [second] and state.works == {"s2": second}


def test_the_inbox_is_bounded():
    state = WorkerState(EchoEngine(ModelSpec(name="echo-test", backend="echo")),
                        inbox_size=2)
    state.inbox.put_nowait(1)
    state.inbox.put_nowait(2)
    with pytest.raises(queue.Full):
        state.inbox.put_nowait(3)


def test_a_dropped_shards_requests_are_aborted_and_its_results_discarded():
    # Requests of ten seconds each: only an abort ends them within the test.
    engine = EchoEngine(ModelSpec(name="echo-test", backend="echo",
                                  options={"seconds_per_request": 10}))
    state = WorkerState(engine, inbox_size=4)
    work = make_work("s1")
    state.register(work)
    line = RequestLine(custom_id="r0", url=URL, body={
        "model": "echo-test", "messages": [{"role": "user", "content": "hi"}]})
    request_id = work.request_id(0)
    work.pending[request_id] = line
    work.out.write(b"an unsaved result\n")
    state.idle.request_started(request_id)
    requests: queue.Queue[EngineRequest | None] = queue.Queue()
    requests.put(EngineRequest(request_id=request_id, url=URL, body=line.body))
    results: list[EngineResult] = []

    def run() -> None:
        results.extend(engine.run(iter(requests.get, None)))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        # In flight once the engine has taken it from the stream.
        for _ in range(200):
            if requests.empty():
                break
            threading.Event().wait(0.01)
        threading.Event().wait(0.1)
        state.drop(work)
        requests.put(None)
        thread.join(timeout=5)
        assert not thread.is_alive(), "the aborted request still runs"
    finally:
        engine.close()
    assert [(r.request_id, r.aborted) for r in results] == [(request_id, True)]
    assert work.dead and work.stopped and work.pending == {}
    assert bytes(work.out.held) == b""
    assert state.current_works() == []
    # Its share of the engine's time is taken: a later finish cannot charge it.
    assert "s1:1" not in state.idle.shares
