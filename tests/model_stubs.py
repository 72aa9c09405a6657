"""Test doubles with optional capabilities: a causal model given a cache that replays the sequence."""

from __future__ import annotations

import torch


class TokenCache:
    """A "KV cache" that keeps the tokens fed so far [B, P]: crop and select as a real cache does."""

    def __init__(self, tokens: torch.Tensor | None = None):
        self.tokens = tokens

    @property
    def length(self) -> int:
        return 0 if self.tokens is None else self.tokens.shape[1]

    @property
    def batch_size(self) -> int | None:
        return None if self.tokens is None else self.tokens.shape[0]

    def crop(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"crop length must be in [0, {self.length}], got {length}")
        if self.tokens is not None:
            self.tokens = self.tokens[:, :length]

    def select(self, rows: torch.Tensor) -> TokenCache:
        return TokenCache(None if self.tokens is None else self.tokens[rows])


class Replaying:
    """A causal model with the cache capability, computed by replaying the whole cached sequence.

    Its cached logits equal the plain ones exactly, so a sampler that keeps a wrong entry in its cache
    (a rejected draft, padding) gets different logits and shows it.
    """

    def __init__(self, model):
        self.model = model
        self.vocab_size = model.vocab_size
        self.fed_tokens = 0

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids)

    def new_cache(self) -> TokenCache:
        return TokenCache()

    def forward_cached(self, input_ids, cache: TokenCache, *, rows=None, append=True, **unused) -> torch.Tensor:
        if rows is not None or not append:
            raise NotImplementedError("Replaying supports appending calls only")
        full = input_ids if cache.tokens is None else torch.cat([cache.tokens, input_ids], dim=1)
        self.fed_tokens += input_ids.numel()
        cache.tokens = full
        return self.model(full)[:, -input_ids.shape[1]:]
