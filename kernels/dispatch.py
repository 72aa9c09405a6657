"""When the Triton kernels run, and how to choose.

Modes (``DLLM_KERNELS`` in the environment, or ``dllm.kernels.use_kernels(mode)`` for a block of code):
- ``auto`` (default): Triton for CUDA tensors when Triton is installed, the torch reference otherwise;
- ``reference``: always the torch reference (to rule a kernel out when chasing a difference);
- ``triton``: always Triton; on CPU tensors only through Triton's interpreter (``TRITON_INTERPRET=1``
  set before the kernels are imported; about 10 ms per program, for tests at tiny shapes).
Calls with per-row generators (``dllm.numerics.RowGenerators``) always take the reference: a kernel draws
one seed per call, which cannot keep rows independent of the batch.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib.util
import os
from collections.abc import Iterator

import torch

MODES = ("auto", "reference", "triton")
_override: contextvars.ContextVar[str | None] = contextvars.ContextVar("dllm_kernels", default=None)  # per thread


@functools.cache
def triton_installed() -> bool:
    """Whether ``import triton`` would succeed; checked without importing it (importing is slow)."""
    return importlib.util.find_spec("triton") is not None


def kernel_mode() -> str:
    """The mode in force: the innermost ``use_kernels`` block, else ``DLLM_KERNELS``, else ``auto``."""
    if _override.get() is not None:
        return _override.get()
    mode = os.environ.get("DLLM_KERNELS", "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise ValueError(f"DLLM_KERNELS must be one of {', '.join(MODES)}; got {mode!r}")
    return mode


@contextlib.contextmanager
def use_kernels(mode: str) -> Iterator[None]:
    """Run the enclosed code with kernel dispatch ``mode`` (one of MODES); nests and restores."""
    if mode not in MODES:
        raise ValueError(f"use_kernels: mode must be one of {', '.join(MODES)}; got {mode!r}")
    token = _override.set(mode)
    try:
        yield
    finally:
        _override.reset(token)


def use_triton(tensor: torch.Tensor) -> bool:
    """The dispatch rule shared by every kernel (see the module docstring)."""
    mode = kernel_mode()
    if mode == "reference":
        return False
    if mode == "auto":
        return tensor.is_cuda and triton_installed()
    if not triton_installed():
        from dllm.extras import missing

        raise RuntimeError(missing("triton", "gpu", "kernel mode 'triton'"))
    if not tensor.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("kernel mode 'triton' on CPU tensors needs TRITON_INTERPRET=1 set before the kernels "
                           "are imported (Triton compiles kernels only for GPUs)")
    return True
