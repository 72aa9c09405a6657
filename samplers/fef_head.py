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

from .drafters import MarginalDrafts


class HeadDrafts(MarginalDrafts):
    """Marginal draft logits from the state call, then drafts from ``head`` over the window."""

    def __init__(self, head: DraftHead):
        self.head = head
        self.features: torch.Tensor | None = None  # [R, Ls, D] of the last state call

    def logits(self, view) -> tuple[torch.Tensor, bool]:
        logits, self.features = view.call(view.x, torch.arange(view.x.shape[0], device=view.x.device), hidden=True)
        return logits, True

    @torch.no_grad()
    def sample(self, view, draft_logits: torch.Tensor, positions: torch.Tensor, temperature: float,
               generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Head drafts at ``positions`` [R, W] -> (tokens [R, W], the logits each was drawn from [R, W, V])."""
        rows = torch.arange(positions.shape[0], device=positions.device)
        head = self.head if next(self.head.parameters()).device == positions.device else self.head.to(positions.device)
        features = self.features[rows[:, None], positions]  # [R, W, D]
        base = forbid_token(draft_logits[rows[:, None], positions], view.mask_token_id)  # [R, W, V]
        offsets = positions - torch.cat([positions[:, :1], positions[:, :-1]], dim=1)  # s_j - s_{j-1}
        previous = torch.zeros_like(positions)  # slot j holds d_{j-1}
        tokens, steps = torch.zeros_like(positions), []
        for j in range(positions.shape[1]):
            # The window is at most a block long, so re-running the head on the prefix is cheaper than
            # keeping a cache for it; step j reads only slots <= j (causal attention).
            logits = forbid_token(head(features[:, : j + 1], base[:, : j + 1], previous[:, : j + 1],
                                       offsets[:, : j + 1])[:, j], view.mask_token_id)
            tokens[:, j] = sample_from_logits(logits, temperature, bind_rows(generator, rows))
            if j + 1 < positions.shape[1]:
                previous[:, j + 1] = tokens[:, j]
            steps.append(logits)
        return tokens, torch.stack(steps, dim=1)
