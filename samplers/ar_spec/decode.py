"""Autoregressive decoding of a CausalModel: plain sampling (``ar``) and speculative decoding (``ar_spec``).

Rows may hold different lengths (ragged acceptance). They share one right-padded buffer: a causal model's
logits at position i depend only on tokens <= i, so whatever follows a row's end cannot change them.

``ar_spec`` drafters:
- a CausalModel: ``num_draft_tokens`` sequential calls, each draft sampled from softmax(logits / T);
  with its own KV cache when it has one (``cache`` applies to target and drafter alike), so each call
  feeds only the previous draft (plus, once a round, the tokens the target accepted);
- a DiffusionModel: one call on the sequence followed by mask tokens, drafts sampled independently
  from its marginals at the next positions. A bidirectional one sees a canvas of fixed length (prompt +
  max_new_tokens + num_draft_tokens, so a row's drafts never depend on the rest of the batch). A
  block-causal one (``block_size``) gets blocks anchored at the answer start, as in training and in
  ``fef``: the canvas ends with the block holding the last draft (later blocks cannot be seen), and with
  a cache, finished blocks are computed once, so a call feeds about one block per row;
- ``"ngram"``: prompt lookup: the continuation of the latest earlier occurrence of the sequence's last
  n tokens (n = ``max_ngram`` .. 1), proposed as point masses;
- ``"head"``: an EAGLE head (``draft_head``, default the one shipped for ``dllm/weights/ar``) drafting
  from the target's own features, which the verification call returns (``return_hidden``), k head
  steps a round, or a DFlash head (a ``dflash`` head folder) drafting the k tokens in one head call; a
  DiffusionModel drafter with ``draft_head`` a repair head has its block rewritten left to right
  (``samplers/ar_spec/heads.py``). ``draft_confidence`` gives the EAGLE head EAGLE-2's dynamic draft
  length: a round's drafts end at the first one the head gave a probability below it (still exact).
Each is a ``Drafter`` object (``samplers/ar_spec/drafters.py``, which says how to add one), built once from the
``drafter`` option; the loop calls only its ``propose`` and ``rollback``. The shared verification
(``samplers/verify.py``) makes the output distributed exactly as ``ar`` at the same temperature.

``draft_candidates`` (c > 1): a draft tree. At every depth j the chain's draft d_j and c - 1 further
candidates drawn without replacement from the law d_j was drawn from (``more_candidates``: the drafter's
logits; point-mass drafters have none to give), verified in the same call at d_j's position, each seeing
the chain before it (``tree_mask``, ``Capabilities.tree_attention``). The recursive rule
(``dllm.kernels.verify``: each rejected candidate leaves a residual the next one is tested against) keeps the
law exact. With independent drafts (``Draft.independent``: a diffusion drafter's marginals) each alternative
roots a branch, the chain's own drafts after it, and an accepted alternative continues down its branch by the
chain rule; otherwise the alternatives are leaves, and an accepted one ends the round with one more token from
its leaf row. A target call then feeds up to (c - 1) K (K + 1) / 2 more tokens with branches, K (c - 1) with
leaves: trees trade compute per call for calls.

No call reads past position prompt + max_new_tokens - 2, the last input ``ar`` feeds: a draft there
would leave no room for the bonus token, so it is never verified (drafts past that point are
placeholders that ``num_drafts`` excludes). ``ar_spec`` therefore fits any context ``ar`` fits.
"""

from __future__ import annotations

import torch

from dllm.numerics import bind_rows, positions_from_mask, sample_from_logits
from dllm.protocols import capabilities, is_diffusion_model
from dllm.stats import DecodeStats, StepEvent
from dllm.stops import emitted_until_stop, fill_token, is_stop

from ..calling import Caller, check_logits
from ..drafting import Draft, cut_draft, more_candidates
from ..likelihood import Emissions
from ..verify import Continuations, Noise, rejection_sample, tree_path
from .caches import rollback_cache, use_cache
from .drafters import CausalDrafter, DiffusionDrafter, DraftContext, Drafter, NgramDrafter, append_at_lengths
from .heads import head_drafter


