"""The compile cache's key and the engine mode it leads to (engine/compile_cache.py), and
the mode in the provenance record. No engine: the directories are what vLLM would find."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import compile_cache
from engine.provenance import Provenance

KEY = {"model_sha256": "a" * 64, "dtype": "float32", "vllm_version": "0.32.0",
       "torch_version": "2.13.0+cpu"}


def _compiled(directory: Path) -> None:
    """What a compiled engine leaves in its key's directory (vLLM's AOT artifact)."""
    artifact = directory / "torch_compile_cache/torch_aot_compile/c700c06f/rank_0_0/model"
    artifact.parent.mkdir(parents=True)
    artifact.write_bytes(b"compiled")


@pytest.mark.parametrize("changed", [
    {"model_sha256": "b" * 64}, {"dtype": "bfloat16"}, {"vllm_version": "0.33.0"},
    {"torch_version": "2.14.0+cpu"}])
def test_a_changed_model_dtype_or_engine_never_loads_the_old_cache(tmp_path, changed):
    old = compile_cache.cache_dir(compile_cache.cache_key(**KEY), tmp_path)
    _compiled(old)
    new = compile_cache.cache_dir(compile_cache.cache_key(**{**KEY, **changed}), tmp_path)
    assert new != old and new.parent == old.parent
    assert compile_cache.is_warm(old) and not compile_cache.is_warm(new)
    # The new key's first start under auto is eager: nothing of the old one is read.
    assert compile_cache.choose("auto", new) == "eager"
    assert compile_cache.choose("auto", old) == "compiled"


def test_the_same_key_finds_the_same_directory_after_a_restart(tmp_path):
    first = compile_cache.cache_dir(compile_cache.cache_key(**KEY), tmp_path)
    assert compile_cache.cache_dir(compile_cache.cache_key(**dict(KEY)), tmp_path) == first


def test_a_key_needs_the_models_content_hash():
    with pytest.raises(ValueError, match="content hash"):
        compile_cache.cache_key(**{**KEY, "model_sha256": ""})


def test_auto_is_eager_on_the_first_start_and_compiled_from_the_second(tmp_path):
    key = compile_cache.cache_key(**KEY)
    directory = compile_cache.cache_dir(key, tmp_path)
    assert compile_cache.choose("auto", directory) == "eager"
    compile_cache.mark_started(directory, key, "eager")
    assert compile_cache.choose("auto", directory) == "compiled"
    # The explicit modes never depend on the cache.
    assert compile_cache.choose("eager", directory) == "eager"
    assert compile_cache.choose("compiled", tmp_path / "empty") == "compiled"


@pytest.mark.parametrize(("options", "env", "mode"), [
    ({}, {}, "compiled"),  # vLLM's own default
    ({"enforce_eager": True}, {}, "eager"),
    ({"enforce_eager": False}, {}, "compiled"),
    ({"engine_mode": "auto", "enforce_eager": True}, {}, "auto"),
    ({"engine_mode": "auto"}, {"BATCHWEB_ENGINE_MODE": "Eager"}, "eager"),
    ({"engine_mode": "eager"}, {"BATCHWEB_ENGINE_MODE": "compiled"}, "compiled"),
    ({"engine_mode": "auto"}, {"BATCHWEB_ENFORCE_EAGER": "1"}, "eager"),
    ({"enforce_eager": True}, {"BATCHWEB_ENFORCE_EAGER": "0"}, "compiled"),
])
def test_one_setting_overrides_every_models_mode(options, env, mode):
    assert compile_cache.requested_mode(options, env) == mode


@pytest.mark.parametrize(("options", "env"), [
    ({"engine_mode": "fast"}, {}), ({}, {"BATCHWEB_ENGINE_MODE": "jit"})])
def test_an_unknown_mode_is_refused_by_name(options, env):
    with pytest.raises(ValueError, match="must be one of eager, compiled, auto"):
        compile_cache.requested_mode(options, env)


def test_the_cache_lives_with_the_workers_state(tmp_path):
    assert compile_cache.cache_root({"BATCHWEB_VAR_DIR": str(tmp_path)}) == (
        tmp_path / "compile-cache")
    assert compile_cache.cache_root({"BATCHWEB_VAR_DIR": str(tmp_path),
                                     "BATCHWEB_COMPILE_CACHE_DIR": "/cache"}) == Path("/cache")


def test_the_provenance_record_says_which_mode_ran():
    record = Provenance(model="m", model_source="s", model_sha256="a" * 64, engine="vllm",
                        engine_version="0.32.0", dtype="float32",
                        engine_mode="compiled").as_json()
    assert record["engine_mode"] == "compiled"
    # An engine without the choice (echo, remote) records none.
    assert Provenance(model="m", model_source="s", model_sha256="", engine="echo",
                      engine_version="1", dtype="").as_json()["engine_mode"] == ""
