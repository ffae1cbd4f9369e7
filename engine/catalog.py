"""The models a fresh deployment serves, declared once, as data (`catalog.json` beside
this file): settings turns each entry into its `BATCHWEB_MODELS` entry (its folder under
the models directory and the machine's engine options added; settings reads the JSON
itself, as it must not import the engine package), and `engine.prepare` builds each
folder from its source.

An entry's options are the model's own (its context, a pooling runner); the deployment's
(dtype, eager or compiled, LoRA) are settings'. The embeddings model serves score and
rerank through vLLM's score path for embeddings models (the cosine similarity of the two
embeddings: no PyPI package ships cross-encoder or reranker weights vLLM can load), and
moderations as its embeddings (every model that serves embeddings does).
"""

from __future__ import annotations

import json
from pathlib import Path

from engine.base import ModelSpec

CATALOG = Path(__file__).with_name("catalog.json")

DEFAULT_MODELS: tuple[ModelSpec, ...] = tuple(
    ModelSpec(name=entry["name"], backend=entry["backend"],
              endpoints=tuple(entry["endpoints"]), options=entry.get("options", {}),
              source=entry["source"])
    for entry in json.loads(CATALOG.read_text()))
