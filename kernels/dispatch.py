"""When the Triton kernels run: CUDA tensors and an installed Triton; the torch references otherwise."""

from __future__ import annotations

import functools
import importlib.util

import torch


@functools.cache
def triton_installed() -> bool:
    """Whether ``import triton`` would succeed; checked without importing it (importing is slow)."""
    return importlib.util.find_spec("triton") is not None


def use_triton(tensor: torch.Tensor) -> bool:
    """The dispatch rule shared by every kernel: Triton for CUDA tensors when it is installed."""
    return tensor.is_cuda and triton_installed()
