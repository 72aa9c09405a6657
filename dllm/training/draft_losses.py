"""Losses for draft heads, one place for every drafter recipe (fef draft head, EAGLE head, repair head).

A draft is accepted with probability sum_v min(p_draft(v), p_target(v)) = 1 - TV(p_draft, p_target) (the
rejection rule of ``samplers/verify.py``), so the targets are free: the target model's own distributions at
the positions the drafts are verified at. Objectives over logits [..., V] (each position one distribution):

- ``"ce"``: forward KL(target || draft), the cross-entropy against the target's distribution up to a
  constant (EAGLE/DFlash-style offline distillation);
- ``"tv"``: total variation, the quantity acceptance depends on (Bebop): its gradient is zero where the
  draft already covers the target and pushes mass only where the two differ;
- ``"opd"``: on-policy (Draft-OPD): forward KL where the draft was accepted, reverse KL(draft || target)
  where it was rejected (``accepted`` bool [...] required).

``valid`` [...] (bool) drops positions (padding, window slots past a row's count); the mean is over the rest.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

OBJECTIVES = ("ce", "tv", "opd")


def expected_acceptance(draft_logits: torch.Tensor, target_logits: torch.Tensor,
                        temperature: float = 1.0) -> torch.Tensor:
    """Probability each draft position is accepted, sum_v min(p, q) at ``temperature`` -> [...]."""
    p = F.softmax(draft_logits.float() / temperature, dim=-1)
    q = F.softmax(target_logits.float() / temperature, dim=-1)
    return torch.minimum(p, q).sum(dim=-1)


def draft_loss(objective: str, draft_logits: torch.Tensor, target_logits: torch.Tensor, *,
               accepted: torch.Tensor | None = None, valid: torch.Tensor | None = None,
               temperature: float = 1.0) -> torch.Tensor:
    """Mean ``objective`` loss of drafts [..., V] against the target's (no gradient) [..., V] -> scalar."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    if objective == "opd" and accepted is None:
        raise ValueError("objective='opd' needs accepted= (which drafts the target accepted)")
    log_p = F.log_softmax(draft_logits.float() / temperature, dim=-1)
    log_q = F.log_softmax(target_logits.detach().float() / temperature, dim=-1)
    q = log_q.exp()
    forward = (q * (log_q - log_p)).nan_to_num().sum(dim=-1)  # 0 * -inf where the target forbids a token
    if objective == "ce":
        per = forward
    elif objective == "tv":
        per = 0.5 * (log_p.exp() - q).abs().sum(dim=-1)
    else:
        p = log_p.exp()
        reverse = (p * (log_p - log_q)).nan_to_num().sum(dim=-1)
        per = torch.where(accepted.bool(), forward, reverse)
    if valid is None:
        return per.mean()
    valid = valid.bool()
    return (per * valid).sum() / valid.sum().clamp(min=1)
