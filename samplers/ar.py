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
  n tokens (n = ``max_ngram`` .. 1), proposed as point masses.
The shared ``verify`` makes the output distributed exactly as ``ar`` at the same temperature.

No call reads past position prompt + max_new_tokens - 2, the last input ``ar`` feeds: a draft there
would leave no room for the bonus token, so it is never verified (drafts past that point are
placeholders that ``num_drafts`` excludes). ``ar_spec`` therefore fits any context ``ar`` fits.
"""

from __future__ import annotations

import operator
import warnings

import torch

from dllm.kernels import verify_logits
from dllm.numerics import bind_rows, forbid_token, sample_from_logits
from dllm.protocols import has_cache, is_diffusion_model
from dllm.stats import DecodeStats, StepEvent
from dllm.stops import emitted_until_stop, fill_token, is_stop

from .canvas import Caller


def ar(
    model, prompt, gen_length, *, temperature, generator, stats: DecodeStats, cache="auto", attention_mask=None,
    eos_token_id=None, callback=None,
) -> torch.Tensor:
    """One token per call from the next-token distribution -> [B, P + N]."""
    batch, prompt_len = prompt.shape
    seq = _buffer(prompt, gen_length, eos_token_id)
    caller = Caller(model, stats, attention_mask=_full_mask(attention_mask, batch, seq.shape[1] + 1, prompt.device))
    rows = torch.arange(batch, device=prompt.device)
    kv = model.new_cache() if _use_cache(cache, model) else None
    for t in range(gen_length):
        end = prompt_len + t
        if kv is None:
            logits = caller(seq[rows, :end], rows, served=len(rows))[:, -1]
        else:
            start = kv.length
            logits = caller.cached(seq[rows, start:end], kv, rows, served=len(rows), keys=slice(0, end),
                                   append=True)[:, -1]
        token = sample_from_logits(logits, temperature, bind_rows(generator, rows))
        seq[rows, end] = token
        stats.count_round(torch.ones_like(token))
        if callback is not None:
            callback(StepEvent("ar", rows, seq[rows, : end + 1]))
        if eos_token_id is not None and bool(is_stop(token, eos_token_id).any()):
            keep = ~is_stop(token, eos_token_id)
            rows = rows[keep]
            kv = kv.select(keep.nonzero().squeeze(-1)) if kv is not None and rows.numel() else kv
            if not rows.numel():
                break
    return seq


def ar_spec(
    model, prompt, gen_length, *, temperature, generator, stats: DecodeStats, drafter="ngram",
    num_draft_tokens=4, max_ngram=3, cache="auto", attention_mask=None, eos_token_id=None, callback=None,
) -> torch.Tensor:
    """Speculative decoding against the causal target ``model`` -> [B, P + N]."""
    batch, prompt_len = prompt.shape
    total = prompt_len + gen_length
    seq = _buffer(prompt, gen_length, eos_token_id)
    full_mask = _full_mask(attention_mask, batch, total + num_draft_tokens + 1, prompt.device)
    caller = Caller(model, stats, attention_mask=full_mask)
    draft_caller = Caller(drafter, stats, attention_mask=full_mask, draft=True)
    lengths = torch.full((batch,), prompt_len, dtype=torch.long, device=prompt.device)
    rows = torch.arange(batch, device=prompt.device)
    kv = _rollback_cache(model) if _use_cache(cache, model) else None  # holds [0, min(len) - 1) of every row
    causal_drafter = not isinstance(drafter, str) and not is_diffusion_model(drafter)
    block_drafter = not isinstance(drafter, str) and is_diffusion_model(drafter) and _block_size(drafter)
    draft_kv = _rollback_cache(drafter) if (causal_drafter or block_drafter) and _use_cache(cache, drafter) else None
    while rows.numel():
        length = lengths[rows]
        num_drafts = torch.clamp(total - length - 1, max=num_draft_tokens)  # leave room for the bonus
        drafts, draft_logits, num_drafts = _draft(
            drafter, draft_caller, seq[rows], rows, length, num_drafts, num_draft_tokens, temperature, generator,
            max_ngram, draft_kv, prompt_len, model.vocab_size,
        )
        target = _target_rows(caller, kv, seq[rows], rows, length, drafts)  # [R, K + 1, V]
        outcome = verify_logits(drafts, draft_logits, target, num_drafts, temperature=temperature,
                                generator=bind_rows(generator, rows))
        stats.count_verification(num_drafts, outcome.num_accepted, outcome.num_emitted)
        emitted, stopped = emitted_until_stop(outcome.tokens, outcome.num_emitted, eos_token_id)
        offsets = torch.arange(outcome.tokens.shape[1], device=seq.device)
        hit = offsets[None, :] < emitted[:, None]
        seq[rows[:, None].expand_as(hit)[hit], (length[:, None] + offsets)[hit]] = outcome.tokens[hit]
        lengths[rows] += emitted
        if callback is not None:
            callback(StepEvent("ar_spec", rows, seq[rows], drafts=drafts, num_drafts=num_drafts,
                               num_accepted=outcome.num_accepted))
        keep = (lengths[rows] < total) & ~stopped
        rows = rows[keep]
        if rows.numel():
            kept = None if bool(keep.all()) else keep.nonzero().squeeze(-1)
            accepted = int(lengths[rows].min()) - 1  # tokens every row holds for sure (drafts match before)
            if kv is not None:
                kv = kv if kept is None else kv.select(kept)
                kv.crop(accepted)
            if draft_kv is not None:
                draft_kv = draft_kv if kept is None else draft_kv.select(kept)
                if causal_drafter:  # (a block-causal drafter's cache holds finished blocks only: nothing to undo)
                    # Entries past min(length) + K - 1 saw padding where a shorter row's last draft goes.
                    draft_kv.crop(min(draft_kv.length, accepted, int(length.min()) + num_draft_tokens - 1))
    return seq


def _rollback_cache(model):
    """A new cache for speculative decoding, which rolls back rejected drafts every round; None (run
    uncached, same results) when the model's cache cannot roll back (sliding-window or linear layers)."""
    kv = model.new_cache()
    if getattr(kv, "croppable", True):
        return kv
    warnings.warn(f"{type(model).__name__}'s cache cannot roll back rejected drafts; ar_spec runs it uncached",
                  stacklevel=3)
    return None


