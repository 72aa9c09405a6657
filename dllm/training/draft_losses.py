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
LOG_FLOOR = -100.0  # log-probability standing in for a forbidden token's -inf inside a KL (e^-100)


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
    p, q = log_p.exp(), log_q.exp()
    if objective == "ce":
        per = _kl(q, log_q, log_p)
    elif objective == "tv":
        per = 0.5 * (p - q).abs().sum(dim=-1)
    else:
        per = torch.where(accepted.bool(), _kl(q, log_q, log_p), _kl(p, log_p, log_q))
    if valid is None:
        return per.mean()
    valid = valid.bool()
    return (per * valid).sum() / valid.sum().clamp(min=1)


def _kl(w: torch.Tensor, log_w: torch.Tensor, log_other: torch.Tensor) -> torch.Tensor:
    """sum_v w (log w - log other) [..., V] -> [...], a token with w = 0 adding 0 in value AND gradient.

    A token both distributions forbid (the mask token: -inf in both) would give 0 * (-inf - -inf) = nan;
    selecting 0 there before the product keeps the backward pass finite too (nan_to_num would not). Where
    only ``other`` forbids a token the KL is infinite; ``other`` is floored at LOG_FLOOR so that the loss
    stays finite and its gradient still pushes the mass off that token.
    """
    gap = torch.where(w > 0, log_w - log_other.clamp(min=LOG_FLOOR), torch.zeros_like(log_w))
    return (w * gap).sum(dim=-1)
