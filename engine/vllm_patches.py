"""Fixes to the installed vLLM, applied in every process vLLM starts (the engine core and
its workers too) as a vLLM general plugin: pyproject.toml declares `register` under the
`vllm.general_plugins` entry points, which vLLM loads at start in each process.

Each fix first checks that the installed vLLM still has its bug, so a vLLM that fixed it
runs unpatched.

- LoRA on CPU: vLLM's PyTorch LoRA ops (`vllm.lora.ops.torch_ops`, the CPU platform's
  punica path) gather each token's adapter weights with the token's adapter slot as an
  index. A token of the base model carries the slot -1, meaning "no adapter", and indexing
  with -1 takes the *last* slot: once every slot holds an adapter, a base-model request
  computed in the same step as adapter requests gets the last adapter's delta, a wrong
  answer with no error (the GPU kernels skip -1). vLLM's open fix is
  vllm-project/vllm#48421. The fix here leaves the base tokens' rows of the output as the
  op found them, which is what the GPU kernels do.
- The compile cache on CPU: vLLM saves a compiled model (its AOT artifact) and, at the next
  start, loads it and calls `finalize_loading` on the compiled function, a method of vLLM's
  own backend's function only. On CPU vLLM compiles with torch's plain inductor backend
  (mode DYNAMO_TRACE_ONCE), whose function has no such method: every load failed
  ("'function' object has no attribute 'finalize_loading'") and every start compiled again
  (70-170 s). There is nothing to finalize for it; the fix gives it a method that does
  nothing (engine/compile_cache.py).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

_LORA_OPS = ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice")


def register() -> None:
    """The plugin's entry point; loading it again is harmless (each fix applies once)."""
    # A vLLM without these modules has nothing to fix.
    with contextlib.suppress(ImportError):
        _fix_lora_base_tokens()
    with contextlib.suppress(ImportError):
        _fix_compile_cache_load()


def _fix_lora_base_tokens() -> None:
    from vllm.lora.ops import torch_ops
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    if getattr(lora_ops, "_batchweb_fixed", False) or not _applies_base_tokens_delta(
            lora_ops.bgmv_shrink):
        return
    # The sgmv ops call the bgmv ones through lora_ops' globals; punica_cpu and the
    # package imported them by name: every binding is replaced.
    for name in _LORA_OPS:
        fixed = _skipping_base_tokens(getattr(lora_ops, name))
        for module in (lora_ops, torch_ops, punica_cpu):
            if hasattr(module, name):
                setattr(module, name, fixed)
    lora_ops._batchweb_fixed = True
    log.info("batchweb: vLLM's CPU LoRA ops patched to skip base-model tokens")


def _applies_base_tokens_delta(shrink: Callable[..., None]) -> bool:
    """Whether `shrink` writes an adapter's delta for a token marked -1 (no adapter)."""
    import torch

    output = torch.zeros(1, 1)
    shrink(torch.ones(1, 2), torch.ones(1, 1, 2), output, torch.tensor([-1]), 1.0)
    return bool(output.abs().sum() > 0)


def _skipping_base_tokens(op: Callable[..., None]) -> Callable[..., None]:
    """`op` (inputs, lora weights, output, token slots, ...) run with base tokens' slots
    pointed at slot 0, then their output rows put back as they were: what the op wrote
    there was another adapter's delta."""

    @functools.wraps(op)
    def fixed(inputs: Any, weights: Any, output: Any, indices: Any, *args: Any,
              **kwargs: Any) -> None:
        base = indices < 0
        # One input row spread over many output rows has no row to keep per token.
        if indices.shape[0] != output.shape[0] or not bool(base.any()):
            op(inputs, weights, output, indices, *args, **kwargs)
            return
        kept = output[base].clone()
        op(inputs, weights, output, indices.clamp(min=0), *args, **kwargs)
        output[base] = kept

    return fixed


def _fix_compile_cache_load() -> None:
    import inspect

    import torch.compiler
    from vllm.compilation import decorators

    load = torch.compiler.load_compiled_function
    if getattr(load, "_batchweb_fixed", False) or ".compiled_fn.finalize_loading(" not in (
            inspect.getsource(decorators._try_load_aot_compiled_fn)):
        return

    @functools.wraps(load)
    def loading(*args: Any, **kwargs: Any) -> Any:
        loaded = load(*args, **kwargs)
        compiled = loaded._artifacts.compiled_fn
        if not hasattr(compiled, "finalize_loading"):
            compiled.finalize_loading = lambda vllm_config: None
        return loaded

    loading._batchweb_fixed = True  # type: ignore[attr-defined]
    # vLLM's decorators look it up on torch.compiler at each load.
    torch.compiler.load_compiled_function = loading
    log.info("batchweb: vLLM's compile cache made loadable for torch's inductor backend")
