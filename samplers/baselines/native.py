"""``native``: a checkpoint's own generation loop, run and counted in the same harness as ours."""

from __future__ import annotations

import torch

from dllm.counting import count_calls
from dllm.kernels import draw_seed
from dllm.stops import fit_output


def native(model, prompt, gen_length, *, temperature, generator, stats, attention_mask=None, eos_token_id=None,
           callback=None, drafter=None, generate_kwargs=None) -> torch.Tensor:
    """The model's ``native_loop`` (transformers' ``generate`` for DiffusionGemma and causal LMs, with
    ``drafter`` its assisted generation; Dream's ``diffusion_generate``) -> [B, P + N]. DecodeStats count
    every model call the loop makes, under the definitions our samplers use, so the reference and ours
    compare directly. The loop's noise comes from torch's global generator, seeded from ``generator``
    inside ``fork_rng`` so a seeded call replays; rows follow the stop rule of ``dllm.stops``."""
    if callback is not None:
        raise ValueError("sampler='native' runs the checkpoint's own loop: it takes no callback")
    if not isinstance(generator, torch.Generator):
        raise TypeError("sampler='native' draws from torch's global generator: pass one torch.Generator")
    extra = {} if drafter is None else {"drafter": drafter}
    loop = model.native_loop(prompt, gen_length, temperature=temperature, attention_mask=attention_mask,
                             eos_token_id=eos_token_id, **extra, **(generate_kwargs or {}))
    steps: list = []
    hooks = [count_calls(c.module, stats, draft=c.draft, key=c.key, calls=steps if c.steps else None)
             for c in loop.counted]
    try:
        with torch.random.fork_rng(devices=[loop.device] if loop.device.type == "cuda" else []):
            torch.manual_seed(draw_seed(generator))
            out = loop.run()
    finally:
        for hook in hooks:
            hook.remove()
    sequences = out.sequences if hasattr(out, "sequences") else out
    sequences, lengths = fit_output(sequences.to(prompt.device), prompt.shape[1], gen_length, eos_token_id,
                                    loop.pad_token_id)
    stats.new_tokens += prompt.shape[0] * gen_length  # (generate cuts at stop tokens after this)
    stats.rounds += {"steps": prompt.shape[0] * len(steps), "tokens": int(lengths.sum()),
                     "calls": len(steps)}[loop.rounds]
    return sequences
