"""The block loop every masked-diffusion sampler runs: ``run`` builds the canvas and the session and calls the
sampler's stepper until each block is done. A family only says how to build its stepper (``Stepping``); its run
function is ``run`` with that bound (``functools.partial``, which adds no call frame).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from dllm.stats import DecodeStats, StepEvent

from .canvas import Canvas
from .sessions import Stepper, open_session


@dataclass(frozen=True)
class Stepping:
    """How one sampler's loop is built.

    ``build(temperature, generator, stats, blocks, block_length, **options)`` -> its stepper; ``layout(model,
    options)`` -> a run function replacing the loop for a model layout that brings its own exact chain (fef and
    sequential on a two-stream model), or None to run the stepper; None: the stepper on every model.
    """

    build: Callable[..., Stepper]
    layout: Callable[[object, dict], Callable | None] | None = None


def options_stepper(cls) -> Callable[..., Stepper]:
    """A stepper whose fields after (temperature, generator, stats) are the sampler's options, named alike
    (so a new option on the config reaches the stepper by its name)."""
    def build(temperature, generator, stats, blocks, block_length, **options):
        return cls(temperature, generator, stats, **options)
    return build


def run(
    stepping: Stepping, model, prompt, gen_length, *, temperature, generator, stats: DecodeStats, block_length: int,
    cache: str = "auto", attention_mask: torch.Tensor | None = None, eos_token_id: tuple[int, ...] | None = None,
    callback=None, **options,
) -> torch.Tensor:
    """Decode ``gen_length`` masked positions after ``prompt`` [B, P] -> [B, P + N], with the stepper that
    ``stepping.build(temperature, generator, stats, blocks, block_length, **options)`` builds.

    The loop is written out here, not in a helper, so that a model call is four frames below ``generate``
    (this loop, the step, the session, the model: ``python -m dllm.eval.study.call_depth``).
    """
    layout = stepping.layout(model, options) if stepping.layout is not None else None
    if layout is not None:  # a model layout with its own exact loop (the two-stream layout: samplers/fef/two_stream.py)
        return layout(model, prompt, gen_length, temperature=temperature, generator=generator, stats=stats,
                      block_length=block_length, cache=cache, attention_mask=attention_mask,
                      eos_token_id=eos_token_id, callback=callback)
    canvas = Canvas.start(prompt, gen_length, block_length, model.mask_token_id, eos_token_id)
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
            canvas.stop_at_eos(rows)
            if callback is not None:
                callback(StepEvent(**info, rows=rows, x=canvas.x[rows], offset=view.offset))
    return canvas.x
