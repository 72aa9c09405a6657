"""``sequential`` and ``fef`` on a two-stream model (``Capabilities.reveal_order_cache``): cached and one-pass.

The model (dllm/models/two_stream.py) keeps revealed tokens in a content stream, in reveal order, whose
keys/values are cached; masked positions are read by queries that see a prefix of it. One round, per row
(shapes for R active rows, window W; ``sequential`` is the round with W = 0 and no lookahead):

1. window: the next W positions ``s`` in ``order`` among those with draft logits (from earlier queries);
2. drafts: ``d_j ~ softmax(draft_logits[s_j] / T)``, independently, or from a draft head, step j given the
   token before s_j (``draft="head"``; below);
3. ONE call: content = [tokens emitted last round (the prompt at first), d_0..d_{W-1}], causal among
   themselves and appended to the cache; copy k's queries see the cache, the pending tokens and d_<k:
   at the next position in ``order`` (left_to_right) or at every masked position of the block
   (confidence, whose pick needs them all). Plus lookahead queries seeing all drafts: the next round's
   draft logits beyond the window. Copy k's queries are exactly the call ``sequential`` makes after
   revealing d_<k, so copy k must pick s_k (as in samplers/fef/round.py); the first that does not ends the
   drafts and its pick is the bonus position;
4. ``rejection_sample`` (samplers/verify.py) accepts while u < target/draft, then one correction or bonus;
5. reveal; accepted drafts stay in the cache, rejected ones are dropped, the correction is pending.

Exact by construction for every order, temperature and block length: the emitted tokens follow the chain
of query conditionals of ``sequential`` on this model. Draft logits at a position are the latest query
there, preferring one that saw exactly the accepted drafts (a valid proposal either way: the test uses
the very probabilities the drafts were drawn from). fef's ``marginal`` and ``stale`` drafts both take these
query logits, which cost no call of their own; ``draft="head"`` drafts from a two-stream draft head over
them and the queries' features (``DraftHeadConfig.condition_first``: step 0 reads the pending correction,
which those queries did not see), still without a call of its own. Left to right, the blocks do not change
the law (position order is the reveal order), so the answer is decoded as one block and windows run
across the model's blocks. ``cache`` may be ``auto`` or ``none``: the reveal-order cache is exact, so both
give the same law. ``draft_candidates`` > 1 (left to right) adds a draft tree to the same call: siblings of
each draft, each the root of a branch drafted after it, with their own queries (``_Tree``), verified by the
recursive rule and then the chain rule down the taken branch. Limit: the draft-logit
buffer is [B, N, V] over the N answer columns (the prompt's are never drafted), in the logits' dtype: 2 GB
at LLaDA's vocabulary for 8 rows of 512 answer tokens in float32 (to chunk, or keep only live columns).
"""

from __future__ import annotations

import functools

import torch

from dllm.counting import CountingModel
from dllm.defaults import default_draft_head
from dllm.models.draft_head import load_draft_head
from dllm.numerics import bind_rows, forbid_token, positions_from_mask
from dllm.protocols import capabilities
from dllm.stats import DecodeStats, StepEvent

from ..canvas import Canvas
from ..drafting import Draft, cut_draft, independent_drafts, more_candidates
from ..likelihood import Emissions
from ..order import choose_window, top1_probability
from ..verify import Continuations, Noise, rejection_sample, tree_path
from .sources import head_drafts
from .trees import branch_paths


class _Decoding:
    """Canvas, cache and per-row state of one two-stream decode."""

    def __init__(self, model, prompt, gen_length, block_length, mask, eos_token_id, head=None, compiled=False):
        self.model, self.mask_id, self.head = model, model.mask_token_id, head
        self.canvas = Canvas.start(prompt, gen_length, block_length, self.mask_id, eos_token_id)
        batch, length = self.canvas.x.shape
        real = torch.ones_like(self.canvas.x, dtype=torch.bool)
        if mask is not None:
            real[:, : prompt.shape[1]] = mask.bool()
        self.positions = positions_from_mask(real)  # [B, L] rotary positions of canvas columns
        self.cache = model.new_cache(batch)
        p = prompt.shape[1]
        # The pending content: the prompt before the first round, then each row's last correction token.
        self.pending = (self.canvas.x[:, :p].clone(), self.positions[:, :p].clone(), real[:, :p].clone())
        # The last token each row emitted and its canvas column: a head's "token before" the next window
        # (the pending correction or bonus, else the last accepted draft, else the prompt's last token).
        self.last_tok = self.canvas.x[:, p - 1].clone() if p else torch.zeros(batch, dtype=torch.long,
                                                                                device=prompt.device)
        self.last_col = torch.full((batch,), p - 1, dtype=torch.long, device=prompt.device)
        # Latest query logits per answer column (the prompt's columns are never drafted: not stored).
        self.start = p  # canvas column of the buffers' column 0
        self.draft_logits: torch.Tensor | None = None  # [B, N, V]
        self.draft_features: torch.Tensor | None = None  # [B, N, D] their query features (with a head)
        self.have = torch.zeros((batch, length), dtype=torch.bool, device=prompt.device)
        self.compiled = compiled  # the head's steps through torch.compile (fef's compile option)


