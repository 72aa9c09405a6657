"""The front door: ``generate`` validates its arguments once, picks the sampler, runs and times it."""

from __future__ import annotations

import math
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dllm.defaults import MAX_NEW_TOKENS, TEMPERATURE
from dllm.numerics import RowGenerators, check_int, synchronize
from dllm.protocols import (
    accepts_attention_mask,
    context_length,
    is_causal_model,
    is_diffusion_model,
    max_prompt_length,
    needs_prompt,
    padding_refusal,
)
from dllm.samplers import SAMPLERS, SamplerSpec
from dllm.samplers.registry import check_callback
from dllm.stats import DecodeStats
from dllm.stops import answer_lengths, resolve


@dataclass
class GenerateOutput:
    """Result of ``generate``."""

    sequences: torch.Tensor  # [B, P + max_new_tokens], prompt included
    stats: DecodeStats
    sampler: str
    options: dict[str, Any] = field(default_factory=dict)  # every option, defaults filled in
    exact: bool = True  # False for samplers that only approximate the sequential chain, or approximate caches
    seed: int | None = None  # the seed of the generator generate made, when none was given


def generate(
    model,
    input_ids: torch.Tensor,
    sampler: str = "fef",
    max_new_tokens: int = MAX_NEW_TOKENS,
    temperature: float = TEMPERATURE,
    generator: torch.Generator | Sequence[torch.Generator] | None = None,
    attention_mask: torch.Tensor | None = None,
    eos_token_id: int | Sequence[int] | None | str = "model",
    **options: Any,
) -> GenerateOutput:
    """Generate ``max_new_tokens`` tokens after ``input_ids`` [B, P] with the named sampler.

    ``model`` follows ``dllm.DiffusionModel`` (masked-diffusion samplers) or ``dllm.CausalModel``
    (``ar``, ``ar_spec``). ``temperature`` 0 is greedy. Sampler options are listed in
    ``dllm.samplers.SAMPLERS`` (e.g. ``window``, ``order``, ``block_length`` for fef). Without a
    ``generator`` a fresh one is seeded from the OS and its seed returned in ``GenerateOutput.seed``. A
    list of generators, one per row, makes each row's sample independent of the rest of the batch.
    ``attention_mask`` [B, P] (1 = token, 0 = left padding) allows ragged prompts for models that accept
    it. Rows stop at ``eos_token_id``: one id or several (default: the model's ``stop_token_ids`` or
    ``eos_token_id`` attribute, if any; None disables), by the rule of ``dllm.stops``: the stop token
    is kept, positions after it hold the first stop id, and ``stats.new_tokens`` counts up to and
    including the stop.
    """
    spec = _check_sampler(sampler)
    _check_model(model, spec)
    _check_input_ids(input_ids, model, spec)
    check_int("max_new_tokens", max_new_tokens, minimum=1)
    _check_temperature(temperature)
    seed = None
    if generator is None:
        seed = secrets.randbits(63)
        generator = torch.Generator(device=input_ids.device).manual_seed(seed)
    elif isinstance(generator, list | tuple):
        if len(generator) != input_ids.shape[0] or not all(isinstance(g, torch.Generator) for g in generator):
            raise TypeError(f"generator as a sequence must hold one torch.Generator per row "
                            f"({input_ids.shape[0]}), got {len(generator)} items")
        generator = RowGenerators(generator)
    elif not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, a list of them (one per row) or None, "
                        f"got {type(generator).__name__}")
    attention_mask = _check_attention_mask(attention_mask, input_ids, model)
    stop_ids = resolve(model, eos_token_id)
    config = spec.configure(options, model=model, max_new_tokens=max_new_tokens)
    callback = check_callback(options.get("callback"))
    _check_context(model, input_ids, attention_mask, max_new_tokens)

    stats = DecodeStats()
    synchronize(input_ids.device)
    start = time.perf_counter()
    with torch.no_grad():  # decoding never trains: no autograd graph over the model's calls (time, memory)
        sequences = spec.run(model, input_ids, max_new_tokens, temperature=temperature, generator=generator,
                             stats=stats, attention_mask=attention_mask, eos_token_id=stop_ids,
                             callback=callback, **config.values())
    synchronize(input_ids.device)
    stats.wall_time_s = time.perf_counter() - start
    stats.settle()  # the counters the loop kept on the device, read once: the returned stats hold plain numbers
    if stop_ids is not None:
        stats.new_tokens = int(answer_lengths(sequences[:, input_ids.shape[1] :], stop_ids).sum())
    shown = config.values()
    if shown.get("drafter") is not None and not isinstance(shown["drafter"], str):
        named = options.get("drafter", spec.preferred(model, options).get("drafter"))  # a drafter given by name
        shown["drafter"] = named if isinstance(named, str) else type(shown["drafter"]).__name__
    return GenerateOutput(sequences, stats, sampler, shown, config.exact, seed)


def _check_sampler(sampler: str) -> SamplerSpec:
    if not isinstance(sampler, str) or sampler not in SAMPLERS:
        raise ValueError(f"sampler must be one of {sorted(SAMPLERS)}, got {sampler!r}")
    return SAMPLERS[sampler]


