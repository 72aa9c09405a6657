"""The speculative verification core shared by ``fef`` and ``ar_spec``: a pure function over tensors.

The rule, its numerics and the layout of the target rows are documented once, in ``dllm.kernels.verify``
(``verify_probs``), beside the fused kernel that applies the same rule to logits (``verify_logits``).
"""

from __future__ import annotations

from dllm.kernels.verify import VerifyResult
from dllm.kernels.verify import verify_probs as verify

__all__ = ["VerifyResult", "verify"]
