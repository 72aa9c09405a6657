"""Entry points of the masked-diffusion samplers: build the canvas, pick the session, run the stepper."""

from __future__ import annotations

import torch

from dllm.protocols import capabilities
from dllm.stats import DecodeStats

from .canvas import SESSIONS, Caller, Canvas, choose_session, decode
from .fef import FefStepper
from .masked import DreamStepper, EbStepper, FastDllmStepper, LladaStepper
from .sequential import SequentialStepper


def run(
    stepper, model, prompt, gen_length, *, stats: DecodeStats, block_length: int, cache: str = "auto",
    attention_mask: torch.Tensor | None = None, eos_token_id: tuple[int, ...] | None = None, callback=None,
) -> torch.Tensor:
    """Decode ``gen_length`` masked positions after ``prompt`` [B, P] with ``stepper`` -> [B, P + N]."""
    canvas = Canvas.start(prompt, gen_length, block_length, model.mask_token_id, eos_token_id)
    length = canvas.x.shape[1]
    mask = None
    if attention_mask is not None:
        mask = torch.ones((prompt.shape[0], length), dtype=torch.long, device=prompt.device)
        mask[:, : prompt.shape[1]] = attention_mask
    # Block-causal models line their blocks up with the answer: its first position, in position ids.
    offset = None
    if capabilities(model).block_size is not None:
        real = prompt.new_full((prompt.shape[0],), prompt.shape[1])
        offset = (attention_mask.sum(dim=1) if attention_mask is not None else real).long()
    mode = choose_session(cache, model, block_length)
    lookahead = {"lookahead": True} if mode == "block" and getattr(stepper, "lookahead", False) else {}
    session = SESSIONS[mode](canvas, Caller(model, stats, mask, offset), **lookahead)
    return decode(canvas, session, stepper, callback)


def _common(kw: dict) -> dict:
    return {k: kw.pop(k) for k in ("block_length", "cache", "attention_mask", "eos_token_id", "callback") if k in kw}


# Option defaults are written once, on the configs in samplers/registry.py; generate passes every option.
def sequential(model, prompt, gen_length, *, temperature, generator, stats, order, **kw):
    stepper = SequentialStepper(temperature, generator, stats, order)
    return run(stepper, model, prompt, gen_length, stats=stats, **_common(kw))


def fef(model, prompt, gen_length, *, temperature, generator, stats, order, window, draft, verifier, draft_head=None,
        **kw):
    stepper = FefStepper(temperature, generator, stats, order, window, draft, verifier, draft_head)
    return run(stepper, model, prompt, gen_length, stats=stats, **_common(kw))


def llada(model, prompt, gen_length, *, temperature, generator, stats, steps, remasking, cfg_scale, **kw):
    common = _common(kw)
    steps_per_block = steps // (gen_length // common["block_length"])
    stepper = LladaStepper(temperature, generator, stats, steps_per_block, common["block_length"], remasking,
                           cfg_scale)
    return run(stepper, model, prompt, gen_length, stats=stats, **common)


def dream(model, prompt, gen_length, *, temperature, generator, stats, steps, alg, alg_temp, top_p, top_k, **kw):
    common = _common(kw)
    steps_per_block = steps // (gen_length // common["block_length"])
    stepper = DreamStepper(temperature, generator, stats, steps_per_block, alg, alg_temp, top_p, top_k)
    return run(stepper, model, prompt, gen_length, stats=stats, **common)


def fast_dllm(model, prompt, gen_length, *, temperature, generator, stats, threshold, factor, **kw):
    stepper = FastDllmStepper(temperature, generator, stats, threshold, factor)
    return run(stepper, model, prompt, gen_length, stats=stats, **_common(kw))


def eb(model, prompt, gen_length, *, temperature, generator, stats, gamma, **kw):
    stepper = EbStepper(temperature, generator, stats, gamma)
    return run(stepper, model, prompt, gen_length, stats=stats, **_common(kw))

