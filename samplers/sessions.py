"""How the masked-diffusion samplers call the model: sessions over a canvas (``samplers/canvas.py``).

Decoding is block-synchronous: block k of every row is finished before any row starts block k + 1
(rows that finish a block early wait and cost nothing). A *session* hands each step a *view* of the
active rows: their tokens, the active block's positions inside the view, and a ``call`` that runs the
model on tokens shaped like the view (copies included). Four sessions:

- ``full``: every call sees the whole sequence (prompt + answer). Always exact.
- ``block``: a KV cache holds the prompt and finished blocks; calls cover the active block only. Exact
  for models whose cache is exact there (causal across blocks: ``cache_exact``, in the run's blocks).
- ``prefix``: Fast-dLLM's prefix cache: at each block start one full call fills the cache, which keeps
  the prefix's keys; calls cover the active block and everything after it. An approximation for
  bidirectional models (cached keys never see later updates), so opt-in only.
- ``dual``: Fast-dLLM's dual cache: the block-start call caches the prefix and the masked suffix; calls cover
  the active block only. Approximate for the same reason, opt-in only.

The run's attention blocks (``dllm.protocols.run_block_size``) reach the model here and only here: ``Caller``
passes ``block_size=`` on every call of a model whose blocks are a run's choice (``Capabilities.run_blocks``).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Protocol

import torch

from dllm.counting import Call, structured_tokens
from dllm.numerics import positions_from_mask
from dllm.protocols import capabilities, gather_positions, has_cache, rolls_back, run_block_size
from dllm.stats import DecodeStats

from .canvas import Canvas, View

CACHE_MODES = ("auto", "none", "block", "prefix", "dual")


@dataclass
class Caller:
    """What every call of one model needs: the counter it reports to and the per-row keyword arguments its
    capabilities take. Sessions call ``model`` themselves and ``count`` each call (``dllm.counting.Call``,
    the one record every counter shares); ar and its drafters use ``__call__`` and ``cached``."""

    model: object
    stats: DecodeStats
    attention_mask: torch.Tensor | None = None  # [B, L_max] 0/1, left padding of ragged prompts
    block_offset: torch.Tensor | None = None  # [B] answer start in position-id coordinates
    block_size: int | None = None  # the run's attention blocks, for a model that takes them per call (run_blocks)
    draft: bool = False

    def kwargs(self, rows: torch.Tensor, keys: slice) -> dict:
        """Keyword arguments for inputs of ``rows`` [N] covering canvas key positions ``keys``."""
        out = {}
        if self.attention_mask is not None:
            out["attention_mask"] = self.attention_mask[rows, keys]
        if self.block_offset is not None:
            out["block_offset"] = self.block_offset[rows]
        if self.block_size is not None:
            out["block_size"] = self.block_size
        return out

    def count(self, input_ids: torch.Tensor, served: int | None, cache=None, tokens: int | None = None) -> None:
        """Record one call on ``input_ids`` [N, n] serving ``served`` sequences, reading ``cache``'s keys."""
        context = cache.length if cache is not None else 0
        self.stats.record(Call(input_ids.shape[0], tokens or input_ids.shape[1], context, self.draft, served))

    def __call__(self, input_ids: torch.Tensor, rows: torch.Tensor, served: int, at: torch.Tensor | None = None,
                 **extra) -> torch.Tensor:
        """Plain call on full-length inputs [N, L] of canvas rows ``rows`` [N], serving ``served`` rows; ``at``
        [N, K]: float32 logits there only (as ``View.call``)."""
        self.count(input_ids, served)
        native = capabilities(self.model).logits_at
        out = self.model(input_ids, **self.kwargs(rows, slice(0, input_ids.shape[1])), **extra, **_ask(at, 0, native))
        return _settle(out, input_ids, at, 0, native)

    def cached(self, input_ids, cache, batch_rows, served: int, keys: slice, at: torch.Tensor | None = None,
               **extra) -> torch.Tensor:
        """``forward_cached`` on inputs [N, n] of canvas rows ``batch_rows`` [N]; ``keys`` are the canvas
        positions of cached + new keys; ``at`` [N, K] input positions: float32 logits there only; ``extra`` goes
        to forward_cached (rows=, append=)."""
        self.count(input_ids, served, cache)
        native = capabilities(self.model).logits_at
        out = self.model.forward_cached(input_ids, cache, **self.kwargs(batch_rows, keys), **extra,
                                        **_ask(at, 0, native))
        return _settle(out, input_ids, at, 0, native)


