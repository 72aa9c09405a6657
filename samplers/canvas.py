"""What the masked-diffusion samplers share: the token canvas, its blocks, and how the model is called.

Decoding is block-synchronous: block k of every row is finished before any row starts block k + 1
(rows that finish a block early wait and cost nothing). A *session* hands each step a *view* of the
active rows: their tokens, the active block's positions inside the view, and a ``call`` that runs the
model on tokens shaped like the view (copies included). Three sessions:

- ``full``: every call sees the whole sequence (prompt + answer). Always exact.
- ``block``: a KV cache holds the prompt and finished blocks; calls cover the active block only. Exact
  for models whose cache is exact there (causal across blocks: ``cache_exact`` and ``block_size``).
- ``prefix``: Fast-dLLM's prefix cache: at each block start one full call fills the cache, which keeps
  the prefix's keys; calls cover the active block and everything after it. An approximation for
  bidirectional models (cached keys never see later updates), so opt-in only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from dllm import stops
from dllm.counting import CountingModel
from dllm.numerics import positions_from_mask
from dllm.protocols import capabilities
from dllm.stats import DecodeStats, StepEvent

CACHE_MODES = ("auto", "none", "block", "prefix", "dual")


@dataclass
class Canvas:
    """Prompt plus a masked answer region [B, P + N], decoded in blocks of ``block_length``."""

    x: torch.Tensor  # [B, L]
    prompt_length: int
    block_length: int
    mask_token_id: int
    eos_token_id: tuple[int, ...] | None = None  # stop ids (dllm.stops); the first one fills stopped rows
    finished: torch.Tensor | None = None  # [B] rows that stopped at EOS

    @classmethod
    def start(cls, prompt: torch.Tensor, gen_length: int, block_length: int, mask_token_id: int,
              eos_token_id: tuple[int, ...] | None = None) -> Canvas:
        answer = torch.full((prompt.shape[0], gen_length), mask_token_id, dtype=torch.long, device=prompt.device)
        finished = torch.zeros(prompt.shape[0], dtype=torch.bool, device=prompt.device)
        return cls(torch.cat([prompt.long(), answer], dim=1), prompt.shape[1], block_length, mask_token_id,
                   eos_token_id, finished)

    @property
    def num_blocks(self) -> int:
        return (self.x.shape[1] - self.prompt_length) // self.block_length

    def span(self, block: int) -> tuple[int, int]:
        """Canvas positions [start, end) of a block."""
        start = self.prompt_length + block * self.block_length
        return start, start + self.block_length

    def rows_in_block(self, block: int) -> torch.Tensor:
        """Unfinished rows with masked positions left in ``block`` -> [R]."""
        start, end = self.span(block)
        pending = (self.x[:, start:end] == self.mask_token_id).any(dim=1) & ~self.finished
        return pending.nonzero().squeeze(-1)

    def stop_at_eos(self, rows: torch.Tensor) -> None:
        """Finish rows whose first revealed stop token has no mask before it, filling what follows it
        (the rule of ``dllm.stops``: the stop token is kept).

        Tokens after the first stop are not part of the answer, so stopping there keeps every sampler's
        answer distribution unchanged while the row stops costing calls.
        """
        if self.eos_token_id is None or not rows.numel():
            return
        answer = self.x[rows, self.prompt_length :]
        first = stops.first_stop(answer, self.eos_token_id)  # [R]
        before = torch.arange(answer.shape[1], device=answer.device)[None, :] < first[:, None]
        done = (first < answer.shape[1]) & ~((answer == self.mask_token_id) & before).any(dim=1)
        filled = stops.fill_after_stop(answer, self.eos_token_id)
        self.x[rows, self.prompt_length :] = torch.where(done[:, None], filled, answer)  # (no host sync)
        self.finished[rows] |= done


def block_candidates(x: torch.Tensor, block_ids: torch.Tensor, mask_token_id: int) -> torch.Tensor:
    """Masked positions inside each row's active block (that of its leftmost masked position) -> [R, L]."""
    masked = x == mask_token_id
    big = torch.iinfo(torch.long).max
    active = torch.where(masked, block_ids, torch.full_like(x, big)).min(dim=1).values  # [R]
    return masked & (block_ids[None, :] == active[:, None])


