"""Drafters for ``ar_spec``: objects that propose tokens and forget what the target rejected.

A drafter answers ``propose(sequences, lengths, k, ctx) -> Draft``: for R rows holding ``lengths`` [R]
tokens of ``sequences`` [R, T], up to ``k`` drafts per row, the logits they were sampled from (None for
point masses such as n-gram lookups) and how many of them are valid. After verification ``rollback``
keeps the surviving rows and forgets anything past the tokens every row holds for sure. The output law
stays exact for any drafter, provided ``Draft.logits`` are the very logits the tokens were sampled from
(softmax(logits / T), as ``dllm.numerics.sample_from_logits`` draws them); a drafter changes speed only.

Drafters here: ``NgramDrafter`` (prompt lookup), ``CausalDrafter`` (k sequential calls of a CausalModel,
with its own KV cache when given one), ``DiffusionDrafter`` (one call on a fixed-length canvas of a
bidirectional DiffusionModel) and ``BlockDiffusionDrafter`` (a block-causal one, blocks anchored at the
answer start, finished blocks cached). ``ar_spec`` builds one from its ``drafter`` option once, before
the loop (``samplers/ar_spec/decode.py: _make_drafter``); the loop only calls ``propose`` and ``rollback``.

fef's draft sources (``MarginalDrafts``, ``StaleDrafts``) answer a wider question, since fef picks its
window from the draft logits of the positions it may choose: ``logits(view) -> (draft logits [R, K, V] on a
band of K view positions per row, whether they are the model at the state, the ``Band``)`` and, for a source
that ``wants_next`` (stale drafts), ``observe(view, next_logits, band)`` after each round.

Adding a drafter (e.g. a trained draft head): subclass ``Drafter``, implement ``propose`` (sample each
draft with ``bind_rows(ctx.generator, ctx.rows)`` so rows replay independently, never read past
position ``sequences.shape[1] - 2``, and return the logits you sampled from, at most
``ctx.vocab_size`` wide), override ``rollback`` if it keeps state across rounds, and return it from
``_make_drafter`` for the option value that selects it. ``tests/test_drafters.py`` shows the contract.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dllm.numerics import bind_rows, forbid_token, sample_from_logits

from ..calling import Caller
from ..drafting import Draft


@dataclass(frozen=True)
class DraftContext:
    """What a drafter may need besides the sequences, for one round."""

    rows: torch.Tensor  # [R] batch rows of the sequences (per-row generators, attention mask)
    num_drafts: torch.Tensor  # [R] drafts each row can still verify (room is left for the bonus)
    temperature: float
    generator: torch.Generator
    vocab_size: int  # the target's vocabulary; logits past it are dropped
    # [R, C, D] the target's final-normed features at positions length - 1 - C .. length - 2 of each row
    # (C = the drafter's ``feature_context``), from the verification calls so far (None before the first);
    # given only to a drafter that declares ``wants_features``; ``feature_valid`` [R, C] marks the positions
    # that hold a real token's feature (not before the row's first token: padding, or before position 0)
    features: torch.Tensor | None = None
    feature_valid: torch.Tensor | None = None


class Drafter:
    """Base class: ``propose`` drafts, ``rollback`` forgets rejected work (default: nothing to forget)."""

    wants_features = False  # True: ar_spec verifies with return_hidden and passes DraftContext.features
    feature_context = 1  # how many positions (ending at length - 2) DraftContext.features holds

    def propose(self, sequences: torch.Tensor, lengths: torch.Tensor, k: int, ctx: DraftContext) -> Draft:
        raise NotImplementedError

    def rollback(self, kept: torch.Tensor | None, accepted: int) -> None:
        """Keep rows ``kept`` [R'] (None: all) of the last round; tokens before ``accepted`` are final."""


@dataclass
class NgramDrafter(Drafter):
    """Prompt lookup: the continuation of the latest earlier match of the last n tokens, n = max_ngram..1."""

    max_ngram: int

    def propose(self, sequences, lengths, k, ctx) -> Draft:
        drafts = torch.zeros((sequences.shape[0], k), dtype=torch.long, device=sequences.device)
        found = torch.zeros(sequences.shape[0], dtype=torch.long, device=sequences.device)
        for r, (row, n_tokens, limit) in enumerate(zip(sequences.tolist(), lengths.tolist(), ctx.num_drafts.tolist())):
            continuation = _lookup(row[:n_tokens], self.max_ngram)[:limit]
            drafts[r, : len(continuation)] = torch.tensor(continuation, dtype=torch.long)
            found[r] = len(continuation)
        return Draft(drafts, None, found)


@dataclass
class CausalDrafter(Drafter):
    """``k`` sequential calls of a CausalModel; with ``kv`` (a croppable cache) each call feeds about a token."""

    caller: Caller
    kv: object | None = None
    _shortest: int = 0  # min(lengths) of the last round
    _width: int = 0  # k of the last round

    def propose(self, sequences, lengths, k, ctx) -> Draft:
        self._shortest, self._width = int(lengths.min()), k
        tokens, logits = causal_drafts(self.caller, sequences, ctx.rows, lengths, k, ctx.temperature, ctx.generator,
                                       self.kv)
        return Draft(tokens, logits, ctx.num_drafts)

    def rollback(self, kept, accepted) -> None:
        if self.kv is None:
            return
        self.kv = self.kv if kept is None else self.kv.select(kept)
        # Entries past min(length) + K - 1 saw padding where a shorter row's last draft goes.
        self.kv.crop(min(self.kv.length, accepted, self._shortest + self._width - 1))


@dataclass
class DiffusionDrafter(Drafter):
    """Independent drafts from a DiffusionModel's marginals at the next ``k`` positions, one call a round.

    A bidirectional drafter sees a canvas of fixed length (the sequence buffer less its last position),
    so a row's drafts never depend on the batch. With ``block_size`` (a block-causal drafter) the canvas
    ends with the block holding the last draft, blocks anchored at ``prompt_len``, and with ``kv`` the
    finished blocks are computed once.
    """

    caller: Caller
    block_size: int | None = None
    prompt_len: int = 0
    kv: object | None = None  # holds finished blocks only, so a rollback has nothing to undo

    def propose(self, sequences, lengths, k, ctx) -> Draft:
        model = self.caller.model
        if self.block_size:
            logits = block_draft_logits(model, self.caller, sequences, ctx.rows, lengths, k, self.prompt_len, self.kv)
        else:
            logits = diffusion_draft_logits(model, self.caller, sequences, ctx.rows, lengths, k)
        logits = logits[..., : ctx.vocab_size]  # a mask id appended past the target's vocabulary is dropped
        flat = logits.reshape(-1, logits.shape[-1])
        flat_rows = ctx.rows.repeat_interleave(logits.shape[1])
        tokens = sample_from_logits(flat, ctx.temperature, bind_rows(ctx.generator, flat_rows))
        return Draft(tokens.reshape(logits.shape[:2]), logits, ctx.num_drafts, independent=True)

    def rollback(self, kept, accepted) -> None:
        if self.kv is not None and kept is not None:
            self.kv = self.kv.select(kept)


def append_at_lengths(seq: torch.Tensor, length: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Each row's sequence with ``tokens`` [R, K] written after its end -> [R, max(len) + K] (right padded)."""
    width = tokens.shape[1]
    out = torch.zeros((seq.shape[0], int(length.max()) + width), dtype=torch.long, device=seq.device)
    out[:, : min(seq.shape[1], out.shape[1])] = seq[:, : out.shape[1]]
    at = length[:, None] + torch.arange(width, device=seq.device)
    out.scatter_(1, at, tokens)
    return out


def draft_canvas(seq, length, size: int, mask_token_id: int) -> torch.Tensor:
    """Each row's tokens before its length, then mask tokens, over ``size`` positions -> [R, size]."""
    canvas = torch.full((seq.shape[0], size), mask_token_id, dtype=torch.long, device=seq.device)
    known = min(size, seq.shape[1])
    keep = torch.arange(known, device=seq.device)[None, :] < length[:, None]
    canvas[:, :known] = torch.where(keep, seq[:, :known], canvas[:, :known])
    return canvas


def diffusion_draft_logits(drafter, caller, seq, rows, length, width, features=False):
    """Marginals of a bidirectional diffusion drafter at the next ``width`` positions, one call -> [R, K, V]
    (``features``: and the drafter's features there [R, K, D], for a repair head)."""
    size = seq.shape[1] - 1  # up to position total - 2 (module docstring): fixed, so drafts ignore the batch
    at = (length[:, None] + torch.arange(width, device=seq.device)).clamp(max=size - 1)
    out = caller(draft_canvas(seq, length, size, drafter.mask_token_id), rows, served=len(rows), at=at,
                 **({"return_hidden": True} if features else {}))
    return _at_drafts(out, drafter.mask_token_id)


def _at_drafts(out, mask_id):
    """Logits asked at the draft positions, mask forbidden, and the features there when ``out`` has them."""
    if isinstance(out, tuple):
        return forbid_token(out[0], mask_id), out[1]
    return forbid_token(out, mask_id)


def block_draft_logits(drafter, caller, seq, rows, length, width, prompt_len, kv, features=False):
    """Marginals of a block-causal drafter at the next ``width`` positions -> [R, K, V].

    Blocks start at the answer start (canvas position ``prompt_len``). The canvas ends with the block of
    the batch's last draft, capped at position total - 2 (a fixed cap, so a row's drafts never depend on
    the batch: blocks after a row's own are invisible to it). With ``kv`` (holding
    finished blocks), only positions from the cache's end are fed, and the blocks every row has finished
    are kept for later rounds. ``features``: also the drafter's features there [R, K, D].
    """
    block = drafter.block_size
    last = length + width - 1  # [R] each row's last draft position
    block_end = prompt_len + torch.div(last - prompt_len, block, rounding_mode="floor").add(1).mul(block)
    size = min(int(block_end.max()), seq.shape[1] - 1)
    canvas = draft_canvas(seq, length, size, drafter.mask_token_id)
    pads = (caller.attention_mask[rows] == 0).sum(dim=1) if caller.attention_mask is not None else 0
    offset = prompt_len - pads + torch.zeros_like(length)  # answer start in position-id coordinates
    start = 0 if kv is None else kv.length
    if start >= size:  # every row is one token from the end: no draft can be verified, placeholders
        logits = torch.zeros((seq.shape[0], width, drafter.vocab_size), device=seq.device).index_fill_(
            -1, torch.tensor([drafter.mask_token_id], device=seq.device), float("-inf"))
        return (logits, logits.new_zeros((*logits.shape[:2], drafter.config.dim))) if features else logits
    hidden = {"return_hidden": True} if features else {}
    at = (length[:, None] - start + torch.arange(width, device=seq.device)).clamp(max=size - start - 1)
    if kv is None:
        logits = caller(canvas, rows, served=len(rows), block_offset=offset, at=at, **hidden)
    else:
        logits = caller.cached(canvas[:, start:], kv, rows, served=len(rows), keys=slice(0, size), append=True,
                               block_offset=offset, at=at, **hidden)
        # Blocks before min(length)'s block hold final tokens in every row and never see later blocks.
        kv.crop(prompt_len + (int(length.min()) - prompt_len) // block * block)
    return _at_drafts(logits, drafter.mask_token_id)


def causal_drafts(caller, seq, rows, length, width, temperature, generator, kv=None):
    """``width`` sequential draft calls of a causal drafter -> (drafts [R, K], their logits [R, K, V]).

    With a cache, call j feeds positions from min(len) + j - 1 on: cached entries before that hold final
    tokens for every row (a longer row's entries there are its own tokens or earlier drafts), so a batch
    of equal lengths feeds one token per call.
    """
    drafts = torch.zeros((seq.shape[0], width), dtype=torch.long, device=seq.device)
    shortest, limit = int(length.min()), seq.shape[1] - 1  # inputs stop at position total - 2
    steps = []
    for j in range(width):
        extended = append_at_lengths(seq, length, drafts[:, :j])[:, :limit]
        at = length + j - 1
        if shortest + j - 1 >= limit:
            # No row can verify draft j or later: placeholders, still sampled so that every row draws the
            # same noise whatever else is in the batch (per-row generators stay batch-invariant).
            logits = steps[-1]
        elif kv is None:
            logits = caller(extended, rows, served=len(rows), at=at.clamp(max=extended.shape[1] - 1)[:, None])[:, 0]
        else:
            start = min(kv.length, shortest + j - 1)
            kv.crop(start)
            read = (at - start).clamp(max=extended.shape[1] - start - 1)[:, None]
            logits = caller.cached(extended[:, start:], kv, rows, served=len(rows), keys=slice(0, extended.shape[1]),
                                   append=True, at=read)[:, 0]
        drafts[:, j] = sample_from_logits(logits, temperature, bind_rows(generator, rows))
        steps.append(logits)
    return drafts, torch.stack(steps, dim=1)


def _lookup(tokens: list[int], max_ngram: int) -> list[int]:
    """Tokens that followed the latest earlier occurrence of the longest matching suffix n-gram."""
    for n in range(min(max_ngram, len(tokens) - 1), 0, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n :]
    return []