def check_logits(out, input_ids: torch.Tensor, at: torch.Tensor | None = None):
    """The model's answer unchanged, once its logits (the first item of a (logits, features) pair) are [N, n, V]
    (with ``at`` [N, K], asked through ``logits_at``: [N, K, V])."""
    logits = out[0] if isinstance(out, tuple) else out
    expected = input_ids.shape if at is None else at.shape
    if logits.dim() != 3 or logits.shape[:2] != expected:
        raise ValueError(f"model returned logits of shape {tuple(logits.shape)} for input_ids "
                         f"{tuple(input_ids.shape)}" + ("; expected [B, L, V]" if at is None else
                                                         f" and logits_at {tuple(at.shape)}; expected [B, K, V]"))
    return out


def _ask(at: torch.Tensor | None, skip: int, native: bool) -> dict:
    """The model keyword for logits at ``at`` [N, K] (positions after ``skip`` leading inputs), when the model
    answers it itself (``Capabilities.logits_at``)."""
    return {"logits_at": at + skip} if at is not None and native else {}


def _settle(out, tokens: torch.Tensor, at: torch.Tensor | None, skip: int, native: bool):
    """A session's answer from the model's: logits [N, n - skip, V] after ``skip`` leading inputs, or float32
    logits [N, K, V] at ``at`` [N, K] (gathered here for a model without ``logits_at``); features alike."""
    check_logits(out, tokens, at if native else None)
    if at is None and not skip:
        return out
    parts = out if isinstance(out, tuple) else (out,)
    if at is None:
        parts = tuple(part[:, skip:] for part in parts)
    else:
        if not native:
            parts = tuple(gather_positions(part, at + skip) for part in parts)
        parts = (parts[0].float(), *parts[1:])  # only the rows read turn to float32
    return parts if isinstance(out, tuple) else parts[0]


class Session(Protocol):
    """How a step's model calls reach the model: which tokens the model sees, and through which cache.
    A session counts each call (``Caller.count``) and calls the model itself.

    ``exact``: the logits equal those of the plain full-sequence call (up to floating point), so every
    exact sampler stays exact through this session.
    """

    exact: bool

    def begin_block(self, block: int) -> None: ...

    def view(self, rows: torch.Tensor, masked: list[int] | None = None) -> View: ...

    def logits(self, tokens: torch.Tensor, which: torch.Tensor, hidden: bool = False, *, rows: torch.Tensor,
               at: torch.Tensor | None = None, most: int | None = None):
        """Logits [N, Ls, V] of view-shaped ``tokens`` [N, Ls]; input i belongs to canvas row
        ``rows[which[i]]`` (``rows`` [R] the view's rows, each served by the call); ``hidden``: (logits,
        features [N, Ls, D]); ``at`` [N, K] view positions: float32 logits [N, K, V] (features [N, K, D]) there;
        ``most``: the most inputs of one view row, where the caller knows it (a hint; sessions may ignore it)."""
        ...

    def structured(self, tokens: torch.Tensor, *args, rows: torch.Tensor) -> tuple: ...


