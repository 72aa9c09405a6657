"""Speculative verification: the rule over probabilities, its logits form, and the logits dispatcher.

Rule (Leviathan et al. 2023; Chen et al. 2023), per row b with ``n_b`` valid drafts:
accept draft j with probability min(1, target(d_j) / draft(d_j)) while every earlier draft was accepted;
at the first rejection emit a correction drawn from normalize(max(0, target_j - draft_j)); if all n_b
drafts are accepted and the row has a bonus, emit a token drawn from target row n_b. Point-mass drafts
(``draft_probs=None``: n-gram lookup, or any deterministic proposal) are the special case
draft = one-hot(d_j): accept with probability target(d_j) and correct from target with d_j removed.
Greedy mode accepts while the draft equals the target argmax and corrects (or adds the bonus) with the
argmax. The emitted tokens are then distributed exactly as sequential sampling from the targets.

Numerics (see also ``dllm.numerics``):
- the test is ``u * draft(d) < target(d)`` in float64 with u ~ U[0, 1) in float64: no division, so a
  tiny draft probability cannot overflow the ratio;
- a draft probability of 0 is a rejection (such a draft cannot have been sampled from the proposal, so
  accepting it would bias the output);
- if the residual max(0, target - draft) has no mass (target == draft up to rounding, where rejection
  has probability ~0), the correction is drawn from the target row itself.

Layout of ``target_probs`` [B, K or K + 1, V]: row j < n_b is the target for draft j; row n_b is the
bonus row of row b (so ragged rows keep their bonus at index n_b, not K). With K + 1 rows every row has
a bonus unless ``has_bonus`` says otherwise; with K rows no row has one.

Trees (``verify_tree_logits``): at each depth j the chain's draft d_j is candidate 0, and A more
candidates (leaves, siblings of d_j) were drawn from the same draft law without replacement. Candidate i
is tested with the chain rule against the current target p_i, its proposal q_i being the draft law with
candidates 0..i-1 removed and renormalised (the law it was drawn from); a rejection moves the target to
normalize(max(0, p_i - q_i)) (Chen et al. 2023's recursive rejection sampling, SpecInfer's multi-step
verification, here without replacement). Each step is one exact speculative-sampling step, so the token
emitted at depth j is distributed as p_0 = target_j whatever the candidates: d_j continues the chain, an
alternative ends it and its leaf row (the target after it) gives one more token, and when every
candidate is rejected the last residual gives the correction. Greedy mode takes the first candidate equal
to the target's argmax. With A = 0 the tree rule is the chain rule (the same function is called).
With ``Continuations`` each alternative (j, a) roots a branch: drafts at depths j + 1 .. n_b - 1 drawn after
it, and the targets after each of its prefixes. An accepted alternative then continues down its branch by
the chain rule (correction at its first rejection, or the bonus after it), with acceptance noise
independent of the first stage's (``Noise.continuation``): given the token at depth j, its branch is
a chain speculative step like any other, so the emitted tokens are still the target chain's.

``verify_probs`` is the one definition of the rule. ``verify_logits_reference`` applies it to
softmax(logits / T) (float32, ``dllm.numerics.softmax``); the fused Triton kernel in
``verify_triton.py`` computes the same from logits without materialising probabilities, and
``verify_logits`` dispatches between them.

Noise: one ``Noise`` object says where every random number comes from, per component: explicit
``uniforms`` [B, K] / ``gumbels`` [B, V] (float64) win; else ``seed`` derives them from a counter-based
generator (``dllm.kernels.noise``: acceptance uniform (b, j) and Gumbel (b, v) are pure functions of
(seed, b, j or v)), so reference and kernel replay each other; else the reference draws from
``generator`` (uniforms first, then each correction/bonus row's Gumbels) and the kernel draws one seed
from it (same law, different stream). The noise is drawn apart from the rule (``_verify``), as in vLLM's
rejection sampler; the old keywords (``generator=``, ``seed=``, ``uniforms=``, ``gumbels=``) build one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dllm.numerics import RowGenerators, bind_rows, gumbel, softmax, uniform

from .dispatch import use_triton
from .noise import (
    SEED_LIMIT,
    STREAM_ACCEPT,
    STREAM_BRANCH_ACCEPT,
    STREAM_BRANCH_RESIDUAL,
    STREAM_RESIDUAL,
    counter_gumbels,
    counter_uniforms,
)


@dataclass(frozen=True)
class VerifyResult:
    """Emitted tokens of one verification round."""

    tokens: torch.Tensor  # [B, K + 1] accepted drafts, then the correction/bonus; -1 after the last
    num_emitted: torch.Tensor  # [B] tokens emitted (accepted + 1 when a correction/bonus was drawn)
    num_accepted: torch.Tensor  # [B] accepted drafts (a tree's accepted alternative included)
    # tree verification (``verify_tree_logits``): [B] the alternative accepted (1 .. A), 0 where the chain's
    # own drafts were; None for a chain. Its depth is ``branch_depth`` [B] (-1: none): the last accepted
    # depth for leaves, or, with continuations, the depth where the accepted path left the chain
    branch: torch.Tensor | None = None
    branch_depth: torch.Tensor | None = None


@dataclass(frozen=True)
class Continuations:
    """Drafts after each alternative of a draft tree (``verify_tree_logits``), one entry per alternative,
    indexed by absolute depth: ``slot`` [B, K, A] is alternative (j, a)'s entry (-1 only where there is no
    alternative), and for entry s the depths i > j hold its continuation: ``tokens`` [S, K] (-1 past the
    row's drafts; depths i <= j are never read), ``logits`` [S, K, V] the law each was drawn from given the path
    before it, and ``targets`` [S, K + 1, V] the target at depth i after the chain prefix d_<j, the alternative
    and its continuation before i (i = j + 1: the leaf; row n_b: the bonus, as in ``target_logits``). Memory
    goes with the alternatives drawn, not with B x K x A."""

    slot: torch.Tensor
    tokens: torch.Tensor
    logits: torch.Tensor
    targets: torch.Tensor


@dataclass(frozen=True)
class Noise:
    """The randomness of one verification; each component explicit, else from ``seed``, else ``generator``."""

    generator: torch.Generator | None = None
    seed: int | None = None  # counter-based noise (dllm.kernels.noise), in [0, 2^63)
    uniforms: torch.Tensor | None = None  # [B, K] float64 acceptance noise
    gumbels: torch.Tensor | None = None  # [B, V] float64 noise for the correction/bonus draw

    def __post_init__(self) -> None:
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < SEED_LIMIT):
            raise ValueError(f"Noise: seed must be an integer in [0, 2^63) or None, got {self.seed!r}")
        for name in ("uniforms", "gumbels"):
            value = getattr(self, name)
            # float64: the noise rule of dllm.numerics (a float32 uniform would silently move the test)
            if value is not None and (not isinstance(value, torch.Tensor) or value.dim() != 2
                                      or value.dtype != torch.float64):
                raise ValueError(f"Noise: {name} must be a 2-D float64 tensor or None, got {_describe(value)}")

    def acceptance(self, batch: int, width: int, device) -> torch.Tensor:
        """Acceptance uniforms -> [B, K] float64."""
        if self.uniforms is not None:
            return self.uniforms
        if self.seed is not None:
            return counter_uniforms(self.seed, STREAM_ACCEPT, torch.arange(batch, device=device), width)
        return uniform(need_generator(self.generator), (batch, width), device)

    def continuation(self, rows: torch.Tensor, width: int, vocab: int) -> Noise:
        """The noise of a second chain verification on batch rows ``rows`` [R] of width ``width``, independent of
        this one's (a draft tree's continuation after an accepted alternative)."""
        self.check_continuable()
        if self.seed is not None:
            return Noise(uniforms=counter_uniforms(self.seed, STREAM_BRANCH_ACCEPT, rows, width),
                         gumbels=counter_gumbels(self.seed, STREAM_BRANCH_RESIDUAL, rows, vocab))
        return Noise(generator=bind_rows(need_generator(self.generator), rows))

    def check_continuable(self) -> None:
        """Explicit noise tensors cover one verification; a tree with continuations needs a second one."""
        if self.uniforms is not None or self.gumbels is not None:
            raise ValueError("Noise: explicit uniforms/gumbels cover the chain and its alternatives only; verify "
                             "a draft tree with continuations with seed or generator noise")

    def residual(self, rows: torch.Tensor, vocab: int, device) -> torch.Tensor:
        """Gumbel noise for the correction/bonus draw of batch rows ``rows`` [R] -> [R, V] float64."""
        if self.gumbels is not None:
            return self.gumbels[rows]
        if self.seed is not None:
            return counter_gumbels(self.seed, STREAM_RESIDUAL, rows, vocab)
        return gumbel(bind_rows(need_generator(self.generator), rows), (rows.numel(), vocab), device)


def verify_probs(
    draft_tokens: torch.Tensor,  # [B, K]
    draft_probs: torch.Tensor | None,  # [B, K, V], or None for point-mass drafts
    target_probs: torch.Tensor,  # [B, K or K + 1, V]; in greedy mode any scores with the same argmax
    num_drafts: torch.Tensor | None = None,  # [B] valid drafts per row (default K)
    *,
    has_bonus: torch.Tensor | None = None,  # [B] bool; default: True iff target has K + 1 rows
    generator: torch.Generator | None = None,
    uniforms: torch.Tensor | None = None,  # [B, K] float64, explicit acceptance noise
    gumbels: torch.Tensor | None = None,  # [B, V] float64, explicit noise for correction/bonus sampling
    greedy: bool = False,
) -> VerifyResult:
    """Accept/reject a ragged batch of drafts against target distributions; see the module docstring."""
    noise = Noise(generator=generator, uniforms=uniforms, gumbels=gumbels)
    return _verify(draft_tokens, draft_probs, target_probs, num_drafts, has_bonus, noise, greedy)


def verify_logits_reference(
    draft_tokens: torch.Tensor,  # [B, K]
    draft_logits: torch.Tensor | None,  # [B, K, V], or None for point-mass drafts
    target_logits: torch.Tensor,  # [B, K or K + 1, V]
    num_drafts: torch.Tensor | None = None,  # [B] valid drafts per row (default K)
    *,
    temperature: float,  # 0: greedy
    has_bonus: torch.Tensor | None = None,  # [B] bool; default: True iff target has K + 1 rows
    generator: torch.Generator | None = None,
    uniforms: torch.Tensor | None = None,  # [B, K] float64
    gumbels: torch.Tensor | None = None,  # [B, V] float64
    seed: int | None = None,  # counter-based noise where uniforms/gumbels are not given
    noise: Noise | None = None,  # instead of the four keywords above
) -> VerifyResult:
    """``verify_probs`` on softmax(logits / T) in float32; T = 0 is greedy on the logits."""
    check_temperature(temperature)
    noise = as_noise(noise, generator, seed, uniforms, gumbels)
    if temperature == 0:
        return _verify(draft_tokens, None, target_logits, num_drafts, has_bonus, noise, True)
    draft_probs = None if draft_logits is None else softmax(draft_logits, temperature)
    return _verify(draft_tokens, draft_probs, softmax(target_logits, temperature), num_drafts, has_bonus, noise,
                   False)


def verify_logits(
    draft_tokens: torch.Tensor,  # [B, K]
    draft_logits: torch.Tensor | None,  # [B, K, V], or None for point-mass drafts
    target_logits: torch.Tensor,  # [B, K or K + 1, V]
    num_drafts: torch.Tensor | None = None,  # [B]
    *,
    temperature: float,
    has_bonus: torch.Tensor | None = None,  # [B] bool
    generator: torch.Generator | None = None,
    uniforms: torch.Tensor | None = None,  # [B, K] float64
    gumbels: torch.Tensor | None = None,  # [B, V] float64
    seed: int | None = None,
    noise: Noise | None = None,  # instead of the four keywords above
) -> VerifyResult:
    """Dispatcher: the fused Triton kernel for CUDA tensors when Triton is installed, else the reference
    (``dllm.kernels.dispatch`` has the rule and how to override it)."""
    noise = as_noise(noise, generator, seed, uniforms, gumbels)
    if not isinstance(noise.generator, RowGenerators) and use_triton(target_logits):
        from .verify_triton import verify_logits_triton

        return verify_logits_triton(draft_tokens, draft_logits, target_logits, num_drafts, temperature=temperature,
                                    has_bonus=has_bonus, generator=noise.generator, uniforms=noise.uniforms,
                                    gumbels=noise.gumbels, seed=noise.seed)
    return verify_logits_reference(draft_tokens, draft_logits, target_logits, num_drafts, temperature=temperature,
                                   has_bonus=has_bonus, noise=noise)


def _verify(
    draft_tokens: torch.Tensor,  # [B, K]
    draft_probs: torch.Tensor | None,  # [B, K, V]
    target_probs: torch.Tensor,  # [B, K or K + 1, V]
    num_drafts: torch.Tensor | None,  # [B]
    has_bonus: torch.Tensor | None,  # [B]
    noise: Noise,  # unused when greedy
    greedy: bool,
) -> VerifyResult:
    """The rule itself, with its acceptance and correction/bonus noise drawn from ``noise``."""
    batch, width = draft_tokens.shape
    device = draft_tokens.device
    num_drafts, has_bonus = normalise_counts(draft_tokens, target_probs, num_drafts, has_bonus)
    valid = torch.arange(width, device=device) < num_drafts[:, None]  # [B, K]
    safe_drafts = draft_tokens.clamp(min=0)

    if greedy:
        accept = valid & (safe_drafts == target_probs[:, :width].argmax(-1))
    else:
        target_at_draft = target_probs[:, :width].gather(-1, safe_drafts[..., None]).squeeze(-1).double()
        if draft_probs is None:
            draft_at_draft = torch.ones_like(target_at_draft)
        else:
            draft_at_draft = draft_probs.gather(-1, safe_drafts[..., None]).squeeze(-1).double()
        uniforms = noise.acceptance(batch, width, device)  # [B, K] float64
        accept = valid & (draft_at_draft > 0) & (uniforms * draft_at_draft < target_at_draft)

    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)  # [B]
    rejected = num_accepted < num_drafts
    extra = rejected | has_bonus  # rows that draw a correction or a bonus token

    tokens = torch.full((batch, width + 1), -1, dtype=torch.long, device=device)
    kept = torch.arange(width, device=device) < num_accepted[:, None]
    tokens[:, :width] = torch.where(kept, draft_tokens, tokens[:, :width])
    rows = _extra_rows(extra, noise, greedy)
    if rows.numel() and target_probs.shape[1]:  # (no target row: K = 0 without a bonus, nothing to draw)
        at = num_accepted[rows]
        law = _draw_extra(target_probs[rows, at.clamp(max=target_probs.shape[1] - 1)], draft_probs, draft_tokens,
                          rows, at, rejected[rows], noise, greedy)
        tokens[rows, at] = torch.where(extra[rows], law, tokens[rows, at])
    return VerifyResult(tokens=tokens, num_emitted=num_accepted + extra.long(), num_accepted=num_accepted)


def _extra_rows(extra: torch.Tensor, noise: Noise, greedy: bool) -> torch.Tensor:
    """The batch rows whose correction/bonus token is drawn -> [R] (their token is written where ``extra`` [B]).

    Greedy and counter or explicit noise give each row the same token whatever else is drawn, so every row is
    drawn and ``extra`` masks the write: no read of ``extra`` on the host. A generator's draws must go to the
    ``extra`` rows alone (rows that draw nothing consume nothing, so runs replay), which takes one read.
    """
    if greedy or noise.gumbels is not None or noise.seed is not None:
        return torch.arange(extra.shape[0], device=extra.device)
    return extra.nonzero().squeeze(-1)


def _draw_extra(
    target_row: torch.Tensor,  # [R, V]
    draft_probs: torch.Tensor | None,
    draft_tokens: torch.Tensor,
    rows: torch.Tensor,  # [R]
    at: torch.Tensor,  # [R] window index of the rejection (or of the bonus row)
    rejected: torch.Tensor,  # [R] bool: correction (True) or bonus (False)
    noise: Noise,
    greedy: bool,
) -> torch.Tensor:
    """The correction token (residual distribution) or bonus token (target row) per row -> [R]."""
    if greedy:
        return target_row.argmax(-1)
    weights = target_row.float()
    # Every row's residual is computed and ``rejected`` picks (asking whether any row was rejected is a read);
    # without drafts (K = 0) nothing can be rejected.
    if draft_tokens.shape[1]:
        if draft_probs is None:
            draft_row = torch.zeros_like(weights)
            drafted = draft_tokens[rows, at.clamp(max=draft_tokens.shape[1] - 1)]
            draft_row.scatter_(-1, drafted.clamp(min=0)[:, None], 1.0)
        else:
            draft_row = draft_probs[rows, at.clamp(max=draft_probs.shape[1] - 1)].float()
        residual = (weights - draft_row).clamp(min=0)
        # Zero residual mass: target == draft up to rounding; fall back to the target (documented above).
        use_residual = rejected & (residual.sum(-1) > 0)
        weights = torch.where(use_residual[:, None], residual, weights)
    return (torch.log(weights.double()) + noise.residual(rows, weights.shape[-1], weights.device)).argmax(-1)


def verify_tree_logits(
    draft_tokens: torch.Tensor,  # [B, K] the chain's drafts (candidate 0 of each depth)
    alternatives: torch.Tensor,  # [B, K, A] further candidates per depth, drawn without replacement; -1: none
    draft_logits: torch.Tensor,  # [B, K, V] the law every candidate of depth j was drawn from
    target_logits: torch.Tensor,  # [B, K or K + 1, V] the target after each chain prefix (row n_b: bonus)
    leaf_logits: torch.Tensor,  # [B, K, A, V] the target after chain prefix d_<j and alternative (j, a)
    num_drafts: torch.Tensor | None = None,  # [B] valid depths per row (default K)
    *,
    temperature: float,  # 0: greedy
    has_bonus: torch.Tensor | None = None,  # [B] bool; default: True iff target has K + 1 rows
    noise: Noise,
    continuations: Continuations | None = None,  # drafts after each alternative (then leaf_logits may be None)
) -> VerifyResult:
    """Verify a draft tree: the chain d_0..d_{K-1} plus, at each depth j, A sibling leaves, or with
    ``continuations`` A sibling branches (module docstring).

    With A = 0 this is the chain rule itself (``verify_logits``, the kernel where it applies); with A > 0
    the torch reference of the recursive rule. ``branch`` says which alternative, if any, was accepted.
    """
    check_temperature(temperature)
    if alternatives.shape[-1] == 0:
        return verify_logits(draft_tokens, draft_logits, target_logits, num_drafts, temperature=temperature,
                             has_bonus=has_bonus, noise=noise)
    if continuations is not None:
        return _verify_branches(draft_tokens, alternatives, draft_logits, target_logits, continuations, num_drafts,
                                temperature=temperature, has_bonus=has_bonus, noise=noise)
    if leaf_logits is None:
        raise ValueError("verify_tree_logits: a tree with alternatives needs leaf_logits (the target after each) or "
                         "continuations")
    return _verify_tree(draft_tokens, alternatives, draft_logits, target_logits, leaf_logits, num_drafts,
                        temperature=temperature, has_bonus=has_bonus, noise=noise)


def _verify_tree(draft_tokens, alternatives, draft_logits, target_logits, leaf_logits, num_drafts, *, temperature,
                 has_bonus, noise) -> VerifyResult:
    """The recursive rule (``verify_tree_logits``); ``leaf_logits`` None: nothing is drawn after an accepted
    alternative (its continuation follows, ``_verify_branches``)."""
    batch, width = draft_tokens.shape
    device = draft_tokens.device
    num_drafts, has_bonus = normalise_counts(draft_tokens, target_logits, num_drafts, has_bonus)
    candidates = torch.cat([draft_tokens[..., None], alternatives], dim=-1)  # [B, K, M]
    live = (candidates >= 0) & (torch.arange(width, device=device) < num_drafts[:, None])[..., None]
    safe = candidates.clamp(min=0)
    greedy = temperature == 0
    if greedy:  # accepted: the first candidate equal to the target's argmax
        hit = live & (safe == target_logits[:, :width].argmax(-1, keepdim=True))
        picked = torch.where(hit.any(-1), hit.float().argmax(-1), -1)  # [B, K]
        residual = target_logits[:, :width]
    else:
        picked, residual = _recursive_accept(safe, live, softmax(draft_logits, temperature).double(),
                                             softmax(target_logits[:, :width], temperature).double(),
                                             noise.acceptance(batch, width * candidates.shape[-1], device))
    chain = (picked == 0) & live[..., 0]
    num_chain = chain.long().cumprod(dim=1).sum(dim=1)  # [B]
    rows = torch.arange(batch, device=device)
    at = num_chain.clamp(max=width - 1)
    rejected = num_chain < num_drafts  # the chain stopped at depth ``at``
    branch = torch.where(rejected, picked[rows, at].clamp(min=0), 0)  # an alternative taken there
    took = branch > 0
    num_accepted = num_chain + took.long()
    extra = rejected | has_bonus  # rows that draw a correction, a token after the alternative, or a bonus

    tokens = torch.full((batch, width + 1), -1, dtype=torch.long, device=device)
    tokens[:, :width] = torch.where(torch.arange(width, device=device) < num_chain[:, None], draft_tokens,
                                    tokens[:, :width])
    tokens[rows, at] = torch.where(took, candidates[rows, at, branch], tokens[rows, at])
    depth = torch.where(took, at, -1)
    if leaf_logits is None:  # continuations follow (``_verify_branches``): no token after an alternative here
        extra = extra & ~took
    # The last token's law: the leaf after an accepted alternative, the residual left after a depth's
    # candidates were all rejected, or the bonus row after a full chain.
    last = torch.where(took, at + 1, num_chain)
    need = _extra_rows(extra, noise, greedy)
    if need.numel() and target_logits.shape[1]:
        bonus = target_logits[need, num_chain[need].clamp(max=target_logits.shape[1] - 1)]
        leaf = bonus if leaf_logits is None else leaf_logits[need, at[need], (branch[need] - 1).clamp(min=0)]
        if greedy:
            law = torch.where(took[need, None], leaf, torch.where(rejected[need, None], residual[need, at[need]],
                                                                   bonus)).argmax(-1)
        else:
            weights = torch.where(took[need, None], softmax(leaf, temperature).double(),
                                  torch.where(rejected[need, None], residual[need, at[need]],
                                              softmax(bonus, temperature).double()))
            law = (torch.log(weights) + noise.residual(need, weights.shape[-1], weights.device)).argmax(-1)
        tokens[need, last[need]] = torch.where(extra[need], law, tokens[need, last[need]])
    return VerifyResult(tokens=tokens, num_emitted=num_accepted + extra.long(), num_accepted=num_accepted,
                        branch=branch, branch_depth=depth)


def _verify_branches(draft_tokens, alternatives, draft_logits, target_logits, continuations: Continuations,
                     num_drafts, *, temperature, has_bonus, noise) -> VerifyResult:
    """A draft tree whose alternatives carry continuations: the recursive rule over the chain and the
    alternatives (``verify_tree_logits`` without leaves), then, in rows that took alternative (j, a), the chain
    rule over its continuation at depths j + 1 .. n_b - 1 against its own targets (then a correction, or the
    bonus where the row has one), with noise independent of the first stage's (``Noise.continuation``)."""
    batch, width = draft_tokens.shape
    noise.check_continuable()  # whether or not this round takes an alternative
    num_drafts, has_bonus = normalise_counts(draft_tokens, target_logits, num_drafts, has_bonus)
    if bool(((alternatives >= 0) & (continuations.slot < 0)).any()):
        # Dropping one would leave its token in the later candidates' proposal: give every alternative its entry.
        raise ValueError("Continuations: every alternative (>= 0) needs an entry in slot; found one without")
    first = _verify_tree(draft_tokens, alternatives, draft_logits, target_logits, None, num_drafts,
                         temperature=temperature, has_bonus=has_bonus, noise=noise)
    took = (first.branch > 0).nonzero().squeeze(-1)
    if not took.numel():
        return first
    depth = first.branch_depth[took]
    slot = continuations.slot[took, depth, first.branch[took] - 1]
    # Row t's continuation, shifted so that its depth j + 1 is column 0 (columns past K - 1 are never read).
    shift = (depth[:, None] + 1 + torch.arange(width + 1, device=draft_tokens.device)).clamp(max=width)
    index = slot[:, None]
    sub_tokens = continuations.tokens[index, shift[:, :width].clamp(max=width - 1)].clamp(min=0)
    sub_logits = continuations.logits[index, shift[:, :width].clamp(max=width - 1)]
    sub_targets = continuations.targets[index, shift]
    sub_count = num_drafts[took] - depth - 1
    second = verify_logits(sub_tokens, sub_logits, sub_targets, sub_count, temperature=temperature,
                           has_bonus=has_bonus[took], noise=noise.continuation(took, width, target_logits.shape[-1]))
    tokens, num_accepted, num_emitted = first.tokens.clone(), first.num_accepted.clone(), first.num_emitted.clone()
    columns = depth[:, None] + 1 + torch.arange(width, device=draft_tokens.device)  # [T, K] absolute depths
    inside = columns <= width
    tokens[took[:, None].expand_as(columns)[inside], columns[inside]] = second.tokens[:, :width][inside]
    num_accepted[took] += second.num_accepted
    num_emitted[took] = num_accepted[took] + (second.num_emitted - second.num_accepted)
    return VerifyResult(tokens=tokens, num_emitted=num_emitted, num_accepted=num_accepted, branch=first.branch,
                        branch_depth=first.branch_depth)


