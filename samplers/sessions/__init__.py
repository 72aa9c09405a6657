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

One module per session (``full``, ``block``, ``fast_dllm``), sharing ``base.SessionBase``; the model is called
through ``samplers/calling.py``. This module holds the protocol, the table of sessions and how one is chosen.
"""

from __future__ import annotations

from typing import Protocol

import torch

from dllm.protocols import capabilities, run_block_size
from dllm.stats import DecodeStats

from ..calling import Caller
from ..canvas import Canvas, View
from .block import BlockCacheSession
from .fast_dllm import DualCacheSession, PrefixCacheSession
from .full import FullSession

CACHE_MODES = ("auto", "none", "block", "prefix", "dual")


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


SESSIONS = {"none": FullSession, "block": BlockCacheSession, "prefix": PrefixCacheSession, "dual": DualCacheSession}


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
