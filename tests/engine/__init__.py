"""Tests of the engines behind `engine.base.Engine`."""

from importlib.util import find_spec

import pytest

# Skips a module of the real engine where vLLM is not installed (`make check`), without
# importing it: vLLM's import alone costs seconds of every collection that deselects it.
needs_vllm = pytest.mark.skipif(find_spec("vllm") is None,
                                reason="vLLM is not installed (make engine)")
