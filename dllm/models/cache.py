"""The project's caches, named for what they hold: ``KVCache`` (keys/values of a prefix, computed once and
reused by :class:`dllm.models.transformer.TransformerLM`) and ``RevealCache`` (the two-stream layout's
content stream, in reveal order, over every canvas row). The adapters' caches share ``SizedCache``; how the
samplers use a cache (block, prefix, dual; rolled back for ar_spec) is ``samplers/sessions/`` (and
``samplers/ar_spec/caches.py``).

Exact (same logits as recomputing the prefix) for causal attention, and for block-causal attention
while the cache holds only whole blocks that come before every new query. For bidirectional attention
a cache is an approximation: cached keys never see tokens that arrive later.
"""

from __future__ import annotations

import torch
from einops import repeat
from torch import Tensor


class SizedCache:
    """``length`` and ``batch_size`` of a cache from its [B, P] bookkeeping tensor (``_sized_by``), written
    once for every cache type (KVCache here, the Hugging Face and DiffusionGemma caches of the adapters)."""

    def _sized_by(self) -> Tensor | None:  # [B, P], None while empty
        raise NotImplementedError

    @property
    def length(self) -> int:
        """Cached sequence length P (including invalid entries); 0 when empty."""
        sized = self._sized_by()
        return 0 if sized is None else sized.shape[1]

    @property
    def batch_size(self) -> int | None:
        """Rows B of the cache; None while empty."""
        sized = self._sized_by()
        return None if sized is None else sized.shape[0]


class KVCache(SizedCache):
    """Per-layer keys/values of a prefix, plus each cached token's position and validity.

    keys[i], values[i]: [B, H_kv, P, D], rotary already applied to the keys.
    positions: [B, P] rotary positions of the cached tokens.
    valid: [B, P] False for padding and for entries rolled back by a ragged ``crop``; never attended.
    hidden: [B, P, dim] last-layer states of the cached tokens, or None; kept only for models whose logits
    at position p read the state at p - 1 (Dream's shift), so a call starting after the cache can score p.
    ``append`` and ``crop`` change the cache in place; ``expand`` and ``select`` return a new cache.
    """

    def __init__(
        self,
        keys: list[Tensor] | None = None,
        values: list[Tensor] | None = None,
        positions: Tensor | None = None,
        valid: Tensor | None = None,
        hidden: Tensor | None = None,
    ):
        self.keys = keys or []
        self.values = values or []
        self.positions = positions  # [B, P]
        self.valid = valid  # [B, P]
        self.hidden = hidden  # [B, P, dim] or None

    def _sized_by(self) -> Tensor | None:
        return self.positions

    def layer(self, index: int) -> tuple[Tensor, Tensor]:
        """Keys and values of one layer.  # ([B, H_kv, P, D], [B, H_kv, P, D])"""
        return self.keys[index], self.values[index]

    def next_position(self) -> Tensor:
        """Position of the next token in each row: one past the last valid cached position.  # [B]"""
        last = self.positions.masked_fill(~self.valid, -1).amax(dim=1)
        return last + 1

    def append(self, kv: list[tuple[Tensor, Tensor]], positions: Tensor, valid: Tensor,
               hidden: Tensor | None = None) -> None:
        """Add new tokens' keys/values (one (k, v) per layer, [B, H_kv, L, D]) with positions/valid [B, L]
        and, for shifted models, their last-layer states [B, L, dim]."""
        if self.length == 0:
            self.keys = [k for k, _ in kv]
            self.values = [v for _, v in kv]
            self.positions, self.valid, self.hidden = positions, valid.bool(), hidden
            return
        if positions.shape[0] != self.batch_size:
            raise ValueError(f"cache holds {self.batch_size} rows but {positions.shape[0]} were appended")
        self.keys = [torch.cat((old, new), dim=2) for old, (new, _) in zip(self.keys, kv, strict=True)]
        self.values = [torch.cat((old, new), dim=2) for old, (_, new) in zip(self.values, kv, strict=True)]
        self.positions = torch.cat((self.positions, positions), dim=1)
        self.valid = torch.cat((self.valid, valid.bool()), dim=1)
        if (self.hidden is None) != (hidden is None):
            raise ValueError("append: hidden states must be given for every append or for none")
        if hidden is not None:
            self.hidden = torch.cat((self.hidden, hidden), dim=1)

    def crop(self, length: int | Tensor) -> None:
        """Roll back to the first ``length`` entries: an int for all rows, or a LongTensor [B] per row.

        A per-row length keeps max(length) entries and marks each row's tail invalid, so rows that
        accepted different numbers of speculative drafts share one cache.
        """
        if isinstance(length, Tensor):
            keep = int(length.max())
            self._slice(keep)
            if self.length:
                live = torch.arange(keep, device=self.valid.device) < length.to(self.valid.device)[:, None]
                self.valid = self.valid & live
            return
        if not 0 <= length <= self.length:
            raise ValueError(f"crop length must be in [0, {self.length}], got {length}")
        self._slice(length)

    def _slice(self, length: int) -> None:
        """Keep the first ``length`` entries of every tensor (views, no copy)."""
        if length == 0:
            self.keys, self.values, self.positions, self.valid, self.hidden = [], [], None, None, None
            return
        self.keys = [k[:, :, :length] for k in self.keys]
        self.values = [v[:, :, :length] for v in self.values]
        self.positions, self.valid = self.positions[:, :length], self.valid[:, :length]
        if self.hidden is not None:
            self.hidden = self.hidden[:, :length]

    def drop(self, start: int, end: int) -> KVCache:
        """A cache without entries [start, end) (e.g. the active block, for Fast-dLLM's dual cache)."""
        def cut(x: Tensor, dim: int) -> Tensor:
            return torch.cat((x.narrow(dim, 0, start), x.narrow(dim, end, x.shape[dim] - end)), dim=dim)

        keys, values = [cut(k, 2) for k in self.keys], [cut(v, 2) for v in self.values]
        hidden = None if self.hidden is None else cut(self.hidden, 1)
        return KVCache(keys, values, cut(self.positions, 1), cut(self.valid, 1), hidden)

    def expand(self, n: int) -> KVCache:
        """Each row repeated n times, copies adjacent: row b becomes rows b*n .. b*n+n-1.  # [B*n, ...]

        With one row (B == 1) this is a view (``Tensor.expand``, no memory copied); with B > 1 the
        (b n) merge cannot be a strided view, so the tensors are copied (``einops.repeat``).
        """
        if self.length == 0:
            return KVCache()

        def grow(x: Tensor) -> Tensor:
            if x.shape[0] == 1:
                return x.expand(n, *x.shape[1:])
            return repeat(x, "b ... -> (b n) ...", n=n)

        keys, values = [grow(k) for k in self.keys], [grow(v) for v in self.values]
        hidden = None if self.hidden is None else grow(self.hidden)
        return KVCache(keys, values, grow(self.positions), grow(self.valid), hidden)

    def select(self, rows: Tensor) -> KVCache:
        """A cache of the given rows only (e.g. to drop finished rows).  # rows: LongTensor [B']"""
        if self.length == 0:
            return KVCache()
        keys, values = [k[rows] for k in self.keys], [v[rows] for v in self.values]
        hidden = None if self.hidden is None else self.hidden[rows]
        return KVCache(keys, values, self.positions[rows], self.valid[rows], hidden)


