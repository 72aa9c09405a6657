"""fef's draft trees on the copies verifier (``draft_candidates`` > 1, left to right).

Siblings of each draft are drawn without replacement from the law it was drawn from (``more_candidates``),
each rooting a branch drafted after it; ``CopyTree`` adds one block copy per branch depth to the round's one
verification call, and ``branch_paths`` (shared with the two-stream layout) lays the branches out.
"""

from __future__ import annotations

import torch

from dllm.numerics import bind_rows, forbid_token

from ..canvas import write_at
from ..drafting import Draft, more_candidates
from ..verify import Continuations
from .sources import HeadDrafts


class CopyTree:
    """A round's draft tree for the copies verifier, left to right: at each depth j up to A siblings of d_j drawn
    without replacement from the law d_j was drawn from (``more_candidates``; with ``below``, only where d_j's
    temperature-1 probability is below it), each the root of a branch b_j (the sibling), b_{j+1} .. b_{n-1}
    drafted after it (a head's steps along the forced path, ``HeadDrafts.redraft``; the marginal and stale
    sources draft each position independently, so the chain's own drafts continue every branch). The branch
    brings one copy per depth i = j + 1 .. n: the row with d_<j, b_j .. b_{i-1} revealed, whose logits at s_i
    (at i = n: at its own pick, the bonus) are the target there. The recursive rule and then the chain rule down
    the taken branch verify the tree (``Continuations``). Costs sum(n - j) block copies more per round."""

    def __init__(self, alternatives, slot_row, slot_depth, slot_alt, path, path_logits):
        self.alternatives = alternatives  # [R, W, A] (-1: none), as the verifier takes them
        self.slot_row, self.slot_depth, self.slot_alt = slot_row, slot_depth, slot_alt  # [K] per sibling
        self.path, self.path_logits = path, path_logits  # [K, W] by depth (the sibling at j), [K, W, V]
        self.size = 0  # branch copies in the call
        self.copy_slot = self.copy_depth = None  # [N_b] each branch copy's sibling and the depth it targets
        self.logits = self.picks = None  # [N_b, Ls, V] and [N_b] after the call
        self.positions = self.count = None  # the window [R, W] and its valid drafts [R]

    @classmethod
    def grow(cls, source, drafts, window_logits, count, extra: int, below, temperature, generator,
             skip_first: bool) -> CopyTree:
        """The siblings and their branches. ``skip_first``: the draft logits are the state call's, so draft 0
        is tested against the law it was drawn from and always accepted; its siblings would be copies for
        nothing."""
        n = drafts.shape[0]
        rows = torch.arange(n, device=drafts.device)
        alternatives = more_candidates(Draft(drafts, window_logits, count), extra, temperature, generator, rows,
                                       below)  # [R, W, A]
        if skip_first:
            alternatives[:, 0] = -1
        slot_row, flat = (alternatives >= 0).flatten(1).nonzero(as_tuple=True)  # row-major, depth-major in a row
        slot_depth, slot_alt = flat // extra, flat % extra
        redraft = None
        if isinstance(source, HeadDrafts):  # marginal and stale drafts are independent
            def redraft(which, forced):
                return source.redraft(which, forced, temperature, bind_rows(generator, which))
        path, path_logits = branch_paths(drafts, window_logits, slot_row, slot_depth,
                                         alternatives[slot_row, slot_depth, slot_alt], redraft)
        return cls(alternatives, slot_row, slot_depth, slot_alt, path, path_logits)

    def add_copies(self, x, positions, count, copies, row_of):
        """The branch copies after the chain's -> (copies, their rows)."""
        width = positions.shape[1]
        i = torch.arange(width + 1, device=x.device)
        wanted = (i[None, :] > self.slot_depth[:, None]) & (i[None, :] <= count[self.slot_row][:, None])  # [K, W + 1]
        self.copy_slot, self.copy_depth = wanted.nonzero(as_tuple=True)
        rows = self.slot_row[self.copy_slot]
        reveal = torch.arange(width, device=x.device)[None, :] < self.copy_depth[:, None]  # depths < i
        branch = write_at(x[rows], positions[rows], self.path[self.copy_slot], reveal)
        self.size, self.count = rows.numel(), count
        return torch.cat([copies, branch]), torch.cat([row_of, rows])

    def split(self, copy_logits, picks, positions):
        """Keep the branch copies' logits and picks; return the chain's copy logits."""
        self.logits, self.picks = copy_logits[copy_logits.shape[0] - self.size:], picks
        self.positions = positions
        return copy_logits[: copy_logits.shape[0] - self.size]

    def _targets(self, mask_id):
        """Each branch copy's target logits [N_b, V]: at s_i, or at its own pick after the row's last draft."""
        rows = self.slot_row[self.copy_slot]
        width = self.positions.shape[1]
        inside = self.copy_depth < self.count[rows]
        at = torch.where(inside, self.positions[rows, self.copy_depth.clamp(max=width - 1)], self.picks.clamp(min=0))
        return forbid_token(self.logits[torch.arange(rows.numel(), device=rows.device), at], mask_id)

    def continuations(self, mask_id) -> Continuations:
        """Each sibling's branch for the verifier, by absolute depth, one entry per sibling."""
        n, width, count = self.alternatives.shape
        k = self.slot_row.numel()
        slot = torch.full((n, width, count), -1, dtype=torch.long, device=self.path.device)
        slot[self.slot_row, self.slot_depth, self.slot_alt] = torch.arange(k, device=self.path.device)
        steps = torch.arange(width, device=self.path.device)
        tokens = torch.where(steps[None, :] > self.slot_depth[:, None], self.path, -1)
        targets = self.path_logits.new_zeros((k, width + 1, self.path_logits.shape[-1]))
        targets[self.copy_slot, self.copy_depth] = self._targets(mask_id)
        return Continuations(slot, tokens, self.path_logits, targets)

    def after(self, outcome, next_logits):
        """The verified copy matching the new state per row [R, Ls, V]: after a taken sibling, its branch's copy
        with the accepted tokens revealed."""
        took = ((outcome.branch[self.slot_row] > 0) & (self.slot_depth == outcome.branch_depth[self.slot_row])
                & (self.slot_alt == outcome.branch[self.slot_row] - 1))  # [K] the taken sibling's slot
        rows = self.slot_row[self.copy_slot]
        match = took[self.copy_slot] & (self.copy_depth == outcome.num_accepted[rows])
        if bool(match.any()):
            next_logits = next_logits.clone()
            next_logits[rows[match]] = self.logits[match]
        return next_logits


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
