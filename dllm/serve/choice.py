"""One choice of a request, decoded in its lane: ``dllm.generate`` on the lane's model, and the text that is final.

Text is final when no later step can change it: the answer's tokens up to its first masked position (a masked
sampler reveals each position once; ``ar`` and ``ar_spec`` append), cut at the first stop id, minus a tail that
could still turn into a stop string or is half a character. Streams send each step's new final text; a stop
string found in it ends the lane at once (``StopString``), which changes nothing in the law of the text before it.
Samplers that edit revealed tokens (LLaDA2.1's ``editing_threshold``) have no final text before the end.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

import dllm
from dllm.stats import StepEvent

from .requests import Job

CANVAS_MASK = "\u2591"  # what a masked position looks like in a streamed canvas


class StopString(Exception):
    """A stop string appeared in the final text: the lane ends early."""


@dataclass
class Outcome:
    """How a choice ended."""

    text: str
    finish_reason: str  # "stop" or "length"
    completion_tokens: int
    stats: dict
    exact: bool
    seed: int
    token_ids: list[int]  # the completion's tokens, its stop id excluded (text cut at a stop string: those covering it)


@dataclass
class ChoiceRun:
    """A lane's work (``work``) for choice ``index`` of ``job``; ``emit(kind, index, payload)`` is called from the
    lane's thread with ("text", new final text) and, with ``stream_canvas``, ("canvas", the whole answer)."""

    job: Job
    index: int
    prompt: list[int]
    seed: int
    tokenizer: object
    mask_token_id: int | None
    emit: Callable[[str, int, object], None]
    sent: str = ""  # the final text emitted so far
    first_token_at: float | None = None
    _cut: tuple[str, list[int]] | None = field(default=None, repr=False)  # (text, tokens) at a stop string

    def work(self, model) -> Outcome:
        job = self.job
        ids = torch.tensor([self.prompt])
        watch = job.stream or job.stop or job.stream_canvas
        try:
            out = dllm.generate(model, ids, sampler=job.sampler, max_new_tokens=job.max_tokens,
                                temperature=job.temperature, generator=torch.Generator().manual_seed(self.seed),
                                eos_token_id=job.stop_ids, **({"callback": self.on_step} if watch else {}),
                                **job.options)
        except StopString:
            text, tokens = self._cut
            self._send(text)
            return Outcome(text, "stop", len(tokens), {}, job.exact, self.seed, tokens)  # (no stats: cut short)
        answer = out.sequences[0, len(self.prompt):].tolist()
        tokens, stopped = self._until_stop(answer)
        text = self._decode(tokens)
        cut = self._stop_string(text)
        if cut is not None:
            text, stopped = text[:cut], True
            tokens = self._tokens_for(tokens, text)
        self._send(text)
        stats = out.stats
        return Outcome(text, "stop" if stopped else "length", int(stats.new_tokens) if cut is None else len(tokens),
                       {"model_calls": stats.nfe, "tokens_per_call": stats.tokens_per_call,
                        "acceptance_rate": stats.acceptance_rate, "rounds": stats.rounds,
                        "forward_tokens": stats.forward_tokens, "wall_time_s": stats.wall_time_s},
                       out.exact, self.seed, tokens)

    # ------------------------------------------------------------------------------------------------ steps

    def on_step(self, event: StepEvent) -> None:
        answer = event.x[0, len(self.prompt):].tolist()
        if self.job.stream_canvas:
            self.emit("canvas", self.index, self._canvas(answer))
        if _edits(self.job):
            return
        if self.mask_token_id is not None and self.mask_token_id in answer:
            answer = answer[: answer.index(self.mask_token_id)]
        tokens, _ = self._until_stop(answer)
        text = self._decode(tokens)
        cut = self._stop_string(text)
        if cut is not None:
            self._cut = (text[:cut], self._tokens_for(tokens, text[:cut]))
            raise StopString()
        self._send(text[: len(text) - self._held_back(text)])

    def _send(self, text: str) -> None:
        if len(text) > len(self.sent) and text.startswith(self.sent):
            if self.first_token_at is None:
                self.first_token_at = time.monotonic()
            if self.job.stream:
                self.emit("text", self.index, text[len(self.sent):])
            self.sent = text

    def _until_stop(self, answer: list[int]) -> tuple[list[int], bool]:
        stops = set(self.job.stop_ids or ())
        for i, token in enumerate(answer):
            if token in stops:
                return answer[:i], True
        return answer, False

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def _stop_string(self, text: str) -> int | None:
        found = [text.find(stop) for stop in self.job.stop if stop in text]
        return min(found) if found else None

    def _held_back(self, text: str) -> int:
        """Characters at the end that may still change: half a character, or the start of a stop string."""
        held = 1 if text.endswith("\ufffd") else 0
        for stop in self.job.stop:
            for k in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:k]):
                    held = max(held, k)
                    break
        return held

    def _tokens_for(self, tokens: list[int], text: str) -> list[int]:
        """The fewest leading tokens whose text covers ``text`` (the completion's tokens at a stop string)."""
        for k in range(len(tokens) + 1):
            if len(self._decode(tokens[:k])) >= len(text):
                return tokens[:k]
        return tokens

    def _canvas(self, answer: list[int]) -> str:
        pieces = []
        for token in answer:
            pieces.append(CANVAS_MASK if token == self.mask_token_id else self._decode([token]))
        return "".join(pieces)


def _edits(job: Job) -> bool:
    """Samplers that may change a revealed token: nothing is final before they end."""
    return job.sampler == "llada2" and job.options.get("editing_threshold") is not None
