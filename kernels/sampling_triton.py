"""Fused per-position sampling and confidence over vocabulary tiles, without [N, V] probabilities or noise.

Same signature and outputs as ``sample_confidence_reference`` (plus ``block_size``, the tile width, and
``splits``, the vocabulary chunks per row). Two launches:
1. ``_partial_kernel``, one program per (row, vocabulary chunk): per tile it folds into a running state
   an online softmax (max m, s = sum(exp(x - m))), the weighted sum w = sum(exp(x - m) * (x - m)) that
   gives the entropy H = log s - w / s, a running top-2 of the logits and a running Gumbel-max of the
   float64 keys x / T + gumbel (``dllm.numerics.gumbel_argmax`` builds the same keys);
2. ``_finish_kernel``, one program per row: folds the chunks' states with the same merges and writes
   the five outputs. Chunks let a few rows still fill the GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .noise import STREAM_SAMPLE, draw_seed
from .sampling import SampleConfidence
from .triton_common import finite_or_zero, gumbel53, merge_argmax, rescale_exponent, tempered, vocab_splits

MAX_BLOCK = 2048
_STREAM_SAMPLE = tl.constexpr(STREAM_SAMPLE)  # kernels may read module globals only as constexpr
# A chunk's state, stored as float64 fields (float32 values and indices < 2^53 round-trip exactly).
_FIELDS = tl.constexpr(9)
_MAX, _SUM, _WEIGHTED, _TOP1, _TOP2, _TOP1_INDEX, _KEY, _KEY_INDEX, _KEY_LOGIT = (tl.constexpr(i) for i in range(9))


@triton.jit
def _merge_entropy_state(max_a, sum_a, weighted_a, max_b, sum_b, weighted_b):
    """(m, s, w) of two disjoint parts -> of their union; w is relative to m, so it shifts with it."""
    new_max = tl.maximum(max_a, max_b)
    shift_a = rescale_exponent(max_a, new_max)
    shift_b = rescale_exponent(max_b, new_max)
    scale_a, scale_b = tl.exp(shift_a), tl.exp(shift_b)
    new_sum = scale_a * sum_a + scale_b * sum_b
    new_weighted = scale_a * (weighted_a + shift_a * sum_a) + scale_b * (weighted_b + shift_b * sum_b)
    return new_max, new_sum, new_weighted


@triton.jit
def _merge_top2(top1_a, top2_a, index_a, top1_b, top2_b, index_b):
    """Top-2 values and top-1 index of two parts; ``a`` holds the lower indices, so it wins ties."""
    b_leads = top1_b > top1_a
    top2 = tl.where(b_leads, tl.maximum(top1_a, top2_b), tl.maximum(top2_a, top1_b))
    return tl.maximum(top1_a, top1_b), top2, tl.where(b_leads, index_b, index_a)


@triton.jit
def _empty_state(INDEX: tl.constexpr):
    """The state of no logits yet: (m, s, w) of the softmax, the top-2 and its index, the best key, its
    index and logit; ``INDEX`` is the index dtype (int32 within a chunk, int64 across chunks)."""
    minus_inf = float("-inf")
    return (tl.full((), minus_inf, tl.float32), tl.full((), 0.0, tl.float32), tl.full((), 0.0, tl.float32),
            tl.full((), minus_inf, tl.float32), tl.full((), minus_inf, tl.float32), tl.full((), 0, INDEX),
            tl.full((), minus_inf, tl.float64), tl.full((), 0, INDEX), tl.full((), minus_inf, tl.float32))


@triton.jit
def _partial_kernel(
    logits_ptr, gumbels_ptr, partials_ptr,  # [N, V] any float, [N, V] float64 (if NOISE_GIVEN), [N, S, 9]
    vocab, chunk, splits, temperature, seed,
    BLOCK: tl.constexpr, SAMPLE: tl.constexpr, NOISE_GIVEN: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    offsets = tl.arange(0, BLOCK)
    minus_inf = float("-inf")
    (running_max, running_sum, weighted, top1, top2, top1_index,
     best_key, best_index, best_logit) = _empty_state(tl.int32)

    begin = split * chunk
    end = tl.minimum(begin + chunk, vocab)
    for start in range(begin, end, BLOCK):
        columns = start + offsets
        inside = columns < end
        x = tl.load(logits_ptr + row.to(tl.int64) * vocab + columns, mask=inside, other=minus_inf).to(tl.float32)

        # This tile's state; -inf logits are masked out of every product (0 * -inf is NaN).
        tile_top1, tile_index = tl.max(x, 0, return_indices=True)
        finite = x > minus_inf
        shifted = tl.where(finite, x - finite_or_zero(tile_top1), 0.0)
        weights = tl.where(finite, tl.exp(shifted), 0.0)
        running_max, running_sum, weighted = _merge_entropy_state(
            running_max, running_sum, weighted, tile_top1, tl.sum(weights, 0), tl.sum(weights * shifted, 0))
        tile_top2 = tl.max(tl.where(offsets == tile_index, minus_inf, x), 0)
        top1, top2, top1_index = _merge_top2(top1, top2, top1_index, tile_top1, tile_top2, start + tile_index)

        if SAMPLE:  # Gumbel-max over float64 keys
            if NOISE_GIVEN:
                noise = tl.load(gumbels_ptr + row.to(tl.int64) * vocab + columns, mask=inside, other=minus_inf)
            else:
                noise = gumbel53(seed, _STREAM_SAMPLE, row, columns)
            keys = tempered(x, temperature).to(tl.float64) + noise
            tile_key, key_index = tl.max(keys, 0, return_indices=True)
            key_logit = tl.max(tl.where(offsets == key_index, x, minus_inf), 0)
            best_logit = tl.where(tile_key > best_key, key_logit, best_logit)
            best_key, best_index = merge_argmax(best_key, best_index, tile_key, start + key_index)

    state = partials_ptr + (row.to(tl.int64) * splits + split) * _FIELDS
    tl.store(state + _MAX, running_max.to(tl.float64))
    tl.store(state + _SUM, running_sum.to(tl.float64))
    tl.store(state + _WEIGHTED, weighted.to(tl.float64))
    tl.store(state + _TOP1, top1.to(tl.float64))
    tl.store(state + _TOP2, top2.to(tl.float64))
    tl.store(state + _TOP1_INDEX, top1_index.to(tl.float64))
    tl.store(state + _KEY, best_key)
    tl.store(state + _KEY_INDEX, best_index.to(tl.float64))
    tl.store(state + _KEY_LOGIT, best_logit.to(tl.float64))


@triton.jit
def _finish_kernel(
    partials_ptr,  # [N, S, 9] float64
    tokens_ptr, token_prob_ptr, top1_ptr, margin_ptr, entropy_ptr,  # [N] outputs
    splits,
    SAMPLE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    (running_max, running_sum, weighted, top1, top2, top1_index,
     best_key, best_index, best_logit) = _empty_state(tl.int64)
    for split in range(0, splits):  # chunks in vocabulary order, so earlier chunks win ties
        state = partials_ptr + (row * splits + split) * _FIELDS
        running_max, running_sum, weighted = _merge_entropy_state(
            running_max, running_sum, weighted, tl.load(state + _MAX).to(tl.float32),
            tl.load(state + _SUM).to(tl.float32), tl.load(state + _WEIGHTED).to(tl.float32))
        top1, top2, top1_index = _merge_top2(
            top1, top2, top1_index, tl.load(state + _TOP1).to(tl.float32), tl.load(state + _TOP2).to(tl.float32),
            tl.load(state + _TOP1_INDEX).to(tl.int64))
        if SAMPLE:
            key = tl.load(state + _KEY)
            best_logit = tl.where(key > best_key, tl.load(state + _KEY_LOGIT).to(tl.float32), best_logit)
            best_key, best_index = merge_argmax(best_key, best_index, key, tl.load(state + _KEY_INDEX).to(tl.int64))

    if SAMPLE:
        token, token_logit = best_index, best_logit
    else:
        token, token_logit = top1_index, top1
    top1_prob = tl.exp(top1 - running_max) / running_sum
    top2_prob = tl.exp(top2 - running_max) / running_sum
    tl.store(tokens_ptr + row, token)
    tl.store(token_prob_ptr + row, tl.exp(token_logit - running_max) / running_sum)
    tl.store(top1_ptr + row, top1_prob)
    tl.store(margin_ptr + row, top1_prob - top2_prob)
    tl.store(entropy_ptr + row, tl.log(running_sum) - weighted / running_sum)


def sample_confidence_triton(
    logits: torch.Tensor,  # [N, V]
    temperature: float,
    generator: torch.Generator | None = None,
    *,
    gumbels: torch.Tensor | None = None,  # [N, V] float64
    seed: int | None = None,
    block_size: int | None = None,  # vocabulary tile width (a power of two); default min(2048, V)
    splits: int | None = None,  # vocabulary chunks per row; default: enough programs to fill the GPU
) -> SampleConfidence:
    """Fused ``sample_confidence_reference``: same outputs under the same gumbels or seed."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    rows, vocab = logits.shape
    sample = temperature > 0
    if sample and gumbels is None and seed is None:
        if generator is None:
            raise ValueError("sampling at temperature > 0 needs a generator, explicit gumbels or a seed")
        seed = draw_seed(generator)
    out = SampleConfidence(*(torch.empty(rows, dtype=dtype, device=logits.device)
                             for dtype in (torch.long, torch.float32, torch.float32, torch.float32, torch.float32)))
    if rows == 0:
        return out
    logits = logits.contiguous()
    noise_given = sample and gumbels is not None
    block = block_size or min(MAX_BLOCK, triton.next_power_of_2(vocab))
    num_splits, chunk = vocab_splits(rows, vocab, block, logits.device, splits)
    partials = torch.empty((rows, num_splits, 9), dtype=torch.float64, device=logits.device)
    _partial_kernel[(rows, num_splits)](
        logits, gumbels.to(torch.float64).contiguous() if noise_given else logits, partials,
        vocab, chunk, num_splits, float(temperature) if sample else 1.0, seed if seed is not None else 0,
        BLOCK=block, SAMPLE=sample, NOISE_GIVEN=noise_given, num_warps=8 if block >= 2048 else 4,
    )
    _finish_kernel[(rows,)](partials, out.tokens, out.token_prob, out.top1_prob, out.margin, out.entropy,
                            num_splits, SAMPLE=sample, num_warps=1)
    return out
