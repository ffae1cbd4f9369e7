"""Rerun failed requests: a new batch from exactly the input lines whose requests failed."""

from __future__ import annotations

from typing import Any

from jobs.errors import ServiceError, wrong_state
from jobs.models import Batch, File
from jobs.result_lines import failed_custom_ids, iter_input_matches
from jobs.services.batches import MAX_METADATA_PAIRS, create_batch
from jobs.services.files import create_input_file
from jobs.storage.objects import open_file
from jobs.storage.temp import local_temp


def rerun_failed(*, batch: Batch, owner: Any) -> Batch:
    """Create a batch of the failed requests of an ended batch, with its endpoint, window,
    priority and metadata (plus `rerun_of` when there is room). The new input file holds the
    original lines byte for byte, in their original order."""
    if not batch.is_ended:
        raise wrong_state("Wait until the batch has ended to rerun its failed requests.")
    failed = failed_custom_ids(batch)
    if not failed:
        raise ServiceError("This batch has no failed requests to rerun.")
    source = File.objects.filter(pk=batch.input_file_id, owner=owner).first()
    if source is None:
        raise ServiceError("The input file of this batch was deleted; it cannot be rerun.")
    with local_temp(".rerun") as path:
        with open(path, "wb") as target, open_file(source) as stream:
            for _custom_id, raw in iter_input_matches(stream, failed.__contains__):
                target.write(raw + b"\n")
        file = create_input_file(owner=owner, path=path,
                                 filename=f"{batch.pk}_failed.jsonl", purpose="batch")
    metadata = dict(batch.metadata or {})
    if "rerun_of" in metadata or len(metadata) < MAX_METADATA_PAIRS:
        metadata["rerun_of"] = batch.pk
    return create_batch(owner=owner, input_file_id=file.pk, endpoint=batch.endpoint,
                        completion_window=batch.completion_window, metadata=metadata,
                        priority=batch.priority)