def _use_cache(cache: str, model) -> bool:
    """The KV cache is exact for causal models, so ``auto`` uses it whenever the model has one."""
    return cache != "none" and has_cache(model)


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


def _target_rows(caller: Caller, kv, seq, rows, length, drafts) -> torch.Tensor:
    """Target logits for each draft position and the bonus: one call on sequence + drafts -> [R, K + 1, V].

    With a cache holding [0, c), only tokens from c on are fed (each row's unverified tail and drafts).
    Inputs stop at position total - 2 (see the module docstring); rows past it repeat the last one.
    """
    width = drafts.shape[1]
    extended = _append(seq, length, drafts)[:, : min(int(length.max()) + width, seq.shape[1] - 1)]
    start = 0 if kv is None else kv.length
    if kv is None:
        logits = caller(extended, rows, served=len(rows))
    else:
        logits = caller.cached(extended[:, start:], kv, rows, served=len(rows), keys=slice(0, extended.shape[1]),
                               append=True)
    at = length[:, None] - 1 - start + torch.arange(width + 1, device=seq.device)  # position t predicts t + 1
    return logits[torch.arange(seq.shape[0], device=seq.device)[:, None], at.clamp(max=logits.shape[1] - 1)]


def _append(seq: torch.Tensor, length: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Each row's sequence with ``tokens`` [R, K] written after its end -> [R, max(len) + K] (right padded)."""
    width = tokens.shape[1]
    out = torch.zeros((seq.shape[0], int(length.max()) + width), dtype=torch.long, device=seq.device)
    out[:, : min(seq.shape[1], out.shape[1])] = seq[:, : out.shape[1]]
    at = length[:, None] + torch.arange(width, device=seq.device)
    out.scatter_(1, at, tokens)
    return out


def _draft(drafter, caller, seq, rows, length, num_drafts, width, temperature, generator, max_ngram, kv,
           prompt_len, vocab):
    """Drafts [R, K], the logits they were drawn from [R, K, V] (None: point masses), valid drafts [R]."""
    if isinstance(drafter, str):
        drafts, found = _ngram_drafts(seq, length, num_drafts, width, max_ngram)
        return drafts, None, found
    if is_diffusion_model(drafter):
        if _block_size(drafter):
            logits = _block_draft_logits(drafter, caller, seq, rows, length, width, prompt_len, kv)
        else:
            logits = _diffusion_draft_logits(drafter, caller, seq, rows, length, width)
        logits = logits[..., :vocab]  # a mask id appended past the target's vocabulary is dropped
        flat = logits.reshape(-1, logits.shape[-1])
        flat_rows = rows.repeat_interleave(logits.shape[1])
        drafts = sample_from_logits(flat, temperature, bind_rows(generator, flat_rows)).reshape(logits.shape[:2])
        return drafts, logits, num_drafts
    drafts, logits = _causal_drafts(caller, seq, rows, length, width, temperature, generator, kv)
    return drafts, logits, num_drafts


def _block_size(model) -> int | None:
    """A block-causal model's block size (any integer type), else None."""
    size = getattr(model, "block_size", None)
    if size is None or isinstance(size, bool):
        return None
    try:
        size = operator.index(size)
    except TypeError:
        return None
    return size if size > 0 else None


def _draft_canvas(seq, length, size: int, mask_token_id: int) -> torch.Tensor:
    """Each row's tokens before its length, then mask tokens, over ``size`` positions -> [R, size]."""
    canvas = torch.full((seq.shape[0], size), mask_token_id, dtype=torch.long, device=seq.device)
    known = min(size, seq.shape[1])
    keep = torch.arange(known, device=seq.device)[None, :] < length[:, None]
    canvas[:, :known] = torch.where(keep, seq[:, :known], canvas[:, :known])
    return canvas


def _diffusion_draft_logits(drafter, caller, seq, rows, length, width) -> torch.Tensor:
    """Marginals of a bidirectional diffusion drafter at the next ``width`` positions, one call -> [R, K, V]."""
    size = seq.shape[1] - 1  # up to position total - 2 (module docstring): fixed, so drafts ignore the batch
    logits = caller(_draft_canvas(seq, length, size, drafter.mask_token_id), rows, served=len(rows))
    at = (length[:, None] + torch.arange(width, device=seq.device)).clamp(max=size - 1)
    return forbid_token(logits[torch.arange(seq.shape[0], device=seq.device)[:, None], at], drafter.mask_token_id)


def _block_draft_logits(drafter, caller, seq, rows, length, width, prompt_len, kv) -> torch.Tensor:
    """Marginals of a block-causal drafter at the next ``width`` positions -> [R, K, V].

    Blocks start at the answer start (canvas position ``prompt_len``). The canvas ends with the block of
    the batch's last draft, capped at position total - 2 (a fixed cap, so a row's drafts never depend on
    the batch: blocks after a row's own are invisible to it). With ``kv`` (holding
    finished blocks), only positions from the cache's end are fed, and the blocks every row has finished
    are kept for later rounds.
    """
    block = drafter.block_size
    last = length + width - 1  # [R] each row's last draft position
    block_end = prompt_len + torch.div(last - prompt_len, block, rounding_mode="floor").add(1).mul(block)
    size = min(int(block_end.max()), seq.shape[1] - 1)
    canvas = _draft_canvas(seq, length, size, drafter.mask_token_id)
    pads = (caller.attention_mask[rows] == 0).sum(dim=1) if caller.attention_mask is not None else 0
    offset = prompt_len - pads + torch.zeros_like(length)  # answer start in position-id coordinates
    start = 0 if kv is None else kv.length
    if start >= size:  # every row is one token from the end: no draft can be verified, placeholders
        return torch.zeros((seq.shape[0], width, drafter.vocab_size), device=seq.device).index_fill_(
            -1, torch.tensor([drafter.mask_token_id], device=seq.device), float("-inf"))
    if kv is None:
        logits = caller(canvas, rows, served=len(rows), block_offset=offset)
    else:
        logits = caller.cached(canvas[:, start:], kv, rows, served=len(rows), keys=slice(0, size), append=True,
                               block_offset=offset)
        # Blocks before min(length)'s block hold final tokens in every row and never see later blocks.
        kv.crop(prompt_len + (int(length.min()) - prompt_len) // block * block)
    at = (length[:, None] - start + torch.arange(width, device=seq.device)).clamp(max=size - start - 1)
    return forbid_token(logits[torch.arange(seq.shape[0], device=seq.device)[:, None], at], drafter.mask_token_id)


def _causal_drafts(caller, seq, rows, length, width, temperature, generator, kv=None):
    """``width`` sequential draft calls of a causal drafter -> (drafts [R, K], their logits [R, K, V]).

    With a cache, call j feeds positions from min(len) + j - 1 on: cached entries before that hold final
    tokens for every row (a longer row's entries there are its own tokens or earlier drafts), so a batch
    of equal lengths feeds one token per call.
    """
    index = torch.arange(seq.shape[0], device=seq.device)
    drafts = torch.zeros((seq.shape[0], width), dtype=torch.long, device=seq.device)
    shortest, limit = int(length.min()), seq.shape[1] - 1  # inputs stop at position total - 2
    steps = []
    for j in range(width):
        extended = _append(seq, length, drafts[:, :j])[:, :limit]
        at = length + j - 1
        if shortest + j - 1 >= limit:
            # No row can verify draft j or later: placeholders, still sampled so that every row draws the
            # same noise whatever else is in the batch (per-row generators stay batch-invariant).
            logits = steps[-1]
        elif kv is None:
            logits = caller(extended, rows, served=len(rows))[index, at.clamp(max=extended.shape[1] - 1)]
        else:
            start = min(kv.length, shortest + j - 1)
            kv.crop(start)
            logits = caller.cached(extended[:, start:], kv, rows, served=len(rows), keys=slice(0, extended.shape[1]),
                                   append=True)[index, (at - start).clamp(max=extended.shape[1] - start - 1)]
        drafts[:, j] = sample_from_logits(logits, temperature, bind_rows(generator, rows))
        steps.append(logits)
    return drafts, torch.stack(steps, dim=1)


def _ngram_drafts(seq, length, num_drafts, width, max_ngram) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt-lookup drafts: continuation of the latest earlier match of the last n tokens."""
    drafts = torch.zeros((seq.shape[0], width), dtype=torch.long, device=seq.device)
    found = torch.zeros(seq.shape[0], dtype=torch.long, device=seq.device)
    for r, (row, n_tokens, limit) in enumerate(zip(seq.tolist(), length.tolist(), num_drafts.tolist())):
        continuation = _lookup(row[:n_tokens], max_ngram)[:limit]
        drafts[r, : len(continuation)] = torch.tensor(continuation, dtype=torch.long)
        found[r] = len(continuation)
    return drafts, found


def _lookup(tokens: list[int], max_ngram: int) -> list[int]:
    """Tokens that followed the latest earlier occurrence of the longest matching suffix n-gram."""
    for n in range(min(max_ngram, len(tokens) - 1), 0, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n :]
    return []
