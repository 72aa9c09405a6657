"""What every session shares: the canvas, the caller, how its views are made and how a long call is split."""

from __future__ import annotations

import torch

from dllm.protocols import capabilities

from ..calling import Caller
from ..canvas import Canvas, View


class SessionBase:
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
