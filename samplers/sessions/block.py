"""``cache="block"``: the exact block cache. The prompt and finished blocks live in a KV cache; calls cover the active
block (copies of a row packed into one input where the model can: ``BlockCacheSession._pack``)."""

from __future__ import annotations

import torch

from dllm.counting import structured_tokens
from dllm.protocols import capabilities

from ..calling import Caller, ask_at, check_logits, hidden_keyword, join_parts, part_of, settle
from ..canvas import Canvas, View
from .base import SessionBase


class BlockCacheSession(SessionBase):
    """Prompt and finished blocks live in a KV cache; calls cover the active block only (exact for a
    model whose attention is causal across blocks).

    With ``lookahead`` the view also holds the next block: the active block never attends to it, so its
    logits are unchanged, and the call yields logits for the next block too (fef's stale drafts use
    them, so a new block needs no separate draft call).
    """

    def __init__(self, canvas: Canvas, caller: Caller, lookahead: bool = False, call_tokens: int | None = None):
        super().__init__(canvas, caller, call_tokens)
        self.lookahead = lookahead
        self.cache = caller.model.new_cache()
        self.cached_until = 0  # canvas positions [0, cached_until) are in the cache
        # A model that can commit a shared prefix during a copies call lets the finished block ride along
        # with the next block's first call instead of costing a call of its own.
        self.folds = capabilities(caller.model).commits_prefix
        # Copies of a row packed into one input (``Capabilities.packs_copies``): the cache is read once per row
        # and the finished block riding along is fed once, not once per copy.
        self.packs = self.folds and capabilities(caller.model).packs_copies

    def begin_block(self, block: int) -> None:
        self.block = block
        start, _ = self.canvas.span(block)
        # Folding writes through the cache's rows, so the cache must hold them already: after an empty
        # prompt the first finished block is filled on its own.
        if start > self.cached_until and not (self.folds and self.cached_until > 0):
            self._fill(start)

    def _fill(self, start: int) -> None:
        """Append canvas positions [cached_until, start) (the prompt, or a finished block) to the cache."""
        if start > self.cached_until:
            chunk = self.canvas.x[:, self.cached_until : start].clone()  # (the canvas changes in place; a backward
            # through the embedding, score(grad=True), reads these ids later)
            self.caller.count(chunk, len(chunk), self.cache)
            kwargs = self.caller.kwargs(torch.arange(len(chunk), device=chunk.device), slice(0, start))
            none = chunk[:, :0]  # no logit is read: the fill only stores keys and values
            out = self.caller.model.forward_cached(chunk, self.cache, append=True, **kwargs,
                                                   **ask_at(none, 0, self.native_at))
            settle(out, chunk, none, 0, self.native_at)
            self.cached_until = start

    def _span(self) -> tuple[int, int, int]:
        """(start, end, stop): the active block [start, end) and the view's end (after any lookahead)."""
        start, end = self.canvas.span(self.block)
        return start, end, min(end + self.canvas.block_length, self.canvas.x.shape[1]) if self.lookahead else end

    def view(self, rows: torch.Tensor, masked: list[int] | None = None) -> View:
        start, end, stop = self._span()
        return self._view(rows, start, stop, end - start, masked=masked)

    def logits(self, tokens: torch.Tensor, which: torch.Tensor, hidden: bool = False, *, rows: torch.Tensor,
               at: torch.Tensor | None = None, most: int | None = None):
        """As ``Session.logits``; ``most``: the most inputs one view row has, when the caller knows it on the host
        (packing then reads nothing from the device)."""
        view_rows, served, rows = rows, len(rows), rows[which]
        start, _, stop = self._span()
        parts = self._split(tokens)
        if len(parts) > 1:  # the commit below would fold the block in from the first part's rows only
            self._fill(start)
        elif tokens.shape[0] > served and self.packs and self.native_at:  # copies: one packed input per row
            packed, kwargs, unpack = self._pack(tokens, which, view_rows, at, most)
            self.caller.count(packed, served, self.cache)
            out = self.caller.model.forward_cached(packed, self.cache, rows=view_rows, append=False, **kwargs,
                                                   **hidden_keyword(hidden))
            self.cached_until = start
            return unpack(check_logits(out, packed, kwargs["logits_at"]))
        pending = start - self.cached_until  # a finished block not yet in the cache: commit it now
        if pending:
            tokens = torch.cat([self.canvas.x[rows, self.cached_until : start], tokens], dim=1)
        self.caller.count(tokens, served, self.cache)
        kwargs = {"rows": rows, **self.caller.kwargs(rows, slice(0, stop))}
        outs = []
        for part in parts:
            out = self.caller.model.forward_cached(tokens[part], self.cache, append=False,
                                                   **({"commit": pending} if pending else {}), **hidden_keyword(hidden),
                                                   **part_of(kwargs, part),
                                                   **ask_at(part_of(at, part), pending, self.native_at))
            outs.append(settle(out, tokens[part], part_of(at, part), pending, self.native_at))
        self.cached_until = start
        return join_parts(outs)

    def _pack(self, tokens: torch.Tensor, which: torch.Tensor, rows: torch.Tensor, at: torch.Tensor | None,
              most: int | None = None):
        """Copies [N, n] of view rows ``rows`` [R] (N > R) as one model input per row -> (inputs [R, m], the
        forward's keywords, a function from its answer to ``logits``'s). A row's input: the pending finished
        block (segment 0, committed to the cache), then its copies (segments 1, 2, ...), then filler up to the
        row with most copies; the model gives the same logits as for a row per copy (``forward``'s ``segments``)."""
        start, _, stop = self._span()
        served, (count, length) = len(rows), tokens.shape
        device = tokens.device
        per_row = torch.bincount(which, minlength=served)
        if served == 1:
            most = count
        elif most is None:  # one synchronisation, on a batch whose caller did not say
            most = int(per_row.max())
        order = torch.argsort(which, stable=True)
        rank = torch.empty_like(which)  # copy i is the rank[i]-th of its row
        rank[order] = torch.arange(count, device=device) - (per_row.cumsum(0) - per_row)[which[order]]
        pending = start - self.cached_until
        column = pending + rank[:, None] * length + torch.arange(length, device=device)  # [N, n] in the row
        packed = torch.full((served, pending + most * length), self.canvas.mask_token_id, dtype=tokens.dtype,
                            device=device)
        segments = torch.full_like(packed, -1)
        packed[:, :pending] = self.canvas.x[rows, self.cached_until : start]
        segments[:, :pending] = 0
        packed[which[:, None], column] = tokens
        segments[which[:, None], column] = (rank + 1)[:, None].expand(-1, length)
        kwargs = self.caller.kwargs(rows, slice(0, stop))
        if "attention_mask" in kwargs:  # each copy's keys are valid where its row's view is
            mask = kwargs["attention_mask"]
            kwargs["attention_mask"] = torch.cat([mask[:, :start], mask[:, start:].repeat(1, most)], dim=1)
        want = torch.arange(length, device=device).expand(count, -1) if at is None else at  # [N, K]
        width = want.shape[1]
        asked = torch.zeros((served, most * width), dtype=torch.long, device=device)
        asked[which[:, None], rank[:, None] * width + torch.arange(width, device=device)] = column.gather(1, want)
        kwargs.update(segments=segments, logits_at=asked, **({"commit": pending} if pending else {}))

        def unpack(out):  # copy i's answers: the rank[i]-th run of K positions of row which[i] -> [N, K, ...]
            parts = out if isinstance(out, tuple) else (out,)
            parts = tuple(part.reshape(served, most, width, -1)[which, rank] for part in parts)
            parts = (parts[0].float(), *parts[1:])  # float32 logits, as the unpacked call gives
            return parts if isinstance(out, tuple) else parts[0]

        return packed, kwargs, unpack

    def structured(self, tokens, *args, rows):
        """As ``FullSession.structured``, the state read from the active block on against the cache."""
        start, _, stop = self._span()
        self._fill(start)
        self.caller.count(tokens, None, self.cache, structured_tokens(tokens.shape[1], args[0].shape[1]))
        return self.caller.model.structured_verify(tokens, *args, cache=self.cache, rows=rows,
                                                   **self.caller.kwargs(rows, slice(0, stop)))
