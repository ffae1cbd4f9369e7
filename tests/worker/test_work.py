"""A claimed shard's work state (`jobs.worker.work`): its parts in memory from one checkpoint
to the next, its results written once per custom_id of the identical requests it answers
for, when it may finish, and the checkpoint it takes and adopts. Results are the echo
engine's own answers; nothing here touches the database."""

from __future__ import annotations

import json

from engine.base import EngineResult, ModelSpec
from engine.echo import EchoEngine
from jobs.formats.checkpoint_record import Checkpoint, Progress
from jobs.formats.prompts import Room
from jobs.formats.wire import Code, LineError, RequestLine
from jobs.services.shard_input import Screened
from jobs.worker.work import PartBuffer, ShardWork

URL = "/v1/chat/completions"


def make_work(*, copies: dict[int, list[str]] | None = None, model: str = "echo-test"
              ) -> ShardWork:
    return ShardWork(shard_id="s1", attempt=2, batch_id="b1", copies=copies or {},
                     skip=set(), screened={}, room=Room(context=None, cap=64), model=model)


def request(custom_id: str, text: str, *, model: str = "echo-test") -> RequestLine:
    return RequestLine(custom_id=custom_id, url=URL, body={
        "model": model, "messages": [{"role": "user", "content": text}]})


def answer(line: RequestLine, request_id: str = "x") -> EngineResult:
    engine = EchoEngine(ModelSpec(name="echo-test", backend="echo", options={}))
    status, body = engine.handle(line.url, line.body)
    return EngineResult(request_id=request_id, status_code=status, body=body)


def lines_of(part: PartBuffer) -> list[dict]:
    return [json.loads(line) for line in part.between(part.saved, part.tell()).splitlines()]


def test_a_part_holds_only_what_its_last_checkpoint_did_not_store():
    part = PartBuffer()
    part.write(b"one\n")
    part.write(b"two\n")
    assert part.tell() == 8 and part.between(4, 8) == b"two\n"
    part.release(4)
    # Offsets keep counting every byte written; what was released is gone from memory.
    assert (part.saved, part.tell(), bytes(part.held)) == (4, 8, b"two\n")
    part.write(b"three\n")
    assert part.between(4, 14) == b"two\nthree\n"
    part.discard()
    assert bytes(part.held) == b""


def test_a_result_is_written_for_every_copy_and_counted_once():
    work = make_work(copies={0: ["same-b", "same-c"]})
    line = request("same-a", "twice asked")
    result = answer(line)
    usage = result.body["usage"]
    with work.lock:
        work.write_result(line, 0, result)
    out = lines_of(work.out)
    assert [r["custom_id"] for r in out] == ["same-a", "same-b", "same-c"]
    assert all(r["response"]["body"] == result.body for r in out)
    assert lines_of(work.err) == []
    # Every copy is completed; the engine ran the request once, so its tokens count once.
    assert (work.progress.completed, work.progress.ran_ok) == (3, 1)
    assert work.progress.input_tokens == usage["prompt_tokens"]
    assert work.progress.output_tokens == usage["completion_tokens"]
    assert (work.answered, work.computed, work.unsaved_results()) == ({0}, 1, 1)


def test_a_failed_result_goes_to_the_error_part():
    work = make_work()
    line = request("bad", "hello")
    refused = EngineResult(request_id="x", status_code=400,
                           body={"error": {"message": "no", "type": "invalid_request_error"}})
    with work.lock:
        work.write_result(line, 3, refused)
    assert lines_of(work.out) == []
    [error] = lines_of(work.err)
    assert error["custom_id"] == "bad" and error["response"]["status_code"] == 400
    assert (work.progress.failed, work.progress.ran_failed, work.progress.ran_ok) == (1, 1, 0)


def test_an_adapters_requests_are_counted_apart_for_the_ledger():
    work = make_work(copies={1: ["copy"]})
    line = request("lora", "hi", model="echo-test-lora")
    result = answer(line)
    with work.lock:
        work.write_result(line, 1, result)
    usage = result.body["usage"]
    # Requests (the copy included), input, cached, output and reasoning tokens (once).
    assert work.usage.adapters == {"echo-test-lora": [
        2, usage["prompt_tokens"], 0, usage["completion_tokens"], 0]}
    assert work.progress.completed == 2