def ar(
    model, prompt, gen_length, *, temperature, generator, stats: DecodeStats, cache="auto", attention_mask=None,
    eos_token_id=None, callback=None, record: Emissions | None = None,
) -> torch.Tensor:
    """One token per call from the next-token distribution -> [B, P + N]; ``record``: each token with its
    log-probability (``samplers/likelihood.py``)."""
    batch, prompt_len = prompt.shape
    seq = _buffer(prompt, gen_length, eos_token_id)
    caller = Caller(model, stats, attention_mask=_full_mask(attention_mask, batch, seq.shape[1] + 1, prompt.device))
    rows = torch.arange(batch, device=prompt.device)
    kv = model.new_cache() if use_cache(cache, model) else None
    for t in range(gen_length):
        end = prompt_len + t
        start = 0 if kv is None else kv.length
        last = torch.full((len(rows), 1), end - start - 1, device=prompt.device)  # the one position read
        if kv is None:
            logits = caller(seq[rows, :end], rows, served=len(rows), at=last)[:, -1]
        else:
            logits = caller.cached(seq[rows, start:end], kv, rows, served=len(rows), keys=slice(0, end),
                                   append=True, at=last)[:, -1]
        token = sample_from_logits(logits, temperature, bind_rows(generator, rows))
        seq[rows, end] = token
        if record is not None:
            record.take(rows, torch.full((len(rows), 1), end, device=seq.device), logits[:, None], seq)
        stats.count_round(torch.ones_like(token))
        if callback is not None:
            callback(StepEvent("ar", rows, seq[rows, : end + 1], **({} if record is None else record.of_rows(rows))))
        if eos_token_id is not None and bool(is_stop(token, eos_token_id).any()):
            keep = ~is_stop(token, eos_token_id)
            rows = rows[keep]
            kv = kv.select(keep.nonzero().squeeze(-1)) if kv is not None and rows.numel() else kv
            if not rows.numel():
                break
    return seq


def ar_spec(
    model, prompt, gen_length, *, temperature, generator, stats: DecodeStats, drafter="ngram",
    num_draft_tokens=4, max_ngram=3, draft_head=None, draft_confidence=None, draft_candidates=1,
    candidates_below=None, draft_cutoff=None, cache="auto", attention_mask=None, eos_token_id=None, callback=None,
    record: Emissions | None = None,
) -> torch.Tensor:
    """Speculative decoding against the causal target ``model`` -> [B, P + N].

    ``draft_candidates`` > 1 verifies a draft tree: at every depth the chain's draft and that many - 1
    further candidates drawn without replacement from the same draft law (``_tree_rows``); with
    ``candidates_below``, only at depths whose draft has a (temperature-1) probability below it.
    ``draft_cutoff``: k per row and round, the drafts ending where the drafter's own survival estimate falls
    below it (``samplers/drafting.py: cut_draft``)."""
    batch, prompt_len = prompt.shape
    total = prompt_len + gen_length
    seq = _buffer(prompt, gen_length, eos_token_id)
    full_mask = _full_mask(attention_mask, batch, total + num_draft_tokens + 1, prompt.device)
    caller = Caller(model, stats, attention_mask=full_mask)
    lengths = torch.full((batch,), prompt_len, dtype=torch.long, device=prompt.device)
    rows = torch.arange(batch, device=prompt.device)
    kv = rollback_cache(model) if use_cache(cache, model) else None  # holds [0, min(len) - 1) of every row
    proposer = _make_drafter(drafter, Caller(drafter, stats, attention_mask=full_mask, draft=True), cache, max_ngram,
                             prompt_len, draft_head, model, draft_confidence, draft_cutoff)
    features = None  # [B, P + N, D] the target's features at every position fed so far, for a drafter that wants them
    while rows.numel():
        length = lengths[rows]
        num_drafts = torch.clamp(total - length - 1, max=num_draft_tokens)  # leave room for the bonus
        context = None if features is None else _feature_context(features, rows, length, proposer.feature_context,
                                                                  full_mask)
        draft = proposer.propose(seq[rows], length, num_draft_tokens,
                                 DraftContext(rows, num_drafts, temperature, generator, model.vocab_size,
                                              *(context or (None, None))))
        draft = cut_draft(draft, draft_cutoff)
        drafts, num_drafts = draft.tokens, draft.count
        tree = {}
        if draft_candidates > 1:  # the tree's other candidates, and the target after each of them
            alternatives = more_candidates(draft, draft_candidates - 1, temperature, generator, rows, candidates_below)
            # Independent drafts continue every sibling's branch; otherwise siblings are leaves.
            branches = draft.independent and not proposer.wants_features
            target, after, fed = _tree_rows(caller, kv, seq[rows], rows, length, drafts, alternatives,
                                            proposer.wants_features, draft if branches else None)
            tree = {"alternatives": alternatives, ("continuations" if branches else "leaf_logits"): after}
        else:
            target, fed = _target_rows(caller, kv, seq[rows], rows, length, drafts, proposer.wants_features)
        outcome = rejection_sample(drafts, draft.logits, target, num_drafts, temperature=temperature,
                                   noise=Noise(generator=bind_rows(generator, rows)), **tree)
        if fed is not None:
            features = _keep_features(features, fed, rows, length, (batch, total), outcome)
        stats.count_verification(num_drafts, outcome.num_accepted, outcome.num_emitted, outcome.branch,
                                 width=drafts.shape[1])
        emitted, stopped = emitted_until_stop(outcome.tokens, outcome.num_emitted, eos_token_id)
        offsets = torch.arange(outcome.tokens.shape[1], device=seq.device)
        hit = offsets[None, :] < emitted[:, None]
        seq[rows[:, None].expand_as(hit)[hit], (length[:, None] + offsets)[hit]] = outcome.tokens[hit]
        lengths[rows] += emitted
        if callback is not None or record is not None:  # the path verification followed, and each token's law
            path = tree_path(drafts, target, outcome, tree.get("continuations"), tree.get("leaf_logits"))
            if record is not None:
                record.take(rows, torch.where(hit, length[:, None] + offsets, -1), path["emitted_logits"], seq)
            if callback is not None:
                callback(StepEvent("ar_spec", rows, seq[rows], num_drafts=num_drafts,
                                   num_accepted=outcome.num_accepted, **path,
                                   **({} if record is None else record.of_rows(rows))))
        # Tokens every row holds for sure and the caches may keep: those before the last emitted one; after an
        # accepted alternative, before it (the caches hold the chain's draft at its position).
        held = lengths[rows] - 1
        if outcome.branch is not None:
            held = torch.where(outcome.branch > 0, length + outcome.branch_depth, held)
        keep = (lengths[rows] < total) & ~stopped
        rows = rows[keep]
        if rows.numel():
            kept = None if bool(keep.all()) else keep.nonzero().squeeze(-1)
            accepted = int(held[keep].min())
            if kv is not None:
                kv = kv if kept is None else kv.select(kept)
                kv.crop(accepted)
            proposer.rollback(kept, accepted)
    return seq