def decode(model, prompt, gen_length, *, temperature, generator, stats: DecodeStats, order: str, window: int,
           block_length: int, cache: str = "auto", attention_mask=None, eos_token_id=None, callback=None,
           sampler: str = "sequential", draft_head=None, draft_candidates: int = 1,
           candidates_below: float | None = None, draft_cutoff: float | None = None,
           compile: bool = False, record: Emissions | None = None) -> torch.Tensor:
    """Decode ``gen_length`` tokens after ``prompt`` [B, P] -> [B, P + N]; window 0 is ``sequential``.

    ``draft_head`` (a ``DraftHead`` with ``condition_first``): drafts come from it, step j reading the
    stored query features and logits at s_j and the token before (the last round's correction at step 0),
    in W head steps and no extra call; None drafts the stored query logits independently.
    ``draft_candidates`` > 1 (left to right): a draft tree (``_Tree``), siblings (each with its branch) only where
    the draft's temperature-1 probability is below ``candidates_below`` when given. ``draft_cutoff``: adaptive
    windows, each row's drafts ending where the drafter's own survival estimate falls below it
    (``samplers/drafting.py: cut_count``; the call then feeds only the longest row's drafts). ``compile``: the
    head's steps through ``torch.compile`` (``dllm.models.draft_head.HeadSteps``)."""
    if draft_candidates > 1 and order != "left_to_right":
        raise ValueError(f"draft_candidates={draft_candidates}: draft trees on a two-stream model run left to right; "
                         f"got order={order!r}")
    if cache not in ("auto", "none"):
        raise ValueError(f"cache={cache!r}: a two-stream model decodes with its own exact reveal-order cache; "
                         "use cache='auto'")
    if order == "left_to_right":
        # Position order is the reveal order whatever the blocks (the law is the same for every
        # block_length), so one block lets fef's windows run across the model's blocks.
        block_length = gen_length
    state = _Decoding(CountingModel(model, stats.record), prompt, gen_length, block_length, attention_mask,
                      eos_token_id, draft_head if window else None, compile)
    canvas = state.canvas
    for block in range(canvas.num_blocks):
        state.cache.compact()
        start, end = canvas.span(block)
        in_block = torch.zeros(canvas.x.shape[1], dtype=torch.bool, device=prompt.device)
        in_block[start:end] = True
        while (rows := canvas.rows_in_block(block)).numel():
            info = two_stream_round(state, rows, in_block, temperature, bind_rows(generator, rows), stats,
                                    order=order, window=window, tree=(draft_candidates, candidates_below),
                                    cutoff=draft_cutoff)
            if record is not None:
                record.take(rows, info["revealed"], info["emitted_logits"], canvas.x)
            canvas.stop_at_eos(rows)
            state.cache.compact(min_unused=0.25)  # rejected drafts pile up within a long block
            if callback is not None:
                callback(StepEvent(sampler=sampler, rows=rows, x=canvas.x[rows], **info,
                                   **({} if record is None else record.of_rows(rows))))
    return canvas.x


