"""What this worker serves, recorded where it runs: the engine's provenance on every shard it
claims (and on the shard's batch), the LoRA adapters the shard's requests load, and the eval
runs a claim starts (jobs.services.evals): the set the batch's owner attached, and once per
worker, the operator's sets watching the model when this worker serves a model hash or
engine version none has run them for."""

from __future__ import annotations

import functools
import logging
import threading
from typing import Any

from engine.provenance import adapter_record, serving_key
from jobs.models import LoraAdapter, Shard
from jobs.services import evals, what_ran
from jobs.worker.db import with_db_retry

log = logging.getLogger(__name__)


class Served:
    def __init__(self, engine: Any, *, worker_name: str) -> None:
        self.engine = engine
        self.worker_name = worker_name
        self._lock = threading.Lock()
        # The engine's record, read once (its content hash is cached beside the model).
        self._record: dict[str, Any] | None = None
        # Whether the operator's watching sets were looked at for this engine yet.
        self._watched = False
        # The adapters recorded per shard attempt ("<shard>:<attempt>" -> names), and
        # each adapter's record (its folder hashed once per worker).
        self._noted: dict[str, set[str]] = {}
        self._adapters: dict[str, dict[str, str]] = {}

    def record(self) -> dict[str, Any]:
        with self._lock:
            if self._record is None:
                self._record = self.engine.provenance()
            return self._record

    def claimed(self, shard: Shard) -> None:
        """After a claim: record the engine on the shard and its batch (fenced by the
        attempt), then start the eval runs the claim is the first to need. A run that
        cannot start never fails the shard."""
        record = self.record()
        with_db_retry(functools.partial(what_ran.record_claim, shard=shard,
                                        worker=self.worker_name, engine=record))
        with self._lock:
            # An engine that cannot say what it is (no record) has no serving key to watch.
            watch = not self._watched and bool(record)
            self._noted = {key: names for key, names in self._noted.items()
                           if not key.startswith(f"{shard.pk}:")}
        try:
            started = with_db_retry(lambda: evals.start_runs(
                batch=shard.batch, serving_key=serving_key(record), watch=watch))
        except Exception:
            log.exception("shard %s: could not start its batch's eval runs", shard.pk)
            return
        if started is not None:  # a user's running batch: the watching sets were seen
            with self._lock:
                self._watched = True

    def adapter_used(self, shard: Shard, name: str, folder: str) -> None:
        """A request of the shard's attempt names a LoRA adapter, about to go in: its source
        and content hash join the shard's provenance and the batch's (once per attempt)."""
        key = f"{shard.pk}:{shard.attempt}"
        with self._lock:
            if name in self._noted.setdefault(key, set()):
                return
        adapter = self._adapters.get(name)
        if adapter is None:
            source = with_db_retry(lambda: LoraAdapter.objects.filter(name=name).values_list(
                "source", flat=True).first()) or ""
            adapter = self._adapters[name] = adapter_record(name, source, folder)
        with_db_retry(functools.partial(what_ran.record_adapter, shard=shard,
                                        worker=self.worker_name, engine=self.record(),
                                        adapter=adapter))
        with self._lock:
            self._noted.setdefault(key, set()).add(name)
