"""The speculative verification core shared by ``fef`` and ``ar_spec``: a pure function over tensors.

Samplers verify through one call, ``rejection_sample(drafts, draft_logits, target_logits, num_drafts,
temperature=, noise=, has_bonus=)``, in vLLM's shape: a ``Noise`` object says where the random numbers
come from (explicit tensors, a counter seed, or a generator), then one rule accepts or rejects. The
rule, its numerics and the layout of the target rows are documented once, in ``dllm.kernels.verify``
beside the fused Triton kernel; kernels sit on the ground floor, below the samplers, so the rule's torch
reference lives there and this module is the samplers' door to it (``verify`` is the rule on
probabilities, ``rejection_sample`` on logits with the kernel dispatched behind it).
"""

from __future__ import annotations

import torch

from dllm.kernels.verify import Continuations, Noise, VerifyResult, verify_logits, verify_tree_logits
from dllm.kernels.verify import verify_probs as verify

__all__ = ["Continuations", "Noise", "VerifyResult", "rejection_sample", "verify"]


def rejection_sample(
    draft_tokens: torch.Tensor,  # [B, K]
    draft_logits: torch.Tensor | None,  # [B, K, V] the drafts were sampled from; None for point masses
    target_logits: torch.Tensor,  # [B, K or K + 1, V]
    num_drafts: torch.Tensor | None = None,  # [B] valid drafts per row (default K)
    *,
    temperature: float,  # 0: greedy
    noise: Noise,
    has_bonus: torch.Tensor | None = None,  # [B] bool; default: True iff target has K + 1 rows
    alternatives: torch.Tensor | None = None,  # [B, K, A] a draft tree's further candidates per depth (-1: none)
    leaf_logits: torch.Tensor | None = None,  # [B, K, A, V] the target after each alternative
    continuations: Continuations | None = None,  # or: drafts after each alternative, with their targets
) -> VerifyResult:
    """Accept drafts while u < target/draft, then one correction or bonus (Triton or reference); with
    ``alternatives``, a draft tree by the recursive rule (``dllm.kernels.verify``)."""
    if not isinstance(noise, Noise):
        raise ValueError(f"rejection_sample: noise must be a dllm.samplers.verify.Noise, got {type(noise).__name__}")
    if alternatives is not None:
        if draft_logits is None or (leaf_logits is None) == (continuations is None):
            raise ValueError("rejection_sample: a draft tree needs draft_logits (the law its candidates were drawn "
                             "from) and either leaf_logits or continuations")
        return verify_tree_logits(draft_tokens, alternatives, draft_logits, target_logits, leaf_logits, num_drafts,
                                  temperature=temperature, has_bonus=has_bonus, noise=noise,
                                  continuations=continuations)
    return verify_logits(draft_tokens, draft_logits, target_logits, num_drafts, temperature=temperature,
                         has_bonus=has_bonus, noise=noise)
