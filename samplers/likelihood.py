"""The probability of what was emitted: the one record every decoding loop fills (``GenerateOutput.logprobs``).

Each round hands the record the positions it revealed and the logits the token there was drawn from: for the
exact samplers the chain's conditional at that position (fef's and ar_spec's verification target, whichever of
accepted draft, correction or bonus it was; sequential's and ar's call), for the approximate ones the model's
marginal when the token was committed. The record turns only those rows into float32 log-probabilities, keeps the
emitted token's and the top-K alternatives, and so costs no model call and no [B, L, V] tensor.

Two distributions can be reported (vLLM's ``logprobs_mode`` makes the same choice):

- ``"sampled"`` (default): the law the token was drawn from, softmax(logits / T) after the sampler's own filters
  (top-k / top-p, the mask token removed). For an exact sampler the sum over a row is the log-probability of the
  answer under the chain it samples. At T = 0 that law is a point mass on the argmax; the record then reports the
  temperature-1 distribution instead (its argmax is the token), as vLLM does for greedy requests.
- ``"raw"``: the model's distribution, softmax(logits) at temperature 1 with no filter (the mask token removed).

Each number is the conditional of the token given the state it was drawn in. Left to right (every AR sampler, and
the masked ones' default order) the states hold only earlier answer tokens, so a row's sum is the log-probability
of its answer. In another order (``order="confidence"``) a token later discarded may be drawn before a kept one
and condition it: one after the row's stop token (overwritten by the fill), or one of the masks past
max_new_tokens that a model with blocks anchored at position 0 decodes to finish its last block. The sum is then
the log-probability of the answer jointly with those discarded draws, not of the answer alone (whose marginal sums
over them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dllm.defaults import LOGPROBS_MODES

__all__ = ["LOGPROBS_MODES", "Emissions", "log_probs"]


def log_probs(logits: torch.Tensor, temperature: float, mode: str) -> torch.Tensor:
    """float32 log-probabilities [..., V] of the distribution ``mode`` reports for ``logits`` [..., V]."""
    scale = temperature if mode == "sampled" and temperature > 0 else 1.0
    scores = logits.float()
    return torch.log_softmax(scores / scale if scale != 1.0 else scores, dim=-1)


@dataclass
class Emissions:
    """Per answer position of each row: the emitted token's log-probability and the top-K alternatives.

    ``logprobs`` [B, N] float32 (0.0 where nothing was recorded: past a row's stop, the fill is certain);
    ``top_ids`` / ``top_logprobs`` [B, N, K] (K = 0: empty). Canvas (or sequence) position ``start + j`` is answer
    column j. ``rows`` maps the rows a loop sees to batch rows (a loop over a group of rows writes through
    ``bind``). Writes read nothing from the device: entries that are not kept go to a spare last column.
    """

    buffer: torch.Tensor  # [B, N + 1] the logprobs and the spare column
    top_buffer: torch.Tensor  # [B, N + 1, K]
    top_ids_buffer: torch.Tensor  # [B, N + 1, K]
    start: int
    temperature: float
    mode: str
    rows: torch.Tensor

    @classmethod
    def empty(cls, batch: int, new_tokens: int, top_k: int, start: int, temperature: float, mode: str,
              device) -> Emissions:
        return cls(torch.zeros((batch, new_tokens + 1), dtype=torch.float32, device=device),
                   torch.full((batch, new_tokens + 1, top_k), float("-inf"), dtype=torch.float32, device=device),
                   torch.full((batch, new_tokens + 1, top_k), -1, dtype=torch.long, device=device),
                   start, temperature, mode, torch.arange(batch, device=device))

    @property
    def logprobs(self) -> torch.Tensor:
        return self.buffer[:, :-1]

    @property
    def top_logprobs(self) -> torch.Tensor:
        return self.top_buffer[:, :-1]

    @property
    def top_ids(self) -> torch.Tensor:
        return self.top_ids_buffer[:, :-1]

    def bind(self, rows: torch.Tensor, start: int | None = None) -> Emissions:
        """The record of batch rows ``rows`` [G] of this one (a loop over a group), answer column 0 at ``start``."""
        return Emissions(self.buffer, self.top_buffer, self.top_ids_buffer, self.start if start is None else start,
                         self.temperature, self.mode, self.rows[rows])

    def take(self, rows: torch.Tensor, positions: torch.Tensor, logits: torch.Tensor, tokens: torch.Tensor) -> None:
        """Record the tokens loop rows ``rows`` [R] emitted at ``positions`` [R, K] (-1: none) of ``tokens``
        [B', L] (every row's sequence after the round, indexed by loop row), each drawn from ``logits`` [R, K, V]
        (row-aligned with ``positions``). Positions outside the answer (a block's tail past max_new_tokens) are not
        kept."""
        new = self.buffer.shape[1] - 1
        columns = positions - self.start
        keep = (positions >= 0) & (columns >= 0) & (columns < new)
        column = torch.where(keep, columns, new)  # the rest to the spare column: no boolean index, no host read
        token = tokens[rows].gather(1, positions.clamp(min=0, max=tokens.shape[1] - 1))  # [R, K]
        logp = log_probs(logits, self.temperature, self.mode)  # [R, K, V], the rows read only
        batch = self.rows[rows][:, None].expand_as(column)
        self.buffer[batch, column] = logp.gather(-1, token[..., None])[..., 0]
        top = self.top_buffer.shape[2]
        if top:
            values, ids = logp.topk(min(top, logp.shape[-1]), dim=-1)
            self.top_buffer[batch, column, : ids.shape[-1]] = values
            self.top_ids_buffer[batch, column, : ids.shape[-1]] = ids

    def of_rows(self, rows: torch.Tensor) -> dict:
        """The record so far of loop rows ``rows`` [R], as ``StepEvent``'s fields."""
        batch = self.rows[rows]
        return {"logprobs": self.logprobs[batch], "top_logprobs": self.top_logprobs[batch],
                "top_token_ids": self.top_ids[batch]}

    def take_step(self, rows: torch.Tensor, info: dict, offset: int, block: int, tokens: torch.Tensor) -> None:
        """Record one step of the block loop from its event's fields (``dllm.stats.StepEvent``): ``revealed`` as
        canvas positions with ``emitted_logits`` [R, K, V], or as a bool mask over view columns (the view starting
        at canvas position ``offset``) with ``emitted_logits`` over the active block, which starts at view column
        ``block`` (``View.block``: the approximate samplers read and reveal only there)."""
        revealed, logits = info.get("revealed"), info.get("emitted_logits")
        if revealed is None:
            return
        if logits is None:
            raise RuntimeError(f"sampler {info.get('sampler')!r} does not report the logits its tokens were drawn "
                               "from (StepEvent.emitted_logits), so it cannot give logprobs")
        if revealed.dtype == torch.bool:
            revealed = revealed[:, block : block + logits.shape[1]]
            positions = torch.arange(revealed.shape[1], device=revealed.device) + offset + block
            self.take(rows, torch.where(revealed, positions, -1), logits[:, : revealed.shape[1]], tokens)
        else:
            self.take(rows, revealed, logits, tokens)

    def clear_after(self, lengths: torch.Tensor) -> None:
        """Past each row's answer length (its stop token included) nothing is kept: 0.0, no alternatives."""
        past = torch.arange(self.buffer.shape[1], device=lengths.device)[None, :] >= lengths[:, None]
        self.buffer.masked_fill_(past, 0.0)
        self.top_ids_buffer.masked_fill_(past[..., None], -1)
        self.top_buffer.masked_fill_(past[..., None], float("-inf"))
