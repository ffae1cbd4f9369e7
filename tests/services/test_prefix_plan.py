"""Prefix planning: the prefix key of a request, the decision to group, grouped shards and
the line index a grouped shard reads its lines from."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from jobs.formats.prefix_keys import PREFIX_BLOCK_CHARS, prefix_key
from jobs.formats.wire import RequestLine
from jobs.models import Batch, RequestCopy, Shard
from jobs.services.shard_input import shard_custom_ids, shard_lines, shard_requests
from jobs.storage import line_index
from tests.factories import chat_line, chat_lines, make_batch, shared_prefix_lines, template_of

pytestmark = pytest.mark.django_db


def _request(messages: list[dict], **body: object) -> RequestLine:
    return RequestLine("x", "/v1/chat/completions",
                       {"model": "echo-test", "messages": messages, **body})


SYSTEM = {"role": "system", "content": "You label support tickets by topic. " * 10}


def test_requests_with_the_same_context_share_a_key_whatever_the_item_and_sampling():
    a = prefix_key(_request([SYSTEM, {"role": "user", "content": "printer broken"}]))
    b = prefix_key(_request([SYSTEM, {"role": "user", "content": "refund please"}],
                            temperature=0.7, max_tokens=3))
    assert a is not None and a == b
    assert a.chars >= len(SYSTEM["content"])


def test_what_the_template_renders_before_the_messages_is_part_of_the_key():
    messages = [SYSTEM, {"role": "user", "content": "item"}]
    plain = prefix_key(_request(messages))
    tools = prefix_key(_request(messages, tools=[{"type": "function", "function": {
        "name": "lookup", "parameters": {"type": "object"}}}]))
    salted = prefix_key(_request(messages, cache_salt="tenant-a"))
    other_model = prefix_key(RequestLine("x", "/v1/chat/completions",
                                         {"model": "other", "messages": messages}))
    assert len({plain, tools, salted, other_model}) == 4


def test_responses_requests_key_their_instructions_as_chat_keys_a_system_prompt():
    def responses(item: str, **body: object) -> RequestLine:
        return RequestLine("x", "/v1/responses", {"model": "echo-test", "input": item,
                                                  "instructions": SYSTEM["content"], **body})

    a = prefix_key(responses("printer broken"))
    b = prefix_key(responses("refund please", temperature=0.7, max_output_tokens=3))
    assert a is not None and a == b
    assert a.chars >= len(SYSTEM["content"])
    # Their messages are the chat messages vLLM renders: the same context, the same key.
    assert a == prefix_key(_request([SYSTEM, {"role": "user", "content": "item"}]))
    assert prefix_key(responses("x", reasoning={"effort": "high"})) != a


def test_a_short_context_has_no_key_but_a_long_lone_message_keys_its_first_block():
    assert prefix_key(_request([{"role": "user", "content": "short question"}])) is None
    instructions = "Translate the text below into French, keeping names. " * 30
    a = prefix_key(_request([{"role": "user", "content": instructions + "First text."}]))
    b = prefix_key(_request([{"role": "user", "content": instructions + "Second one."}]))
    assert a is not None and a == b and a.chars == PREFIX_BLOCK_CHARS
    completions = RequestLine("x", "/v1/completions", {"model": "m", "prompt": instructions})
    assert prefix_key(completions) is None


def test_a_shuffled_file_with_more_prefixes_than_the_cache_is_grouped(user, tmp_path, settings):
    lines = shared_prefix_lines(60, groups=5)
    batch = make_batch(user, lines, tmp_path, shard_size=8, settings=settings)
    assert batch.plan["grouped"] is True, batch.plan
    assert batch.plan["groups"] == 5 and batch.plan["keyed"] == 60
    assert batch.plan["hits_grouped"] > batch.plan["hits_file_order"]
    assert batch.line_index
    shards = list(Shard.objects.filter(batch=batch).order_by("index"))
    assert all(s.lines_from is not None and s.request_count <= 8 for s in shards)
    run_order = [cid for shard in shards for cid in shard_custom_ids(shard)]
    assert sorted(run_order) == sorted(line["custom_id"] for line in lines)
    # Groups run together: the run order changes template at most once per group (+ the
    # shards' cuts, which never split a group across non-neighbouring shards).
    templates = [template_of(int(cid[1:])) for cid in run_order]
    changes = sum(1 for a, b in zip(templates, templates[1:], strict=False) if a != b)
    assert changes == 4
    # Within a group, file order.
    for template in range(5):
        members = [int(cid[1:]) for cid in run_order if template_of(int(cid[1:])) == template]
        assert members == sorted(members)


def test_a_file_without_groups_or_already_in_order_keeps_byte_range_shards(
        user, tmp_path, settings):
    plain = make_batch(user, chat_lines(30), tmp_path, shard_size=8, settings=settings)
    assert plain.plan["grouped"] is False and plain.plan["keyed"] == 0
    ordered = sorted(shared_prefix_lines(60, groups=5),
                     key=lambda line: template_of(int(line["custom_id"][1:])))
    in_order = make_batch(user, ordered, tmp_path, shard_size=8, settings=settings)
    assert in_order.plan["grouped"] is False
    assert in_order.plan["hits_file_order"] == in_order.plan["hits_grouped"]
    assert "pays from" in in_order.plan["reason"]
    for batch in (plain, in_order):
        assert not batch.line_index
        assert not Shard.objects.filter(batch=batch, lines_from__isnull=False).exists()


def test_grouping_can_be_turned_off(user, tmp_path, settings):
    settings.BATCHWEB = {**settings.BATCHWEB, "PREFIX_GROUPING": False}
    batch = make_batch(user, shared_prefix_lines(40), tmp_path, shard_size=8,
                       settings=settings)
    assert batch.plan["grouped"] is False and not batch.line_index


def test_a_group_that_fits_a_shard_is_never_split(user, tmp_path, settings):
    # Groups of 6 and shards of 8: each shard takes one whole group (two would not fit).
    lines = shared_prefix_lines(30, groups=5)
    batch = make_batch(user, lines, tmp_path, shard_size=8, settings=settings)
    for shard in Shard.objects.filter(batch=batch):
        ids = list(shard_custom_ids(shard))
        assert len({template_of(int(cid[1:])) for cid in ids}) == 1
        assert len(ids) == 6


def test_dedup_copies_are_answered_by_the_primarys_grouped_shard(user, tmp_path, settings):
    lines = shared_prefix_lines(40, groups=4, temperature=0)
    copies = [dict(line, custom_id=f"copy-{line['custom_id']}") for line in lines[:6]]
    batch = make_batch(user, lines + copies, tmp_path, shard_size=8, settings=settings)
    assert batch.plan["grouped"] and batch.dedup_saved == 6
    assert RequestCopy.objects.filter(batch=batch).count() == 6
    shards = list(Shard.objects.filter(batch=batch))
    answered = [cid for shard in shards for cid in shard_custom_ids(shard)]
    assert sorted(answered) == sorted(line["custom_id"] for line in lines + copies)
    assert sum(s.request_count for s in shards) == 46
    for shard in shards:
        assert shard.request_count == len(list(shard_custom_ids(shard)))
        lines_of = shard_lines(shard)
        assert not lines_of.skip  # copies never enter a grouped shard's lines


def test_a_grouped_shard_reads_exactly_its_lines_in_run_order(user, tmp_path, settings):
    lines = shared_prefix_lines(50, groups=5)
    lines.insert(7, "")  # a blank line: numbers count it, no shard runs it
    batch = make_batch(user, lines, tmp_path, shard_size=10, settings=settings)
    by_id = {line["custom_id"]: n for n, line in enumerate(lines, start=1) if line}
    for shard in Shard.objects.filter(batch=batch):
        with shard_requests(shard, skip=set(),
                            records=shard_lines(shard).records) as requests:
            got = list(requests)
        assert [number for number, _ in got] == [by_id[r["custom_id"]] for _, r in got]
        assert len(got) == shard.request_count


def test_spans_merge_neighbours_within_a_tenth_of_the_bytes():
    rng = random.Random(3)
    records = np.zeros(200, dtype=line_index.RECORD)
    offset = 0
    for i in range(200):
        length = rng.randint(50, 400)
        records[i] = (offset, length, i + 1)
        offset += length + rng.choice([0, 0, 5, 5000])
    wanted = rng.sample(range(200), 60)
    chosen = records[wanted]
    spans = line_index._spans(chosen)
    read = sum(end - start for start, end in spans)
    assert read <= 1.1 * int(chosen["length"].sum())
    for record in chosen:
        start, end = int(record["start"]), int(record["start"] + record["length"])
        assert any(s <= start and end <= e for s, e in spans)


def test_the_line_index_reads_back_what_was_written(user, tmp_path, settings):
    from tests.factories import use_private_storage

    use_private_storage(settings, tmp_path)
    data = b"".join(json.dumps(chat_line(f"r{i}", "x" * i)).encode() + b"\n"
                    for i in range(40))
    from django.core.files.base import ContentFile
    from django.core.files.storage import default_storage

    name = default_storage.save("files/line-index-test", ContentFile(data))
    offsets = [0]
    for line in data.splitlines(keepends=True):
        offsets.append(offsets[-1] + len(line))
    order = list(range(40))
    random.Random(5).shuffle(order)
    records = np.array([(offsets[i], offsets[i + 1] - offsets[i], i + 1) for i in order],
                       dtype=line_index.RECORD)
    index = line_index.write_line_index("batch_test", records)
    back = line_index.read_records(index, 10, 30)
    assert back.tobytes() == records[10:30].tobytes()
    got = list(line_index.iter_indexed_lines(name, back))
    assert [n for n, _ in got] == [i + 1 for i in order[10:30]]
    assert [json.loads(c)["custom_id"] for _, c in got] == [f"r{i}" for i in order[10:30]]


def test_a_batch_records_its_plan_even_when_not_grouped(user, tmp_path, settings):
    batch = make_batch(user, chat_lines(3), tmp_path, settings=settings)
    assert Batch.objects.get(pk=batch.pk).plan["reason"]
