"""Per-position sampling and confidence: everything the llada, dream, fast_dllm and eb rules read.

``sample_confidence_reference`` is the torch reference; ``sampling_triton.py`` holds the fused kernel
with the same signature (one pass over vocabulary tiles, no [N, V] probabilities or noise), and
``sample_confidence`` dispatches between them.

Noise: explicit ``gumbels`` [N, V] float64 wins; else ``seed`` derives Gumbel (n, v) from a counter-based
generator (``dllm.kernels.noise``), so reference and kernel replay each other token for token; else the
reference draws from ``generator`` as ``dllm.numerics.sample_from_logits`` does, and the kernel draws one
seed from it (same law, different stream).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dllm.numerics import RowGenerators, sample_from_logits

from .dispatch import use_triton
from .noise import STREAM_SAMPLE, counter_gumbel_argmax


@dataclass(frozen=True)
class SampleConfidence:
    """A sample and confidence measures per row; probabilities are of the untempered softmax(logits)."""

    tokens: torch.Tensor  # [N] sampled at the given temperature (argmax at T = 0)
    token_prob: torch.Tensor  # [N] probability of the sampled token
    top1_prob: torch.Tensor  # [N]
    margin: torch.Tensor  # [N] top-1 minus top-2 probability
    entropy: torch.Tensor  # [N] in nats


def sample_confidence_reference(
    logits: torch.Tensor,  # [N, V]
    temperature: float,
    generator: torch.Generator | None = None,
    *,
    gumbels: torch.Tensor | None = None,  # [N, V] float64, explicit sampling noise
    seed: int | None = None,  # counter-based noise when gumbels are not given
) -> SampleConfidence:
    """Sample from softmax(logits / T) with float64 Gumbel noise and measure confidence."""
    tokens = _sample(logits, temperature, generator, gumbels, seed)
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    probs = log_probs.exp()
    top2 = probs.topk(min(2, probs.shape[-1]), dim=-1).values
    second = top2[:, 1] if top2.shape[1] > 1 else torch.zeros_like(top2[:, 0])
    return SampleConfidence(
        tokens=tokens,
        token_prob=probs.gather(-1, tokens[:, None]).squeeze(-1),
        top1_prob=top2[:, 0],
        margin=top2[:, 0] - second,
        entropy=torch.special.entr(probs).sum(-1),
    )


def sample_confidence(
    logits: torch.Tensor,  # [N, V]
    temperature: float,
    generator: torch.Generator | None = None,
    *,
    gumbels: torch.Tensor | None = None,  # [N, V] float64
    seed: int | None = None,
) -> SampleConfidence:
    """Dispatcher: the fused Triton kernel for CUDA tensors when Triton is installed, else the reference
    (``dllm.kernels.dispatch`` has the rule and how to override it)."""
    implementation = sample_confidence_reference
    if not isinstance(generator, RowGenerators) and use_triton(logits):
        from .sampling_triton import sample_confidence_triton

        implementation = sample_confidence_triton
    return implementation(logits, temperature, generator, gumbels=gumbels, seed=seed)


def _sample(
    logits: torch.Tensor,  # [N, V]
    temperature: float,
    generator: torch.Generator | None,
    gumbels: torch.Tensor | None,  # [N, V] float64
    seed: int | None,
) -> torch.Tensor:
    """Gumbel-max over float64 keys (logits / T in float32) + noise -> [N]; argmax at T = 0."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if temperature == 0:
        return logits.argmax(-1)
    if gumbels is not None:
        return ((logits.float() / temperature).double() + gumbels).argmax(-1)
    if seed is not None:
        return counter_gumbel_argmax(logits.float() / temperature, seed, STREAM_SAMPLE)
    if generator is None:
        raise ValueError("sampling at temperature > 0 needs a generator, explicit gumbels or a seed")
    return sample_from_logits(logits, temperature, generator)