def _recursive_accept(candidates: torch.Tensor, live: torch.Tensor, draft: torch.Tensor, target: torch.Tensor,
                      uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The recursive rule at every depth at once: candidates, live [B, K, M], draft and target laws [B, K, V]
    (float64), uniforms [B, K * M] -> (the accepted candidate's index per depth [B, K], -1: none; the
    residual law left after the rejected ones [B, K, V])."""
    picked = torch.full(candidates.shape[:2], -1, dtype=torch.long, device=candidates.device)
    uniforms = uniforms.view(candidates.shape)
    free = draft.clone()  # the proposal's mass not yet drawn: candidate i's law is free / free.sum()
    for i in range(candidates.shape[-1]):
        token = candidates[..., i : i + 1]
        testing = live[..., i] & (picked < 0)
        mass = free.sum(-1, keepdim=True)
        proposal = free / mass.clamp(min=torch.finfo(free.dtype).tiny)
        q, p = proposal.gather(-1, token)[..., 0], target.gather(-1, token)[..., 0]
        accept = testing & (q > 0) & (uniforms[..., i] * q < p)  # the chain rule's test, no division
        picked = torch.where(accept, i, picked)
        rest = (target - proposal).clamp(min=0)
        rest_mass = rest.sum(-1, keepdim=True)
        # Rejected: the next candidate is tested against the normalised residual; zero residual mass means
        # target == proposal up to rounding, where rejection had probability ~0 (the chain rule's fallback).
        move = (testing & ~accept)[..., None] & (rest_mass > 0)
        target = torch.where(move, rest / rest_mass.clamp(min=torch.finfo(rest.dtype).tiny), target)
        free = torch.where(live[..., i : i + 1], free.scatter(-1, token, 0.0), free)
    return picked, target


def normalise_counts(
    draft_tokens: torch.Tensor,  # [B, K]
    target: torch.Tensor,  # [B, K or K + 1, V]
    num_drafts: torch.Tensor | None,
    has_bonus: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Default and check ``num_drafts`` [B] (long) and ``has_bonus`` [B] (bool) against the tensor shapes."""
    batch, width = draft_tokens.shape
    rows_given = target.shape[1]
    if rows_given not in (width, width + 1):
        raise ValueError(f"target must have K={width} or K+1 rows per batch row, got {rows_given}")
    if num_drafts is None:
        num_drafts = torch.full((batch,), width, dtype=torch.long, device=draft_tokens.device)
    if has_bonus is None:  # (no row then needs a bonus row it lacks: nothing to check, nothing to read)
        has_bonus = torch.full((batch,), rows_given == width + 1, dtype=torch.bool, device=draft_tokens.device)
    elif rows_given == width and bool((has_bonus & (num_drafts == width)).any()):
        raise ValueError("has_bonus needs a bonus row: pass target_probs with K+1 rows")
    return num_drafts.long(), has_bonus.bool()


def check_temperature(temperature: float) -> None:
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")


def as_noise(noise: Noise | None, generator, seed, uniforms, gumbels) -> Noise:
    """``noise``, or the one built from the separate keywords; giving both ways is an error."""
    if noise is None:
        return Noise(generator=generator, seed=seed, uniforms=uniforms, gumbels=gumbels)
    if not isinstance(noise, Noise):
        raise ValueError(f"noise must be a dllm.kernels.Noise, got {_describe(noise)}")
    if any(value is not None for value in (generator, seed, uniforms, gumbels)):
        raise ValueError("give the noise either as noise= or as generator=/seed=/uniforms=/gumbels=, not both")
    return noise


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return repr(value)


def need_generator(generator: torch.Generator | None) -> torch.Generator:
    if generator is None:
        raise ValueError("verify needs a torch.Generator (generator=) or explicit noise (uniforms=, gumbels=)")
    return generator
