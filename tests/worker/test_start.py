"""What `batchworker` loads before it says it is ready: its model's prompt counter (the
tokenizer its shards' input is read with) comes with the engine, so the first batch's
validation and shards do not load it beside the engine's steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.factories import wait_for

# The chat model's tokenizer files, prepared by `make models`.
pytestmark = pytest.mark.models

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = ROOT / "var" / "models" / "SmolLM2-135M-Instruct"


def test_a_worker_is_ready_with_its_models_prompt_counter_loaded(workers,
                                                                 tmp_path: Path) -> None:
    if not (TOKENIZER / "tokenizer.json").exists():
        pytest.skip("needs the prepared chat model (make models)")
    # The test engine, told the chat model's tokenizer (as a remote model is): the worker
    # imports the tokenizers library only to load its prompt counter.
    models = tmp_path / "models.json"
    models.write_text(json.dumps([{
        "name": "echo-counted", "backend": "echo",
        "endpoints": ["/v1/chat/completions"], "options": {"tokenizer": str(TOKENIZER)}}]))
    proc = workers.start("echo-counted", env={"BATCHWEB_MODELS_FILE": str(models),
                                              "BATCHWEB_ECHO_MODEL": "0"})
    log = tmp_path / "worker-0.log"
    wait_for(lambda: b"ready on" in log.read_bytes() or proc.poll() is not None,
             timeout=120, message="the worker's ready line")
    assert proc.poll() is None, log.read_text()
    # No batch has come: what is mapped was loaded at the start.
    maps = Path(f"/proc/{proc.pid}/maps").read_text()
    assert "/tokenizers/" in maps, "the worker started without its model's tokenizer"
