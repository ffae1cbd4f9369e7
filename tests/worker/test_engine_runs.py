"""What the batch page's rates count, from a real pipeline run (echo engine): only the
requests the engine ran. Lines validation kept from running and dedup copies take no engine
time and no input tokens, so they move neither the throughput nor the mean context length."""

from __future__ import annotations

import pytest

from jobs.models import Batch, Shard
from jobs.queries.dashboard import batch_stats
from jobs.services.preflight import model_throughput
from tests.factories import chat_line, finalized, run_all_shards, wait_for

pytestmark = pytest.mark.django_db(transaction=True)


def refused(n: int) -> list[dict]:
    # temperature 9: the endpoint refuses it, so validation keeps the line from running.
    return [chat_line(f"bad-{i}", "hello", temperature=9) for i in range(n)]


def test_refused_lines_are_no_throughput(make_batch, make_pipeline):
    """A shard of refused lines ends in a moment: "now" and the average stay at zero while
    the engine has run nothing, and so does the chart."""
    batch = make_batch(refused(3) + [chat_line(f"ok-{i}", "hello") for i in range(3)],
                       shard_size=3)
    first = Shard.objects.get(batch=batch, index=0)
    make_pipeline().intake.run_shard(first.pk)
    wait_for(lambda: Shard.objects.get(pk=first.pk).status == "done", timeout=30)
    batch = Batch.objects.get(pk=batch.pk)
    assert (batch.status, batch.completed, batch.failed) == ("in_progress", 0, 3)
    stats = batch_stats(batch)
    assert stats.rate_now == 0 and stats.rate_avg == 0
    assert not any(stats.throughput)


def test_a_batch_of_refused_lines_ran_nothing(make_batch, make_pipeline):
    batch = make_batch(refused(3), shard_size=3)
    run_all_shards(make_pipeline(), batch)
    batch, out, err = finalized(batch)
    assert (batch.failed, len(err)) == (3, 3)
    stats = batch_stats(batch)
    assert stats.rate_avg == 0 and not any(stats.throughput)
    # Nor do they make the model look fast to the next batch's estimate.
    assert model_throughput("echo-test") is None


def test_mean_context_and_throughput_count_dedup_copies_once(make_batch, make_pipeline):
    """9 lines, 3 distinct deterministic prompts of the same length: computed 3 times, so
    the mean context is one prompt's tokens and the requests run are 3."""
    lines = [chat_line(f"d-{i}", f"{'word ' * 30}{i % 3}", temperature=0, max_tokens=5)
             for i in range(9)]
    batch = make_batch(lines, shard_size=9)
    assert batch.dedup_saved == 6
    run_all_shards(make_pipeline(), batch)
    batch, out, err = finalized(batch)
    assert (batch.completed, len(out), err) == (9, 9, [])
    prompt = {r["response"]["body"]["usage"]["prompt_tokens"] for r in out}
    assert len(prompt) == 1 and batch.input_tokens == 3 * prompt.pop()
    stats = batch_stats(batch)
    assert stats.report.mean_context_tokens == pytest.approx(batch.input_tokens / 3)
    assert stats.rate_avg * stats.elapsed_seconds == pytest.approx(3)
    shard = Shard.objects.get(batch=batch)
    assert (shard.completed, shard.ran_ok, shard.ran_failed) == (9, 3, 0)
