"""Numerical rules shared by every sampler and kernel, each with the reason it exists.

- Probabilities come from logits through a max-subtracted softmax in float32 or wider: bf16 logits
  lose the small probabilities that acceptance ratios divide by.
- Sampling noise (uniforms, Gumbel) is float64: LLaDA's reference sampler uses float64 Gumbel noise,
  and low-precision noise measurably biases masked-diffusion sampling (ties and truncated tails).
- Categorical samples are Gumbel-max over ``log(weights) + gumbel`` in float64, so a zero weight (or a
  ``-inf`` logit) can never be drawn.
- Greedy is ``argmax`` of the logits; ties go to the lowest token id (torch's documented argmax rule),
  so two samplers that see the same logits pick the same token.
- Never a [B, L, V] float64 tensor at real vocabulary sizes: noise is drawn in row chunks of at most
  ``NOISE_CHUNK_ELEMENTS`` entries.
- Every random draw takes an explicit ``torch.Generator``; there is no global RNG in sampling code.
"""

from __future__ import annotations

import torch

NOISE_CHUNK_ELEMENTS = 1 << 23  # 64 MB of float64 noise at most per chunk


def softmax(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """float32 (or wider) probabilities of ``logits / temperature`` along the last axis; temperature > 0."""
    scores = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    if temperature != 1.0:
        scores = scores / temperature
    return torch.softmax(scores, dim=-1)


def uniform(generator: torch.Generator, shape: tuple[int, ...], device: torch.device | str) -> torch.Tensor:
    """float64 uniforms in [0, 1) drawn from ``generator`` and moved to ``device``."""
    noise = torch.rand(shape, generator=generator, dtype=torch.float64, device=generator.device)
    return noise.to(device)


def gumbel(generator: torch.Generator, shape: tuple[int, ...], device: torch.device | str) -> torch.Tensor:
    """float64 standard Gumbel noise; u = 0 maps to -inf, which only ever loses an argmax."""
    return -torch.log(-torch.log(uniform(generator, shape, device)))


def gumbel_argmax(log_weights: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Sample one index per row of ``log_weights`` [N, V] (unnormalised log-probabilities) -> [N].

    Rows are processed in chunks so the float64 noise never exceeds NOISE_CHUNK_ELEMENTS entries.
    """
    n, vocab = log_weights.shape
    chunk = max(1, NOISE_CHUNK_ELEMENTS // max(vocab, 1))
    out = torch.empty(n, dtype=torch.long, device=log_weights.device)
    for start in range(0, n, chunk):
        rows = log_weights[start : start + chunk].double()
        out[start : start + chunk] = (rows + gumbel(generator, tuple(rows.shape), rows.device)).argmax(-1)
    return out


def sample_from_logits(logits: torch.Tensor, temperature: float, generator: torch.Generator) -> torch.Tensor:
    """One token per row of ``logits`` [N, V] from softmax(logits / T); T = 0 is greedy -> [N]."""
    if temperature == 0:
        return logits.argmax(-1)
    return gumbel_argmax(logits.float() / temperature, generator)


def sample_from_probs(weights: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One index per row of non-negative ``weights`` [N, V] (need not sum to 1) -> [N]."""
    return gumbel_argmax(torch.log(weights.double()), generator)


def forbid_token(logits: torch.Tensor, token_id: int | None) -> torch.Tensor:
    """``logits`` with ``token_id`` set to -inf (a sampler never emits the mask token); not in place."""
    if token_id is None or token_id >= logits.shape[-1]:
        return logits
    logits = logits.clone()
    logits[..., token_id] = float("-inf")
    return logits