@dataclass
class Caller:
    """Counts and runs model calls, adding the per-row keyword arguments the model's capabilities need."""

    model: object
    stats: DecodeStats
    attention_mask: torch.Tensor | None = None  # [B, L_max] 0/1, left padding of ragged prompts
    block_offset: torch.Tensor | None = None  # [B] answer start in position-id coordinates
    draft: bool = False

    def __post_init__(self):
        self.counted = CountingModel(self.model, self.stats.record, self.draft)

    def kwargs(self, rows: torch.Tensor, keys: slice) -> dict:
        """Keyword arguments for inputs of ``rows`` [N] covering canvas key positions ``keys``."""
        out = {}
        if self.attention_mask is not None:
            out["attention_mask"] = self.attention_mask[rows, keys]
        if self.block_offset is not None:
            out["block_offset"] = self.block_offset[rows]
        return out

    def __call__(self, input_ids: torch.Tensor, rows: torch.Tensor, served: int, **extra) -> torch.Tensor:
        """Plain call on full-length inputs [N, L] of canvas rows ``rows`` [N], serving ``served`` rows
        (``return_hidden=True`` in ``extra``: a (logits, features) pair)."""
        out = self.counted(input_ids, served=served, **self.kwargs(rows, slice(0, input_ids.shape[1])), **extra)
        return check_logits(out, input_ids)

    def structured(self, input_ids, batch_rows, keys: slice, *args, **extra):
        """The model's ``structured_verify`` on R rows; counted as one call over state + 2W + 1 tokens."""
        return self.counted.structured_verify(input_ids, *args, **self.kwargs(batch_rows, keys), **extra)

    def cached(self, input_ids, cache, batch_rows, served: int, keys: slice, **extra) -> torch.Tensor:
        """``forward_cached`` on inputs [N, n] of canvas rows ``batch_rows`` [N]; ``keys`` are the canvas
        positions of cached + new keys; ``extra`` goes to forward_cached (rows=, append=)."""
        out = self.counted.forward_cached(input_ids, cache, served=served, **self.kwargs(batch_rows, keys), **extra)
        return check_logits(out, input_ids)


def check_logits(out, input_ids: torch.Tensor):
    """The model's answer unchanged, once its logits (the first item of a (logits, features) pair) are [N, n, V]."""
    logits = out[0] if isinstance(out, tuple) else out
    if logits.dim() != 3 or logits.shape[:2] != input_ids.shape:
        raise ValueError(f"model returned logits of shape {tuple(logits.shape)} for input_ids "
                         f"{tuple(input_ids.shape)}; expected [B, L, V]")
    return out


@dataclass
class View:
    """What one step sees of R active rows: tokens, the active block inside them, and a model call."""

    x: torch.Tensor  # [R, Ls] tokens from canvas position ``offset`` on
    region: torch.Tensor  # [Ls] bool, the active block
    rows: torch.Tensor  # [R] canvas rows
    offset: int
    prompt_length: int  # prompt positions inside the view (0 when the view starts after the prompt)
    mask_token_id: int
    session: Session  # the one call path: every model call of a step goes through it

    def candidates(self, tokens: torch.Tensor) -> torch.Tensor:
        """Masked positions of the active block in ``tokens`` [N, Ls] -> bool [N, Ls]."""
        return (tokens == self.mask_token_id) & self.region[None, :]

    def call(self, tokens: torch.Tensor, which: torch.Tensor, hidden: bool = False):
        """Logits [N, Ls, V] of ``tokens`` [N, Ls] shaped like the view; ``which`` [N] in 0..R-1 names the
        view row each input belongs to (copies repeat it). ``hidden`` (a model with
        ``Capabilities.hidden_states``): (logits, features [N, Ls, D])."""
        return self.session.logits(tokens, self.rows[which], hidden)

    def structured(self, tokens: torch.Tensor, *args):
        """The model's one-pass window verification of every view row (``structured_verify``'s arguments)."""
        return self.session.structured(tokens, self.rows, *args)


class Session(Protocol):
    """How a step's model calls reach the model: which tokens the model sees, and through which cache.

    ``exact``: the logits equal those of the plain full-sequence call (up to floating point), so every
    exact sampler stays exact through this session.
    """

    exact: bool

    def begin_block(self, block: int) -> None: ...

    def view(self, rows: torch.Tensor) -> View: ...

    def logits(self, tokens: torch.Tensor, rows: torch.Tensor, hidden: bool = False) -> torch.Tensor:
        """Logits [N, Ls, V] of view-shaped ``tokens`` [N, Ls] of canvas rows ``rows`` [N] (repeats allowed);
        ``hidden``: (logits, features [N, Ls, D])."""
        ...