def two_stream_round(state: _Decoding, rows, in_block, temperature, generator, stats: DecodeStats, *,
                     order: str, window: int, tree: tuple[int, float | None] = (1, None),
                     cutoff: float | None = None) -> dict:
    """One draft-verify-reveal round (or one sequential step) for ``rows`` [R]; see the module docstring.
    ``tree`` = (draft_candidates, candidates_below): with more than one candidate, a draft tree (``_Tree``)."""
    x, mask_id = state.canvas.x[rows], state.mask_id
    n = rows.numel()
    index = torch.arange(n, device=x.device)
    candidates = (x == mask_id) & in_block[None, :]  # [R, L]
    positions, count, drafts, window_logits, redraft = _drafts(state, rows, candidates, temperature, generator,
                                                               order, window, cutoff)
    width = positions.shape[1]
    branches = _Tree.grow(drafts, window_logits, count, positions, candidates, window, *tree, temperature,
                          generator, redraft) if tree[0] > 1 and width else None

    ids, pos, valid = state.pending
    ids, pos, valid = ids[rows], pos[rows], valid[rows]
    k_pending = ids.shape[1]
    content_ids = torch.cat([ids, drafts], dim=1)
    content_pos = torch.cat([pos, state.positions[rows].gather(1, positions)], dim=1)
    content_valid = torch.cat([valid, torch.arange(width, device=x.device)[None, :] < count[:, None]], dim=1)
    q_col, q_copy, q_valid = _queries(x, candidates, positions, count, order, window, mask_id)
    sees = k_pending + torch.minimum(q_copy, count[:, None])  # lookahead (copy W + 1) sees every valid draft
    q_all, sees_all, extra = q_col, sees, {}
    if branches is not None:  # the siblings join the content, their queries the call's
        content_ids, content_pos, content_valid, q_all, sees_all, extra = branches.inputs(
            content_ids, content_pos, content_valid, q_col, sees, k_pending)
    logits = state.model.streams(content_ids, content_pos, content_valid, state.positions[rows].gather(1, q_all),
                                 sees_all, cache=state.cache, rows=rows, append=True,
                                 hidden=state.head is not None, **extra)  # [R, Q, V], counted once
    logits, features = logits if state.head is not None else (logits, None)
    logits = forbid_token(logits, mask_id)
    verify = {}
    if branches is not None:  # split the siblings' queries off
        logits, features = branches.split(logits, features, q_col.shape[1])
        verify = {"alternatives": branches.alternatives, "continuations": branches.continuations()}

    # Each copy's pick: the position sequential reveals next after d_<k, from that copy's own queries.
    if order == "left_to_right":
        score = -q_col.float()
    else:
        score = top1_probability(logits)
    copies = torch.arange(width + 1, device=x.device)
    mine = (q_copy[:, None, :] == copies[None, :, None]) & q_valid[:, None, :]  # [R, W + 1, Q]
    scores = torch.where(mine, score[:, None, :], float("-inf"))
    slot = scores.argmax(dim=2)  # first maximum: queries are in position order, so ties go leftmost
    picks = torch.where(mine.any(dim=2), q_col.gather(1, slot), -1)  # [R, W + 1]
    num_drafts = torch.zeros_like(count)
    if width:
        agree = (picks[:, :width] == positions) | (torch.arange(width, device=x.device) >= count[:, None])
        num_drafts = torch.minimum(count, (~agree).long().argmax(dim=1) + agree.all(dim=1).long() * width)
    has_bonus = picks[index, num_drafts] >= 0
    target_logits = logits[index[:, None], slot]  # [R, W + 1, V]: copy k at its pick (= s_k while k < num_drafts)
    outcome = rejection_sample(drafts, window_logits, target_logits, num_drafts, temperature=temperature,
                               has_bonus=has_bonus, noise=Noise(generator=generator), **verify)
    if window:
        stats.count_verification(num_drafts, outcome.num_accepted, outcome.num_emitted, outcome.branch,
                                 width=drafts.shape[1])
    else:
        stats.count_round(outcome.num_emitted)

    emitted = torch.where(outcome.tokens >= 0, picks, -1)  # [R, W + 1] canvas columns
    hit = emitted >= 0
    new_x = x.clone()
    new_x[index[:, None].expand_as(hit)[hit], emitted[hit]] = outcome.tokens[hit]
    state.canvas.x[rows] = new_x
    # The chain's accepted drafts stay cached (those before an accepted sibling, which stays too).
    chain = outcome.num_accepted  # the chain's accepted drafts: before the taken sibling, if any
    if branches is not None:
        chain = torch.where(outcome.branch > 0, outcome.branch_depth, chain)
    keep = [valid, torch.arange(width, device=x.device)[None, :] < chain[:, None]]
    if branches is not None:
        keep.append(branches.taken(outcome))
    state.cache.keep(rows, torch.cat(keep, dim=1))
    _set_pending(state, rows, outcome, emitted)
    if window:
        _store_drafts(state, rows, logits, features, q_col, q_copy, q_valid, chain, count)
        if branches is not None:
            branches.store(state, rows, outcome)
    info = {"revealed": emitted, "emitted_logits": target_logits}  # a sequential step's one token: copy 0's pick
    if window:
        tree = tree_path(drafts, target_logits, outcome, verify.get("continuations"))
        info.update(window=positions, num_drafts=num_drafts, num_accepted=outcome.num_accepted, **tree)
    return info