def _feature_context(features, rows, length, width: int, full_mask) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's features at positions length - 1 - width .. length - 2 of each row [R, width, D] and
    which of them are a real token's [R, width] bool (not before position 0, not left padding)."""
    at = length[:, None] - 1 - width + torch.arange(width, device=length.device)
    valid = at >= 0
    at = at.clamp(min=0)
    if full_mask is not None:
        valid &= full_mask[rows[:, None], at].bool()
    return features[rows[:, None], at], valid


def _buffer(prompt: torch.Tensor, gen_length: int, eos_token_id: tuple[int, ...] | None) -> torch.Tensor:
    """[B, P + N] holding the prompt, then the fill token (dllm.stops) where rows stop early."""
    seq = torch.full((prompt.shape[0], prompt.shape[1] + gen_length), fill_token(eos_token_id), dtype=torch.long,
                     device=prompt.device)
    seq[:, : prompt.shape[1]] = prompt
    return seq


def _full_mask(attention_mask, batch: int, length: int, device) -> torch.Tensor | None:
    """The prompt's padding mask extended with ones to ``length`` positions -> [B, length] or None."""
    if attention_mask is None:
        return None
    full = torch.ones((batch, length), dtype=torch.long, device=device)
    full[:, : attention_mask.shape[1]] = attention_mask
    return full


def _make_drafter(drafter, caller: Caller, cache: str, max_ngram: int, prompt_len: int, draft_head=None,
                  target=None, confidence=None, cutoff=None) -> Drafter:
    """The ``drafter`` option as a Drafter (samplers/ar_spec/drafters.py), chosen once so the loop never dispatches."""
    if isinstance(drafter, Drafter):
        return drafter
    if drafter == "head" or draft_head is not None:  # trained heads: samplers/ar_spec/heads.py
        block = None if isinstance(drafter, str) else _block_size(drafter)
        kv = rollback_cache(drafter) if block and use_cache(cache, drafter) else None
        return head_drafter(drafter, draft_head, target, caller, block, prompt_len, kv, confidence, cutoff)
    if isinstance(drafter, str):
        return NgramDrafter(max_ngram)
    if not is_diffusion_model(drafter):
        return CausalDrafter(caller, rollback_cache(drafter) if use_cache(cache, drafter) else None)
    block = _block_size(drafter)
    kv = rollback_cache(drafter) if block and use_cache(cache, drafter) else None
    return DiffusionDrafter(caller, block, prompt_len, kv)


