"""``cache="none"``: every call sees the whole sequence (prompt and answer). Always exact."""

from __future__ import annotations

import torch

from dllm.counting import structured_tokens

from ..calling import ask_at, hidden_keyword, join_parts, part_of, settle
from ..canvas import View
from .base import SessionBase


class FullSession(SessionBase):
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
            out = self.caller.model(tokens[part], **part_of(kwargs, part), **hidden_keyword(hidden),
                                    **ask_at(part_of(at, part), 0, self.native_at))
            outs.append(settle(out, tokens[part], part_of(at, part), 0, self.native_at))
        return join_parts(outs)

    def structured(self, tokens, *args, rows):
        """The model's ``structured_verify`` on R rows; counted as one call over state + 2W + 1 tokens."""
        self.caller.count(tokens, None, tokens=structured_tokens(tokens.shape[1], args[0].shape[1]))
        return self.caller.model.structured_verify(tokens, *args, **self.caller.kwargs(rows, slice(0, tokens.shape[1])))
