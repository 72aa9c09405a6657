"""Whether the Triton kernels can run in this test session: compiled on CUDA, else in Triton's interpreter.

Triton 3.6's interpreter passes scalar kernel arguments as one-element arrays, so ``range(0, vocab, BLOCK)``
over a runtime argument fails there (compiled kernels are unaffected: ``python -m dllm.kernels.compile_check``
compiles every variant with 3.6). The interpreter tests were checked with Triton 3.9, so older versions
skip them on machines without CUDA.
"""

import importlib.metadata
import importlib.util

import torch

CUDA = torch.cuda.is_available()
HAVE_TRITON = importlib.util.find_spec("triton") is not None
INTERPRETER_MIN_VERSION = (3, 9)


def triton_version() -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in importlib.metadata.version("triton").split(".")[:2])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return (0,)


KERNELS_RUN = HAVE_TRITON and (CUDA or triton_version() >= INTERPRETER_MIN_VERSION)
SKIP_REASON = ("triton is not installed" if not HAVE_TRITON else
               f"Triton {'.'.join(map(str, triton_version()))}'s interpreter cannot run these kernels "
               f"(needs >= {'.'.join(map(str, INTERPRETER_MIN_VERSION))} without CUDA)")
