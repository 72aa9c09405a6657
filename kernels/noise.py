"""Counter-based float64 noise: the same numbers from a torch function and from inside a Triton kernel.

A kernel that samples over vocabulary tiles cannot take its noise from a ``torch.Generator`` without a
[rows, V] float64 tensor, so it derives each value from (seed, row, column, stream) with Philox-4x32-10
(Salmon et al. 2011, "Parallel random numbers: as easy as 1, 2, 3"), a counter-based generator: the
value at a counter needs no state, so tiles, rows and devices can compute it in any order and replay it.
``counter_uniforms`` here and ``uniform53`` in ``triton_common.py`` compute the same bits.

Layout: element (row r, column c) of a noise stream is Philox(key = seed, counter = (c, r, stream, 0));
its first two 32-bit words give a float64 uniform on the 2^-53 grid of [0, 1), the precision of
``torch.rand(dtype=float64)``. Gumbel noise is -log(-log(u)) in float64 (u = 0 gives -inf, which only
ever loses an argmax, as in ``dllm.numerics.gumbel``); its last bit can differ between platforms' float64
``log``, which changes a Gumbel-max sample only on a tie to within 1e-16.
"""

from __future__ import annotations

import torch

# draw_seed (a generator -> one seed, without waiting for a device) lives beside the noise rules, which also use it
# to move a generator to the tensors' device; kernels import it from here.
from dllm.numerics import NOISE_CHUNK_ELEMENTS, SEED_LIMIT, draw_seed  # noqa: F401

# Streams keep the noise of different uses independent under one seed.
STREAM_ACCEPT = 0  # verification: one uniform per (row, draft)
STREAM_RESIDUAL = 1  # verification: Gumbel noise per (row, token) for the correction/bonus
STREAM_SAMPLE = 2  # per-position sampling: Gumbel noise per (row, token)
STREAM_BRANCH_ACCEPT = 3  # a draft tree's continuation after an accepted alternative: uniforms
STREAM_BRANCH_RESIDUAL = 4  # ... and its correction/bonus Gumbels

# Philox-4x32 constants (Salmon et al. 2011, Table 2; the Random123 defaults).
PHILOX_MULTIPLIERS = (0xD2511F53, 0xCD9E8D57)
PHILOX_KEY_BUMPS = (0x9E3779B9, 0xBB67AE85)
PHILOX_ROUNDS = 10
_MASK32 = 0xFFFFFFFF


def philox4x32(seed: int, c0: torch.Tensor, c1: torch.Tensor, c2: torch.Tensor, c3: torch.Tensor):
    """Philox-4x32-10 of the counter (c0, c1, c2, c3) under the key ``seed``; uint32 values held in int64."""
    _check_seed(seed)
    k0, k1 = seed & _MASK32, (seed >> 32) & _MASK32
    for _ in range(PHILOX_ROUNDS):
        hi0, lo0 = _mul_hi_lo(PHILOX_MULTIPLIERS[0], c0)
        hi1, lo1 = _mul_hi_lo(PHILOX_MULTIPLIERS[1], c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + PHILOX_KEY_BUMPS[0]) & _MASK32, (k1 + PHILOX_KEY_BUMPS[1]) & _MASK32
    return c0, c1, c2, c3


def _mul_hi_lo(multiplier: int, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32 bits of ``multiplier * value`` (both < 2^32) without overflowing int64."""
    low_part = multiplier * (value & 0xFFFF)  # < 2^48
    high_part = multiplier * (value >> 16) + (low_part >> 16)  # < 2^49
    return high_part >> 16, ((high_part & 0xFFFF) << 16) | (low_part & 0xFFFF)


def counter_uniforms(seed: int, stream: int, rows: torch.Tensor, num_columns: int) -> torch.Tensor:
    """float64 uniforms in [0, 1) of ``stream`` at rows ``rows`` [R] and columns 0..num_columns-1 -> [R, C]."""
    columns = torch.arange(num_columns, dtype=torch.int64, device=rows.device)
    c0, c1 = torch.broadcast_tensors(columns[None, :], rows.long()[:, None])
    zero = torch.zeros_like(c0)
    word0, word1, _, _ = philox4x32(seed, c0, c1, zero + stream, zero)
    bits53 = (word0 >> 5) * (1 << 26) + (word1 >> 6)  # 27 + 26 random bits, exact in int64 and float64
    return bits53.double() * 2.0**-53


def counter_gumbels(seed: int, stream: int, rows: torch.Tensor, num_columns: int) -> torch.Tensor:
    """float64 standard Gumbel noise of ``stream`` at rows ``rows`` [R] -> [R, C]."""
    return -torch.log(-torch.log(counter_uniforms(seed, stream, rows, num_columns)))


def counter_gumbel_argmax(log_weights: torch.Tensor, seed: int, stream: int) -> torch.Tensor:
    """Gumbel-max sample per row of ``log_weights`` [N, V] with counter noise (row r uses noise row r) -> [N].

    Rows go in chunks so the float64 noise never exceeds NOISE_CHUNK_ELEMENTS entries.
    """
    n, vocab = log_weights.shape
    chunk = max(1, NOISE_CHUNK_ELEMENTS // max(vocab, 1))
    out = torch.empty(n, dtype=torch.long, device=log_weights.device)
    for start in range(0, n, chunk):
        rows = torch.arange(start, min(start + chunk, n), device=log_weights.device)
        noise = counter_gumbels(seed, stream, rows, vocab)
        out[start : start + chunk] = (log_weights[start : start + chunk].double() + noise).argmax(-1)
    return out


def _check_seed(seed: int) -> None:
    if not 0 <= seed < SEED_LIMIT:
        raise ValueError(f"seed must be an integer in [0, 2^63), got {seed}")
