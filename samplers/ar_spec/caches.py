"""The KV caches of the AR loops: whether a causal model's cache is used, and one that rolls back rejected drafts."""

from __future__ import annotations

import warnings

from dllm.protocols import has_cache, rolls_back


def rollback_cache(model):
    """A new cache for speculative decoding, which rolls back rejected drafts every round; None (run
    uncached, same results) when the model's cache cannot roll back (sliding-window or linear layers)."""
    kv = model.new_cache()
    if rolls_back(kv):
        return kv
    warnings.warn(f"{type(model).__name__}'s cache cannot roll back rejected drafts; ar_spec runs it uncached",
                  stacklevel=3)
    return None


def use_cache(cache: str, model) -> bool:
    """The KV cache is exact for causal models, so ``auto`` uses it whenever the model has one."""
    return cache != "none" and has_cache(model)
