"""The two model protocols every sampler is written against: tokens in, logits out.

Samplers see nothing else. Faster paths (a KV cache, a model-specific window verifier) are optional
capabilities found with ``getattr`` and must give the same answer as the plain call.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class DiffusionModel(Protocol):
    """A masked-diffusion denoiser: ``logits[:, i]`` scores the clean token at position i.

    Only masked positions are read. Logits may hold ``-inf`` (the mask token's own logit, say).
    """

    mask_token_id: int
    vocab_size: int

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:  # [B, L] -> [B, L, V]
        ...


@runtime_checkable
class CausalModel(Protocol):
    """An autoregressive LM: ``logits[:, i]`` scores the token at position i + 1."""

    vocab_size: int

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:  # [B, L] -> [B, L, V]
        ...


def is_diffusion_model(model: object) -> bool:
    """True when ``model`` declares a mask token, i.e. follows the DiffusionModel protocol."""
    return callable(model) and getattr(model, "mask_token_id", None) is not None and hasattr(model, "vocab_size")


def is_causal_model(model: object) -> bool:
    """True for a callable with a vocabulary and no mask token (the CausalModel protocol)."""
    return callable(model) and hasattr(model, "vocab_size") and not is_diffusion_model(model)
