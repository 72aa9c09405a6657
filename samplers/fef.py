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
All are draft-source objects (``MarginalDrafts``, ``StaleDrafts``, ``HeadDrafts``), chosen once
per call; a round asks its source for logits and tells it the verified copy afterwards.
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


@dataclass(frozen=True)
class RoundResult:
    """What one fef round did for its R rows."""

    x: torch.Tensor  # [R, Ls] the view's tokens after the round
    next_logits: torch.Tensor  # [R, Ls, V] logits of the copy whose revealed drafts match the new state
    window: torch.Tensor  # [R, W] window positions
    drafts: torch.Tensor  # [R, W] drafted tokens
    num_drafts: torch.Tensor  # [R] drafts verified (window size, cut at a position disagreement)
    num_accepted: torch.Tensor  # [R]
    emitted_positions: torch.Tensor  # [R, W + 1], -1 where nothing was emitted


@dataclass
class FefStepper:
    """Speculative denoising rounds over the active block; see the module docstring."""

    temperature: float
    generator: torch.Generator
    stats: DecodeStats
    order: str = "left_to_right"
    window: int = 4
    draft: str = "marginal"
    verifier: str = "copies"
    draft_head: object = None  # draft="head": a head folder or DraftHead (None: the shipped head)

    def __post_init__(self) -> None:  # the source is chosen once, not per round
        head = FEF_HEAD if self.draft_head is None else self.draft_head
        sources = {"stale": StaleDrafts, "head": lambda: HeadDrafts(load_draft_head(head))}
        self.source = sources.get(self.draft, MarginalDrafts)()

    @property
    def lookahead(self) -> bool:
        """Stale drafts want the next block's logits from each call (see BlockCacheSession)."""
        return self.source.lookahead

    def begin_block(self, block: int) -> None:
        pass  # stale logits carry over: the last round's copy already scored the next block

    def step(self, view: View) -> tuple[torch.Tensor, dict]:
        draft_logits, fresh = self.source.logits(view)
        one_round = structured_round if self.verifier == "structured" else fef_round
        generator = bind_rows(self.generator, view.rows)  # every draw below is per view row
        result = one_round(view, draft_logits, fresh, self.temperature, generator, self.stats,
                           order=self.order, window=self.window, source=self.source)
        self.source.observe(view, result.next_logits)
        revealed = torch.where(result.emitted_positions >= 0, result.emitted_positions + view.offset, -1)
        return result.x, {"sampler": "fef", "window": result.window + view.offset, "drafts": result.drafts,
                          "num_drafts": result.num_drafts, "num_accepted": result.num_accepted,
                          "revealed": revealed}


