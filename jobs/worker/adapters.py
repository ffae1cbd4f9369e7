"""The LoRA adapters a worker's requests name: looked up in the registry and prepared on
this host on first use (a wheel is downloaded into the models folder), then remembered for
the worker's life. A registered adapter's source never changes (the admin shows it
read-only), so a folder once found stays right."""

from __future__ import annotations

import threading

from django.conf import settings

from engine.prepare import prepare_adapter
from jobs.models import LoraAdapter
from jobs.worker.db import with_db_retry


class AdapterFolders:
    def __init__(self) -> None:
        # By name: an adapter's name is unique in the registry.
        self._folders: dict[str, str] = {}
        self._lock = threading.Lock()

    def known(self, name: str) -> str:
        """The folder of an adapter already prepared here; "" for any other name (a base
        model's). What a request's second run (the JSON retry) is given again."""
        return self._folders.get(name, "")

    def folder(self, name: str, *, base_model: str) -> str | None:
        """The local folder of the adapter `name` of `base_model`; None when no such
        adapter is registered (any longer). The registry is read across a dropped
        connection. Preparing it may raise (a download failed): the shard's attempt fails
        and is retried, as for any failure of its inputs."""
        with self._lock:
            if name in self._folders:
                return self._folders[name]
            adapter = with_db_retry(lambda: LoraAdapter.objects.filter(
                name=name, base_model=base_model).first())
            if adapter is None:
                return None
            folder = str(prepare_adapter(name, adapter.source, settings.MODELS_DIR))
            self._folders[name] = folder
            return folder
