"""The model registry: the models this deployment serves, typed.

`settings.BATCHWEB_MODELS` is the operator's raw declaration (JSON from
`BATCHWEB_MODELS_FILE`, or the CPU defaults); everything else reads models through the
functions here, so a default is filled in, and a model is looked up, in one place.
"""

from __future__ import annotations

import functools

from django.conf import settings

from engine.base import ModelSpec
from engine.endpoints import ENDPOINTS, served


@functools.cache
def _cpu_dtype() -> str:
    # Read /proc/cpuinfo once per process. Imported here, not in settings: settings must
    # not import the engine package.
    from engine.vllm_engine import best_cpu_dtype

    return best_cpu_dtype()


def _options(entry: dict) -> dict:
    options = dict(entry.get("options", {}))
    # An empty dtype (the CPU defaults without BATCHWEB_DTYPE) means: what this CPU
    # computes natively.
    if entry.get("backend") == "vllm" and options.get("dtype") == "":
        options["dtype"] = _cpu_dtype()
    if entry.get("backend") == "vllm" and "allowed_media_domains" not in options:
        options["allowed_media_domains"] = engine_media_domains()
    if entry.get("backend") == "remote":
        # The shared limit of its server lives in the deployment's Redis.
        options.setdefault("redis_url", settings.REDIS_URL)
    return options


def engine_media_domains() -> list[str]:
    """BATCHWEB_MEDIA_ALLOWED_DOMAINS as vLLM's own allow-list, which the engine checks
    again before fetching a media URL (for a field validation missed). vLLM matches exact
    host names: ".example.com" becomes "example.com", and a subdomain passes the engine
    only when listed itself. Empty: the engine fetches nothing (engine/vllm_engine.py)."""
    return [domain.lower().strip(".") for domain in settings.BATCHWEB["MEDIA_ALLOWED_DOMAINS"]
            if domain.strip(".")]


def _endpoints(entry: dict) -> tuple[str, ...]:
    # The test-only echo engine answers every endpoint (each endpoint's own `echo`): an
    # echo model that names none serves them all.
    if entry.get("backend") == "echo" and "endpoints" not in entry:
        return ENDPOINTS
    return served(entry.get("endpoints", ()))


def model_specs() -> list[ModelSpec]:
    """Every model this deployment serves, in the declared order."""
    return [
        ModelSpec(name=entry["name"], backend=entry["backend"], path=entry.get("path", ""),
                  endpoints=_endpoints(entry), options=_options(entry),
                  source=entry.get("source", ""))
        for entry in settings.BATCHWEB_MODELS
    ]


def model_spec(name: str) -> ModelSpec | None:
    return next((spec for spec in model_specs() if spec.name == name), None)


def model_names() -> list[str]:
    return [spec.name for spec in model_specs()]


def served_endpoints() -> dict[str, tuple[str, ...]]:
    """Model name -> the endpoints it serves (what validation and the forms offer)."""
    return {spec.name: spec.endpoints for spec in model_specs()}


def serves_adapters(spec: ModelSpec) -> bool:
    """Whether the model's engine starts with LoRA support (vLLM's own enable_lora option;
    the echo test engine reads the same option)."""
    return bool(spec.options.get("enable_lora"))


def adapter_problem(*, name: str, base_model: str, source: str) -> tuple[str, str] | None:
    """(field, message) when a LoRA adapter cannot be registered so, else None."""
    from engine.prepare import adapter_name_problem, adapter_source_problem

    if model_spec(name) is not None:
        return "name", f"{name!r} is a served model's name."
    problem = adapter_name_problem(name)
    if problem:
        return "name", problem
    spec = model_spec(base_model)
    if spec is None:
        return "base_model", f"{base_model!r} is not a served model ({', '.join(model_names())})."
    if not serves_adapters(spec):
        return "base_model", (f"{base_model!r} does not load adapters: set enable_lora (and "
                              "max_lora_rank) in its options.")
    problem = adapter_source_problem(source)
    return ("source", problem) if problem else None