class FullSession:
    """Every call sees the whole sequence."""

    exact = True

    def __init__(self, canvas: Canvas, caller: Caller):
        self.canvas, self.caller = canvas, caller

    def begin_block(self, block: int) -> None:
        self.block = block

    def view(self, rows: torch.Tensor) -> View:
        start, end = self.canvas.span(self.block)
        length = self.canvas.x.shape[1]
        region = (torch.arange(length, device=rows.device) >= start) & (torch.arange(length, device=rows.device) < end)
        return View(self.canvas.x[rows], region, rows, 0, self.canvas.prompt_length, self.canvas.mask_token_id, self)

    def logits(self, tokens: torch.Tensor, rows: torch.Tensor, hidden: bool = False) -> torch.Tensor:
        return self.caller(tokens, rows, served=_served(rows), **_hidden(hidden))

    def structured(self, tokens, rows, *args):
        return self.caller.structured(tokens, rows, slice(0, self.canvas.x.shape[1]), *args)


class BlockCacheSession:
    """Prompt and finished blocks live in a KV cache; calls cover the active block only (exact for a
    model whose attention is causal across blocks).

    With ``lookahead`` the view also holds the next block: the active block never attends to it, so its
    logits are unchanged, and the call yields logits for the next block too (fef's stale drafts use
    them, so a new block needs no separate draft call).
    """

    exact = True

    def __init__(self, canvas: Canvas, caller: Caller, lookahead: bool = False):
        self.canvas, self.caller, self.lookahead = canvas, caller, lookahead
        self.cache = caller.model.new_cache()
        self.cached_until = 0  # canvas positions [0, cached_until) are in the cache
        # A model that can commit a shared prefix during a copies call lets the finished block ride along
        # with the next block's first call instead of costing a call of its own.
        self.folds = capabilities(caller.model).commits_prefix

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
            rows = torch.arange(self.canvas.x.shape[0], device=self.canvas.x.device)
            chunk = self.canvas.x[:, self.cached_until : start]
            self.caller.cached(chunk, self.cache, rows, served=len(rows), keys=slice(0, start), append=True)
            self.cached_until = start

    def _span(self) -> tuple[int, int, int]:
        """(start, end, stop): the active block [start, end) and the view's end (after any lookahead)."""
        start, end = self.canvas.span(self.block)
        return start, end, min(end + self.canvas.block_length, self.canvas.x.shape[1]) if self.lookahead else end

    def view(self, rows: torch.Tensor) -> View:
        start, end, stop = self._span()
        region = torch.arange(stop - start, device=rows.device) < end - start
        return View(self.canvas.x[rows, start:stop], region, rows, start, 0, self.canvas.mask_token_id, self)

    def logits(self, tokens: torch.Tensor, rows: torch.Tensor, hidden: bool = False) -> torch.Tensor:
        start, _, stop = self._span()
        pending = start - self.cached_until  # a finished block not yet in the cache: commit it now
        if pending:
            tokens = torch.cat([self.canvas.x[rows, self.cached_until : start], tokens], dim=1)
        out = self.caller.cached(tokens, self.cache, rows, served=_served(rows), keys=slice(0, stop), rows=rows,
                                 append=False, **({"commit": pending} if pending else {}), **_hidden(hidden))
        self.cached_until = start
        if hidden:
            return out[0][:, pending:], out[1][:, pending:]
        return out[:, pending:]

    def structured(self, tokens, rows, *args):
        start, _, stop = self._span()
        self._fill(start)
        return self.caller.structured(tokens, rows, slice(0, stop), *args, cache=self.cache, rows=rows)


