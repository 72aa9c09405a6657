"""Triton device functions shared by the kernels: counter-based noise, online softmax, vocabulary splits.

Imported only when a Triton kernel runs (``import triton`` is slow and absent on some machines).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

PROGRAMS_PER_SM = 4  # enough programs in flight to hide memory latency when there are few rows


def vocab_splits(rows: int, vocab: int, block: int, device: torch.device, splits: int | None) -> tuple[int, int]:
    """(splits, chunk): cut each row's vocabulary into chunks of ``chunk`` columns (whole tiles) so that
    rows x splits programs fill the GPU; each chunk is reduced by one program and the partials merged."""
    tiles = triton.cdiv(vocab, block)
    if splits is None:
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
        splits = triton.cdiv(PROGRAMS_PER_SM * sms, max(rows, 1))
    tiles_per_split = triton.cdiv(tiles, max(1, min(splits, tiles)))
    return triton.cdiv(tiles, tiles_per_split), tiles_per_split * block


@triton.jit
def uniform53(seed, stream, row, columns):
    """float64 uniforms in [0, 1) at (row, columns) of ``stream``: the bits of ``noise.counter_uniforms``."""
    c0 = columns.to(tl.uint32)
    zero = c0 * 0
    word0, word1, _, _ = tl.philox(seed, c0, zero + row.to(tl.uint32), zero + stream, zero)
    bits53 = (word0 >> 5).to(tl.int64) * 67108864 + (word1 >> 6).to(tl.int64)  # 27 + 26 random bits
    return bits53.to(tl.float64) * 1.1102230246251565e-16  # 2^-53, exact


@triton.jit
def gumbel53(seed, stream, row, columns):
    """float64 Gumbel noise at (row, columns) of ``stream``: ``noise.counter_gumbels``."""
    return -tl.log(-tl.log(uniform53(seed, stream, row, columns)))


@triton.jit
def tempered(x, temperature):
    """``x / T`` rounded as torch rounds it (IEEE division), so sampling keys match the reference bit for bit."""
    return tl.math.div_rn(x, temperature)


@triton.jit
def finite_or_zero(value):
    """``value``, or 0 where it is -inf: a shift that never computes -inf - (-inf) = NaN."""
    return tl.where(value > float("-inf"), value, 0.0)


@triton.jit
def rescale_exponent(old_max, new_max):
    """old_max - new_max, or 0 while nothing finite has been seen (the accumulators are still 0 then)."""
    return tl.where(old_max > float("-inf"), old_max - finite_or_zero(new_max), 0.0)


@triton.jit
def merge_max_sum(max_a, sum_a, max_b, sum_b):
    """Two softmax normalisers (max m, sum of exp(x - m)) of disjoint parts -> that of their union."""
    new_max = tl.maximum(max_a, max_b)
    new_sum = sum_a * tl.exp(rescale_exponent(max_a, new_max)) + sum_b * tl.exp(rescale_exponent(max_b, new_max))
    return new_max, new_sum


@triton.jit
def merge_argmax(value_a, index_a, value_b, index_b):
    """The larger of two (value, index) candidates; ``a`` holds the lower indices, so it wins ties."""
    b_wins = value_b > value_a
    return tl.where(b_wins, value_b, value_a), tl.where(b_wins, index_b, index_a)


@triton.jit
def row_max_sum(row_ptr, vocab, temperature, BLOCK: tl.constexpr):
    """Online softmax normaliser of ``row_ptr[0:vocab] / T``: the max m and sum(exp(x / T - m))."""
    offsets = tl.arange(0, BLOCK)
    running_max = tl.full((), float("-inf"), tl.float32)
    running_sum = tl.full((), 0.0, tl.float32)
    for start in range(0, vocab, BLOCK):
        columns = start + offsets
        x = tempered(tl.load(row_ptr + columns, mask=columns < vocab, other=float("-inf")).to(tl.float32),
                     temperature)
        tile_max = tl.max(x, 0)
        tile_sum = tl.sum(tl.exp(x - finite_or_zero(tile_max)), 0)  # -inf logits give exp(-inf) = 0
        running_max, running_sum = merge_max_sum(running_max, running_sum, tile_max, tile_sum)
    return running_max, running_sum


@triton.jit
def probability(x, temperature, row_max, row_sum):
    """softmax(x / T) from the row's normaliser, float32 (-inf logits give 0)."""
    return tl.exp(tempered(x, temperature) - row_max) / row_sum
