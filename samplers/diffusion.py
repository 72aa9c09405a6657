"""Entry points of the masked-diffusion samplers: ``run`` builds the canvas and the session and loops over
the blocks, calling the sampler's stepper until each block is done; each sampler only builds its stepper."""

from __future__ import annotations

import functools

import torch

from dllm.defaults import default_draft_head
from dllm.models.draft_head import DraftHead, load_draft_head
from dllm.protocols import capabilities
from dllm.stats import DecodeStats, StepEvent

from .canvas import Canvas, Stepper, open_session
from .fef import FefStepper
from .masked import DreamStepper, EbStepper, FastDllmStepper, LladaStepper
from .sequential import SequentialStepper
from .two_stream import decode as two_stream_decode


def run(
    make_stepper, model, prompt, gen_length, *, temperature, generator, stats: DecodeStats, block_length: int,
    cache: str = "auto", attention_mask: torch.Tensor | None = None, eos_token_id: tuple[int, ...] | None = None,
    callback=None, **options,
) -> torch.Tensor:
    """Decode ``gen_length`` masked positions after ``prompt`` [B, P] -> [B, P + N], with the stepper that
    ``make_stepper(temperature, generator, stats, blocks, block_length, **options)`` builds.

    The loop is written out here, not in a helper, so that a model call is four frames below ``generate``
    (this loop, the step, the session, the model: ``python -m dllm.eval.call_depth``).
    """
    if make_stepper in _TWO_STREAM and capabilities(model).reveal_order_cache:
        # The two-stream layout has its own exact cached chain and one-call verifier (samplers/two_stream.py).
        return two_stream_decode(model, prompt, gen_length, temperature=temperature, generator=generator, stats=stats,
                                 block_length=block_length, cache=cache, attention_mask=attention_mask,
                                 eos_token_id=eos_token_id, callback=callback,
                                 **_TWO_STREAM[make_stepper](options, model))
    canvas = Canvas.start(prompt, gen_length, block_length, model.mask_token_id, eos_token_id)
    stepper: Stepper = make_stepper(temperature, generator, stats, canvas.num_blocks, block_length, **options)
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


# Each sampler's stepper from its options; the defaults are written once, on the configs in
# samplers/registry.py, and generate passes every option.
def _stepper(cls):
    """A stepper whose fields after (temperature, generator, stats) are the sampler's options, named alike
    (so a new option on the config reaches the stepper by its name)."""
    def make(temperature, generator, stats, blocks, block_length, **options):
        return cls(temperature, generator, stats, **options)
    return make


def _llada(temperature, generator, stats, blocks, block_length, *, steps, remasking, cfg_scale) -> LladaStepper:
    return LladaStepper(temperature, generator, stats, steps // blocks, block_length, remasking, cfg_scale)


def _dream(temperature, generator, stats, blocks, block_length, *, steps, alg, alg_temp, top_p, top_k) -> DreamStepper:
    return DreamStepper(temperature, generator, stats, steps // blocks, alg, alg_temp, top_p, top_k)


_SEQUENTIAL, _FEF = _stepper(SequentialStepper), _stepper(FefStepper)
# What sequential and fef pass to the two-stream decoder (its own draft logits; fef's verifier does not apply).
_TWO_STREAM = {_SEQUENTIAL: lambda options, model: {"order": options["order"], "window": 0},
               _FEF: lambda options, model: {"order": options["order"], "window": options["window"], "sampler": "fef",
                                             "draft_head": _two_stream_head(options, model),
                                             "draft_candidates": options["draft_candidates"],
                                             "candidates_below": options["candidates_below"]}}


def _two_stream_head(options, model) -> DraftHead | None:
    """fef's draft="head" on a two-stream model: the head given, else the model's default one."""
    if options["draft"] != "head":
        return None
    return load_draft_head(default_draft_head(model) if options["draft_head"] is None else options["draft_head"])

# The registry's run functions: ``run`` with the sampler's stepper bound (a partial adds no call frame).
sequential = functools.partial(run, _SEQUENTIAL)
fef = functools.partial(run, _FEF)
llada = functools.partial(run, _llada)
dream = functools.partial(run, _dream)
fast_dllm = functools.partial(run, _stepper(FastDllmStepper))
eb = functools.partial(run, _stepper(EbStepper))