def _check_model(model, spec: SamplerSpec) -> None:
    diffusion, causal = is_diffusion_model(model), is_causal_model(model)
    fits = spec.model_kind == "any" and (diffusion or causal) or spec.model_kind == ("diffusion" if diffusion else
                                                                                    "causal" if causal else None)
    if not fits:
        needs = {"diffusion": "a DiffusionModel (callable, with mask_token_id and vocab_size)",
                 "causal": "a CausalModel (callable, with vocab_size and no mask_token_id)",
                 "any": "a DiffusionModel or a CausalModel"}[spec.model_kind]
        kind = "diffusion" if diffusion else "causal" if causal else None
        if kind is None:
            raise TypeError(f"sampler {spec.name!r} needs {needs}; got {type(model).__name__}, which is neither")
        fitting = sorted(name for name, other in SAMPLERS.items() if other.model_kind in (kind, "any"))
        raise TypeError(f"sampler {spec.name!r} needs {needs}; this {type(model).__name__} is a {kind} model "
                        f"(samplers for it: {', '.join(fitting)})")
    if not isinstance(model.vocab_size, int) or model.vocab_size < 2:
        raise ValueError(f"model.vocab_size must be an int >= 2, got {model.vocab_size!r}")


def _check_input_ids(input_ids, model, spec: SamplerSpec) -> None:
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"input_ids must be a torch.Tensor, got {type(input_ids).__name__}")
    if input_ids.dim() != 2 or input_ids.shape[0] < 1:
        raise ValueError(
            f"input_ids must have shape [batch, prompt_length] with batch >= 1, got {tuple(input_ids.shape)}"
        )
    if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
        raise TypeError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    causal = spec.model_kind == "causal" or (spec.model_kind == "any" and is_causal_model(model))
    if causal and input_ids.shape[1] < 1:
        raise ValueError("input_ids must hold at least one token for a causal model (a BOS token, say)")
    if needs_prompt(model) and input_ids.shape[1] < 1:
        raise ValueError(f"input_ids must hold at least one token for {type(model).__name__} (needs_prompt: it "
                         "cannot decode after an empty prompt); give a prompt, a BOS token say")
    if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= model.vocab_size):
        raise ValueError(f"input_ids must lie in [0, vocab_size={model.vocab_size}), got "
                         f"[{int(input_ids.min())}, {int(input_ids.max())}]")
    mask_id = getattr(model, "mask_token_id", None)
    if not causal and mask_id is not None and bool((input_ids == mask_id).any()):
        raise ValueError(f"input_ids must not contain the mask token (id {mask_id}) in the prompt")


def _check_attention_mask(attention_mask, input_ids: torch.Tensor, model) -> torch.Tensor | None:
    """A [B, P] 0/1 mask of left padding; None when absent or all ones (no padding to honour)."""
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask must be a tensor shaped like input_ids {tuple(input_ids.shape)}, got "
                         f"{getattr(attention_mask, 'shape', type(attention_mask).__name__)}")
    mask = attention_mask.long()
    if bool(((mask != 0) & (mask != 1)).any()):
        raise ValueError("attention_mask must hold only 0 (padding) and 1 (token)")
    if bool((mask[:, 1:] < mask[:, :-1]).any()):
        raise ValueError("attention_mask must be left padding: zeros before the first token, ones after")
    if bool((mask.sum(dim=1) == 0).any()):
        raise ValueError("attention_mask leaves a row with no token; every prompt needs at least one")
    if bool(mask.all()):
        return None
    if not accepts_attention_mask(model):
        raise ValueError(f"attention_mask pads these prompts, but {padding_refusal(model)}; pass equal-length "
                         "prompts (or one row per call)")
    return mask


def _check_context(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, max_new_tokens: int) -> None:
    """Refuse prompt + max_new_tokens beyond the model's declared context, whether or not a stop comes first."""
    room = max_prompt_length(model, max_new_tokens)
    # Positions come from the mask, so a padded row needs only its real tokens' positions.
    prompt = input_ids.shape[1] if attention_mask is None else int(attention_mask.sum(dim=1).max())
    if room is not None and prompt > room:
        fits = (f"max_new_tokens <= {max_new_tokens - prompt + room} fits this prompt" if prompt < room + max_new_tokens
                else "the prompt alone fills the context")
        causal = " (a causal model never reads its last token: one more fits)" if is_causal_model(model) else ""
        raise ValueError(f"prompt length {prompt} + max_new_tokens {max_new_tokens} = {prompt + max_new_tokens} "
                         f"tokens exceeds the model's context of {context_length(model)}{causal} "
                         f"({type(model).__name__}.context_length); shorten the prompt or lower max_new_tokens "
                         f"({fits})")


def _check_temperature(temperature) -> None:
    if isinstance(temperature, bool) or not isinstance(temperature, int | float):
        raise TypeError(f"temperature must be a number, got {type(temperature).__name__}")
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be finite and >= 0 (0 means greedy), got {temperature}")
