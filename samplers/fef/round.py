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
  (draft j conditioned on drafts 0..j-1; ``samplers/fef/sources.py``), no extra backbone call.
``draft_candidates`` > 1 (left to right, copies): a draft tree, siblings of each draft with branches drafted
after them, verified in the same call with one more copy per branch depth (``CopyTree``).
All are draft-source objects (``MarginalDrafts``, ``StaleDrafts`` and ``HeadDrafts``
in ``samplers/fef/sources.py``), chosen once per call; the loop asks the source for draft logits, the round
samples the drafts through it and tells it the verified copy afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dllm.defaults import FEF_HEAD
from dllm.models.draft_head import load_draft_head
from dllm.numerics import bind_rows, forbid_token
from dllm.protocols import gather_positions
from dllm.stats import DecodeStats

from ..canvas import Band, View, write_at
from ..drafting import cut_count
from ..order import choose_window, pick_next
from ..verify import Noise, rejection_sample, tree_path
from .sources import HeadDrafts, MarginalDrafts, StaleDrafts
from .trees import CopyTree


@dataclass
class FefStepper:
    """Speculative denoising rounds over the active block; see the module docstring.

    ``logits`` is the draft source's (so its state call is the source's own, one frame from the loop) and
    ``step`` is one round, with copies or with the model's one-pass verifier, both chosen once per call.
    """

    temperature: float
    generator: torch.Generator
    stats: DecodeStats
    # the sampler's options (FefConfig; their defaults: dllm.defaults.SAMPLER_DEFAULTS["fef"])
    order: str
    window: int
    draft: str
    verifier: str
    draft_head: object  # draft="head": a head folder or DraftHead (None: the shipped head)
    # A draft tree (``CopyTree``; on a two-stream model samplers/fef/two_stream.py runs it), left to right
    draft_candidates: int
    candidates_below: float | None
    call_tokens: int | None  # the most token positions one forward holds: the copies call runs in parts
    # adaptive windows: a row's drafts end where the drafter's own survival estimate falls below it
    # (samplers/drafting.py: cut_count); None: the whole window
    draft_cutoff: float | None = None
    compile: bool = False  # draft="head": the head's steps through torch.compile (dllm.models.draft_head.HeadSteps)

    def __post_init__(self) -> None:  # the source is chosen once, not per round
        head = FEF_HEAD if self.draft_head is None else self.draft_head
        sources = {"stale": StaleDrafts,
                   "head": lambda *a: HeadDrafts(load_draft_head(head), *a, compiled=self.compile)}
        self.source = sources.get(self.draft, MarginalDrafts)(self.order, self.window)
        # (view) -> (draft logits [R, K, V] on the round's band, whether they are the model at the state, the band)
        self.logits = self.source.logits
        self.step = self.structured_round if self.verifier == "structured" else self.round

    @property
    def lookahead(self) -> bool:
        """Stale drafts want the next block's logits from each call (see BlockCacheSession)."""
        return self.source.lookahead

    def begin_block(self, block: int) -> None:
        pass  # stale logits carry over: the last round's copy already scored the next block

    def round(self, view: View, proposal: tuple[torch.Tensor, bool, Band]) -> tuple[torch.Tensor, dict]:
        """One draft-verify-reveal round for the view's R rows from ``proposal`` = (draft logits [R, K, V] on the
        round's band, whether they are the model at view.x itself, so that they serve as copy 0, the band); see
        the module docstring. Every call of the round reads the band only: positions below are its slots."""
        draft_logits, draft_is_state, band = proposal
        generator = bind_rows(self.generator, view.rows)  # every draw below is per view row
        x, mask_id = view.x, view.mask_token_id
        rows = torch.arange(x.shape[0], device=x.device)
        slots, count = choose_window(self.order, draft_logits, band.candidates(view, x), mask_id, self.window)
        # a source written before draft_cutoff existed (no cutoff parameter) still runs without one
        cut = {} if self.draft_cutoff is None else {"cutoff": self.draft_cutoff}
        drafts, window_logits = self.source.sample(view, draft_logits, slots, self.temperature, generator, **cut)
        counts = None  # each row's drafts, when the host knows them
        if self.draft_cutoff is not None:  # adaptive window: one host read sizes the round's call
            count = cut_count(window_logits, drafts, count, self.draft_cutoff)
            counts = count.tolist()
            width = min(drafts.shape[1], max(max(counts, default=0), 1))
            slots, drafts, window_logits = slots[:, :width], drafts[:, :width], window_logits[:, :width]
        elif view.masked is not None:
            counts = [min(slots.shape[1], m) for m in view.masked]
        tree = CopyTree.grow(self.source, drafts, window_logits, count, self.draft_candidates - 1,
                              self.candidates_below, self.temperature, generator,
                              skip_first=draft_is_state) if self.draft_candidates > 1 else None

        positions = band.positions(slots)  # view positions, where the copies reveal drafts
        total = None if counts is None else sum(c + 1 - draft_is_state for c in counts)
        copies, copy_index, row_of = build_copies(x, positions, drafts, count, draft_is_state, total)
        if tree is not None:  # the branches' copies join the call
            copies, row_of = tree.add_copies(x, positions, count, copies, row_of)
        most = None if counts is None or tree is not None else \
            max(c + 1 - draft_is_state for c in counts)  # copies of one row (host)
        copy_logits = view.call(copies, row_of, at=band.at(row_of), **({} if most is None else {"most": most}))
        if tree is not None:  # the branch copies' logits and picks stay with the tree; the chain's go on
            chain = copies.shape[0] - tree.size
            branch_candidates = band.candidates(view, copies[chain:], row_of[chain:])
            copy_logits = tree.split(copy_logits, pick_next(self.order, copy_logits[chain:], branch_candidates,
                                                            mask_id), slots)
            copies, row_of = copies[:chain], row_of[:chain]
        all_logits = torch.cat([draft_logits, copy_logits]) if draft_is_state else copy_logits
        all_tokens = torch.cat([x, copies]) if draft_is_state else copies
        all_rows = torch.cat([rows, row_of]) if draft_is_state else row_of
        if draft_is_state:  # the draft call was made on x itself: it is copy 0, stored first in all_logits
            copy_index = torch.where(copy_index >= 0, copy_index + x.shape[0], copy_index)
            copy_index[:, 0] = rows

        # The position sequential would reveal next in every copy, from that copy's own logits.
        picks_flat = pick_next(self.order, all_logits, band.candidates(view, all_tokens, all_rows), mask_id)
        picks = torch.where(copy_index >= 0, picks_flat[copy_index.clamp(min=0)], -1)  # [R, W + 1]
        width = slots.shape[1]
        agree = (picks[:, :width] == slots) | (torch.arange(width, device=x.device) >= count[:, None])
        num_drafts = torch.minimum(count, (~agree).long().argmax(dim=1) + agree.all(dim=1).long() * width)

        # Target row c < num_drafts: copy c at s_c; row num_drafts: that copy at its own pick (the bonus).
        target_slots = torch.cat([slots, slots[:, :1]], dim=1)
        target_slots[rows, num_drafts] = picks[rows, num_drafts].clamp(min=0)
        has_bonus = picks[rows, num_drafts] >= 0
        target_logits = forbid_token(all_logits[copy_index.clamp(min=0), target_slots], mask_id)  # [R, W+1, V]
        verify = {} if tree is None else {"alternatives": tree.alternatives,
                                          "continuations": tree.continuations(mask_id)}
        outcome = rejection_sample(drafts, window_logits, target_logits, num_drafts, temperature=self.temperature,
                                   has_bonus=has_bonus, noise=Noise(generator=generator), **verify)
        if self.source.wants_next:  # the verified copy matching the new state
            next_logits = all_logits[copy_index[rows, outcome.num_accepted]]
            if tree is not None:  # after a taken sibling: its branch's copy with the accepted tokens revealed
                next_logits = tree.after(outcome, next_logits)
            self.source.observe(view, next_logits, band)
        event = tree_path(drafts, target_logits, outcome, verify.get("continuations"))
        return self._reveal(view, band, slots, num_drafts, target_slots, outcome, event)

    def structured_round(self, view: View, proposal: tuple[torch.Tensor, bool]) -> tuple[torch.Tensor, dict]:
        """A left-to-right round verified by the model's one-pass ``structured_verify`` instead of copies.

        Exact with respect to the conditionals that pass defines; they equal the sequential chain's only for
        a model trained for it (or a one-layer model), so generate labels the output approximate.
        """
        draft_logits, _, band = proposal
        generator = bind_rows(self.generator, view.rows)
        x, mask_id = view.x, view.mask_token_id
        rows = torch.arange(x.shape[0], device=x.device)
        ranked, available = choose_window("left_to_right", draft_logits, band.candidates(view, x), mask_id,
                                          self.window + 1)
        width = min(self.window, ranked.shape[1])
        slots, count = ranked[:, :width], available.clamp(max=width)
        bonus = torch.full_like(count, -1)
        if ranked.shape[1] > width:  # the next position after the window, where the row has one
            bonus = torch.where(available > width, ranked[:, width], bonus)
        drafts, window_logits = self.source.sample(view, draft_logits, slots, self.temperature, generator)
        positions = band.positions(slots)
        targets = view.structured(x, positions, drafts, count, band.positions(bonus[:, None])[:, 0])
        targets, state_logits = forbid_token(targets[0], mask_id), targets[1]
        outcome = rejection_sample(drafts, window_logits, targets, count,
                                   temperature=self.temperature, has_bonus=bonus >= 0, noise=Noise(generator=generator))
        target_slots = torch.cat([slots, slots[:, :1]], dim=1)
        target_slots[rows, count] = bonus.clamp(min=0)
        if self.source.wants_next:  # the state's logits: a valid proposal (any proposal keeps verification exact)
            self.source.observe(view, gather_positions(state_logits, band.at()), band)
        event = {"drafts": drafts, "target_logits": targets, "emitted_logits": targets}
        return self._reveal(view, band, slots, count, target_slots, outcome, event)

    def _reveal(self, view: View, band: Band, slots, num_drafts, target_slots, outcome, event: dict):
        """Write the emitted tokens at their positions (``target_slots`` [R, W + 1] of ``band``) and count the
        round -> (tokens [R, Ls], event fields); ``event``: the drafts and ``target_logits`` [R, W + 1, V] (what
        draft j was tested against, then the bonus), along the path verification followed with a draft tree
        (``tree_path``)."""
        self.stats.count_verification(num_drafts, outcome.num_accepted, outcome.num_emitted, outcome.branch,
                                      width=slots.shape[1])
        emitted = band.positions(torch.where(outcome.tokens >= 0, target_slots, -1))  # [R, W + 1], -1: nothing
        new_x = write_at(view.x, emitted, outcome.tokens, emitted >= 0)
        revealed = torch.where(emitted >= 0, emitted + view.offset, -1)
        return new_x, {"sampler": "fef", "window": band.positions(slots) + view.offset,
                                   "num_drafts": num_drafts, "num_accepted": outcome.num_accepted,
                                   "revealed": revealed, **event}


