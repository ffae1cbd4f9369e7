"""What this worker serves, recorded where it runs: the engine's provenance on every shard it
claims (and on the shard's batch), the LoRA adapters the shard's requests load, and the eval
runs a claim starts (jobs.services.evals): the set the batch's owner attached, and once per
worker, the operator's sets watching the model when this worker serves a model hash or
engine version none has run them for. Written through the worker's `ShardStore`; the
adapters are prepared by `adapters`."""

from __future__ import annotations

import logging
import threading
from typing import Any

from engine.provenance import serving_key
from jobs.lib import release
from jobs.models import Shard
from jobs.worker.adapters import AdapterFolders
from jobs.worker.db import ShardStore
from jobs.worker.work import ShardWork

log = logging.getLogger(__name__)


class Served:
    def __init__(self, engine: Any, *, store: ShardStore, adapters: AdapterFolders) -> None:
        self.engine = engine
        self.store = store
        self.adapters = adapters
        self._lock = threading.Lock()
        # The engine's record, read once (its content hash is cached beside the model).
        self._record: dict[str, Any] | None = None
        # Whether the operator's watching sets were looked at for this engine yet.
        self._watched = False

    def record(self) -> dict[str, Any]:
        with self._lock:
            if self._record is None:
                # The engine's record, and the release of batchweb that ran it.
                self._record = {**self.engine.provenance(),
                                "batchweb_version": release.version()}
            return self._record

    def claimed(self, shard: Shard) -> None:
        """After a claim: record the engine on the shard and its batch (fenced by the
        attempt), then start the eval runs the claim is the first to need. A run that
        cannot start never fails the shard."""
        record = self.record()
        self.store.record_claim(shard, engine=record)
        with self._lock:
            # An engine that cannot say what it is (no record) has no serving key to watch.
            watch = not self._watched and bool(record)
        try:
            started = self.store.start_evals(shard, serving_key=serving_key(record),
                                             watch=watch)
        except Exception:
            log.exception("shard %s: could not start its batch's eval runs", shard.pk)
            return
        if started is not None:  # a user's running batch: the watching sets were seen
            with self._lock:
                self._watched = True

    def adapter_folder(self, shard: Shard, work: ShardWork, model: str) -> str | None:
        """The folder of the LoRA adapter a line of the shard names as its `model` ("" for
        the batch's model); None when that adapter is no longer registered. Each adapter
        is resolved once per attempt (kept on its work), not once per line: prepared on
        this host, and recorded in the attempt's provenance and its batch's."""
        if model == work.model:  # validation let only the model's adapters by
            return ""
        if model not in work.adapter_paths:
            adapter = self.adapters.prepared(model, base_model=work.model)
            if adapter is not None:
                self.store.record_adapter(shard, engine=self.record(), adapter=adapter.record)
            work.adapter_paths[model] = adapter.folder if adapter else None
        return work.adapter_paths[model]