def _target_rows(caller: Caller, kv, seq, rows, length, drafts, hidden=False):
    """Target logits for each draft position and the bonus: one call on sequence + drafts -> ([R, K + 1, V],
    ``hidden``: (the target's features at every position fed [R, L, D], the first one's position, None);
    else None).

    With a cache holding [0, c), only tokens from c on are fed (each row's unverified tail and drafts).
    Inputs stop at position total - 2 (see the module docstring); rows past it repeat the last one.
    """
    width = drafts.shape[1]
    extended = append_at_lengths(seq, length, drafts)[:, : min(int(length.max()) + width, seq.shape[1] - 1)]
    start = 0 if kv is None else kv.length
    at = length[:, None] - 1 - start + torch.arange(width + 1, device=seq.device)  # position t predicts t + 1
    at = at.clamp(max=extended.shape[1] - start - 1)
    if hidden:  # a drafter reading the target's features gets every fed position's, so logits come in full
        extra = {"return_hidden": True}
    else:  # logits at the K + 1 positions read only
        extra = {"at": at}
    if kv is None:
        out = caller(extended, rows, served=len(rows), **extra)
    else:
        out = caller.cached(extended[:, start:], kv, rows, served=len(rows), keys=slice(0, extended.shape[1]),
                            append=True, **extra)
    if not hidden:
        return out, None
    index = (torch.arange(seq.shape[0], device=seq.device)[:, None], at)
    return out[0][index], (out[1], start, None)


def _tree_rows(caller: Caller, kv, seq, rows, length, drafts, alternatives, hidden=False,
               branches: Draft | None = None):
    """A draft tree's target logits in one call -> ([R, K + 1, V] after each chain prefix, as ``_target_rows``;
    the targets after the alternatives: [R, K, A, V] after each (leaves), or with ``branches`` (the round's
    independent ``Draft``) the ``Continuations`` of each alternative's branch; ``hidden`` (leaves only): (chain
    features, their first position, the alternatives' features [R, K, A, D]), else None).

    The inputs are the chain's (as ``_target_rows``), then, for each of the K x A columns in which some row has
    an alternative, the alternative at d_j's position, and with ``branches`` the chain's own drafts d_{j+1} ..
    d_{K-1} after it at their positions: the alternative's branch (``tree_mask``: it sees the prefix, d_<j and
    the branch before it), so each of its logits is the target after its prefix. Without a cache the call fills
    a fresh one (the same logits), since the tree's mask is a cached call's. The extra cache entries lie past
    the chain's, where the round's crop drops them.
    """
    if branches is not None and hidden:
        raise ValueError("_tree_rows: branches are for drafters that read no target features (hidden=False)")
    n_rows, width = drafts.shape
    device = seq.device
    siblings = alternatives.flatten(1)  # [R, K A], depth-major
    used = (siblings >= 0).any(dim=0).nonzero().squeeze(-1)  # only the columns some row has a sibling in
    root = used // alternatives.shape[2]  # [U] each used column's depth
    span = width - root if branches is not None else torch.ones_like(root)  # tokens per used column
    owner = torch.repeat_interleave(torch.arange(used.numel(), device=device), span)  # [E] its used column
    depth = root[owner] + torch.arange(owner.numel(), device=device) - (span.cumsum(0) - span)[owner]  # [E]
    count = owner.numel()
    extra_tokens = torch.where(depth == root[owner], siblings[:, used[owner]], drafts[:, depth])  # [R, E]
    extended = append_at_lengths(seq, length, drafts)[:, : min(int(length.max()) + width, seq.shape[1] - 1)]
    cache = kv if kv is not None else caller.model.new_cache()
    start, columns = cache.length, extended.shape[1]
    real = torch.ones_like(extended, dtype=torch.bool)
    if caller.attention_mask is not None:
        real = caller.attention_mask[rows, :columns].bool()
    positions = positions_from_mask(real)  # [R, columns], the model's own position ids
    depth_at = (length[:, None] + torch.arange(width, device=device)).clamp(max=columns - 1)  # d_j's column
    extra_at = depth_at[:, depth]  # [R, E] each extra token's column
    chain_cols = torch.arange(start, columns, device=device)
    sees_chain = torch.cat([
        (chain_cols[:, None] >= chain_cols[None, :]).expand(n_rows, -1, -1),  # the chain: causal
        chain_cols[None, None, :] < depth_at[:, root[owner], None],  # a branch: the chain before its root
    ], dim=1) & real[:, None, start:]  # [R, n + E, n]
    sees_extra = torch.cat([torch.zeros((columns - start, count), dtype=torch.bool, device=device),
                            _branch_mask(owner, depth)])
    tree = torch.cat([sees_chain, sees_extra.expand(n_rows, -1, -1)], dim=2)
    inputs = torch.cat([extended[:, start:], extra_tokens.clamp(min=0)], dim=1)
    caller.count(inputs, served=len(rows), cache=cache)
    keys = torch.cat([real, real.new_ones((n_rows, count))], 1)  # padding over cached + new keys
    out = caller.model.forward_cached(inputs, cache, attention_mask=keys, tree_mask=tree, append=True,
                                      position_ids=torch.cat([positions[:, start:], positions.gather(1, extra_at)], 1),
                                      **({"return_hidden": True} if hidden else {}))
    logits, features = check_logits(out, inputs) if hidden else (check_logits(out, inputs), None)
    n = columns - start
    at = length[:, None] - 1 - start + torch.arange(width + 1, device=device)  # position t predicts t + 1
    target = logits[torch.arange(n_rows, device=device)[:, None], at.clamp(max=n - 1)]
    if branches is not None:
        return target, _branch_continuations(logits[:, n:], alternatives, used, owner, depth, branches), None
    leaves = logits.new_zeros((n_rows, siblings.shape[1], logits.shape[-1]))  # never read where no sibling
    leaves[:, used] = logits[:, n:]
    fed = None
    if hidden:
        leaf_features = features.new_zeros((n_rows, siblings.shape[1], features.shape[-1]))
        leaf_features[:, used] = features[:, n:]
        fed = (features[:, :n], start, leaf_features.unflatten(1, alternatives.shape[1:]))
    return target, leaves.unflatten(1, alternatives.shape[1:]), fed


