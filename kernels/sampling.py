"""Per-position sampling and confidence: everything the llada, dream, fast_dllm and eb rules read.

``sample_confidence_reference`` is the torch reference; a fused Triton kernel with the same signature
may sit beside it, and ``sample_confidence`` dispatches between them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dllm.numerics import sample_from_logits


@dataclass(frozen=True)
class SampleConfidence:
    """A sample and confidence measures per row; probabilities are of the untempered softmax(logits)."""

    tokens: torch.Tensor  # [N] sampled at the given temperature (argmax at T = 0)
    token_prob: torch.Tensor  # [N] probability of the sampled token
    top1_prob: torch.Tensor  # [N]
    margin: torch.Tensor  # [N] top-1 minus top-2 probability
    entropy: torch.Tensor  # [N] in nats


def sample_confidence_reference(
    logits: torch.Tensor, temperature: float, generator: torch.Generator
) -> SampleConfidence:
    """Sample from softmax(logits / T) with float64 Gumbel noise and measure confidence; logits [N, V]."""
    tokens = sample_from_logits(logits, temperature, generator)
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


def sample_confidence(logits: torch.Tensor, temperature: float, generator: torch.Generator) -> SampleConfidence:
    """Dispatcher: the fused kernel where one is available for these tensors, else the reference."""
    return sample_confidence_reference(logits, temperature, generator)
