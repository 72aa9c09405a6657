"""``fef``: exact speculative denoising. Drafts from cheap marginals, verified against the sequential chain.

One round per row (shapes for R active rows, window W):
1. window: the next W candidate positions in ``order``, predicted from the draft logits;
2. drafts: d_j ~ softmax(draft_logits[s_j] / T), independently (the factorized marginals);
3. verify: copy c of the sequence has drafts d_<c revealed; one batched model call gives each copy's
   logits. Copy c must agree that s_c is the position ``sequential`` reveals next (always true for
   left_to_right); the first copy that disagrees ends the drafts, and its own choice becomes the bonus.
   Target row c is copy c at s_c; the bonus row is the copy after the last draft at its chosen position;
4. ``verify`` accepts each draft with probability min(1, target/draft) and draws the correction from the
   residual (or the bonus);
5. reveal the emitted tokens; the rest of the window stays masked.

The emitted tokens are distributed exactly as ``sequential`` with the same order and temperature, for
any model: verification compares against the same conditionals sequential would use, and position
choices are re-checked on the copies. Temperature 0 accepts while the draft is the copy's argmax and
reproduces greedy ``sequential`` token for token.

``draft`` chooses where draft logits come from:
- ``"marginal"``: a model call on the current state (copy 0 of the verify step, so it is reused and
  the first draft is always accepted): two calls per round, at least two tokens per round;
- ``"stale"``: the logits of the verified copy that matches the new state's revealed drafts, from the
  previous round's verify call (no draft call at all); still exact, since any proposal works as long as
  drafts are sampled from the very probabilities the test uses. One call per round.
- ``"head"``: the state call as for marginal drafts, then a trained causal draft head drafts the window
  (draft j conditioned on drafts 0..j-1; ``samplers/fef_head.py``), no extra backbone call.
All are draft-source objects (``MarginalDrafts``, ``StaleDrafts`` in ``samplers/drafters.py``, ``HeadDrafts``
in ``samplers/fef_head.py``), chosen once per call; the loop asks the source for draft logits, the round
samples the drafts through it and tells it the verified copy afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dllm.defaults import FEF_HEAD
from dllm.models.draft_head import load_draft_head
from dllm.numerics import bind_rows, forbid_token
from dllm.stats import DecodeStats

from .canvas import View
from .drafters import MarginalDrafts, StaleDrafts
from .fef_head import HeadDrafts
from .order import choose_window, pick_next
from .verify import Noise, rejection_sample

DRAFT_SOURCES = ("marginal", "stale", "head")
VERIFIERS = ("copies", "structured")


@dataclass
class FefStepper:
    """Speculative denoising rounds over the active block; see the module docstring.

    ``logits`` is the draft source's (so its state call is the source's own, one frame from the loop) and
    ``step`` is one round, with copies or with the model's one-pass verifier, both chosen once per call.
    """

    temperature: float
    generator: torch.Generator
    stats: DecodeStats
    order: str = "left_to_right"
    window: int = 4
    draft: str = "marginal"
    verifier: str = "copies"
    draft_head: object = None  # draft="head": a head folder or DraftHead (None: the shipped head)
    # Draft trees run on two-stream models only (samplers/two_stream.py); the registry refuses them here.
    draft_candidates: int = 1
    candidates_below: float | None = None

    def __post_init__(self) -> None:  # the source is chosen once, not per round
        head = FEF_HEAD if self.draft_head is None else self.draft_head
        sources = {"stale": StaleDrafts, "head": lambda: HeadDrafts(load_draft_head(head))}
        self.source = sources.get(self.draft, MarginalDrafts)()
        self.logits = self.source.logits  # (view) -> (draft logits [R, Ls, V], whether they are the model at the state)
        self.step = self.structured_round if self.verifier == "structured" else self.round

    @property
    def lookahead(self) -> bool:
        """Stale drafts want the next block's logits from each call (see BlockCacheSession)."""
        return self.source.lookahead

    def begin_block(self, block: int) -> None:
        pass  # stale logits carry over: the last round's copy already scored the next block

    def round(self, view: View, proposal: tuple[torch.Tensor, bool]) -> tuple[torch.Tensor, dict]:
        """One draft-verify-reveal round for the view's R rows from ``proposal`` = (draft logits [R, Ls, V],
        whether they are the model at view.x itself, so that they serve as copy 0); see the module docstring."""
        draft_logits, draft_is_state = proposal
        generator = bind_rows(self.generator, view.rows)  # every draw below is per view row
        x, mask_id = view.x, view.mask_token_id
        rows = torch.arange(x.shape[0], device=x.device)
        positions, count = choose_window(self.order, draft_logits, view.candidates(x), mask_id, self.window)
        drafts, window_logits = self.source.sample(view, draft_logits, positions, self.temperature, generator)

        copies, copy_index, row_of = _build_copies(x, positions, drafts, count, skip_first=draft_is_state)
        copy_logits = view.call(copies, row_of)
        all_logits = torch.cat([draft_logits, copy_logits]) if draft_is_state else copy_logits
        all_tokens = torch.cat([x, copies]) if draft_is_state else copies
        if draft_is_state:  # the draft call was made on x itself: it is copy 0, stored first in all_logits
            copy_index = torch.where(copy_index >= 0, copy_index + x.shape[0], copy_index)
            copy_index[:, 0] = rows

        # The position sequential would reveal next in every copy, from that copy's own logits.
        picks_flat = pick_next(self.order, all_logits, view.candidates(all_tokens), mask_id)
        picks = torch.where(copy_index >= 0, picks_flat[copy_index.clamp(min=0)], -1)  # [R, W + 1]
        width = positions.shape[1]
        agree = (picks[:, :width] == positions) | (torch.arange(width, device=x.device) >= count[:, None])
        num_drafts = torch.minimum(count, (~agree).long().argmax(dim=1) + agree.all(dim=1).long() * width)

        # Target row c < num_drafts: copy c at s_c; row num_drafts: that copy at its own pick (the bonus).
        target_positions = torch.cat([positions, positions[:, :1]], dim=1)
        target_positions[rows, num_drafts] = picks[rows, num_drafts].clamp(min=0)
        has_bonus = picks[rows, num_drafts] >= 0
        target_logits = forbid_token(all_logits[copy_index.clamp(min=0), target_positions], mask_id)  # [R, W+1, V]
        outcome = rejection_sample(drafts, window_logits, target_logits, num_drafts, temperature=self.temperature,
                                   has_bonus=has_bonus, noise=Noise(generator=generator))
        next_logits = all_logits[copy_index[rows, outcome.num_accepted]]
        return self._reveal(view, positions, drafts, num_drafts, target_positions, outcome, next_logits, target_logits)

    def structured_round(self, view: View, proposal: tuple[torch.Tensor, bool]) -> tuple[torch.Tensor, dict]:
        """A left-to-right round verified by the model's one-pass ``structured_verify`` instead of copies.

        Exact with respect to the conditionals that pass defines; they equal the sequential chain's only for
        a model trained for it (or a one-layer model), so generate labels the output approximate.
        """
        draft_logits, _ = proposal
        generator = bind_rows(self.generator, view.rows)
        x, mask_id = view.x, view.mask_token_id
        rows = torch.arange(x.shape[0], device=x.device)
        ranked, available = choose_window("left_to_right", draft_logits, view.candidates(x), mask_id, self.window + 1)
        width = min(self.window, ranked.shape[1])
        positions, count = ranked[:, :width], available.clamp(max=width)
        bonus = torch.full_like(count, -1)
        if ranked.shape[1] > width:  # the next position after the window, where the row has one
            bonus = torch.where(available > width, ranked[:, width], bonus)
        drafts, window_logits = self.source.sample(view, draft_logits, positions, self.temperature, generator)
        targets = view.structured(x, positions, drafts, count, bonus)
        targets, state_logits = forbid_token(targets[0], mask_id), targets[1]
        outcome = rejection_sample(drafts, window_logits, targets, count,
                                   temperature=self.temperature, has_bonus=bonus >= 0, noise=Noise(generator=generator))
        target_positions = torch.cat([positions, positions[:, :1]], dim=1)
        target_positions[rows, count] = bonus.clamp(min=0)
        # The state's logits are a valid proposal for the next round (any proposal keeps verification exact).
        return self._reveal(view, positions, drafts, count, target_positions, outcome, state_logits, targets)

    def _reveal(self, view: View, positions, drafts, num_drafts, target_positions, outcome, next_logits,
                target_logits):
        """Write the emitted tokens at their positions, count the round and hand ``next_logits`` [R, Ls, V]
        (the verified copy matching the new state) to the draft source -> (tokens [R, Ls], event fields);
        ``target_logits`` [R, W + 1, V] (what draft j was tested against, then the bonus) ride on the event."""
        self.stats.count_verification(num_drafts, outcome.num_accepted, outcome.num_emitted)
        emitted_positions = torch.where(outcome.tokens >= 0, target_positions, -1)  # [R, W + 1], -1: nothing
        new_x = view.x.clone()
        hit = emitted_positions >= 0
        rows = torch.arange(view.x.shape[0], device=view.x.device)
        new_x[rows[:, None].expand_as(hit)[hit], emitted_positions[hit]] = outcome.tokens[hit]
        self.source.observe(view, next_logits)
        revealed = torch.where(emitted_positions >= 0, emitted_positions + view.offset, -1)
        return new_x, {"sampler": "fef", "window": positions + view.offset, "drafts": drafts,
                       "num_drafts": num_drafts, "num_accepted": outcome.num_accepted, "revealed": revealed,
                       "target_logits": target_logits}


def _build_copies(
    x: torch.Tensor,  # [R, L]
    positions: torch.Tensor,  # [R, W]
    drafts: torch.Tensor,  # [R, W]
    count: torch.Tensor,  # [R]
    skip_first: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Copy c of row r reveals drafts 0..c-1, for c = 0 (or 1) .. count[r].

    Returns the copies [N, L], their index per (row, c) [R, W + 1] (-1 where no copy was built) and the
    row of each copy [N]. Rows build only the copies they need, so ragged windows cost no padding.
    """
    width = positions.shape[1]
    c = torch.arange(width + 1, device=x.device)
    wanted = (c[None, :] <= count[:, None]) & (c[None, :] >= int(skip_first))  # [R, W + 1]
    row_of, copy_of = wanted.nonzero(as_tuple=True)
    copies = x[row_of].clone()
    reveal = torch.arange(width, device=x.device)[None, :] < copy_of[:, None]  # [N, W]
    current = copies.gather(1, positions[row_of])
    copies.scatter_(1, positions[row_of], torch.where(reveal, drafts[row_of], current))
    index = torch.full(wanted.shape, -1, dtype=torch.long, device=x.device)
    index[row_of, copy_of] = torch.arange(row_of.numel(), device=x.device)
    return copies, index, row_of
