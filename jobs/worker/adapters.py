"""The LoRA adapters a worker's requests name: looked up in the registry and prepared on
this host on first use (a wheel is downloaded into the models folder), then remembered for
the worker's life with their provenance record (source and content hash, hashed once). A
registered adapter's source never changes (the admin shows it read-only), so a folder once
found stays right."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from django.conf import settings

from engine.prepare import prepare_adapter
from engine.provenance import adapter_record
from jobs.worker.db import ShardStore


@dataclass(frozen=True)
class Adapter:
    folder: str
    # Its part of a shard's provenance (engine.provenance.adapter_record).
    record: dict[str, str]


class AdapterFolders:
    def __init__(self, *, store: ShardStore) -> None:
        self.store = store
        # By name: an adapter's name is unique in the registry.
        self._adapters: dict[str, Adapter] = {}
        self._lock = threading.Lock()

    def known(self, name: str) -> str:
        """The folder of an adapter already prepared here; "" for any other name (a base
        model's). What a request's second run (the JSON retry) is given again."""
        adapter = self._adapters.get(name)
        return adapter.folder if adapter else ""

    def prepared(self, name: str, *, base_model: str) -> Adapter | None:
        """The adapter `name` of `base_model`, prepared on this host; None when no such
        adapter is registered (any longer). Preparing it may raise (a download failed):
        the shard's attempt fails and is retried, as for any failure of its inputs."""
        with self._lock:
            if name in self._adapters:
                return self._adapters[name]
            source = self.store.adapter_source(name, base_model=base_model)
            if source is None:
                return None
            folder = str(prepare_adapter(name, source, settings.MODELS_DIR))
            adapter = self._adapters[name] = Adapter(folder, adapter_record(name, source,
                                                                            folder))
            return adapter