def _branch_mask(owner: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
    """Which extra tokens of a tree call each one sees [E, E]: its own branch (``owner``), up to itself."""
    return (owner[:, None] == owner[None, :]) & (depth[None, :] <= depth[:, None])


def _branch_continuations(extra_logits, alternatives, used, owner, depth, draft: Draft) -> Continuations:
    """The ``Continuations`` of a tree call's branches: extra token e (at ``depth[e]`` of used column
    ``owner[e]``) gives the target at depth[e] + 1; the continuation's drafts are the chain's own."""
    n_rows, width, count = alternatives.shape
    device = extra_logits.device
    r, column = (alternatives.flatten(1)[:, used] >= 0).nonzero(as_tuple=True)  # one entry per alternative
    slot = torch.full((n_rows, width * count), -1, dtype=torch.long, device=device)
    slot[r, used[column]] = torch.arange(r.numel(), device=device)
    root = used[column] // count
    steps = torch.arange(width, device=device)
    tokens = torch.where(steps[None, :] > root[:, None], draft.tokens[r], -1)
    targets = extra_logits.new_zeros((r.numel(), width + 1, extra_logits.shape[-1]))
    mine = owner[None, :] == column[:, None]  # [S, E] the extra tokens of each entry's branch
    s, e = mine.nonzero(as_tuple=True)
    targets[s, depth[e] + 1] = extra_logits[r[s], e]
    return Continuations(slot.view(n_rows, width, count), tokens, draft.logits[r], targets)


def _keep_features(features, fed, rows, length, shape: tuple[int, int], outcome) -> torch.Tensor:
    """Write a round's fed target features into ``features`` [B, total, D] (``shape`` (B, total); made on first
    use): every chain position's (those up to each row's new length - 2 held final tokens when fed, later
    ones are rewritten next round, the cache rolling back to before them), and an accepted alternative's at
    its position."""
    chain, start, leaves = fed
    if features is None:
        features = chain.new_zeros((*shape, chain.shape[-1]))
    width = min(chain.shape[1], shape[1] - start)
    features[rows[:, None], start + torch.arange(width, device=chain.device)] = chain[:, :width]
    if leaves is not None:
        took = (outcome.branch > 0).nonzero().squeeze(-1)
        depth = outcome.num_accepted[took] - 1
        features[rows[took], length[took] + depth] = leaves[took, depth, outcome.branch[took] - 1]
    return features


def _block_size(model) -> int | None:
    """A block-causal model's block size, else None."""
    return capabilities(model).block_size
