"""fef's draft sources: where a round's draft logits come from (the ``draft`` option).

- ``MarginalDrafts`` (``"marginal"``): a model call at the current state, which also serves as verify copy 0;
- ``StaleDrafts`` (``"stale"``): the logits of the verified copy matching the new state, from the previous
  round's verify call (no draft call);
- ``HeadDrafts`` (``"head"``): the state call returns the backbone's features too, then a trained causal draft
  head (``dllm.models.draft_head``) drafts the window in W cheap steps, step j conditioned on drafts 0..j-1
  (``head_drafts``, also the two-stream layout's), no further backbone call.
Each draft is sampled with the per-row generators, and the logits it was sampled from go to the verifier, so
the output law is unchanged for any source (``samplers/drafting.py``).
"""

from __future__ import annotations

import torch

from dllm.models.draft_head import DraftHead
from dllm.numerics import bind_rows, forbid_token, sample_from_logits

from ..canvas import Band
from ..drafting import draft_survival, independent_drafts
from ..order import read_band


class MarginalDrafts:
    """fef's ``draft="marginal"``: a model call on the current state, which also serves as verify copy 0.

    Every call of a round reads logits on one band per row (``band``): left to right the window and the bonus
    position after it, W + 1 positions from the first masked one; in another order the active block."""

    lookahead = False  # the session need not score the next block
    wants_next = False  # the round need not hand over the verified copy matching the new state

    def __init__(self, order: str = "left_to_right", window: int = 4):
        self.order, self.window = order, window

    def band(self, view) -> Band:
        """The view positions every call of this round reads, per row."""
        return read_band(self.order, view, self.window + 1)

    def logits(self, view) -> tuple[torch.Tensor, bool, Band]:
        """Draft logits for the view's rows on their band [R, K, V], whether they are the model at ``view.x``,
        and the band."""
        band = self.band(view)
        return view.call(view.x, torch.arange(view.x.shape[0], device=view.x.device), at=band.at()), True, band

    def observe(self, view, next_logits: torch.Tensor, band: Band) -> None:
        """After a round (``wants_next``): ``next_logits`` [R, K, V] on ``band`` are the verified copy matching
        the new state."""

    def sample(self, view, draft_logits: torch.Tensor, positions: torch.Tensor, temperature: float,
               generator: torch.Generator, cutoff: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Drafts at the window ``positions`` [R, W] (slots of the band) -> (tokens [R, W'], the logits they were
        drawn from [R, W', V], mask token forbidden). Here independent draws from ``draft_logits`` [R, K, V], all
        W; a source that conditions draft j on drafts 0..j-1 (a draft head) overrides this and stays exact as long
        as it returns the very logits it sampled from, and may stop early (W' < W) once every row's drafts fall
        below ``cutoff`` (``samplers/drafting.py: cut_count``)."""
        rows = torch.arange(positions.shape[0], device=positions.device)
        return independent_drafts(draft_logits[rows[:, None], positions], view.mask_token_id, temperature, generator)


class StaleDrafts(MarginalDrafts):
    """fef's ``draft="stale"``: the previous round's verified copy (no draft call); a fresh call in a row's
    first round.

    Its band reaches further than the marginal one, so that the copy matching the new state also covers the
    next round's window: left to right 2W + 2 positions (a round emits at most W + 1 tokens, so the next window
    starts at most W + 1 on), in another order the active block and the next one (``lookahead``: the block
    cache's view holds it). Every later window lies inside what the last round stored, by construction, so no
    check reads the device."""

    lookahead = True  # each call also scores the next block, so its first round can draft stale too
    wants_next = True

    def __init__(self, order: str = "left_to_right", window: int = 4) -> None:
        super().__init__(order, window)
        self.stale: torch.Tensor | None = None  # [B, K, V] per canvas row, on its band
        self.start: torch.Tensor | None = None  # [B] canvas position of each row's first stored slot

    def band(self, view) -> Band:
        return read_band(self.order, view, 2 * self.window + 2, ahead=True)

    def logits(self, view) -> tuple[torch.Tensor, bool, Band]:
        band = self.band(view)
        if self.stale is None:  # the state call itself, not through super(): one frame fewer below generate
            return view.call(view.x, torch.arange(view.x.shape[0], device=view.x.device), at=band.at()), True, band
        shift = band.start + view.offset - self.start[view.rows]  # [R] >= 0: the band moved right
        slots = (shift[:, None] + torch.arange(band.width, device=shift.device)).clamp(max=self.stale.shape[1] - 1)
        # slots past what was stored hold the last stored column: past the next window, never read
        return self.stale[view.rows].gather(1, slots[..., None].expand(-1, -1, self.stale.shape[2])), False, band

    def observe(self, view, next_logits: torch.Tensor, band: Band) -> None:
        if self.stale is None:
            self.stale = next_logits.new_zeros((view.batch, *next_logits.shape[1:]))
            self.start = band.start.new_zeros(view.batch)
        self.stale[view.rows] = next_logits
        self.start[view.rows] = band.start + view.offset


class HeadDrafts(MarginalDrafts):
    """Marginal draft logits from the state call, then drafts from ``head`` over the window."""

    def __init__(self, head: DraftHead, order: str = "left_to_right", window: int = 4, compiled: bool = False):
        super().__init__(order, window)
        self.head, self.compiled = head, compiled
        self.features: torch.Tensor | None = None  # [R, K, D] of the last state call, on its band
        self.inputs: tuple | None = None  # the last window's head inputs (``redraft``)

    def logits(self, view) -> tuple[torch.Tensor, bool, Band]:
        band = self.band(view)
        logits, self.features = view.call(view.x, torch.arange(view.x.shape[0], device=view.x.device), hidden=True,
                                          at=band.at())
        return logits, True, band

    @torch.no_grad()
    def sample(self, view, draft_logits: torch.Tensor, positions: torch.Tensor, temperature: float,
               generator: torch.Generator, cutoff: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Head drafts at ``positions`` [R, W] (slots of the band) -> (tokens [R, W'], the logits each was drawn
        from [R, W', V]; W' < W when every row fell below ``cutoff`` first)."""
        rows = torch.arange(positions.shape[0], device=positions.device)
        features = self.features[rows[:, None], positions]  # [R, W, D]
        base = draft_logits[rows[:, None], positions]  # [R, W, V]
        offsets = positions - torch.cat([positions[:, :1], positions[:, :-1]], dim=1)  # s_j - s_{j-1}
        self.inputs = (features, base, torch.zeros_like(positions[:, 0]), offsets, view.mask_token_id)
        return head_drafts(self.head, *self.inputs[:4], temperature, generator, view.mask_token_id, cutoff=cutoff,
                           compiled=self.compiled)

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
                mask_id: int | None, forced: torch.Tensor | None = None,
                cutoff: float | None = None, compiled: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft a window in W head steps, each sampled before the next reads it (fef and the two-stream
    samplers share this loop) -> (tokens [R, W], the logits each was drawn from [R, W, V]).

    features [R, W, D] and base [R, W, V] at the window's positions; ``first`` [R] seeds slot 0's previous
    token (read only by a ``condition_first`` head); offsets [R, W] (slot 0 likewise). One draw per row and
    slot with the per-row generators, as ``independent_drafts`` draws. ``forced`` [R, W] (-1: draw): the
    token a slot takes instead of its draw (a draft tree's branch, drafted after the path it follows); the
    draw is made all the same, so a row's random stream does not depend on what was forced. ``cutoff``: the
    steps stop once no row's ``draft_survival`` is still at least it (those drafts would be cut: fewer head steps,
    W' < W columns; one host read per step). ``compiled``: the head's steps through ``torch.compile``.
    """
    rows = torch.arange(features.shape[0], device=features.device)
    if next(head.parameters()).device != features.device:
        head = head.to(features.device)
    steps = head.start(features, forbid_token(base, mask_id), compiled)  # one cached head step per slot
    tokens, drawn, token, survival = torch.zeros_like(offsets), [], first, None
    for j in range(offsets.shape[1]):
        logits = steps.next(token, offsets[:, j])  # base forbids the mask token: so does the step's sum
        token = sample_from_logits(logits, temperature, bind_rows(generator, rows))
        if forced is not None:
            token = torch.where(forced[:, j] >= 0, forced[:, j], token)
        tokens[:, j] = token
        drawn.append(logits)
        if cutoff is not None:
            survival = draft_survival(logits[:, None], token[:, None])[:, 0] * (1.0 if survival is None else survival)
            if not bool((survival >= cutoff).any()):
                break
    return tokens[:, : len(drawn)], torch.stack(drawn, dim=1)
