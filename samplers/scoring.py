"""Scoring given tokens under the chain the exact samplers sample (``dllm.score``'s loops).

The log-likelihood of a continuation c [N] after a prompt is the sum of the left-to-right chain's conditionals:
token c_j given the prompt and c_<j, on the canvas ``sequential`` would decode (the prompt, then N positions;
masked where not yet revealed). Each layout computes them with the calls its exact samplers make:

- a diffusion model through the block loop (``samplers/loop.py``) with ``ScoringStepper``: per block one call over
  copies of the block, copy j with c_<j revealed, the target at position j read from copy j: fef's verification
  call with the continuation as its drafts, all of them kept. A bidirectional model decodes the answer as one
  block (one call, in parts of at most ``call_tokens`` positions); a block-causal one goes through the exact
  block cache, one call per block (copies packed per row where the model can), its prompt filled once;
- a two-stream model: one pass, the continuation as content in reveal order and a query per position;
- a causal model: the ordinary forward over prompt + c_<N.

The conditionals land in the same record as ``generate``'s (``samplers/likelihood.py``), so the law scored and
the law sampled are one: ``generate(..., logprobs=True)``'s numbers are ``score``'s on the same sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dllm.counting import CountingModel
from dllm.numerics import forbid_token, positions_from_mask
from dllm.protocols import capabilities, is_diffusion_model
from dllm.stats import DecodeStats

from .calling import Caller
from .canvas import View, write_at
from .fef.round import build_copies
from .likelihood import Emissions
from .loop import Stepping, run


@dataclass(frozen=True)
class Forced:
    """The tokens a scoring run reveals: ``tokens`` [B, N], answer column j at canvas position ``start + j``. Bound
    to a group of rows like the generator (``samplers/loop.py: _by_group``)."""

    tokens: torch.Tensor
    start: int

    def bind(self, rows: torch.Tensor) -> Forced:
        return Forced(self.tokens[rows], self.start)


@dataclass
class ScoringStepper:
    """One step per block: every masked position of the active block, left to right, revealed with the given
    token, each read from the copy that has the tokens before it revealed (see the module docstring)."""

    temperature: float
    generator: object
    stats: DecodeStats
    forced: Forced
    call_tokens: int | None = None  # the most token positions one forward holds (the copies call runs in parts)

    lookahead = False  # (samplers.loop.Stepper) calls need not score the next block

    def begin_block(self, block: int) -> None:
        pass

    def logits(self, view: View) -> None:
        return None  # the step's one call is its own: the copies

    def step(self, view: View, _) -> tuple[torch.Tensor, dict]:
        band = view.block_band()  # [R] rows, the active block's slots
        x = view.x
        candidates = band.candidates(view, x)  # [R, W] the masked slots, a suffix of the block (after the prompt's)
        slots = torch.sort((~candidates).int(), dim=1, stable=True).indices  # masked slots first, left to right
        count = candidates.sum(dim=1)
        positions = band.positions(slots)  # view positions
        valid = torch.arange(slots.shape[1], device=x.device)[None, :] < count[:, None]
        columns = (positions + view.offset - self.forced.start).clamp(0, self.forced.tokens.shape[1] - 1)
        tokens = self.forced.tokens[view.rows[:, None], columns]  # [R, W] the given token at each slot
        counts = view.masked if view.masked is not None else count.tolist()
        copies, copy_index, row_of = build_copies(x, positions, tokens, count - 1, False, sum(counts))
        logits = view.call(copies, row_of, at=band.at(row_of), most=max(counts))  # [N, W, V]
        targets = logits[copy_index[:, : slots.shape[1]].clamp(min=0), slots]  # [R, W, V]: copy j at slot j
        self.stats.count_round(count)
        revealed = torch.where(valid, positions + view.offset, -1)
        new_x = write_at(x, positions, tokens, valid)
        return new_x, {"sampler": "score", "revealed": revealed,
                       "emitted_logits": forbid_token(targets, view.mask_token_id)}


def _scoring_stepper(temperature, generator, stats, blocks, block_length, *, forced, call_tokens=None):
    return ScoringStepper(temperature, generator, stats, forced, call_tokens)


SCORING = Stepping(_scoring_stepper)


def score_chain(model, prompt: torch.Tensor, continuation: torch.Tensor, *, temperature: float, stats: DecodeStats,
                record: Emissions, attention_mask: torch.Tensor | None, eos_token_id: tuple[int, ...] | None,
                block_length: int, cache: str, call_tokens: int | None) -> torch.Tensor:
    """Fill ``record`` with the chain's conditional of every token of ``continuation`` [B, N] after ``prompt``
    [B, P] (attention_mask [B, P]: left padding) -> the scored sequences [B, P + N] (after a stop token, the fill:
    what the chain holds there)."""
    if not is_diffusion_model(model):
        return _causal(model, prompt, continuation, stats, record, attention_mask)
    if capabilities(model).reveal_order_cache:
        return _two_stream(model, prompt, continuation, stats, record, attention_mask)
    forced = Forced(continuation, prompt.shape[1])
    return run(SCORING, model, prompt, continuation.shape[1], temperature=temperature, generator=None, stats=stats,
               block_length=block_length, cache=cache, attention_mask=attention_mask, eos_token_id=eos_token_id,
               record=record, forced=forced, call_tokens=call_tokens)


def _causal(model, prompt, continuation, stats: DecodeStats, record: Emissions, attention_mask) -> torch.Tensor:
    """The ordinary forward over prompt + c_<N, logits read at the N positions before each token."""
    sequence = torch.cat([prompt, continuation], dim=1)
    p, n = prompt.shape[1], continuation.shape[1]
    mask = None
    if attention_mask is not None:
        mask = torch.ones_like(sequence)
        mask[:, :p] = attention_mask
    rows = torch.arange(sequence.shape[0], device=sequence.device)
    at = (p - 1 + torch.arange(n, device=sequence.device)).expand(len(rows), -1)  # [B, N]
    logits = Caller(model, stats, attention_mask=mask)(sequence[:, : p + n - 1], rows, served=len(rows), at=at)
    record.take(rows, (p + torch.arange(n, device=sequence.device)).expand(len(rows), -1), logits, sequence)
    return sequence


def _two_stream(model, prompt, continuation, stats: DecodeStats, record: Emissions, attention_mask) -> torch.Tensor:
    """One pass of the two streams: the prompt and c_<N as content in reveal order (left to right), and at each
    answer position a query that sees the prompt and the tokens before it (samplers/fef/two_stream.py's chain)."""
    sequence = torch.cat([prompt, continuation], dim=1)
    p, n = prompt.shape[1], continuation.shape[1]
    real = torch.ones_like(sequence, dtype=torch.bool)
    if attention_mask is not None:
        real[:, :p] = attention_mask.bool()
    positions = positions_from_mask(real)
    queries = torch.arange(n, device=sequence.device)
    sees = (p + queries).expand(sequence.shape[0], -1)  # query j sees the prompt and c_<j
    counted = CountingModel(model, stats.record)
    logits = counted.streams(sequence[:, : p + n - 1], positions[:, : p + n - 1], real[:, : p + n - 1],
                             positions[:, p:], sees)
    rows = torch.arange(sequence.shape[0], device=sequence.device)
    record.take(rows, (p + queries).expand(len(rows), -1), forbid_token(logits, model.mask_token_id), sequence)
    return sequence
