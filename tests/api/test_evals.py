"""An eval set through the official openai client and real worker processes: attached with
`extra_body={"eval_set": ...}`, run by the workers beside the batch (its validation, shards
and finalization as RQ jobs), scored when both end, shown on the batch object; the user's
files and counts hold only the user's requests."""

from __future__ import annotations

import io
import json

import pytest

from jobs.services import evals
from tests.factories import chat_line, jsonl, wait_for

pytestmark = pytest.mark.django_db(transaction=True)


def test_an_eval_set_attached_through_the_api(openai_client, workers, tmp_path):
    path = tmp_path / "set.jsonl"
    path.write_bytes(jsonl([{"custom_id": f"q{i}", "body": {"messages": [
        {"role": "user", "content": f"Word {i}"}]}, "expected": f"echo: word {i}"}
        for i in range(4)]))
    evals.create_eval_set(name="smoke", path=path, rule="normalized")
    file_id = openai_client.files.create(file=("in.jsonl", io.BytesIO(jsonl(
        [chat_line(f"u{i}", f"hello {i}") for i in range(5)]))), purpose="batch").id
    with pytest.raises(Exception, match="No such eval set"):
        openai_client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                     completion_window="24h", extra_body={"eval_set": "nope"})
    batch = openai_client.batches.create(input_file_id=file_id,
                                         endpoint="/v1/chat/completions",
                                         completion_window="24h",
                                         extra_body={"eval_set": "smoke"})
    workers.start()
    done = wait_for(lambda: (b := openai_client.batches.retrieve(batch.id)).status
                    == "completed" and (b.model_extra["evaluations"] or [{}])[0].get(
                        "status") == "scored" and b, timeout=90, message="a scored run")
    run = done.model_extra["evaluations"][0]
    assert (run["eval_set"], run["items"], run["passed"], run["score"]) == ("smoke", 4, 4, 1.0)
    assert done.model_extra["eval_drift"] is False
    assert done.model_extra["provenance"]["workers"][0]["engine"]["engine"] == "echo"
    assert done.request_counts.total == done.request_counts.completed == 5
    out = openai_client.files.content(done.output_file_id).text.splitlines()
    assert sorted(json.loads(line)["custom_id"] for line in out) == [f"u{i}" for i in range(5)]
    assert [f.id for f in openai_client.files.list()] == [file_id, done.output_file_id][::-1]
