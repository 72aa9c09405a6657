"""fef's ``draft="head"``: drafts from a trained causal draft head (``dllm.models.draft_head``).

The state call (copy 0 of the verify step, as for marginal drafts) also returns the backbone's features;
the head then drafts the window in W cheap steps, step j conditioned on drafts 0..j-1, with no further
backbone call. Each draft is sampled with the per-row generators exactly as ``independent_drafts`` draws
(one draw per row and window slot), and the logits it was sampled from are returned to the verifier, so
the output law is unchanged for any head, trained or random.
"""

from __future__ import annotations

import torch

from dllm.models.draft_head import DraftHead
from dllm.numerics import bind_rows, forbid_token, sample_from_logits

from .canvas import Band
from .drafters import MarginalDrafts


class HeadDrafts(MarginalDrafts):
    """Marginal draft logits from the state call, then drafts from ``head`` over the window."""

    def __init__(self, head: DraftHead, order: str = "left_to_right", window: int = 4):
        super().__init__(order, window)
        self.head = head
        self.features: torch.Tensor | None = None  # [R, K, D] of the last state call, on its band
        self.inputs: tuple | None = None  # the last window's head inputs (``redraft``)

    def logits(self, view) -> tuple[torch.Tensor, bool, Band]:
        band = self.band(view)
        logits, self.features = view.call(view.x, torch.arange(view.x.shape[0], device=view.x.device), hidden=True,
                                          at=band.at())
        return logits, True, band

    @torch.no_grad()
    def sample(self, view, draft_logits: torch.Tensor, positions: torch.Tensor, temperature: float,
               generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Head drafts at ``positions`` [R, W] (slots of the band) -> (tokens [R, W], the logits each was drawn
        from [R, W, V])."""
        rows = torch.arange(positions.shape[0], device=positions.device)
        features = self.features[rows[:, None], positions]  # [R, W, D]
        base = draft_logits[rows[:, None], positions]  # [R, W, V]
        offsets = positions - torch.cat([positions[:, :1], positions[:, :-1]], dim=1)  # s_j - s_{j-1}
        self.inputs = (features, base, torch.zeros_like(positions[:, 0]), offsets, view.mask_token_id)
        return head_drafts(self.head, *self.inputs[:4], temperature, generator, view.mask_token_id)

    @torch.no_grad()
    def redraft(self, which: torch.Tensor, forced: torch.Tensor, temperature: float,
                generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """The last window's head drafts again for rows ``which`` [K] of it, along ``forced`` [K, W] paths (-1:
        draw; a draft tree's branches) -> (tokens [K, W], logits [K, W, V])."""
        features, base, first, offsets, mask_id = self.inputs
        return head_drafts(self.head, features[which], base[which], first[which], offsets[which], temperature,
                           generator, mask_id, forced=forced)


@torch.no_grad()
def head_drafts(head: DraftHead, features: torch.Tensor, base: torch.Tensor, first: torch.Tensor,
                offsets: torch.Tensor, temperature: float, generator: torch.Generator,
                mask_id: int | None, forced: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft a window in W head steps, each sampled before the next reads it (fef and the two-stream
    samplers share this loop) -> (tokens [R, W], the logits each was drawn from [R, W, V]).

    features [R, W, D] and base [R, W, V] at the window's positions; ``first`` [R] seeds slot 0's previous
    token (read only by a ``condition_first`` head); offsets [R, W] (slot 0 likewise). One draw per row and
    slot with the per-row generators, as ``independent_drafts`` draws. ``forced`` [R, W] (-1: draw): the
    token a slot takes instead of its draw (a draft tree's branch, drafted after the path it follows); the
    draw is made all the same, so a row's random stream does not depend on what was forced.
    """
    rows = torch.arange(features.shape[0], device=features.device)
    if next(head.parameters()).device != features.device:
        head = head.to(features.device)
    steps = head.start(features, forbid_token(base, mask_id))  # one cached head step per slot
    tokens, drawn, token = torch.zeros_like(offsets), [], first
    for j in range(offsets.shape[1]):
        logits = steps.next(token, offsets[:, j])  # base forbids the mask token: so does the step's sum
        token = sample_from_logits(logits, temperature, bind_rows(generator, rows))
        if forced is not None:
            token = torch.where(forced[:, j] >= 0, forced[:, j], token)
        tokens[:, j] = token
        drawn.append(logits)
    return tokens, torch.stack(drawn, dim=1)


def branch_paths(drafts: torch.Tensor, window_logits: torch.Tensor, rows: torch.Tensor, depth: torch.Tensor,
                 sibling: torch.Tensor, redraft) -> tuple[torch.Tensor, torch.Tensor]:
    """The drafts along each draft-tree branch (fef's two layouts share this) -> (path [k, W] by depth: the
    chain's drafts before the sibling, the sibling at its ``depth``, then its continuation; the logits each
    continuation draft was drawn from [k, W, V]). Branch i roots at window row ``rows[i]``. ``redraft(rows,
    forced)``: a head's steps along the forced paths; None for independent drafts, whose chain draws fit any
    branch (the law at a position does not depend on the token before)."""
    k = rows.numel()
    index = torch.arange(k, device=drafts.device)
    if redraft is None or not k:
        path, path_logits = drafts[rows].clone(), window_logits[rows]
    else:
        steps = torch.arange(drafts.shape[1], device=drafts.device)
        forced = torch.where(steps[None, :] < depth[:, None], drafts[rows], -1)
        forced[index, depth] = sibling
        path, path_logits = redraft(rows, forced)
    path[index, depth] = sibling
    return path, path_logits