def test_lines_not_run_get_the_stop_codes_error_line():
    work = make_work(copies={5: ["copy"]})
    with work.lock:
        assert not work.write_unrunnable("r5", 5)  # nothing stops it: the line runs
        work.stop_code = Code.BATCH_CANCELLED
        assert work.write_unrunnable("r5", 5)
    errors = lines_of(work.err)
    assert [e["custom_id"] for e in errors] == ["r5", "copy"]
    assert {e["error"]["code"] for e in errors} == {Code.BATCH_CANCELLED}
    assert work.answered == {5} and work.progress.failed == 2 and work.computed == 0


def test_a_shard_finishes_once_every_line_is_in_and_every_result_written():
    work = make_work()
    work.pending[work.request_id(0)] = request("r0", "a")
    with work.lock:
        assert not work.claim_finish()  # not all handed in
        work.all_submitted = True
        assert not work.claim_finish()  # a result still in the engine
        work.pending.clear()
        assert work.claim_finish()
        assert not work.claim_finish()  # once


def test_a_shard_being_handed_back_never_finishes():
    work = make_work()
    with work.lock:
        work.all_submitted = True
        work.handing_back = True
        assert work.stopped and not work.claim_finish()


def test_request_ids_name_the_shard_its_attempt_and_the_line():
    work = make_work()
    assert work.request_id(7) == "s1:2:7"
    assert work.attempt_key == "s1:2"


def test_a_checkpoint_covers_what_was_written_and_lets_it_go():
    work = make_work()
    for index in range(3):
        line = request(f"r{index}", f"q {index}")
        with work.lock:
            work.write_result(line, index, answer(line))
    with work.lock:
        checkpoint, sizes, computed = work.snapshot()
    assert checkpoint.attempt == 2 and checkpoint.lines == {0, 1, 2}
    assert checkpoint.progress.completed == 3 and computed == 3
    assert sizes == (work.out.tell(), 0, 0)
    # A result written while the checkpoint is stored is not in it.
    late = request("r3", "late")
    with work.lock:
        work.write_result(late, 3, answer(late))
        work.mark_saved(checkpoint, sizes, computed)
    assert work.saved_offsets() == sizes
    assert work.unsaved_results() == 1 and work.saved_computed == 3
    assert [r["custom_id"] for r in lines_of(work.out)] == ["r3"]


def test_the_next_attempt_starts_from_the_checkpoint_it_adopts():
    work = make_work()
    assert not work.adopt(Checkpoint())  # holds no result: nothing adopted
    assert work.answered == set()
    adopted = Checkpoint(attempt=1, lines={0, 2}, progress=Progress(completed=2, ran_ok=2),
                         flag_counts={"empty": 1}, json_retries=1)
    assert work.adopt(adopted)
    assert work.adopted == work.answered == {0, 2}
    assert work.progress.completed == 2 and work.json_retries == 1
    # Its results are saved already: nothing to checkpoint, nothing computed by this one.
    assert work.unsaved_results() == 0 and work.computed == 0


def test_a_line_validation_kept_from_running_gets_its_error_line_and_its_copies_too():
    refused = Screened(LineError(Code.INVALID_PARAMETER, "temperature must be at most 2",
                                 "body.temperature"), refused=True)
    work = ShardWork(shard_id="s1", attempt=1, batch_id="b1", copies={2: ["copy"]},
                     skip=set(), screened={2: refused}, room=Room(context=None, cap=64))
    with work.lock:
        assert work.write_unrunnable("hot", 2)
    errors = lines_of(work.err)
    assert [e["custom_id"] for e in errors] == ["hot", "copy"]
    # The endpoint's own 400, as the request would have had it.
    body = errors[0]["response"]["body"]["error"]
    assert errors[0]["response"]["status_code"] == 400
    assert (body["code"], body["param"]) == (Code.INVALID_PARAMETER, "body.temperature")
    assert work.answered == {2} and work.progress.failed == 2 and work.computed == 0


def test_a_flagged_answer_is_written_with_its_flags_and_counted():
    work = make_work(copies={0: ["copy"]})
    line = RequestLine(custom_id="short", url=URL, body={
        "model": "echo-test", "max_tokens": 2,
        "messages": [{"role": "user", "content": "one two three four five"}]})
    result = answer(line)
    assert result.body["choices"][0]["finish_reason"] == "length"  # cut at max_tokens
    with work.lock:
        work.write_result(line, 0, result)
    assert lines_of(work.flags) == [{"custom_id": "short", "flags": ["length_limit"]},
                                    {"custom_id": "copy", "flags": ["length_limit"]}]
    assert work.flag_counts == {"length_limit": 2}