class _Tree:
    """A round's draft tree, left to right: at each depth j up to A = ``draft_candidates`` - 1 siblings of
    d_j, drawn without replacement from the law d_j was drawn from (``more_candidates``; with ``below``,
    only where d_j's temperature-1 probability is below it), each the root of a branch: the sibling b_0 at
    s_j, then a continuation b_1 .. b_{L-1} at s_{j+1} .. s_{n-1} (L = n - j for the row's n drafts), drafted
    after the sibling (the head's steps with the path d_<j, b_0, b_<m forced; without a head the chain's own
    independent drafts, whose laws do not depend on the token before). Branch token b_m is content revealed
    after d_<j and b_<m; its leaf query (the target for b_{m+1}, or the bonus after b_{L-1}) sees them and
    b_m, and W lookahead queries after the branch see the whole branch. The recursive rule accepts at most
    one sibling, then the chain rule runs down its branch (``Continuations`` in ``dllm.kernels.verify``).
    When a sibling is taken, its branch's queries are the next round's draft logits (and features), as the
    chain's are after a chain round. Siblings are listed per row (S = the most any row has); in the call each
    branch is packed tightly (``inputs``): its L tokens and L + W queries."""

    def __init__(self, alternatives, depth, alt, tokens, columns, length, branch, branch_logits):
        self.alternatives = alternatives  # [R, W, A] (-1: none), as the verifier takes them
        self.depth, self.alt, self.tokens = depth, alt, tokens  # [R, S] per packed sibling (token -1: empty)
        self.length = length  # [R, S] L, the branch's tokens (sibling included)
        # [R, S, W] by depth: the sibling at j, its continuation after (-1 elsewhere); [R, S, W, V] their laws
        self.branch, self.branch_logits = branch, branch_logits
        self.columns = columns  # [R, S, 2W] its queries' canvas columns (-1: none): L leaves, then W lookahead
        self.logits: torch.Tensor | None = None  # [R, S, 2W, V] after the call
        self.features: torch.Tensor | None = None
        # The packing of the call (``inputs``): content index of each branch token [R, S, W] among the branch
        # content (C_b per row), and of each valid query [R, S, 2W] among the branch queries
        self.c_index = self.c_total = self.q_index = self.q_valid = None

    @classmethod
    def grow(cls, drafts, window_logits, count, positions, masked, window, candidates, below, temperature,
             generator, redraft) -> _Tree:
        """The siblings of this round's drafts and their branches (``redraft(rows, forced)``: the head's drafts
        along forced paths; None without a head). A round where no row has a sibling still goes through the
        tree rule (with no siblings), so that each row's random draws do not depend on its batch mates."""
        n, width = drafts.shape
        device = drafts.device
        alternatives = more_candidates(Draft(drafts, window_logits, count), candidates - 1, temperature, generator,
                                       torch.arange(n, device=device), below)  # [R, W, A]
        # The 2W masked columns after each s_j in position order: the branch's leaves, then the lookahead.
        length = masked.shape[1]
        rank = masked.long().cumsum(dim=1) - 1  # [R, L] a masked column's rank among its row's
        by_rank = torch.where(masked, torch.arange(length, device=device), length).sort(dim=1).values
        at = rank.gather(1, positions)[:, :, None] + 1 + torch.arange(2 * window, device=device)  # [R, W, 2W]
        inside = at < masked.sum(dim=1)[:, None, None]
        columns = torch.where(inside, by_rank.gather(1, at.clamp(max=length - 1).flatten(1)).view_as(at), -1)
        live = (alternatives >= 0) & (columns[:, :, :1] >= 0)  # a sibling needs a leaf
        alternatives = torch.where(live, alternatives, -1)
        flat = live.flatten(1)  # [R, W A], depth-major
        per_row = flat.sum(dim=1)
        size = int(per_row.max())
        r, f = flat.nonzero(as_tuple=True)
        slot = torch.arange(r.numel(), device=device) - (per_row.cumsum(0) - per_row)[r]
        count_alt = alternatives.shape[2]
        depth = torch.zeros((n, size), dtype=torch.long, device=device)
        alt, tokens = torch.zeros_like(depth), torch.full_like(depth, -1)
        depth[r, slot], alt[r, slot] = f // count_alt, f % count_alt
        tokens[r, slot] = alternatives.flatten(1)[r, f]
        branch_length = torch.where(tokens >= 0, count[:, None] - depth, 0)  # [R, S]
        steps = torch.arange(width, device=device)  # the window's drafts (fewer than W near the answer's end)
        cols = torch.full((n, size, 2 * window), -1, dtype=torch.long, device=device)
        lead = columns[r, f // count_alt]  # [k, 2W]
        q = torch.arange(2 * window, device=device)
        cols[r, slot] = torch.where(q[None, :] < branch_length[r, slot][:, None] + window, lead, -1)
        # The branch: b_0 (the sibling) at depth j, its continuation at depths j + 1 .. n - 1.
        j = depth[r, slot]
        path, path_logits = branch_paths(drafts, window_logits, r, j, tokens[r, slot], redraft)
        branch = torch.full((n, size, width), -1, dtype=torch.long, device=device)
        branch_logits = window_logits.new_zeros((n, size, width, window_logits.shape[-1]))
        mine = (steps[None, :] >= j[:, None]) & (steps[None, :] < count[r][:, None])
        branch[r, slot] = torch.where(mine, path, -1)
        branch_logits[r, slot] = path_logits
        return cls(alternatives, depth, alt, tokens, cols, branch_length, branch, branch_logits)

    def inputs(self, content_ids, content_pos, content_valid, q_col, sees, k_pending: int):
        """The call's content and queries with the branches' -> (content ids, positions, valid, query columns,
        prefix each query sees, the ``streams`` keywords ``content_sees``, ``content_extra`` and ``query_extra``).
        A row's branches are packed after the chain, each contiguous: its L tokens in depth order (the token
        at depth i at s_i's position), then, among the queries, its L + W (fewer at the canvas's end)."""
        n, width = content_ids.shape
        size, window = self.branch.shape[1:]
        per = self.columns.shape[2]
        device = content_ids.device
        before = k_pending + self.depth  # [R, S] the chain content a branch sees: pending, d_<j
        # Where each branch token and query goes among the row's branch content / branch queries.
        c_valid, q_valid = self.branch >= 0, self.columns >= 0  # [R, S, W], [R, S, 2W]
        c_first = width + _exclusive_cumsum(self.length)  # [R, S] the branch's first content index
        c_index = c_first[:, :, None] + torch.arange(window, device=device) - self.depth[:, :, None]  # at depth i
        q_index = _exclusive_cumsum(q_valid.sum(dim=2))[:, :, None] + torch.arange(per, device=device)
        c_total, q_total = int(self.length.sum(dim=1).max()), int(q_valid.sum(dim=(1, 2)).max())
        self.c_index, self.c_total, self.q_index, self.q_valid = c_index - width, c_total, q_index, q_valid
        rows_c = torch.arange(n, device=device)[:, None, None].expand_as(c_index)[c_valid]
        rows_q = torch.arange(n, device=device)[:, None, None].expand_as(q_index)[q_valid]
        at_c, at_q = c_index[c_valid] - width, q_index[q_valid]

        def packed(values, total, rows, at, fill=0):
            out = values.new_full((n, total, *values.shape[1:]), fill)
            out[rows, at] = values
            return out

        ids = packed(self.branch[c_valid], c_total, rows_c, at_c)
        pos = packed(content_pos[:, k_pending:][:, None, :].expand(-1, size, -1)[c_valid], c_total, rows_c, at_c)
        valid = packed(torch.ones_like(at_c, dtype=torch.bool), c_total, rows_c, at_c, False)
        first = c_first[:, :, None].expand_as(c_index)
        c_sees = packed(before[:, :, None].expand_as(c_index)[c_valid], c_total, rows_c, at_c, 1)
        c_range = packed(torch.stack([first, c_index], dim=-1)[c_valid], c_total, rows_c, at_c)  # depths j .. i - 1
        # Query p < L is the leaf of the branch's token at depth j + p and sees the branch through it; the
        # lookahead (p >= L) sees the whole branch.
        p = torch.arange(per, device=device)
        stop = c_first[:, :, None] + torch.minimum(p + 1, self.length[:, :, None])  # [R, S, 2W]
        q_cols = packed(self.columns[q_valid], q_total, rows_q, at_q)
        q_sees = packed(before[:, :, None].expand_as(q_index)[q_valid], q_total, rows_q, at_q)
        q_range = packed(torch.stack([c_first[:, :, None].expand_as(stop), stop], dim=-1)[q_valid], q_total, rows_q,
                         at_q)
        zeros = torch.zeros((n, width, 2), dtype=torch.long, device=device)
        return (torch.cat([content_ids, ids], dim=1), torch.cat([content_pos, pos], dim=1),
                torch.cat([content_valid, valid], dim=1), torch.cat([q_col, q_cols], dim=1),
                torch.cat([sees, q_sees], dim=1),
                {"content_sees": torch.cat([torch.arange(1, width + 1, device=device).expand(n, -1), c_sees], dim=1),
                 "content_extra": torch.cat([zeros, c_range], dim=1),
                 "query_extra": torch.cat([torch.zeros_like(zeros[:, :1]).expand(n, q_col.shape[1], 2), q_range],
                                          dim=1)})

    def split(self, logits, features, chain_queries: int):
        """Keep the branches' query outputs as [R, S, 2W, ...] (zeros where none); return the chain's."""
        def unpack(values):
            rows = torch.arange(values.shape[0], device=values.device)[:, None, None].expand_as(self.q_index)
            out = values.new_zeros((*self.q_index.shape, values.shape[-1]))
            out[self.q_valid] = values[:, chain_queries:][rows[self.q_valid], self.q_index[self.q_valid]]
            return out

        self.logits = unpack(logits)
        if features is not None:
            self.features = unpack(features)
            features = features[:, :chain_queries]
        return logits[:, :chain_queries], features

    def continuations(self) -> Continuations:
        """Each sibling's branch for the verifier, by absolute depth: drafts, their laws and targets (leaf query
        p is the target at depth j + 1 + p), one entry per sibling."""
        n, width, count = self.alternatives.shape
        r, s = (self.tokens >= 0).nonzero(as_tuple=True)
        j = self.depth[r, s]
        slot = torch.full((n, width, count), -1, dtype=torch.long, device=j.device)
        slot[r, j, self.alt[r, s]] = torch.arange(r.numel(), device=j.device)
        tokens = torch.where(torch.arange(width, device=j.device)[None, :] > j[:, None], self.branch[r, s], -1)
        leaf = torch.arange(width + 1, device=j.device)[None, :] - j[:, None] - 1  # [k, W + 1]: query for depth i
        ok = (leaf >= 0) & (leaf < self.length[r, s][:, None])
        picked = self.logits[r, s][torch.arange(r.numel(), device=j.device)[:, None], leaf.clamp(min=0)]
        return Continuations(slot, tokens, self.branch_logits[r, s], torch.where(ok[..., None], picked, 0.0))

    def _taken(self, outcome) -> torch.Tensor:
        """The accepted sibling's slot -> [R, S] bool."""
        return ((self.tokens >= 0) & (outcome.branch > 0)[:, None] & (self.depth == outcome.branch_depth[:, None])
                & (self.alt == (outcome.branch - 1)[:, None]))

    def taken(self, outcome) -> torch.Tensor:
        """The accepted branch tokens (the sibling and its accepted continuation) among the call's branch
        content -> [R, C_b] bool."""
        took = self._taken(outcome)
        i = torch.arange(self.branch.shape[2], device=took.device)
        kept = took[:, :, None] & (i[None, :] < outcome.num_accepted[:, None])[:, None, :] & (self.branch >= 0)
        out = torch.zeros((took.shape[0], self.c_total), dtype=torch.bool, device=took.device)
        rows = torch.arange(took.shape[0], device=took.device)[:, None, None].expand_as(kept)
        out[rows[kept], self.c_index[kept]] = True
        return out

    def store(self, state: _Decoding, rows, outcome) -> None:
        """After an accepted sibling, its branch's queries are the next round's draft logits (and features)."""
        r, s = self._taken(outcome).nonzero(as_tuple=True)
        cols = self.columns[r, s]  # [k, 2W]
        ok = cols >= 0
        at_rows = rows[r][:, None].expand_as(cols)[ok]
        state.draft_logits[at_rows, cols[ok] - state.start] = self.logits[r, s][ok]
        if self.features is not None:
            state.draft_features[at_rows, cols[ok] - state.start] = self.features[r, s][ok]
        state.have[at_rows, cols[ok]] = True


def _exclusive_cumsum(counts: torch.Tensor) -> torch.Tensor:
    """Per row, the sum of the counts before each one [R, S] -> [R, S]."""
    return counts.cumsum(dim=1) - counts


def _drafts(state, rows, candidates, temperature, generator, order, window, cutoff=None):
    """Window positions [R, W], counts [R], drafts [R, W], the logits they were drawn from [R, W, V], and with a
    head ``redraft(index, forced)``: its drafts for rows ``index`` [k] of these along forced paths (a draft
    tree's branches; else None). ``cutoff``: counts cut by ``cut_count`` and W trimmed to the longest row's."""
    n = rows.numel()
    if not window or state.draft_logits is None:
        empty = torch.zeros((n, 0), dtype=torch.long, device=rows.device)
        vocab = state.model.vocab_size
        return (empty, torch.zeros(n, dtype=torch.long, device=rows.device), empty,
                torch.zeros((n, 0, vocab), device=rows.device), None)
    draft_logits, start = state.draft_logits[rows], state.start
    positions, count = choose_window(order, draft_logits, (candidates & state.have[rows])[:, start:], state.mask_id,
                                     window)  # answer columns; canvas columns below
    index = torch.arange(n, device=rows.device)
    if state.head is None:
        drafts, window_logits = independent_drafts(draft_logits[index[:, None], positions], state.mask_id,
                                                   temperature, generator)
        return *_cut(positions + start, count, drafts, window_logits, cutoff), None
    # The head: step 0 reads the last emitted token (the pending correction, which the window's queries
    # did not see, or else the last accepted draft) and its offset.
    columns = positions + start
    before = torch.cat([state.last_col[rows, None], columns[:, :-1]], dim=1)
    inputs = (state.draft_features[rows[:, None], positions], draft_logits[index[:, None], positions],
              state.last_tok[rows], columns - before)
    drafts, window_logits = head_drafts(state.head, *inputs, temperature, generator, state.mask_id, cutoff=cutoff,
                                        compiled=state.compiled)
    columns, count, drafts, window_logits = _cut(columns, count, drafts, window_logits, cutoff)
    width = columns.shape[1]
    inputs = (inputs[0][:, :width], inputs[1][:, :width], inputs[2], inputs[3][:, :width])

    def redraft(which, forced):
        return head_drafts(state.head, *(t[which] for t in inputs), temperature, bind_rows(generator, which),
                           state.mask_id, forced=forced)

    return columns, count, drafts, window_logits, redraft


def _cut(columns, count, drafts, window_logits, cutoff):
    """The adaptive window: ``cut_draft``'s counts and width (one host read; the head may have stopped early
    already), the columns trimmed alike."""
    if cutoff is None or not columns.shape[1]:
        return columns, count, drafts, window_logits
    cut = cut_draft(Draft(drafts, window_logits, count.clamp(max=drafts.shape[1])), cutoff)
    return columns[:, : cut.tokens.shape[1]], cut.count, cut.tokens, cut.logits


def _queries(x, candidates, positions, count, order, window, mask_id):
    """Query columns [R, Q], their copy [R, Q] (W + 1: lookahead) and validity [R, Q], in (copy, column) order.

    Copy k (k <= count) asks the block's candidates left after s_<k: all of them for confidence, the
    leftmost for left_to_right. Lookahead (window > 0) asks the next ``window`` masked columns in position
    order that no copy asks (for confidence, only once the block can finish this round).
    """
    n, length = x.shape
    width = positions.shape[1]
    cols = torch.arange(length, device=x.device)
    drafted = torch.zeros((n, width + 1, length), dtype=torch.bool, device=x.device)
    for k in range(1, width + 1):  # copy k has s_0..s_{k-1} revealed
        hit = torch.zeros((n, length), dtype=torch.bool, device=x.device)
        hit[torch.arange(n, device=x.device), positions[:, k - 1]] = True
        drafted[:, k] = drafted[:, k - 1] | (hit & (k - 1 < count)[:, None])
    asked = candidates[:, None, :] & ~drafted  # [R, W + 1, L]
    asked &= (torch.arange(width + 1, device=x.device)[None, :] <= count[:, None])[:, :, None]
    if order == "left_to_right":  # only the leftmost candidate of each copy
        first = torch.where(asked, cols, length).min(dim=2, keepdim=True).values
        asked &= cols[None, None, :] == first
    lookahead = torch.zeros((n, 1, length), dtype=torch.bool, device=x.device)
    if window:
        free = (x == mask_id) & ~asked.any(dim=1) & ~drafted[:, -1]
        if order == "left_to_right":
            after = torch.where(asked.any(dim=1) | drafted[:, -1], cols, -1).max(dim=1, keepdim=True).values
            free &= cols[None, :] > after
        else:
            free &= ~candidates & (candidates.sum(dim=1, keepdim=True) <= count[:, None] + 1)
        rank = free.long().cumsum(dim=1)
        lookahead[:, 0] = free & (rank <= window)
    asked = torch.cat([asked, lookahead], dim=1)  # [R, W + 2, L]
    r, k, c = asked.nonzero(as_tuple=True)
    per_row = asked.flatten(1).sum(dim=1)
    size = max(int(per_row.max()), 1)
    slot = torch.arange(r.numel(), device=x.device) - (per_row.cumsum(0) - per_row)[r]
    q_col = torch.zeros((n, size), dtype=torch.long, device=x.device)
    q_copy = torch.full((n, size), -1, dtype=torch.long, device=x.device)
    q_valid = torch.zeros((n, size), dtype=torch.bool, device=x.device)
    q_col[r, slot], q_copy[r, slot], q_valid[r, slot] = c, k, True
    return q_col, q_copy, q_valid


def _set_pending(state: _Decoding, rows, outcome, emitted) -> None:
    """The correction/bonus token of each row (at index num_accepted), to enter the content stream next."""
    ids, pos, valid = state.pending
    batch = state.canvas.x.shape[0]
    if ids.shape[1] != 1:  # the prompt was pending: every row takes part in the first round
        if rows.numel() != batch:
            raise RuntimeError("two-stream decoding: the first round must include every row")
        # one fresh column per row (an empty prompt has none to reuse); every row's is written below
        ids, pos = ids.new_full((batch, 1), state.mask_id), pos.new_zeros((batch, 1))
        valid = torch.zeros((batch, 1), dtype=torch.bool, device=ids.device)
    index = torch.arange(rows.numel(), device=rows.device)
    token = outcome.tokens[index, outcome.num_accepted]
    column = emitted[index, outcome.num_accepted]
    has = column >= 0
    ids[rows, 0] = torch.where(has, token, state.mask_id)
    pos[rows, 0] = state.positions[rows].gather(1, column.clamp(min=0)[:, None])[:, 0]
    valid[rows, 0] = has
    state.pending = (ids, pos, valid)
    # The head's token before the next window: the correction/bonus, else the last accepted draft.
    last = (outcome.num_accepted - 1).clamp(min=0)
    accepted = outcome.num_accepted > 0
    tok = torch.where(has, token, torch.where(accepted, outcome.tokens[index, last], state.last_tok[rows]))
    col = torch.where(has, column, torch.where(accepted, emitted[index, last], state.last_col[rows]))
    state.last_tok[rows], state.last_col[rows] = tok, col


def _store_drafts(state, rows, logits, features, q_col, q_copy, q_valid, num_accepted, count) -> None:
    """Keep, per column, the query that saw exactly the accepted drafts, else the one that saw the most
    (and its features, with a head)."""
    batch, length = state.canvas.x.shape
    if state.draft_logits is None:
        state.draft_logits = logits.new_zeros((batch, length - state.start, logits.shape[-1]))
    if features is not None and state.draft_features is None:
        state.draft_features = features.new_zeros((batch, length - state.start, features.shape[-1]))
    seen = torch.minimum(q_copy, count[:, None])
    size = q_col.shape[1]
    priority = ((seen == num_accepted[:, None]).long() * (size + 2) + seen) * size
    priority = priority + torch.arange(size, device=q_col.device)  # ties: the later query
    same = (q_col[:, :, None] == q_col[:, None, :]) & q_valid[:, :, None] & q_valid[:, None, :]
    rival = torch.where(same, priority[:, None, :], -1).max(dim=2).values
    best = q_valid & (priority == rival)
    r, q = best.nonzero(as_tuple=True)
    state.draft_logits[rows[r], q_col[r, q] - state.start] = logits[r, q]
    if features is not None:
        state.draft_features[rows[r], q_col[r, q] - state.start] = features[r, q]
    state.have[rows[r], q_col[r, q]] = True


def layout(model, options: dict):
    """The run function of fef (or, with ``window`` 0, sequential) on a two-stream model: ``decode`` with the
    sampler's options bound (fef's verifier does not apply: the layout verifies a window in one call); None on a
    model without the reveal-order cache (the block loop's stepper runs there)."""
    if not capabilities(model).reveal_order_cache:
        return None
    if options["window"] == 0:
        return functools.partial(decode, order=options["order"], window=0)
    head = None
    if options["draft"] == "head":  # the head given, else the model's default one
        head = load_draft_head(default_draft_head(model) if options["draft_head"] is None else options["draft_head"])
    return functools.partial(decode, order=options["order"], window=options["window"], sampler="fef", draft_head=head,
                             draft_candidates=options["draft_candidates"],
                             candidates_below=options["candidates_below"], draft_cutoff=options["draft_cutoff"],
                             compile=options["compile"])