def build_copies(
    x: torch.Tensor,  # [R, L]
    positions: torch.Tensor,  # [R, W]
    drafts: torch.Tensor,  # [R, W]
    count: torch.Tensor,  # [R]
    skip_first: bool,
    total: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Copy c of row r reveals drafts 0..c-1, for c = 0 (or 1) .. count[r].

    Returns the copies [N, L], their index per (row, c) [R, W + 1] (-1 where no copy was built) and the
    row of each copy [N]. Rows build only the copies they need, so ragged windows cost no padding. ``total``:
    N when the host knows it (``View.masked``), so no shape waits for the device (a wrong one raises).
    """
    width = positions.shape[1]
    if total is None:
        c = torch.arange(width + 1, device=x.device)
        wanted = (c[None, :] <= count[:, None]) & (c[None, :] >= int(skip_first))  # [R, W + 1]
        row_of, copy_of = wanted.nonzero(as_tuple=True)
    else:
        per_row = count + 1 - int(skip_first)
        row_of = torch.repeat_interleave(torch.arange(x.shape[0], device=x.device), per_row, output_size=total)
        first = (per_row.cumsum(0) - per_row)[row_of]  # each row's first copy in the flat order
        copy_of = torch.arange(total, device=x.device) - first + int(skip_first)
    reveal = torch.arange(width, device=x.device)[None, :] < copy_of[:, None]  # [N, W]
    copies = write_at(x[row_of], positions[row_of], drafts[row_of], reveal)
    index = torch.full((x.shape[0], width + 1), -1, dtype=torch.long, device=x.device)
    index[row_of, copy_of] = torch.arange(row_of.numel(), device=x.device)
    return copies, index, row_of