class RevealCache:
    """Content-stream keys/values of every canvas row, in reveal order (a ``KVCache`` over all B rows).

    Calls run on a subset of rows; the other rows get invalid placeholder entries so that every row's
    entries stay aligned. Rejected drafts are marked invalid (``keep``), never attended again.
    """

    def __init__(self, batch: int):
        self.batch = batch
        self.kv = KVCache()

    @property
    def length(self) -> int:
        return self.kv.length

    def rows(self, rows: Tensor) -> KVCache:
        """The cache of ``rows`` [R] (a view of all rows when rows is everything)."""
        if self.kv.length == 0 or (rows.numel() == self.batch and bool((rows == torch.arange(
                self.batch, device=rows.device)).all())):
            return self.kv
        return self.kv.select(rows)

    def extend(self, rows: Tensor, kv: list[tuple[Tensor, Tensor]], positions: Tensor, valid: Tensor) -> None:
        """Append new content entries of ``rows`` [R] (kv [R, H, C, D] per layer, positions/valid [R, C])."""
        if rows.numel() != self.batch:
            def spread(t: Tensor, fill=0) -> Tensor:
                out = t.new_full((self.batch, *t.shape[1:]), fill)
                out[rows] = t
                return out

            kv = [(spread(k), spread(v)) for k, v in kv]
            positions, valid = spread(positions), spread(valid, False)
        self.kv.append(kv, positions, valid)

    def keep(self, rows: Tensor, keep: Tensor) -> None:
        """Of the last C entries of ``rows`` [R], keep those flagged in ``keep`` [R, C] (the rest are dropped)."""
        width = keep.shape[1]
        tail = self.kv.valid[:, -width:].clone()
        tail[rows] &= keep
        self.kv.valid = torch.cat([self.kv.valid[:, :-width], tail], dim=1)

    def compact(self, min_unused: float = 0.0) -> None:
        """Drop entries that no row keeps (rejected drafts, placeholders): less attention, same logits.
        Only once they are at least ``min_unused`` of the cache (copying the keys/values costs too)."""
        if self.kv.length == 0:
            return
        used = self.kv.valid.any(dim=0)
        if bool(used.all()) or float((~used).float().mean()) < min_unused:
            return
        index = used.nonzero().squeeze(-1)
        kv = self.kv
        self.kv = KVCache([k[:, :, index] for k in kv.keys], [v[:, :, index] for v in kv.values],
                          kv.positions[:, index], kv.valid[:, index])
