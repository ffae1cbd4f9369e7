"""The fix engine/vllm_patches.py applies to vLLM's CPU LoRA ops, on small tensors: base
tokens (slot -1) keep their output rows, adapter tokens get exactly the original result."""

from __future__ import annotations

import pytest

from engine.vllm_patches import _applies_base_tokens_delta, _skipping_base_tokens
from tests.engine import needs_vllm

pytestmark = [needs_vllm, pytest.mark.engine]


def original(name: str):
    from vllm.lora.ops.torch_ops import lora_ops

    op = getattr(lora_ops, name)
    return getattr(op, "__wrapped__", op)  # the fix, once applied, wraps vLLM's own


def test_vllms_own_op_applies_the_last_adapter_to_base_tokens() -> None:
    # If this fails, the installed vLLM fixed its bug: the patch then no longer applies.
    assert _applies_base_tokens_delta(original("bgmv_shrink"))
    assert not _applies_base_tokens_delta(_skipping_base_tokens(original("bgmv_shrink")))


@pytest.mark.parametrize("name", ["bgmv_shrink", "bgmv_expand", "bgmv_expand_slice"])
def test_the_fix_keeps_base_rows_and_changes_nothing_else(name: str) -> None:
    import torch

    generator = torch.Generator().manual_seed(0)
    slots, rank, width, tokens = 2, 4, 6, 5
    indices = torch.tensor([0, -1, 1, -1, 1])
    if name == "bgmv_shrink":
        inputs = torch.randn(tokens, width, generator=generator)
        weights = torch.randn(slots, 1, rank, width, generator=generator)
        extra: tuple = (0.5,)
        out_width = rank
    else:
        inputs = torch.randn(tokens, rank, generator=generator)
        weights = torch.randn(slots, 1, width, rank, generator=generator)
        extra = (True,) if name == "bgmv_expand" else (2, width, True)
        out_width = width + (2 if name == "bgmv_expand_slice" else 0)
    start = torch.randn(tokens, out_width, generator=generator)

    expected = start.clone()
    original(name)(inputs, weights, expected, indices, *extra)
    got = start.clone()
    _skipping_base_tokens(original(name))(inputs, weights, got, indices, *extra)

    base = indices < 0
    assert torch.equal(got[base], start[base])
    assert torch.equal(got[~base], expected[~base])
