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

__all__ = ["Continuations", "Noise", "VerifyResult", "rejection_sample", "tree_path", "verify"]


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


def tree_path(drafts: torch.Tensor, target_logits: torch.Tensor, outcome: VerifyResult,
              continuations: Continuations | None = None, leaf_logits: torch.Tensor | None = None) -> dict:
    """``StepEvent``'s draft fields for a round: ``drafts`` [R, K] and ``target_logits`` [R, K + 1, V] along the
    path verification followed (a taken sibling in place of the chain's draft, then its branch's drafts and
    targets when it has ``continuations``, or its leaf row, ``leaf_logits`` [R, K, A, V], after a sibling that
    is a leaf), with ``branch``, ``branch_depth`` and ``replaced`` (the chain's draft the sibling replaced; -1:
    none) for a draft tree. Row k of the path's ``target_logits`` is then the law the k-th emitted token was
    drawn from (whichever of accepted draft, sibling, correction or bonus it was): ``emitted_logits``."""
    if outcome.branch is None:
        return {"drafts": drafts, "target_logits": target_logits, "emitted_logits": target_logits}
    took = outcome.branch > 0
    depth = torch.where(took, outcome.branch_depth, -1)
    rows = took.nonzero().squeeze(-1)
    j = depth[rows]
    path, replaced = drafts.clone(), torch.full_like(depth, -1)
    replaced[rows] = drafts[rows, j]
    path[rows, j] = outcome.tokens[rows, j]
    if continuations is not None and rows.numel():
        slot = continuations.slot[rows, j, outcome.branch[rows] - 1]
        branch = continuations.tokens[slot]  # -1 at and before the sibling's depth, and past the row's drafts
        path[rows] = torch.where(branch >= 0, branch, path[rows])
        target_logits = target_logits.clone()
        after = torch.arange(target_logits.shape[1], device=j.device)[None, :] > j[:, None]
        target_logits[rows] = torch.where(after[..., None], continuations.targets[slot], target_logits[rows])
    elif leaf_logits is not None and rows.numel():  # the token after a leaf sibling came from its leaf row
        target_logits = target_logits.clone()
        target_logits[rows, j + 1] = leaf_logits[rows, j, outcome.branch[rows] - 1].to(target_logits.dtype)
    return {"drafts": path, "target_logits": target_logits, "emitted_logits": target_logits,
            "branch": outcome.branch, "branch_depth": depth, "replaced": replaced}
