"""How a model is called: ``Caller`` (the counter every call reports to and the per-row keywords the model's
capabilities take) and the answer a call gives (logits only at the positions read, those rows in float32).

The sessions (``samplers/sessions/``) and the AR loops call the model through these. The run's attention blocks
(``dllm.protocols.run_block_size``) reach the model here and only here: ``Caller`` passes ``block_size=`` on every
call of a model whose blocks are a run's choice (``Capabilities.run_blocks``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dllm.counting import Call
from dllm.protocols import capabilities, gather_positions
from dllm.stats import DecodeStats


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
        out = self.model(input_ids, **self.kwargs(rows, slice(0, input_ids.shape[1])), **extra, **ask_at(at, 0, native))
        return settle(out, input_ids, at, 0, native)

    def cached(self, input_ids, cache, batch_rows, served: int, keys: slice, at: torch.Tensor | None = None,
               **extra) -> torch.Tensor:
        """``forward_cached`` on inputs [N, n] of canvas rows ``batch_rows`` [N]; ``keys`` are the canvas
        positions of cached + new keys; ``at`` [N, K] input positions: float32 logits there only; ``extra`` goes
        to forward_cached (rows=, append=)."""
        self.count(input_ids, served, cache)
        native = capabilities(self.model).logits_at
        out = self.model.forward_cached(input_ids, cache, **self.kwargs(batch_rows, keys), **extra,
                                        **ask_at(at, 0, native))
        return settle(out, input_ids, at, 0, native)


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


def ask_at(at: torch.Tensor | None, skip: int, native: bool) -> dict:
    """The model keyword for logits at ``at`` [N, K] (positions after ``skip`` leading inputs), when the model
    answers it itself (``Capabilities.logits_at``)."""
    return {"logits_at": at + skip} if at is not None and native else {}


def settle(out, tokens: torch.Tensor, at: torch.Tensor | None, skip: int, native: bool):
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


def part_of(values, part: slice):
    """Inputs ``part`` of per-input ``values``: a tensor [N, ...], a dict of them (other values shared by every
    input pass as they are: the run's block size), or None."""
    if isinstance(values, dict):
        return {key: value[part] if isinstance(value, torch.Tensor) else value for key, value in values.items()}
    return None if values is None else values[part]


def join_parts(outs: list):
    """One answer from the answers of a call's parts (logits, or (logits, features) pairs)."""
    if len(outs) == 1:
        return outs[0]
    if isinstance(outs[0], tuple):
        return tuple(torch.cat(pieces) for pieces in zip(*outs))
    return torch.cat(outs)


def hidden_keyword(hidden: bool) -> dict:
    """The model keyword asking for features too; absent unless asked, so bare logits functions work."""
    return {"return_hidden": True} if hidden else {}