class PrefixCacheSession:
    """Fast-dLLM prefix cache (approximate): one full call per block fills the cache; steps then run the
    active block and the rest of the sequence against the prefix's cached keys."""

    exact = False

    def __init__(self, canvas: Canvas, caller: Caller):
        self.canvas, self.caller = canvas, caller

    def begin_block(self, block: int) -> None:
        self.block = block
        self.cache = self._full_cache()
        self.cache.crop(self.canvas.span(block)[0])

    def _full_cache(self):
        """A fresh cache filled by one full call over every row's whole sequence."""
        rows = torch.arange(self.canvas.x.shape[0], device=self.canvas.x.device)
        cache = self.caller.model.new_cache()
        length = self.canvas.x.shape[1]
        self.caller.cached(self.canvas.x, cache, rows, served=len(rows), keys=slice(0, length), append=True)
        return cache

    def view(self, rows: torch.Tensor) -> View:
        start, end = self.canvas.span(self.block)
        length = self.canvas.x.shape[1]
        region = torch.arange(length - start, device=rows.device) < end - start
        return View(self.canvas.x[rows, start:], region, rows, start, 0, self.canvas.mask_token_id, self)

    def logits(self, tokens: torch.Tensor, rows: torch.Tensor, hidden: bool = False) -> torch.Tensor:
        return self.caller.cached(tokens, self.cache, rows, served=_served(rows), keys=slice(0, self.canvas.x.shape[1]),
                                  rows=rows, append=False, **_hidden(hidden))

    def structured(self, tokens, rows, *args):
        raise ValueError("the structured verifier needs an exact view: cache='none' or 'block', not an "
                         "approximate prefix or dual cache")


class DualCacheSession(PrefixCacheSession):
    """Fast-dLLM dual cache (approximate): the block-start call caches the prefix AND the masked suffix;
    steps run the active block only. Needs a cache with ``drop(start, end)`` and ``position_ids`` support."""

    def begin_block(self, block: int) -> None:
        self.block = block
        self.cache = self._full_cache().drop(*self.canvas.span(block))

    def view(self, rows: torch.Tensor) -> View:
        start, end = self.canvas.span(self.block)
        region = torch.ones(end - start, dtype=torch.bool, device=rows.device)
        return View(self.canvas.x[rows, start:end], region, rows, start, 0, self.canvas.mask_token_id, self)

    def logits(self, tokens: torch.Tensor, rows: torch.Tensor, hidden: bool = False) -> torch.Tensor:
        start, end = self.canvas.span(self.block)
        # The new tokens' mask columns are the last ones of keys=[0, L): answer positions, all ones.
        return self.caller.cached(tokens, self.cache, rows, served=_served(rows), keys=slice(0, self.canvas.x.shape[1]),
                                  rows=rows, append=False, position_ids=self.positions[rows, start:end],
                                  **_hidden(hidden))

    @property
    def positions(self) -> torch.Tensor:
        """Position ids of every canvas position (0 at each row's first real token) -> [B, L]."""
        mask = self.caller.attention_mask
        if mask is None:
            return torch.arange(self.canvas.x.shape[1], device=self.canvas.x.device).expand_as(self.canvas.x)
        return positions_from_mask(mask)


def _hidden(hidden: bool) -> dict:
    """The model keyword asking for features too; absent unless asked, so bare logits functions work."""
    return {"return_hidden": True} if hidden else {}


def _served(rows: torch.Tensor) -> int:
    """Sequences a call serves: its distinct canvas rows (verification copies of a row count once)."""
    return int(rows.unique().numel())


SESSIONS = {"none": FullSession, "block": BlockCacheSession, "prefix": PrefixCacheSession, "dual": DualCacheSession}


def decode(canvas: Canvas, session, stepper, callback=None) -> torch.Tensor:
    """Run ``stepper`` over every block until each row's block is revealed (or the row hit EOS)."""
    for block in range(canvas.num_blocks):
        session.begin_block(block)
        stepper.begin_block(block)
        while (rows := canvas.rows_in_block(block)).numel():
            view = session.view(rows)
            new_x, info = stepper.step(view)
            canvas.x[rows, view.offset : view.offset + new_x.shape[1]] = new_x
            canvas.stop_at_eos(rows)
            if callback is not None:
                callback(StepEvent(**info, rows=rows, x=canvas.x[rows], offset=view.offset))
    return canvas.x


def choose_session(cache: str, model, block_length: int) -> str:
    """Resolve the ``cache`` option: ``auto`` takes the exact block cache when the model offers one."""
    if cache != "auto":
        return cache
    caps = capabilities(model)
    return "block" if caps.cache and caps.cache_exact and caps.block_size == block_length else "none"


def session_exact(model, *, cache: str = "auto", block_length: int | None = None, verifier: str = "copies") -> bool:
    """Whether the session that these resolved options pick is exact (``Session.exact``): what ``generate``
    reports as ``exact`` for an exact sampler. The one-pass structured verifier is not exact (its
    conditionals equal the sequential chain's only for a model trained for it), whatever the session."""
    return SESSIONS.get(choose_session(cache, model, block_length), FullSession).exact and verifier != "structured"
