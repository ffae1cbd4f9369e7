"""The models this deployment serves (settings.BATCHWEB_MODELS) as engine specs."""

from __future__ import annotations

from django.conf import settings

from engine.base import ModelSpec


def model_specs() -> list[ModelSpec]:
    return [
        ModelSpec(name=entry["name"], backend=entry["backend"], path=entry.get("path", ""),
                  endpoints=tuple(entry.get("endpoints", ())), options=entry.get("options", {}),
                  source=entry.get("source", ""))
        for entry in settings.BATCHWEB_MODELS
    ]


def model_spec(name: str) -> ModelSpec | None:
    return next((spec for spec in model_specs() if spec.name == name), None)
