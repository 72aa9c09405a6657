"""Which masked position the exact samplers reveal next (the ``order`` option of sequential and fef).

- ``left_to_right``: the leftmost masked position of the active block.
- ``confidence``: the masked position of the active block whose untempered distribution
  softmax(logits) has the highest top-1 probability; ties go to the leftmost. The choice depends on
  the revealed tokens only (through the logits), never on sampled values, so it is part of the
  sequential chain that fef verifies.
"""

from __future__ import annotations

import torch

from dllm.numerics import forbid_token

from .canvas import Band, View

ORDERS = ("left_to_right", "confidence")


def top1_probability(logits: torch.Tensor) -> torch.Tensor:
    """Largest probability of softmax(logits) along the last axis, in float32 -> logits.shape[:-1]."""
    scores = logits.float()
    return torch.exp(scores.max(-1).values - torch.logsumexp(scores, dim=-1))


def position_scores(order: str, logits: torch.Tensor, candidates: torch.Tensor, mask_token_id: int) -> torch.Tensor:
    """Score per position (higher is revealed first), -inf off the candidates -> [R, L] float32.

    ``logits`` [R, L, V]; the mask token is excluded before the top-1 probability is taken.
    """
    scores = torch.full(candidates.shape, float("-inf"), device=candidates.device)
    if order == "left_to_right":
        positions = torch.arange(candidates.shape[1], device=candidates.device, dtype=torch.float32)
        return torch.where(candidates, -positions, scores)
    # Every position's score, then the candidates': no data-dependent shape (a host sync on a GPU); logits
    # cover a round's band (a block), so the extra positions cost little.
    return torch.where(candidates, top1_probability(forbid_token(logits, mask_token_id)), scores)


def pick_next(order: str, logits: torch.Tensor, candidates: torch.Tensor, mask_token_id: int) -> torch.Tensor:
    """Position that the sequential chain reveals next per row, -1 where nothing is masked -> [R]."""
    scores = position_scores(order, logits, candidates, mask_token_id)
    # argmax returns the first maximum, so ties go to the leftmost position.
    return torch.where(candidates.any(dim=1), scores.argmax(dim=1), torch.full_like(scores[:, 0], -1).long())


def choose_window(
    order: str, logits: torch.Tensor, candidates: torch.Tensor, mask_token_id: int, size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The next ``size`` positions in ``order`` as predicted from ``logits``.

    Returns positions [R, size] (unused slots hold 0) and the number of valid slots per row [R].
    """
    scores = position_scores(order, logits, candidates, mask_token_id)
    # A stable descending sort keeps equal scores in position order: ties go leftmost, as in pick_next.
    ranked = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :size]
    count = candidates.sum(dim=1).clamp(max=size)
    valid = torch.arange(ranked.shape[1], device=ranked.device) < count[:, None]
    return torch.where(valid, ranked, torch.zeros_like(ranked)), count


def read_band(order: str, view: View, width: int, ahead: bool = False) -> Band:
    """Where a round of an exact sampler reads logits: left to right, ``width`` positions from each row's first
    masked one (the window, the bonus after it, what a stale draft reads next); in any other order the whole
    active block (the choice of the next position reads every candidate), and with ``ahead`` the next block."""
    if order == "left_to_right":
        first = view.candidates(view.x).int().argmax(dim=1)  # the first True; rows in a view have one
        return Band(first, width, view.x.shape[1])
    start, stop = view.block
    return view.block_band(stop - start if ahead else 0)
