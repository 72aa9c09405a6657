"""The block loop every masked-diffusion sampler runs: ``run`` builds the canvas and the session and calls the
sampler's stepper until each block is done. A family only says how to build its stepper (``Stepping``); its run
function is ``run`` with that bound (``functools.partial``, which adds no call frame).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from dllm.numerics import bind_rows
from dllm.protocols import capabilities, run_block_size
from dllm.stats import DecodeStats, StepEvent

from .canvas import Canvas, View
from .likelihood import Emissions
from .sessions import open_session


class Stepper(Protocol):
    """One sampler's rounds over the active block (``samplers/loop.py: run`` loops over them).

    ``logits(view)``: what the step starts from, usually the model at the view's state (one call); ``step(view,
    logits)``: the round itself -> (the view's tokens after it, the step event's fields). ``lookahead``: the
    step wants each call to score the next block too (``BlockCacheSession``). Optional: ``edits`` (True: a step may
    rewrite revealed tokens of the active block, LLaDA2.1's, so a row stops at a stop token only once its block is
    done: ``Canvas.stop_at_eos``'s ``until``).
    """

    lookahead: bool

    def begin_block(self, block: int) -> None: ...

    def logits(self, view: View): ...

    def step(self, view: View, logits) -> tuple[torch.Tensor, dict]: ...


@dataclass(frozen=True)
class Stepping:
    """How one sampler's loop is built.

    ``build(temperature, generator, stats, blocks, block_length, **options)`` -> its stepper; ``layout(model,
    options)`` -> a run function replacing the loop for a model layout that brings its own exact chain (fef and
    sequential on a two-stream model), or None to run the stepper; None: the stepper on every model.
    ``check(options, eos_token_id)``: the sampler's checks of its options against the run's stop ids, before
    anything is decoded (an official decoder's own name for them: LLaDA2's ``eos_id``).
    """

    build: Callable[..., Stepper]
    layout: Callable[[object, dict], Callable | None] | None = None
    check: Callable[[dict, tuple[int, ...] | None], None] | None = None


def options_stepper(cls) -> Callable[..., Stepper]:
    """A stepper whose fields after (temperature, generator, stats) are the sampler's options, named alike
    (so a new option on the config reaches the stepper by its name)."""
    def build(temperature, generator, stats, blocks, block_length, **options):
        return cls(temperature, generator, stats, **options)
    return build


def run(
    stepping: Stepping, model, prompt, gen_length, /, *, temperature, generator, stats: DecodeStats, block_length: int,
    cache: str = "auto", attention_mask: torch.Tensor | None = None, eos_token_id: tuple[int, ...] | None = None,
    callback=None, record: Emissions | None = None, **options,
) -> torch.Tensor:
    """Decode ``gen_length`` masked positions after ``prompt`` [B, P] -> [B, P + N], with the stepper that
    ``stepping.build(temperature, generator, stats, blocks, block_length, **options)`` builds; ``record``: what each
    step revealed, with its log-probability (``samplers/likelihood.py``), from the logits the step already read.

    The loop is written out here, not in a helper, so that a model call is four frames below ``generate``
    (this loop, the step, the session, the model: ``python -m dllm.eval.study.call_depth``).
    """
    if stepping.check is not None:
        stepping.check(options, eos_token_id)
    layout = stepping.layout(model, options) if stepping.layout is not None else None
    if layout is not None:  # a model layout with its own exact loop (the two-stream layout: samplers/fef/two_stream.py)
        return layout(model, prompt, gen_length, temperature=temperature, generator=generator, stats=stats,
                      block_length=block_length, cache=cache, attention_mask=attention_mask,
                      eos_token_id=eos_token_id, callback=callback, record=record)
    lead = tail = 0
    if capabilities(model).block_anchor == "absolute":  # blocks from position 0: the prompt's tail opens block 0
        size = run_block_size(model, block_length)  # the run's attention blocks (the checkpoint's, or block_length)
        groups = _anchor_groups(prompt, attention_mask, size)
        if len(groups) > 1:  # rows whose prompts end at different places in a block decode apart
            return _by_group(stepping, model, prompt, gen_length, groups, temperature=temperature, generator=generator,
                             stats=stats, block_length=block_length, cache=cache, attention_mask=attention_mask,
                             eos_token_id=eos_token_id, callback=callback, record=record, **options)
        into = groups[0][0]  # the prompts' length modulo the run's block
        lead, tail = into % block_length, -(into + gen_length) % size
    canvas = Canvas.start(prompt, gen_length, block_length, model.mask_token_id, eos_token_id, lead, tail)
    stepper: Stepper = stepping.build(temperature, generator, stats, canvas.num_blocks, block_length, **options)
    session = open_session(cache, canvas, model, stats, attention_mask, stepper.lookahead,
                           getattr(stepper, "call_tokens", None))
    for block in range(canvas.num_blocks):
        session.begin_block(block)
        stepper.begin_block(block)
        while (left := canvas.left_in_block(block))[1]:  # the step's one host read (rows, masked counts)
            rows = left[0]
            view = session.view(rows, left[1])
            new_x, info = stepper.step(view, stepper.logits(view))
            canvas.x[rows, view.offset : view.offset + new_x.shape[1]] = new_x
            if record is not None:
                record.take_step(rows, info, view.offset, view.block[0], canvas.x)
            canvas.stop_at_eos(rows, canvas.span(block)[1] if getattr(stepper, "edits", False) else None)
            if callback is not None:
                callback(StepEvent(**info, rows=rows, x=canvas.x[rows], offset=view.offset,
                                   **({} if record is None else record.of_rows(rows))))
    return canvas.x[:, : canvas.x.shape[1] - tail]


def _anchor_groups(prompt: torch.Tensor, attention_mask: torch.Tensor | None,
                   block_size: int) -> list[tuple[int, torch.Tensor]]:
    """Rows by how far their prompt reaches into a model block (real tokens modulo ``block_size``): [(that
    remainder, rows [G])], one host read. Rows sharing it share every block boundary on the left-padded canvas."""
    if attention_mask is None:
        return [(prompt.shape[1] % block_size, torch.arange(prompt.shape[0], device=prompt.device))]
    into = attention_mask.sum(dim=1) % block_size
    values = into.tolist()
    return [(value, (into == value).nonzero().squeeze(1)) for value in sorted(set(values))]


def _by_group(stepping: Stepping, model, prompt, gen_length, groups, /, *, generator, attention_mask, callback,
              record, **kwargs) -> torch.Tensor:
    """``run`` on each group of rows (``_anchor_groups``) -> the batch's sequences [B, P + N]. Per-row generators
    stay each row's own (bound to the group's rows), and so do the record and any option holding a value per row
    (one with ``bind(rows)``: scoring's given tokens); callback events name batch rows."""
    out = torch.empty((prompt.shape[0], prompt.shape[1] + gen_length), dtype=torch.long, device=prompt.device)
    for _, rows in groups:
        told = None if callback is None else functools.partial(_renamed, callback, rows)
        options = {key: value.bind(rows) if hasattr(value, "bind") else value for key, value in kwargs.items()}
        out[rows] = run(stepping, model, prompt[rows], gen_length, generator=bind_rows(generator, rows),
                        attention_mask=attention_mask[rows], callback=told,
                        record=None if record is None else record.bind(rows), **options)
    return out


def _renamed(callback, rows: torch.Tensor, event: StepEvent) -> None:
    callback(dataclasses.replace(event, rows=rows[event.rows]))
