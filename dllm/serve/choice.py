"""One choice of a request, decoded in its lane: ``dllm.generate`` on the lane's model, and the text that is final.

Text is final when no later step can change it: the answer's tokens up to its first masked position (a masked
sampler reveals each position once; ``ar`` and ``ar_spec`` append), cut at the first stop id, minus a tail that
could still turn into a stop string or is half a character. Streams send each step's new final text; a stop
string found in it ends the lane at once (``StopString``), which changes nothing in the law of the text before it.
Samplers that edit revealed tokens (LLaDA2.1's ``editing_threshold``) have no final text before the end.

With logprobs asked, each final token goes out with its log-probability and top alternatives, read from the record
``generate`` keeps (``StepEvent.logprobs`` while it runs, ``GenerateOutput.logprobs`` at the end); ``echo`` scores the
prompt under the same chain at temperature 1 (``dllm.score``: the first token has no context, so no number).
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
    logprobs: list[dict] | None = None  # one TokenLogprob-like dict per token of token_ids (logprobs asked)
    prompt_logprobs: list[dict | None] | None = None  # echo with logprobs: one per prompt token, the first None


def token_entries(ids: list[int], logprobs: list[float], top_ids: list[list[int]], top_values: list[list[float]],
                  ) -> list[dict]:
    """One entry per token: its id, log-probability and alternatives [(id, log-probability)], the impossible ones
    (-inf: the mask token, or more alternatives than the law has tokens) left out."""
    return [{"id": token, "logprob": value,
             "top": [(t, v) for t, v in zip(ids_, values) if t >= 0 and v != float("-inf")]}
            for token, value, ids_, values in zip(ids, logprobs, top_ids, top_values)]


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
    sent_tokens: int = 0  # tokens whose log-probabilities went out (streams with logprobs)
    echoed: str = ""  # the prompt's text when the request echoes it (the completion's text follows it)
    first_token_at: float | None = None
    _cut: tuple[str, list[int]] | None = field(default=None, repr=False)  # (text, tokens) at a stop string

    def __post_init__(self) -> None:
        if self.job.echo:
            self.echoed = self.tokenizer.decode(self.prompt)

    def work(self, model) -> Outcome:
        job = self.job
        ids = torch.tensor([self.prompt])
        prompt_logprobs = self._prompt_logprobs(model, ids) if job.echo and job.logprobs is not None else None
        if job.echo and job.stream:  # the prompt first, as the completion's text starts with it
            self.emit("text", self.index, (self.echoed, prompt_logprobs, 0))
        if job.max_tokens == 0:  # echo alone: the prompt, scored when asked, and nothing generated
            return Outcome("", "length", 0, {}, job.exact, self.seed, [], [] if job.logprobs is not None else None,
                           prompt_logprobs)
        watch = job.stream or job.stop or job.stream_canvas
        wanted = {} if job.logprobs is None else {"logprobs": True, "top_logprobs": job.logprobs,
                                                  "logprobs_mode": job.logprobs_mode}
        self._record = None  # (logprobs, top values, top ids) of the answer so far, from the last step
        try:
            out = dllm.generate(model, ids, sampler=job.sampler, max_new_tokens=job.max_tokens,
                                temperature=job.temperature, generator=torch.Generator().manual_seed(self.seed),
                                eos_token_id=job.stop_ids, **({"callback": self.on_step} if watch else {}),
                                **wanted, **job.options)
        except StopString:
            text, tokens = self._cut
            self._send(text, tokens, final=True)
            return Outcome(text, "stop", len(tokens), {}, job.exact, self.seed, tokens,  # (no stats: cut short)
                           self._entries(tokens), prompt_logprobs)
        if job.logprobs is not None:
            self._record = (out.logprobs[0], out.top_logprobs[0], out.top_token_ids[0])
        answer = out.sequences[0, len(self.prompt):].tolist()
        tokens, stopped = self._until_stop(answer)
        text = self._decode(tokens)
        cut = self._stop_string(text)
        if cut is not None:
            text, stopped = text[:cut], True
            tokens = self._tokens_for(tokens, text)
        self._send(text, tokens, final=True)
        stats = out.stats
        return Outcome(text, "stop" if stopped else "length", int(stats.new_tokens) if cut is None else len(tokens),
                       {"model_calls": stats.nfe, "tokens_per_call": stats.tokens_per_call,
                        "acceptance_rate": stats.acceptance_rate, "rounds": stats.rounds,
                        "forward_tokens": stats.forward_tokens, "wall_time_s": stats.wall_time_s},
                       out.exact, self.seed, tokens, self._entries(tokens), prompt_logprobs)

    def _prompt_logprobs(self, model, ids: torch.Tensor) -> list[dict | None]:
        """Each prompt token's conditional given the tokens before it (``dllm.score`` at temperature 1: the model's
        law; on a diffusion model the canvas is the prompt itself, the chain generate would sample there)."""
        if ids.shape[1] < 2:
            return [None]
        scored = dllm.score(model, ids[:, :1], ids[:, 1:], temperature=1.0, eos_token_id=None,
                            top_logprobs=self.job.logprobs)
        top_values = scored.top_logprobs[0].tolist() if self.job.logprobs else [[]] * (ids.shape[1] - 1)
        top_ids = scored.top_token_ids[0].tolist() if self.job.logprobs else [[]] * (ids.shape[1] - 1)
        return [None, *token_entries(ids[0, 1:].tolist(), scored.logprobs[0].tolist(), top_ids, top_values)]

    def _entries(self, tokens: list[int], start: int = 0) -> list[dict] | None:
        """Log-probability entries of answer tokens ``tokens[start:]`` from the record, or None (not asked)."""
        if self.job.logprobs is None or self._record is None:
            return None if self.job.logprobs is None else []
        logprobs, values, top = self._record
        end = len(tokens)
        return token_entries(tokens[start:end], logprobs[start:end].tolist(), top[start:end].tolist(),
                             values[start:end].tolist())

    # ------------------------------------------------------------------------------------------------ steps

    def on_step(self, event: StepEvent) -> None:
        if event.logprobs is not None:
            self._record = (event.logprobs[0], event.top_logprobs[0], event.top_token_ids[0])
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
        self._send(text[: len(text) - self._held_back(text)], tokens)

    def _send(self, text: str, tokens: list[int], final: bool = False) -> None:
        """Stream the text that became final, and (logprobs asked) the entries of the tokens it now covers whole;
        ``final``: the answer is complete, every token goes."""
        covered = len(tokens) if final else self._covered(tokens, text)
        entries = None
        if self.job.logprobs is not None and covered > self.sent_tokens:
            entries = self._entries(tokens[:covered], self.sent_tokens)
        grown = len(text) > len(self.sent) and text.startswith(self.sent)
        if grown or entries:
            if self.first_token_at is None and grown:
                self.first_token_at = time.monotonic()
            if self.job.stream:  # (text, its tokens' entries, the first one's character offset in the whole text)
                offset = len(self.echoed) + len(self.tokenizer.decode(tokens[: self.sent_tokens]))
                self.emit("text", self.index, (text[len(self.sent):] if grown else "", entries, offset))
            if grown:
                self.sent = text
            if entries:
                self.sent_tokens = covered

    def _covered(self, tokens: list[int], text: str) -> int:
        """How many leading tokens decode within ``text`` (their log-probabilities can go with it)."""
        count = self.sent_tokens
        while count < len(tokens) and len(self._decode(tokens[: count + 1])) <= len(text):
            count += 1
        return count

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