def fef_round(
    view: View,
    draft_logits: torch.Tensor,  # [R, Ls, V]
    draft_is_state: bool,  # draft_logits are the model at view.x itself (then they serve as copy 0)
    temperature: float,
    generator: torch.Generator,
    stats: DecodeStats,
    *,
    order: str,
    window: int,
    source: MarginalDrafts | None = None,  # samples the drafts at the window (default: independent marginals)
) -> RoundResult:
    """One draft-verify-reveal round for the view's R rows; see the module docstring."""
    x, mask_id = view.x, view.mask_token_id
    rows = torch.arange(x.shape[0], device=x.device)
    positions, count = choose_window(order, draft_logits, view.candidates(x), mask_id, window)
    drafts, window_logits = (source or MarginalDrafts()).sample(view, draft_logits, positions, temperature, generator)

    copies, copy_index, row_of = _build_copies(x, positions, drafts, count, skip_first=draft_is_state)
    copy_logits = view.call(copies, row_of)
    all_logits = torch.cat([draft_logits, copy_logits]) if draft_is_state else copy_logits
    all_tokens = torch.cat([x, copies]) if draft_is_state else copies
    if draft_is_state:  # the draft call was made on x itself: it is copy 0, stored first in all_logits
        copy_index = torch.where(copy_index >= 0, copy_index + x.shape[0], copy_index)
        copy_index[:, 0] = rows

    # The position sequential would reveal next in every copy, from that copy's own logits.
    picks_flat = pick_next(order, all_logits, view.candidates(all_tokens), mask_id)
    picks = torch.where(copy_index >= 0, picks_flat[copy_index.clamp(min=0)], -1)  # [R, W + 1]
    width = positions.shape[1]
    agree = (picks[:, :width] == positions) | (torch.arange(width, device=x.device) >= count[:, None])
    num_drafts = torch.minimum(count, (~agree).long().argmax(dim=1) + agree.all(dim=1).long() * width)

    # Target row c < num_drafts: copy c at s_c; row num_drafts: that copy at its own pick (the bonus).
    target_positions = torch.cat([positions, positions[:, :1]], dim=1)
    target_positions[rows, num_drafts] = picks[rows, num_drafts].clamp(min=0)
    has_bonus = picks[rows, num_drafts] >= 0
    target_logits = forbid_token(all_logits[copy_index.clamp(min=0), target_positions], mask_id)  # [R, W+1, V]
    outcome = rejection_sample(drafts, window_logits, target_logits, num_drafts, temperature=temperature,
                               has_bonus=has_bonus, noise=Noise(generator=generator))
    stats.count_verification(num_drafts, outcome.num_accepted, outcome.num_emitted)

    emitted_positions = torch.where(outcome.tokens >= 0, target_positions, -1)
    new_x = x.clone()
    hit = emitted_positions >= 0
    new_x[rows[:, None].expand_as(hit)[hit], emitted_positions[hit]] = outcome.tokens[hit]
    next_logits = all_logits[copy_index[rows, outcome.num_accepted]]
    return RoundResult(new_x, next_logits, positions, drafts, num_drafts, outcome.num_accepted, emitted_positions)


def structured_round(
    view: View,
    draft_logits: torch.Tensor,  # [R, Ls, V]
    draft_is_state: bool,
    temperature: float,
    generator: torch.Generator,
    stats: DecodeStats,
    *,
    order: str,
    window: int,
    source: MarginalDrafts | None = None,
) -> RoundResult:
    """A left-to-right round verified by the model's one-pass ``structured_verify`` instead of copies.

    Exact with respect to the conditionals that pass defines; they equal the sequential chain's only for
    a model trained for it (or a one-layer model), so generate labels the output approximate.
    """
    x, mask_id = view.x, view.mask_token_id
    rows = torch.arange(x.shape[0], device=x.device)
    ranked, available = choose_window("left_to_right", draft_logits, view.candidates(x), mask_id, window + 1)
    width = min(window, ranked.shape[1])
    positions, count = ranked[:, :width], available.clamp(max=width)
    bonus = torch.full_like(count, -1)
    if ranked.shape[1] > width:  # the next position after the window, where the row has one
        bonus = torch.where(available > width, ranked[:, width], bonus)
    drafts, window_logits = (source or MarginalDrafts()).sample(view, draft_logits, positions, temperature, generator)
    targets, state_logits = view.structured(x, positions, drafts, count, bonus)
    outcome = rejection_sample(drafts, window_logits, forbid_token(targets, mask_id), count,
                               temperature=temperature, has_bonus=bonus >= 0, noise=Noise(generator=generator))
    stats.count_verification(count, outcome.num_accepted, outcome.num_emitted)
    target_positions = torch.cat([positions, positions[:, :1]], dim=1)
    target_positions[rows, count] = bonus.clamp(min=0)
    emitted_positions = torch.where(outcome.tokens >= 0, target_positions, -1)
    new_x = x.clone()
    hit = emitted_positions >= 0
    new_x[rows[:, None].expand_as(hit)[hit], emitted_positions[hit]] = outcome.tokens[hit]
    # The state's logits are a valid proposal for the next round (any proposal keeps verification exact).
    return RoundResult(new_x, state_logits, positions, drafts, count, outcome.num_accepted, emitted_positions)


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
