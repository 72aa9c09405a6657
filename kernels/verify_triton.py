"""Fused speculative verification from logits: softmax, accept test, residual and correction/bonus sample.

Same signature and result as ``verify_logits_reference`` (plus ``block_size``, the vocabulary tile
width, and ``splits``, the vocabulary chunks of the sampling pass); the rule is documented in
``verify.py``. Three launches over vocabulary tiles, softmax in float32, tests and keys in float64:
1. ``_row_stats_kernel``, one program per (row b, window index j <= n_b): the online softmax normaliser
   (max, sum) of target row j and of draft row j, then the accept test u * draft(d_j) < target(d_j)
   (greedy: the target argmax and d_j == argmax). Rows past n_b are not read.
2. ``_sample_partial_kernel``, one program per (row b, vocabulary chunk), for rows that reject or have a
   bonus: with a = the accepted prefix, the Gumbel-max over the chunk of max(0, target_a - draft_a) (or
   target_a for the bonus) with keys log(weight) + gumbel. Chunks let a few rows still fill the GPU.
3. ``_emit_kernel``, one program per row: merges the chunks (earlier chunks win ties, as torch's argmax)
   and writes the tokens. Only if the residual had no mass does it take one more pass, drawing from the
   target (the documented fallback).
No probabilities, residuals or noise of size [B, K, V] or [B, V] are written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .noise import STREAM_ACCEPT, STREAM_RESIDUAL, draw_seed
from .triton_common import gumbel53, merge_argmax, probability, row_max_sum, uniform53, vocab_splits
from .verify import VerifyResult, check_temperature, need_generator, normalise_counts

MAX_BLOCK = 2048
_STREAM_ACCEPT = tl.constexpr(STREAM_ACCEPT)  # kernels may read module globals only as constexpr
_STREAM_RESIDUAL = tl.constexpr(STREAM_RESIDUAL)


@triton.jit
def _row_stats_kernel(
    draft_tokens_ptr, draft_logits_ptr, target_logits_ptr,  # [B, K], [B, K, V], [B, R, V]
    num_drafts_ptr, has_bonus_ptr, uniforms_ptr,  # [B] int64, [B] int8, [B, K] float64
    target_max_ptr, target_sum_ptr, argmax_ptr,  # [B, R] outputs
    draft_max_ptr, draft_sum_ptr, accept_ptr,  # [B, K] outputs
    width, rows, vocab, temperature, seed,  # K, R, V
    BLOCK: tl.constexpr, GREEDY: tl.constexpr, HAS_DRAFT: tl.constexpr, NOISE_GIVEN: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1).to(tl.int64)
    num_drafts = tl.load(num_drafts_ptr + b)
    # Row j is read if it tests a draft (j < n) or is the bonus row (j == n with a bonus).
    if (j < num_drafts) | ((j == num_drafts) & (tl.load(has_bonus_ptr + b) != 0)):
        target_row = target_logits_ptr + (b * rows + j) * vocab
        if GREEDY:
            best = _row_argmax(target_row, vocab, BLOCK)
            tl.store(argmax_ptr + b * rows + j, best)
            if j < num_drafts:
                draft = tl.maximum(tl.load(draft_tokens_ptr + b * width + j), 0)  # as the reference clamps
                tl.store(accept_ptr + b * width + j, (draft == best).to(tl.int8))
        else:
            target_max, target_sum = row_max_sum(target_row, vocab, temperature, BLOCK)
            tl.store(target_max_ptr + b * rows + j, target_max)
            tl.store(target_sum_ptr + b * rows + j, target_sum)
            if j < num_drafts:
                draft = tl.maximum(tl.load(draft_tokens_ptr + b * width + j), 0)
                target_prob = probability(tl.load(target_row + draft).to(tl.float32), temperature, target_max,
                                          target_sum)
                draft_prob = tl.full((), 1.0, tl.float32)  # point-mass drafts
                if HAS_DRAFT:
                    draft_row = draft_logits_ptr + (b * width + j) * vocab
                    draft_max, draft_sum = row_max_sum(draft_row, vocab, temperature, BLOCK)
                    tl.store(draft_max_ptr + b * width + j, draft_max)
                    tl.store(draft_sum_ptr + b * width + j, draft_sum)
                    draft_prob = probability(tl.load(draft_row + draft).to(tl.float32), temperature, draft_max,
                                             draft_sum)
                if NOISE_GIVEN:
                    u = tl.load(uniforms_ptr + b * width + j)
                else:
                    u = uniform53(seed, _STREAM_ACCEPT, b, j)
                # A draft probability of 0 is a rejection; the comparison needs no division.
                accept = (draft_prob > 0) & (u * draft_prob.to(tl.float64) < target_prob.to(tl.float64))
                tl.store(accept_ptr + b * width + j, accept.to(tl.int8))


@triton.jit
def _row_argmax(row_ptr, vocab, BLOCK: tl.constexpr):
    """Index of the largest logit; ties go to the lowest index (torch's argmax rule)."""
    offsets = tl.arange(0, BLOCK)
    best_value = tl.full((), float("-inf"), tl.float32)
    best_index = tl.full((), 0, tl.int64)
    for start in range(0, vocab, BLOCK):
        columns = start + offsets
        x = tl.load(row_ptr + columns, mask=columns < vocab, other=float("-inf")).to(tl.float32)
        tile_value, tile_index = tl.max(x, 0, return_indices=True)
        best_value, best_index = merge_argmax(best_value, best_index, tile_value, start + tile_index.to(tl.int64))
    return best_index


@triton.jit
def _accepted_prefix(accept_ptr, num_drafts_ptr, has_bonus_ptr, b, width):
    """-> (accepted drafts a, rejected: a < n, extra: a correction or bonus token is drawn) for row b."""
    num_drafts = tl.load(num_drafts_ptr + b)
    accepted = num_drafts * 0
    still = num_drafts >= 0  # True: every test so far passed
    for j in range(0, width):
        still = still & (tl.load(accept_ptr + b * width + j, mask=j < num_drafts, other=0) != 0)
        accepted += still.to(tl.int64)
    rejected = accepted < num_drafts
    return accepted, rejected, rejected | (tl.load(has_bonus_ptr + b) != 0)


@triton.jit
def _gumbel_argmax_pass(
    draft_tokens_ptr, draft_logits_ptr, target_logits_ptr, gumbels_ptr,
    target_max_ptr, target_sum_ptr, draft_max_ptr, draft_sum_ptr,
    b, accepted, use_residual, begin, end, width, rows, vocab, temperature, seed,
    BLOCK: tl.constexpr, HAS_DRAFT: tl.constexpr, NOISE_GIVEN: tl.constexpr,
):
    """Gumbel-max over columns [begin, end) of row b's weights: max(0, target - draft) at window index
    ``accepted`` if ``use_residual``, else the target there -> (best key, its column, largest weight)."""
    target_row = target_logits_ptr + (b * rows + accepted) * vocab
    target_max = tl.load(target_max_ptr + b * rows + accepted)
    target_sum = tl.load(target_sum_ptr + b * rows + accepted)
    # Draft row `accepted` exists only where a draft was rejected; it is read only for a residual.
    draft_index = b * width + tl.where(use_residual, accepted, 0)
    draft = tl.maximum(tl.load(draft_tokens_ptr + draft_index, mask=use_residual, other=0), 0)
    draft_max = tl.load(draft_max_ptr + draft_index, mask=use_residual, other=0.0)
    draft_sum = tl.load(draft_sum_ptr + draft_index, mask=use_residual, other=1.0)
    draft_end = tl.where(use_residual, end, 0)

    offsets = tl.arange(0, BLOCK)
    best_key = tl.full((), float("-inf"), tl.float64)
    best_index = tl.full((), 0, tl.int64)
    largest_weight = tl.full((), 0.0, tl.float32)
    for start in range(begin, end, BLOCK):
        columns = start + offsets
        x = tl.load(target_row + columns, mask=columns < end, other=float("-inf")).to(tl.float32)
        weights = probability(x, temperature, target_max, target_sum)
        if HAS_DRAFT:
            draft_x = tl.load(draft_logits_ptr + draft_index * vocab + columns, mask=columns < draft_end,
                              other=float("-inf")).to(tl.float32)
            draft_probs = probability(draft_x, temperature, draft_max, draft_sum)
        else:  # point mass at the drafted token
            draft_probs = tl.where((columns == draft) & (columns < draft_end), 1.0, 0.0)
        weights = tl.maximum(weights - draft_probs, 0.0)
        largest_weight = tl.maximum(largest_weight, tl.max(weights, 0))
        if NOISE_GIVEN:
            noise = tl.load(gumbels_ptr + b * vocab + columns, mask=columns < end, other=float("-inf"))
        else:
            noise = gumbel53(seed, _STREAM_RESIDUAL, b, columns)
        keys = tl.log(weights.to(tl.float64)) + noise  # a zero weight gives -inf: never drawn
        tile_key, tile_index = tl.max(keys, 0, return_indices=True)
        best_key, best_index = merge_argmax(best_key, best_index, tile_key, start + tile_index.to(tl.int64))
    return best_key, best_index, largest_weight


@triton.jit
def _sample_partial_kernel(
    draft_tokens_ptr, draft_logits_ptr, target_logits_ptr,  # [B, K], [B, K, V], [B, R, V]
    num_drafts_ptr, has_bonus_ptr, gumbels_ptr,  # [B], [B], [B, V] float64
    target_max_ptr, target_sum_ptr, draft_max_ptr, draft_sum_ptr, accept_ptr,  # from _row_stats_kernel
    partials_ptr,  # [B, S, 3] float64 output: best key, its column, largest weight per chunk
    width, rows, vocab, chunk, splits, temperature, seed,
    BLOCK: tl.constexpr, HAS_DRAFT: tl.constexpr, NOISE_GIVEN: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    accepted, rejected, extra = _accepted_prefix(accept_ptr, num_drafts_ptr, has_bonus_ptr, b, width)
    if extra:
        begin = split * chunk
        key, index, largest = _gumbel_argmax_pass(
            draft_tokens_ptr, draft_logits_ptr, target_logits_ptr, gumbels_ptr,
            target_max_ptr, target_sum_ptr, draft_max_ptr, draft_sum_ptr,
            b, accepted, rejected, begin, tl.minimum(begin + chunk, vocab), width, rows, vocab, temperature, seed,
            BLOCK, HAS_DRAFT, NOISE_GIVEN,
        )
        partial = partials_ptr + (b * splits + split) * 3
        tl.store(partial, key)
        tl.store(partial + 1, index.to(tl.float64))  # columns < 2^53 round-trip exactly
        tl.store(partial + 2, largest.to(tl.float64))


@triton.jit
def _emit_kernel(
    draft_tokens_ptr, draft_logits_ptr, target_logits_ptr,
    num_drafts_ptr, has_bonus_ptr, gumbels_ptr,
    target_max_ptr, target_sum_ptr, argmax_ptr, draft_max_ptr, draft_sum_ptr, accept_ptr,
    partials_ptr,  # [B, S, 3] from _sample_partial_kernel (unused when GREEDY)
    tokens_ptr, num_accepted_ptr, num_emitted_ptr,  # [B, K + 1], [B], [B] outputs
    width, rows, vocab, splits, temperature, seed,
    BLOCK: tl.constexpr, WIDTH_BLOCK: tl.constexpr,
    GREEDY: tl.constexpr, HAS_DRAFT: tl.constexpr, NOISE_GIVEN: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    accepted, rejected, extra = _accepted_prefix(accept_ptr, num_drafts_ptr, has_bonus_ptr, b, width)
    token = accepted * 0 - 1
    if extra:
        if GREEDY:
            token = tl.load(argmax_ptr + b * rows + accepted)
        else:
            token = accepted * 0  # torch's argmax of all -inf keys
            best_key = tl.full((), float("-inf"), tl.float64)
            largest = tl.full((), 0.0, tl.float64)
            for split in range(0, splits):  # chunks in vocabulary order, so earlier chunks win ties
                partial = partials_ptr + (b * splits + split) * 3
                best_key, token = merge_argmax(best_key, token, tl.load(partial), tl.load(partial + 1).to(tl.int64))
                largest = tl.maximum(largest, tl.load(partial + 2))
            if rejected & (largest == 0):  # no residual mass (target == draft up to rounding): the target
                _, token, _ = _gumbel_argmax_pass(
                    draft_tokens_ptr, draft_logits_ptr, target_logits_ptr, gumbels_ptr,
                    target_max_ptr, target_sum_ptr, draft_max_ptr, draft_sum_ptr,
                    b, accepted, rejected & (largest > 0), 0, vocab, width, rows, vocab, temperature, seed,
                    BLOCK, HAS_DRAFT, NOISE_GIVEN,
                )

    slots = tl.arange(0, WIDTH_BLOCK).to(tl.int64)
    drafts = tl.load(draft_tokens_ptr + b * width + slots, mask=slots < accepted, other=-1)
    row_tokens = tl.where(extra & (slots == accepted), token, drafts)
    tl.store(tokens_ptr + b * (width + 1) + slots, row_tokens, mask=slots < width + 1)
    tl.store(num_accepted_ptr + b, accepted)
    tl.store(num_emitted_ptr + b, accepted + extra.to(tl.int64))


def verify_logits_triton(
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
    block_size: int | None = None,  # vocabulary tile width (a power of two); default min(2048, V)
    splits: int | None = None,  # vocabulary chunks per row for the sampling pass; default: fill the GPU
) -> VerifyResult:
    """Fused ``verify_logits_reference``: the same result under the same uniforms/gumbels or seed."""
    check_temperature(temperature)
    num_drafts, has_bonus = normalise_counts(draft_tokens, target_logits, num_drafts, has_bonus)
    batch, width = draft_tokens.shape
    rows, vocab = target_logits.shape[1], target_logits.shape[2]
    device = target_logits.device
    result = VerifyResult(
        tokens=torch.full((batch, width + 1), -1, dtype=torch.long, device=device),
        num_emitted=torch.zeros(batch, dtype=torch.long, device=device),
        num_accepted=torch.zeros(batch, dtype=torch.long, device=device),
    )
    if batch == 0 or rows == 0:  # no rows, or no drafts and no bonus row: nothing to emit
        return result
    greedy = temperature == 0
    if not greedy and (uniforms is None or gumbels is None) and seed is None:
        seed = draw_seed(need_generator(generator))

    def buffer(columns: int, dtype: torch.dtype) -> torch.Tensor:  # per-row statistics, never [.., V]
        return torch.zeros((batch, max(columns, 1)), dtype=dtype, device=device)

    target_max, target_sum, argmax = buffer(rows, torch.float32), buffer(rows, torch.float32), buffer(rows, torch.long)
    draft_max, draft_sum, accept = buffer(width, torch.float32), buffer(width, torch.float32), buffer(width, torch.int8)
    has_draft = draft_logits is not None and not greedy
    placeholder = accept  # stands in for pointers a kernel variant never reads
    inputs = (_nonempty(draft_tokens.long().contiguous(), placeholder),
              draft_logits.contiguous() if has_draft else placeholder, target_logits.contiguous(),
              num_drafts.contiguous(), has_bonus.to(torch.int8).contiguous())
    scalars = dict(temperature=1.0 if greedy else float(temperature), seed=0 if seed is None else seed)
    block = block_size or min(MAX_BLOCK, triton.next_power_of_2(vocab))
    flags = dict(BLOCK=block, HAS_DRAFT=has_draft, num_warps=8 if block >= 2048 else 4)
    uniforms_input, gumbels_input = _noise(uniforms, placeholder, greedy), _noise(gumbels, placeholder, greedy)
    num_splits, chunk = vocab_splits(batch, vocab, block, device, splits)
    partials = torch.empty((batch, num_splits, 3), dtype=torch.float64, device=device)

    _row_stats_kernel[(batch, rows)](
        *inputs, uniforms_input, target_max, target_sum, argmax, draft_max, draft_sum, accept,
        width, rows, vocab, **scalars, GREEDY=greedy, NOISE_GIVEN=uniforms_input is not placeholder, **flags,
    )
    if not greedy:
        _sample_partial_kernel[(batch, num_splits)](
            *inputs, gumbels_input, target_max, target_sum, draft_max, draft_sum, accept, partials,
            width, rows, vocab, chunk, num_splits, **scalars, NOISE_GIVEN=gumbels_input is not placeholder, **flags,
        )
    _emit_kernel[(batch,)](
        *inputs, gumbels_input, target_max, target_sum, argmax, draft_max, draft_sum, accept, partials,
        result.tokens, result.num_accepted, result.num_emitted, width, rows, vocab, num_splits, **scalars,
        WIDTH_BLOCK=triton.next_power_of_2(width + 1), GREEDY=greedy, NOISE_GIVEN=gumbels_input is not placeholder,
        **flags,
    )
    return result


def _noise(noise: torch.Tensor | None, placeholder: torch.Tensor, greedy: bool) -> torch.Tensor:
    """Explicit float64 noise as the kernels read it, or the placeholder when they derive (or need) none."""
    if noise is None or greedy or noise.numel() == 0:
        return placeholder
    return noise.to(torch.float64).contiguous()


def _nonempty(tensor: torch.Tensor, placeholder: torch.Tensor) -> torch.Tensor:
    """A zero-width tensor is never read (no drafts), but a kernel argument needs real storage."""
    return tensor if tensor.numel() else placeholder
