"""``native``: a checkpoint's own generation loop, run and counted in the same harness as ours."""

from __future__ import annotations

import torch


def native(model, prompt, gen_length, *, temperature, generator, stats, attention_mask=None, eos_token_id=None,
           callback=None, drafter=None, generate_kwargs=None) -> torch.Tensor:
    """``model.native_generate`` (transformers' ``generate`` for DiffusionGemma and causal LMs; with
    ``drafter``, transformers' assisted generation) -> [B, P + N]. DecodeStats count every model call the
    loop makes, under the definitions our samplers use, so the reference and ours compare directly."""
    if callback is not None:
        raise ValueError("sampler='native' runs the checkpoint's own loop: it takes no callback")
    extra = {} if drafter is None else {"drafter": drafter}
    return model.native_generate(prompt, gen_length, temperature=temperature, generator=generator, stats=stats,
                                 attention_mask=attention_mask, eos_token_id=eos_token_id, **extra,
                                 **(generate_kwargs or {}))
