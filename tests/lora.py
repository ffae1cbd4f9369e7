"""LoRA adapters for the tests, made here: PEFT folders of fixed random weights for the
default chat model (SmolLM2-135M, a Llama), and a wheel carrying one, for the
pypi:<requirement> source. Random, yet strong enough that greedy answers change."""

from __future__ import annotations

import base64
import hashlib
import json
import zipfile
from pathlib import Path

MODELS_DIR = Path(__file__).resolve().parents[1] / "var" / "models"
CHAT_MODEL_DIR = MODELS_DIR / "SmolLM2-135M-Instruct"


def write_adapter(folder: Path, *, seed: int, rank: int = 8, scale: float = 2.0) -> Path:
    """A PEFT LoRA of rank `rank` on every layer's q_proj and v_proj. Needs torch and
    the prepared chat model (its shapes come from the model's config)."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((CHAT_MODEL_DIR / "config.json").read_text())
    hidden, head = config["hidden_size"], config["head_dim"]
    outputs = {"q_proj": config["num_attention_heads"] * head,
               "v_proj": config["num_key_value_heads"] * head}
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module, out in outputs.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = (
                torch.randn(rank, hidden, generator=generator) * scale / hidden ** 0.5)
            tensors[f"{prefix}.lora_B.weight"] = (
                torch.randn(out, rank, generator=generator) * scale)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    write_adapter_config(folder, rank=rank, modules=list(outputs))
    return folder


def write_adapter_config(folder: Path, *, rank: int = 8,
                         modules: tuple[str, ...] | list[str] = ("q_proj", "v_proj")) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
        "target_modules": list(modules), "lora_dropout": 0.0, "bias": "none",
        "fan_in_fan_out": False, "base_model_name_or_path": CHAT_MODEL_DIR.name}))
    return folder


def build_wheel(adapter: Path, dest: Path, *, name: str, version: str = "1.0") -> Path:
    """A wheel of distribution `name` whose package folder is the adapter folder."""
    package = name.replace("-", "_")
    dist_info = f"{package}-{version}.dist-info"
    files = {f"{package}/{path.relative_to(adapter)}": path.read_bytes()
             for path in sorted(adapter.rglob("*")) if path.is_file()}
    files[f"{dist_info}/METADATA"] = (
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n").encode()
    files[f"{dist_info}/WHEEL"] = (
        b"Wheel-Version: 1.0\nGenerator: batchweb-tests\nRoot-Is-Purelib: true\n"
        b"Tag: py3-none-any\n")
    record = [f"{path},sha256={_digest(data)},{len(data)}" for path, data in files.items()]
    files[f"{dist_info}/RECORD"] = ("\n".join([*record, f"{dist_info}/RECORD,,"]) + "\n").encode()
    dest.mkdir(parents=True, exist_ok=True)
    wheel = dest / f"{package}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for path, data in files.items():
            zf.writestr(path, data)
    return wheel


def _digest(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
