"""Fast-dLLM's caches, ``cache="prefix"`` and ``"dual"``: approximate for bidirectional models (cached keys never
see later updates), so opt-in only."""

from __future__ import annotations

import torch

from dllm.numerics import positions_from_mask

from ..calling import ask_at, hidden_keyword, join_parts, part_of, settle
from ..canvas import View
from .base import SessionBase


class PrefixCacheSession(SessionBase):
    """Fast-dLLM prefix cache (approximate): one full call per block fills the cache; steps then run the
    active block and the rest of the sequence against the prefix's cached keys."""

    exact = False

    def begin_block(self, block: int) -> None:
        self.block = block
        self.cache = self._full_cache()
        self.cache.crop(self.canvas.span(block)[0])

    def _full_cache(self):
        """A fresh cache filled by one full call over every row's whole sequence."""
        x, cache = self.canvas.x, self.caller.model.new_cache()
        self.caller.count(x, len(x), cache)
        kwargs = self.caller.kwargs(torch.arange(len(x), device=x.device), slice(0, x.shape[1]))
        none = x[:, :0]  # no logit is read: the call only fills the cache
        settle(self.caller.model.forward_cached(x, cache, append=True, **kwargs, **ask_at(none, 0, self.native_at)),
                x, none, 0, self.native_at)
        return cache

    def view(self, rows: torch.Tensor, masked: list[int] | None = None) -> View:
        start, end = self.canvas.span(self.block)
        return self._view(rows, start, self.canvas.x.shape[1], end - start, masked=masked)

    def logits(self, tokens: torch.Tensor, which: torch.Tensor, hidden: bool = False, *, rows: torch.Tensor,
               at: torch.Tensor | None = None, most: int | None = None):
        served, rows = len(rows), rows[which]
        self.caller.count(tokens, served, self.cache)
        # The new tokens' mask columns are the last ones of keys=[0, L): answer positions, all ones.
        kwargs = {"rows": rows, **self._place(rows), **self.caller.kwargs(rows, slice(0, self.canvas.x.shape[1]))}
        outs = []
        for part in self._split(tokens):
            out = self.caller.model.forward_cached(tokens[part], self.cache, append=False, **part_of(kwargs, part),
                                                   **hidden_keyword(hidden),
                                                   **ask_at(part_of(at, part), 0, self.native_at))
            outs.append(settle(out, tokens[part], part_of(at, part), 0, self.native_at))
        return join_parts(outs)

    def _place(self, rows: torch.Tensor) -> dict:
        """Extra keyword arguments that place the new tokens (none: they follow the cached prefix)."""
        return {}


class DualCacheSession(PrefixCacheSession):
    """Fast-dLLM dual cache (approximate): the block-start call caches the prefix AND the masked suffix;
    steps run the active block only. Needs a cache with ``drop(start, end)`` and ``position_ids`` support."""

    def begin_block(self, block: int) -> None:
        self.block = block
        self.cache = self._full_cache().drop(*self.canvas.span(block))

    def view(self, rows: torch.Tensor, masked: list[int] | None = None) -> View:
        start, end = self.canvas.span(self.block)
        return self._view(rows, start, end, end - start, masked=masked)

    def _place(self, rows: torch.Tensor) -> dict:
        """The active block's position ids: the cache holds keys on both sides of it."""
        start, end = self.canvas.span(self.block)
        return {"position_ids": self.positions[rows, start:end]}

    @property
    def positions(self) -> torch.Tensor:
        """Position ids of every canvas position (0 at each row's first real token) -> [B, L]."""
        mask = self.caller.attention_mask
        if mask is None:
            return torch.arange(self.canvas.x.shape[1], device=self.canvas.x.device).expand_as(self.canvas.x)
        return positions_from_mask(mask)
