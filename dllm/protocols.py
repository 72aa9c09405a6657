"""The two model protocols every sampler is written against: tokens in, logits out.

Samplers see nothing else. Faster paths (a KV cache, a model-specific window verifier) are optional
capabilities found with ``getattr`` and must give the same answer as the plain call.
"""

from __future__ import annotations

import inspect
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


# ---------------------------------------------------------------------------------------------------------
# Optional capabilities. Samplers look them up with getattr and use them only when present; each must
# give the same answer as the plain call (up to floating point) unless it says it is approximate.
#
# attention_mask (ragged prompts): a model whose attribute ``accepts_attention_mask`` is True is called
#   as ``model(input_ids, attention_mask=mask)`` with mask [N, L] of 0/1 (0 = left padding). It derives
#   position ids from the mask (0 at each row's first real token). Without it, padded batches are refused.
#
# context_length (the positions a model can read): an int attribute bounding the longest row's real tokens
#   (padding excluded, since positions come from the mask) plus max_new_tokens, less one for a causal model,
#   which never reads the last token it samples. ``generate`` refuses longer requests before decoding (see
#   ``max_prompt_length``); None or absent means no limit is checked.
#
# block_size (block-causal diffusion models): a model with an int ``block_size`` attends bidirectionally
#   inside blocks and causally across them; samplers call it with ``block_offset=`` a LongTensor [N],
#   the answer's first position per row in position-id coordinates, so model blocks line up with the
#   sampler's blocks (which start at the answer). The sampler's block_length must equal block_size for
#   the exact block cache.
#
# KV cache: ``model.new_cache()`` returns a cache with ``.length`` (int), ``.crop(length: int)`` (in place)
#   and ``.select(rows: LongTensor) -> cache``. ``model.forward_cached(input_ids [N, n], cache, *,
#   rows=None, append=True, attention_mask=None, block_offset=None) -> logits [N, n, V]`` runs the new
#   tokens against the cached prefix (positions continue after it). With ``append`` the cache grows by
#   the new tokens (rows must be None); otherwise ``rows`` [N] names the cache row serving each input
#   (several copies may share one row) and the cache is left unchanged. ``attention_mask`` [N, length + n]
#   covers cached plus new keys. ``model.cache_exact`` (bool) says whether cached logits equal uncached
#   ones: True for causal models, and for block-causal models while the cache holds only whole blocks
#   before the inputs' block; False for bidirectional models (a Fast-dLLM-style approximation, opt-in).
#
# needs_prompt: a model whose attribute ``needs_prompt`` is True cannot decode after an empty prompt (an
#   encoder that reads the prompt, say); ``generate`` refuses empty prompts for it. Every other model
#   decodes from an empty prompt with every sampler and cache mode.
# ---------------------------------------------------------------------------------------------------------


def context_length(model: object) -> int | None:
    """The model's declared context (prompt + new tokens), or None when it declares no limit."""
    value = getattr(model, "context_length", None)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def max_prompt_length(model: object, max_new_tokens: int) -> int | None:
    """The longest prompt that fits in the model's context with ``max_new_tokens`` (None: no limit)."""
    limit = context_length(model)
    if limit is None:
        return None
    # A diffusion canvas holds prompt + answer at once; a causal model reads all but its last sampled token.
    return limit - max_new_tokens + (1 if is_causal_model(model) else 0)


def accepts_attention_mask(model: object) -> bool:
    return bool(getattr(model, "accepts_attention_mask", False))


def padding_refusal(model: object) -> str:
    """Why ``model`` cannot take a left-padded batch, naming its own class (wrappers set ``__wrapped__``).

    A model that declares ``accepts_attention_mask = False`` may say why in ``padding_note`` (a phrase).
    """
    inner = inspect.unwrap(model) if hasattr(model, "__wrapped__") else model
    name = type(inner).__name__
    if not hasattr(inner, "accepts_attention_mask"):
        return f"{name} declares no accepts_attention_mask, so padding would be read as tokens"
    note = getattr(inner, "padding_note", None)
    return f"{name} cannot honour left padding (its accepts_attention_mask is False" + (f": {note})" if note else ")")


def has_cache(model: object) -> bool:
    return callable(getattr(model, "forward_cached", None)) and callable(getattr(model, "new_cache", None))


def needs_prompt(model: object) -> bool:
    return bool(getattr(model, "needs_prompt", False))