class _Session:
    """What every session shares: the canvas, the caller, and how its views are made."""

    exact = True

    def __init__(self, canvas: Canvas, caller: Caller, call_tokens: int | None = None):
        self.canvas, self.caller = canvas, caller
        self.native_at = capabilities(caller.model).logits_at  # the model answers logits_at itself
        self.call_tokens = call_tokens  # the most token positions one forward holds (None: no limit)

    def _split(self, tokens: torch.Tensor) -> list[slice]:
        """Ranges of whole inputs holding at most ``call_tokens`` positions each (at least one input each): a
        call of W copies over a long sequence is run in parts so that the forward's activations stay bounded
        (the answer is the same; it counts as one call, ``forward_tokens`` unchanged)."""
        n, length = tokens.shape
        if self.call_tokens is None or n * length <= self.call_tokens:
            return [slice(0, n)]
        per = max(1, self.call_tokens // max(length, 1))
        return [slice(i, min(n, i + per)) for i in range(0, n, per)]

    def begin_block(self, block: int) -> None:
        self.block = block

    def _view(self, rows: torch.Tensor, start: int, stop: int, active: int, masked: list[int] | None = None) -> View:
        """The view of canvas positions [start, stop) of ``rows``; the first ``active`` of them are the block."""
        first = self.canvas.span(self.block)[0] - start  # the block's first view position
        region = torch.arange(stop - start, device=rows.device) < active
        region[:first] = False
        prompt_length = max(0, self.canvas.prompt_length - start)  # (a block opened by the prompt's tail holds some)
        return View(self.canvas.x[rows, start:stop], region, rows, start, prompt_length, self.canvas.mask_token_id,
                    self, (first, active), masked)

    def structured(self, tokens, *args, rows):
        raise ValueError("the structured verifier needs an exact view: cache='none' or 'block', not an "
                         "approximate prefix or dual cache")


class FullSession(_Session):
    """Every call sees the whole sequence."""

    def view(self, rows: torch.Tensor, masked: list[int] | None = None) -> View:
        start, end = self.canvas.span(self.block)
        return self._view(rows, 0, self.canvas.x.shape[1], end, masked)

    def logits(self, tokens: torch.Tensor, which: torch.Tensor, hidden: bool = False, *, rows: torch.Tensor,
               at: torch.Tensor | None = None, most: int | None = None):
        self.caller.count(tokens, len(rows))  # copies of a view row serve it once; every view row is served
        kwargs = self.caller.kwargs(rows[which], slice(0, tokens.shape[1]))
        outs = []
        for part in self._split(tokens):  # a loop, not a comprehension: no frame between the session and the model
            out = self.caller.model(tokens[part], **_part(kwargs, part), **_hidden(hidden),
                                    **_ask(_part(at, part), 0, self.native_at))
            outs.append(_settle(out, tokens[part], _part(at, part), 0, self.native_at))
        return _join(outs)

    def structured(self, tokens, *args, rows):
        """The model's ``structured_verify`` on R rows; counted as one call over state + 2W + 1 tokens."""
        self.caller.count(tokens, None, tokens=structured_tokens(tokens.shape[1], args[0].shape[1]))
        return self.caller.model.structured_verify(tokens, *args, **self.caller.kwargs(rows, slice(0, tokens.shape[1])))


class BlockCacheSession(_Session):
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
            chunk = self.canvas.x[:, self.cached_until : start]
            self.caller.count(chunk, len(chunk), self.cache)
            kwargs = self.caller.kwargs(torch.arange(len(chunk), device=chunk.device), slice(0, start))
            none = chunk[:, :0]  # no logit is read: the fill only stores keys and values
            out = self.caller.model.forward_cached(chunk, self.cache, append=True, **kwargs,
                                                   **_ask(none, 0, self.native_at))
            _settle(out, chunk, none, 0, self.native_at)
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
                                                   **_hidden(hidden))
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
                                                   **({"commit": pending} if pending else {}), **_hidden(hidden),
                                                   **_part(kwargs, part),
                                                   **_ask(_part(at, part), pending, self.native_at))
            outs.append(_settle(out, tokens[part], _part(at, part), pending, self.native_at))
        self.cached_until = start
        return _join(outs)

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


