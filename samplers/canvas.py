"""The token canvas of the masked-diffusion samplers, its blocks, and what one step sees of it.

Decoding is block-synchronous: block k of every row is finished before any row starts block k + 1 (rows
that finish a block early wait and cost nothing). ``Canvas`` holds the tokens; each step gets a ``View`` of
the active rows (their tokens, the active block's positions inside the view, and the session's calls bound
to those rows) and reads logits on a ``Band`` of positions per row. How the model is called lives in
``samplers/sessions/`` (through ``samplers/calling.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from dllm import stops

if TYPE_CHECKING:
    from .sessions import Session


@dataclass
class Canvas:
    """Prompt plus a masked answer region [B, P + N], decoded in blocks of ``block_length``.

    Blocks start at the answer, or (``lead`` > 0, a model whose blocks are anchored at position 0:
    ``Capabilities.block_anchor == "absolute"``) ``lead`` positions before it, so that the prompt's last
    ``lead`` tokens share the first block (every row's prompt then holds ``lead`` tokens modulo the block); the
    answer region may then run past the N tokens asked for, to the end of a model block (``Canvas.start``'s
    ``tail``), as the model's own generation does.
    """

    x: torch.Tensor  # [B, L]
    prompt_length: int
    block_length: int
    mask_token_id: int
    eos_token_id: tuple[int, ...] | None = None  # stop ids (dllm.stops); the first one fills stopped rows
    finished: torch.Tensor | None = None  # [B] rows that stopped at EOS
    lead: int = 0  # prompt positions inside the first block (absolute block anchors)
    _ahead: tuple | None = field(default=None, repr=False)  # the next block's pending rows, read along (left_in_block)

    @classmethod
    def start(cls, prompt: torch.Tensor, gen_length: int, block_length: int, mask_token_id: int,
              eos_token_id: tuple[int, ...] | None = None, lead: int = 0, tail: int = 0) -> Canvas:
        """The canvas of ``prompt`` [B, P] and ``gen_length`` masked positions, plus ``tail`` more (masked context
        up to a model block's end; decoded, not returned) and ``lead`` prompt positions in the first block."""
        answer = torch.full((prompt.shape[0], gen_length + tail), mask_token_id, dtype=torch.long,
                            device=prompt.device)
        finished = torch.zeros(prompt.shape[0], dtype=torch.bool, device=prompt.device)
        return cls(torch.cat([prompt.long(), answer], dim=1), prompt.shape[1], block_length, mask_token_id,
                   eos_token_id, finished, lead)

    @property
    def num_blocks(self) -> int:
        return (self.x.shape[1] - self.prompt_length + self.lead) // self.block_length

    def span(self, block: int) -> tuple[int, int]:
        """Canvas positions [start, end) of a block."""
        start = self.prompt_length - self.lead + block * self.block_length
        return start, start + self.block_length

    def rows_in_block(self, block: int) -> torch.Tensor:
        """Unfinished rows with masked positions left in ``block`` -> [R]."""
        return self.left_in_block(block)[0]

    def left_in_block(self, block: int) -> tuple[torch.Tensor, list[int]]:
        """Unfinished rows with masked positions left in ``block`` [R], and how many each has left (host ints).

        The step's one read of the device (a host sync on a GPU): the loop must know whether to go on, and the
        counts it reads along give every later shape of the step (a window's copies) without another read. The
        next block is read along: when this one is done, nothing changes before the loop asks for the next, so
        a block's end costs no read of its own."""
        if self._ahead is not None and self._ahead[0] == block:
            found, self._ahead = self._ahead[1], None
            return found
        blocks = [b for b in (block, block + 1) if b < self.num_blocks]
        masked = torch.stack([(self.x[:, slice(*self.span(b))] == self.mask_token_id).sum(dim=1) for b in blocks])
        left = masked * ~self.finished
        counts = left.tolist()
        found = [self._pending(left[i], counts[i]) for i in range(len(blocks))]
        self._ahead = (block + 1, found[1]) if len(found) > 1 and not found[0][1] else None
        return found[0]

    @staticmethod
    def _pending(left: torch.Tensor, counts: list[int]) -> tuple[torch.Tensor, list[int]]:
        """The rows with masked positions left [R] (by ``left`` [B], no read) and their counts (host ints)."""
        pending = [count for count in counts if count]
        return torch.argsort((left == 0).int(), stable=True)[: len(pending)], pending

    def stop_at_eos(self, rows: torch.Tensor, until: int | None = None) -> None:
        """Finish rows whose first revealed stop token has no mask before it, filling what follows it
        (the rule of ``dllm.stops``: the stop token is kept). ``until``: a canvas position before which the sampler
        may still change revealed tokens (LLaDA2.1's edits, inside the active block): a row then finishes only
        once no mask is left before it either, when its answer up to the stop is settled.

        Tokens after the first stop are not part of the answer, so stopping there keeps every sampler's
        answer distribution unchanged while the row stops costing calls.
        """
        if self.eos_token_id is None or not rows.numel():
            return
        answer = self.x[rows, self.prompt_length :]
        first = stops.first_stop(answer, self.eos_token_id)  # [R]
        settled = first if until is None else first.clamp(min=until - self.prompt_length)
        before = torch.arange(answer.shape[1], device=answer.device)[None, :] < settled[:, None]
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
class View:
    """What one step sees of R active rows: tokens, the active block inside them, and the model calls.

    ``call(tokens [N, Ls], which [N], hidden=False, at=None)``: logits [N, Ls, V] of tokens shaped like the view,
    ``which`` in 0..R-1 naming the view row each input belongs to (copies repeat it); ``hidden`` (a model
    with ``Capabilities.hidden_states``): (logits, features [N, Ls, D]); ``at`` [N, K] view positions: float32
    logits [N, K, V] there only (a ``Band``'s; what rounds ask, so that no [N, Ls, V] tensor is made at a real
    vocabulary). ``structured(tokens, positions,
    drafts, count, bonus)``: the model's one-pass window verification of every view row. Both are the
    session's own methods with these rows bound (``functools.partial``: no frame between a step and the
    session, which calls the model).
    """

    x: torch.Tensor  # [R, Ls] tokens from canvas position ``offset`` on
    region: torch.Tensor  # [Ls] bool, the active block
    rows: torch.Tensor  # [R] canvas rows
    offset: int
    prompt_length: int  # prompt positions inside the view (0 when the view starts after the prompt)
    mask_token_id: int
    session: Session  # the one call path: every model call of a step goes through it
    block: tuple[int, int]  # the active block's view positions [start, stop) (``region``, known on the host)
    masked: list[int] | None = None  # masked positions left in the active block per view row (host ints)
    call: Callable[..., torch.Tensor] = field(init=False, repr=False)
    structured: Callable[..., tuple] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.call = functools.partial(self.session.logits, rows=self.rows)
        self.structured = functools.partial(self.session.structured, rows=self.rows)

    def candidates(self, tokens: torch.Tensor) -> torch.Tensor:
        """Masked positions of the active block in ``tokens`` [N, Ls] -> bool [N, Ls]."""
        return (tokens == self.mask_token_id) & self.region[None, :]

    @property
    def batch(self) -> int:
        """Rows of the whole canvas (the view holds some of them)."""
        return self.session.canvas.x.shape[0]

    def block_band(self, extra: int = 0) -> Band:
        """The active block (and ``extra`` positions after it) as every row's band."""
        start, stop = self.block
        return Band(torch.full_like(self.rows, start), stop - start + extra, self.x.shape[1])


@dataclass(frozen=True)
class Band:
    """``width`` consecutive view positions of every view row from ``start`` [R] on: where a round reads logits.

    Logits asked on a band (``View.call(..., at=band.at(which))``) are [N, width, V]: the logit of view position
    p of an input of view row r is at slot p - start[r]. Rounds work in slots and turn them into view positions
    (``positions``) only to write tokens. Slots past the view's end are not ``valid`` (their logits repeat the
    last position's and are never read).
    """

    start: torch.Tensor  # [R] long
    width: int
    length: int  # the view's length Ls

    def at(self, which: torch.Tensor | None = None) -> torch.Tensor:
        """View positions [N, width] of inputs of view rows ``which`` [N] (None: one per row)."""
        start = self.start if which is None else self.start[which]
        return (start[:, None] + torch.arange(self.width, device=start.device)).clamp(max=self.length - 1)

    def valid(self, which: torch.Tensor | None = None) -> torch.Tensor:
        """Slots inside the view -> bool [N, width]."""
        start = self.start if which is None else self.start[which]
        return start[:, None] + torch.arange(self.width, device=start.device) < self.length

    def candidates(self, view: View, tokens: torch.Tensor, which: torch.Tensor | None = None) -> torch.Tensor:
        """``view.candidates(tokens)`` in slots -> bool [N, width]."""
        return view.candidates(tokens).gather(1, self.at(which)) & self.valid(which)

    def positions(self, slots: torch.Tensor, which: torch.Tensor | None = None) -> torch.Tensor:
        """View positions of ``slots`` [N, K] (negative slots stay negative: -1 means none)."""
        start = self.start if which is None else self.start[which]
        return torch.where(slots >= 0, slots + start[:, None], slots)


def write_at(tokens: torch.Tensor, positions: torch.Tensor, values: torch.Tensor, write: torch.Tensor) -> torch.Tensor:
    """A copy of ``tokens`` [N, L] with ``values`` [N, K] at ``positions`` [N, K] where ``write`` [N, K] holds.

    Unwritten entries go to a spare last column, dropped after: their positions may repeat a written one
    (window slots past a row's count), which a plain scatter would race with, and a boolean mask would make
    the shapes data-dependent (a host sync on a GPU)."""
    length = tokens.shape[1]
    out = torch.cat([tokens, tokens[:, :1]], dim=1)
    out.scatter_(1, torch.where(write, positions, length), values)
    return out[:, :length]
