"""The dispatcher (`jobs.worker.dispatch`): it feeds the engine from the inbox, JSON retries
first, and writes each result to its shard's parts; what belongs to no attempt running here
is dropped. On a pipeline's own dispatcher with the echo engine, whose request log says what
it computed; no shard finishes here, so nothing reaches the database (test_finish.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.base import ABORTED_STATUS, EngineRequest, EngineResult, ModelSpec
from engine.echo import EchoEngine
from jobs.formats.prompts import Room
from jobs.formats.wire import Code, RequestLine
from jobs.worker.dispatch import parse_request_id
from jobs.worker.pipeline import Pipeline
from jobs.worker.work import ShardWork
from tests.factories import wait_for

URL = "/v1/chat/completions"


@pytest.fixture
def computed_log(tmp_path: Path) -> Path:
    return tmp_path / "computed.log"


@pytest.fixture
def pipeline(computed_log: Path) -> Iterator[Pipeline]:
    """A pipeline not started: each test starts the threads it needs."""
    engine = EchoEngine(ModelSpec(name="echo-test", backend="echo",
                                  options={"request_log": str(computed_log)}))
    made = Pipeline(engine, worker_name="test-worker", inbox_size=8, reconcile_every=0)
    yield made
    if made.dispatcher.thread.is_alive():
        made.dispatcher.join(timeout=10)
    engine.close()


def computed(log: Path) -> list[str]:
    return log.read_text().split() if log.exists() else []


def make_work(pipeline: Pipeline, shard_id: str, *, attempt: int = 1) -> ShardWork:
    work = ShardWork(shard_id=shard_id, attempt=attempt, batch_id="b", copies={}, skip=set(),
                     screened={}, room=Room(context=None, cap=64), model="echo-test")
    pipeline.state.register(work)
    return work


def line(custom_id: str, text: str, **body: object) -> RequestLine:
    return RequestLine(custom_id=custom_id, url=URL, body={
        "model": "echo-test", "messages": [{"role": "user", "content": text}], **body})


def hand_in(pipeline: Pipeline, work: ShardWork, number: int, request: RequestLine) -> str:
    """What the intake does with a line: in flight from now on, then into the inbox."""
    request_id = work.request_id(number)
    with work.lock:
        work.pending[request_id] = request
    pipeline.state.idle.request_started(request_id)
    pipeline.state.inbox.put(EngineRequest(request_id=request_id, url=URL, body=request.body))
    return request_id


def written(work: ShardWork) -> list[str]:
    import json

    return [json.loads(text)["custom_id"]
            for part in (work.out, work.err) for text in bytes(part.held).splitlines()]


def test_request_ids_parse_back_with_or_without_the_retry_suffix():
    assert parse_request_id("shard-a:3:17") == ("shard-a", 3, 17)
    assert parse_request_id("shard-a:3:17r") == ("shard-a", 3, 17)


def test_each_result_is_written_to_its_shards_parts(pipeline, computed_log):
    first, second = make_work(pipeline, "s1"), make_work(pipeline, "s2")
    hand_in(pipeline, first, 0, line("a0", "one"))
    hand_in(pipeline, second, 4, line("b4", "two"))
    hand_in(pipeline, first, 1, line("a1", "three"))
    pipeline.dispatcher.start()
    wait_for(lambda: len(first.answered) + len(second.answered) == 3, timeout=10,
             every=0.02, message="three results written")
    assert written(first) == ["a0", "a1"] and written(second) == ["b4"]
    assert (first.answered, second.answered) == ({0, 1}, {4})
    assert first.pending == {} and second.pending == {}
    assert first.progress.completed == 2 and first.computed == 2
    assert computed(computed_log) == ["s1:1:0", "s2:1:4", "s1:1:1"]
    # Still submitting (not all handed in): neither finishes.
    assert not first.finishing and pipeline.state.current_works() == [first, second]


def test_a_request_of_a_shard_handed_back_meanwhile_is_never_computed(pipeline, computed_log):
    kept, handed_back = make_work(pipeline, "s1"), make_work(pipeline, "s2")
    hand_in(pipeline, handed_back, 0, line("b0", "waits in the inbox"))
    hand_in(pipeline, kept, 0, line("a0", "runs"))
    handed_back.handing_back = True
    pipeline.dispatcher.start()
    wait_for(lambda: kept.answered == {0}, timeout=10, every=0.02, message="a0 written")
    # Its next attempt computes it: this one neither runs it nor waits for it.
    assert computed(computed_log) == ["s1:1:0"]
    assert handed_back.pending == {} and written(handed_back) == []
    assert pipeline.state.idle.in_flight == 0


def test_json_that_does_not_parse_is_run_once_more_and_the_final_answer_written(
        pipeline, computed_log):
    work = make_work(pipeline, "s1")
    hand_in(pipeline, work, 0, line("j0", "not json", response_format={"type": "json_object"},
                                     seed=7))
    pipeline.dispatcher.start()
    wait_for(lambda: work.answered == {0}, timeout=10, every=0.02, message="j0 written")
    assert computed(computed_log) == ["s1:1:0", "s1:1:0r"]
    # One line for its custom_id: the second run's (the echo engine never answers JSON),
    # flagged as invalid JSON.
    assert written(work) == ["j0"]
    assert work.json_retries == 1 and work.retries_answered == 1
    assert work.flag_counts == {"invalid_json": 1}
    assert work.pending == {} and work.computed == 1


def test_results_of_no_attempt_running_here_are_dropped(pipeline):
    work = make_work(pipeline, "s1", attempt=2)
    request = line("a0", "hi")
    work.pending[work.request_id(0)] = request
    status, body = pipeline.state.engine.handle(URL, request.body)
    for stale_id in ("s1:1:0", "gone:1:0"):  # an earlier attempt's; a shard dropped here
        pipeline.dispatcher.on_result(EngineResult(request_id=stale_id, status_code=status,
                                                   body=body))
    assert written(work) == [] and work.answered == set()
    assert list(work.pending) == ["s1:2:0"]


def test_an_aborted_request_gets_its_error_line_unless_its_shard_is_handed_back(pipeline):
    stopped, aborted, handed_back = (make_work(pipeline, name) for name in ("s1", "s2", "s3"))
    stopped.stop_code = Code.BATCH_CANCELLED
    handed_back.handing_back = True
    for work in (stopped, aborted, handed_back):
        work.pending[work.request_id(0)] = line(f"{work.shard_id}-r0", "hi")
        pipeline.dispatcher.on_result(EngineResult(request_id=work.request_id(0),
                                                   status_code=ABORTED_STATUS, aborted=True))
    assert written(stopped) == ["s1-r0"] and Code.BATCH_CANCELLED.encode() in bytes(
        stopped.err.held)
    assert written(aborted) == ["s2-r0"] and Code.REQUEST_ABORTED.encode() in bytes(
        aborted.err.held)
    # Not run: its next attempt runs it, so it is not answered here.
    assert written(handed_back) == [] and handed_back.answered == set()
    assert all(not work.pending for work in (stopped, aborted, handed_back))


def test_joining_the_dispatcher_ends_the_engines_request_stream(pipeline):
    pipeline.dispatcher.start()
    pipeline.dispatcher.join(timeout=10)
    assert not pipeline.dispatcher.thread.is_alive()
    # The stream ended as it should: not an engine failure.
    assert pipeline.state.broken is None


def test_a_refused_request_is_written_to_the_errors_and_not_run_again(pipeline):
    work = make_work(pipeline, "s1")
    request = line("bad", "hi", response_format={"type": "json_object"})
    work.pending[work.request_id(0)] = request
    pipeline.dispatcher.on_result(EngineResult(
        request_id=work.request_id(0), status_code=400,
        body={"error": {"message": "no", "type": "invalid_request_error"}}))
    assert written(work) == ["bad"] and bytes(work.out.held) == b""
    assert work.json_retries == 0 and work.pending == {}
    assert work.progress.ran_failed == 1


def test_an_answers_tokens_count_toward_the_workers_throughput(pipeline):
    work = make_work(pipeline, "s1")
    request = line("a0", "count these words")
    work.pending[work.request_id(0)] = request
    status, body = pipeline.state.engine.handle(URL, request.body)
    pipeline.dispatcher.on_result(EngineResult(request_id=work.request_id(0),
                                               status_code=status, body=body))
    # A second result for the same line (its request is no longer pending) is ignored.
    pipeline.dispatcher.on_result(EngineResult(request_id=work.request_id(0),
                                               status_code=status, body=body))
    _, prompt, output = pipeline.state.idle.totals()
    assert (prompt, output) == (body["usage"]["prompt_tokens"],
                                body["usage"]["completion_tokens"])
    assert written(work) == ["a0"]