class PrefixCacheSession(_Session):
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
        _settle(self.caller.model.forward_cached(x, cache, append=True, **kwargs, **_ask(none, 0, self.native_at)),
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
            out = self.caller.model.forward_cached(tokens[part], self.cache, append=False, **_part(kwargs, part),
                                                   **_hidden(hidden), **_ask(_part(at, part), 0, self.native_at))
            outs.append(_settle(out, tokens[part], _part(at, part), 0, self.native_at))
        return _join(outs)

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


def _part(values, part: slice):
    """Inputs ``part`` of per-input ``values``: a tensor [N, ...], a dict of them (other values shared by every
    input pass as they are: the run's block size), or None."""
    if isinstance(values, dict):
        return {key: value[part] if isinstance(value, torch.Tensor) else value for key, value in values.items()}
    return None if values is None else values[part]


def _join(outs: list):
    """One answer from the answers of a call's parts (logits, or (logits, features) pairs)."""
    if len(outs) == 1:
        return outs[0]
    if isinstance(outs[0], tuple):
        return tuple(torch.cat(pieces) for pieces in zip(*outs))
    return torch.cat(outs)


def _hidden(hidden: bool) -> dict:
    """The model keyword asking for features too; absent unless asked, so bare logits functions work."""
    return {"return_hidden": True} if hidden else {}


SESSIONS = {"none": FullSession, "block": BlockCacheSession, "prefix": PrefixCacheSession, "dual": DualCacheSession}


class Stepper(Protocol):
    """One sampler's rounds over the active block (``samplers/loop.py: run`` loops over them).

    ``logits(view)``: what the step starts from, usually the model at the view's state (one call); ``step(view,
    logits)``: the round itself -> (the view's tokens after it, the step event's fields). ``lookahead``: the
    step wants each call to score the next block too (``BlockCacheSession``). Optional: ``edits`` (True: a step may
    rewrite revealed tokens of the active block, LLaDA2.1's, so a row stops at a stop token only once its block is
    done: ``Canvas.stop_at_eos``'s ``until``).
    """

    lookahead: bool

    def begin_block(self, block: int) -> None: ...

    def logits(self, view: View): ...

    def step(self, view: View, logits) -> tuple[torch.Tensor, dict]: ...


def open_session(cache: str, canvas: Canvas, model, stats: DecodeStats, attention_mask: torch.Tensor | None,
                 lookahead: bool = False, call_tokens: int | None = None) -> Session:
    """The session the resolved ``cache`` option picks for ``canvas``, with the prompt's padding ``attention_mask``
    [B, P] extended over the answer and, for a block-causal model, each row's answer start as block offset;
    ``call_tokens`` bounds the token positions of one forward (``_Session._split``)."""
    prompt, length = canvas.x[:, : canvas.prompt_length], canvas.x.shape[1]
    mask = None
    if attention_mask is not None:
        mask = torch.ones((prompt.shape[0], length), dtype=torch.long, device=prompt.device)
        mask[:, : prompt.shape[1]] = attention_mask
    # Block-causal models line their blocks up with the answer (its first position, in position ids), or with
    # position 0 when they were trained so (``block_anchor``: the canvas then opens with the prompt's tail); a
    # model whose blocks are a run's choice gets the run's block size with every call.
    offset = size = None
    caps = capabilities(model)
    if caps.block_size is not None:
        real = prompt.new_full((prompt.shape[0],), prompt.shape[1])
        offset = (attention_mask.sum(dim=1) if attention_mask is not None else real).long()
        if caps.block_anchor == "absolute":
            offset = torch.zeros_like(offset)
        size = run_block_size(model, canvas.block_length) if caps.run_blocks else None
    mode = choose_session(cache, model, canvas.block_length)
    extra = {"lookahead": True} if mode == "block" and lookahead else {}
    return SESSIONS[mode](canvas, Caller(model, stats, mask, offset, size), call_tokens=call_tokens, **extra)


def choose_session(cache: str, model, block_length: int) -> str:
    """Resolve the ``cache`` option: ``auto`` takes the exact block cache when the model offers one."""
    if cache != "auto":
        return cache
    caps = capabilities(model)
    exact = caps.cache and caps.cache_exact and caps.block_size is not None
    return "block" if exact and run_block_size(model, block_length) == block_length else "none"


def session_exact(model=None, *, cache: str = "auto", block_length: int | None = None,
                  verifier: str = "copies") -> bool:
    """Whether the session these options pick declares itself exact (``Session.exact``) and the verifier keeps
    it so: the one source of ``generate``'s ``exact`` label (through ``SamplerConfig.exact``). Without a model,
    ``auto`` stands for either session it may pick. The one-pass structured verifier is not exact (its
    conditionals equal the sequential chain's only for a model trained for it), whatever the session."""
    modes = ("block", "none") if cache == "auto" and model is None else (choose_session(cache, model, block_length),)
    return all(SESSIONS[mode].exact for mode in modes) and verifier != "structured"


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
