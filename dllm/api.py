"""The front door: ``generate`` validates its arguments once, picks the sampler, runs and times it."""

from __future__ import annotations

import math
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dllm.defaults import LOGPROBS_MODE, MAX_NEW_TOKENS, TEMPERATURE
from dllm.numerics import RowGenerators, check_int, synchronize
from dllm.protocols import (
    accepts_attention_mask,
    capabilities,
    context_length,
    is_causal_model,
    is_diffusion_model,
    max_prompt_length,
    needs_prompt,
    padding_refusal,
)
from dllm.samplers import SAMPLERS, SamplerSpec
from dllm.samplers.likelihood import LOGPROBS_MODES, Emissions
from dllm.samplers.registry import check_callback
from dllm.samplers.scoring import score_chain
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
    # With logprobs=True (samplers/likelihood.py): per answer position, the emitted token's log-probability
    # [B, max_new_tokens] float32 under ``logprobs_mode``'s distribution (0.0 past a row's stop token, where the
    # fill is certain: a row's sum is its answer's log-probability), and the ``top_logprobs`` most likely tokens
    # there [B, max_new_tokens, K] (ids -1 and -inf past the stop). For an exact run (``exact``) the chain's own
    # conditionals, the probability of what was sampled; for an approximate sampler the model's marginal when
    # the token was committed, which is not the sample's probability.
    logprobs: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None
    top_token_ids: torch.Tensor | None = None
    logprobs_mode: str | None = None


def generate(
    model,
    input_ids: torch.Tensor,
    sampler: str = "fef",
    max_new_tokens: int = MAX_NEW_TOKENS,
    temperature: float = TEMPERATURE,
    generator: torch.Generator | Sequence[torch.Generator] | None = None,
    attention_mask: torch.Tensor | None = None,
    eos_token_id: int | Sequence[int] | None | str = "model",
    logprobs: bool = False,
    top_logprobs: int = 0,
    logprobs_mode: str = LOGPROBS_MODE,
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
    including the stop. ``logprobs``: return each emitted token's log-probability (``GenerateOutput.logprobs``)
    and the ``top_logprobs`` most likely tokens at its position, under ``logprobs_mode`` ("sampled": the law it
    was drawn from, softmax(logits / T), the temperature-1 law at T = 0; "raw": the model's at temperature 1),
    read from the logits the rounds already computed (no extra model call).
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
    _check_logprobs(spec, logprobs, top_logprobs, logprobs_mode, model)
    config = spec.configure(options, model=model, max_new_tokens=max_new_tokens)
    callback = check_callback(options.get("callback"))
    _check_context(model, input_ids, attention_mask, max_new_tokens)

    stats = DecodeStats()
    record = None
    if logprobs:
        record = Emissions.empty(input_ids.shape[0], max_new_tokens, top_logprobs, input_ids.shape[1], temperature,
                                 logprobs_mode, input_ids.device)
    synchronize(input_ids.device)
    start = time.perf_counter()
    with torch.no_grad():  # decoding never trains: no autograd graph over the model's calls (time, memory)
        sequences = spec.run(model, input_ids, max_new_tokens, temperature=temperature, generator=generator,
                             stats=stats, attention_mask=attention_mask, eos_token_id=stop_ids,
                             callback=callback, **({} if record is None else {"record": record}), **config.values())
    synchronize(input_ids.device)
    stats.wall_time_s = time.perf_counter() - start
    stats.settle()  # the counters the loop kept on the device, read once: the returned stats hold plain numbers
    if stop_ids is not None:
        lengths = answer_lengths(sequences[:, input_ids.shape[1] :], stop_ids)
        stats.new_tokens = int(lengths.sum())
        if record is not None:
            record.clear_after(lengths)
    shown = config.values()
    if shown.get("drafter") is not None and not isinstance(shown["drafter"], str):
        named = options.get("drafter", spec.preferred(model, options).get("drafter"))  # a drafter given by name
        shown["drafter"] = named if isinstance(named, str) else type(shown["drafter"]).__name__
    out = GenerateOutput(sequences, stats, sampler, shown, config.exact, seed)
    if record is not None:
        out.logprobs, out.logprobs_mode = record.logprobs, logprobs_mode
        out.top_logprobs, out.top_token_ids = record.top_logprobs, record.top_ids
    return out


@dataclass
class ScoreOutput:
    """Result of ``score``: the continuation's log-likelihood under the chain the exact samplers sample."""

    logprobs: torch.Tensor  # [B, N] float32, each token's conditional; 0.0 past a row's stop token (its fill)
    total: torch.Tensor  # [B] float64, the row's sum: the continuation's log-likelihood
    is_greedy: torch.Tensor  # [B] bool, every token up to the stop is its conditional's most likely one
    lengths: torch.Tensor  # [B] tokens scored: up to and including the first stop token (N without one)
    stats: DecodeStats
    top_logprobs: torch.Tensor | None = None  # [B, N, K] the K most likely tokens at each position
    top_token_ids: torch.Tensor | None = None
    options: dict[str, Any] = field(default_factory=dict)  # block_length, cache: the chain's layout


def score(
    model,
    input_ids: torch.Tensor,
    continuation_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    temperature: float = 1.0,
    eos_token_id: int | Sequence[int] | None | str = "model",
    top_logprobs: int = 0,
    block_length: int | None = None,
    cache: str = "auto",
    call_tokens: int | None = None,
    grad: bool = False,
) -> ScoreOutput:
    """The log-likelihood of ``continuation_ids`` [B, N] after ``input_ids`` [B, P] under the left-to-right chain
    that ``sequential`` (and every exact sampler) samples at ``temperature`` (1.0: the model's own law; 0 scores
    with the temperature-1 law, as ``logprobs_mode="sampled"`` does), per token and summed.

    The chain is the one ``generate(model, input_ids, max_new_tokens=N, block_length=..., ...)`` samples: the
    canvas holds the prompt and N positions, the blocks are ``block_length``'s (default: the model's block size,
    else one block of N; when they do not divide N the canvas runs on, masked, to the end of the last block, as
    generate with max_new_tokens rounded up to whole blocks decodes; a model whose blocks start at position 0 does
    so by itself) and rows stop at ``eos_token_id`` as
    generate's do (positions after a row's first stop
    must hold the fill token, the first stop id, and score 0; anything else there scores -inf: the chain cannot
    produce it). ``attention_mask`` [B, P]: left padding of the prompts. Cost: one call over copies on a
    bidirectional model (in parts of at most ``call_tokens`` positions), one call per block with the exact block
    cache on a block-causal one, one pass on a two-stream model, one forward on a causal model; no sampling.
    ``grad``: keep the autograd graph, so that ``logprobs`` and ``total`` are differentiable in the model's weights
    (a policy-gradient step re-scoring its rollouts: docs/studies/rl-rollouts.md); the numbers are the same.
    """
    spec = SAMPLERS["sequential"] if is_diffusion_model(model) else SAMPLERS["ar"]
    if not (is_diffusion_model(model) or is_causal_model(model)):
        raise TypeError(f"score needs a DiffusionModel or a CausalModel; got {type(model).__name__}")
    _check_model(model, spec)
    _check_input_ids(input_ids, model, spec)
    if not isinstance(continuation_ids, torch.Tensor) or continuation_ids.dim() != 2 \
            or continuation_ids.shape[0] != input_ids.shape[0] or continuation_ids.shape[1] < 1:
        raise ValueError(f"continuation_ids must be a tensor [batch={input_ids.shape[0]}, N >= 1], got "
                         f"{getattr(continuation_ids, 'shape', type(continuation_ids).__name__)}")
    if continuation_ids.dtype.is_floating_point or continuation_ids.dtype == torch.bool:
        raise TypeError(f"continuation_ids must hold integer token ids, got dtype {continuation_ids.dtype}")
    if continuation_ids.device != input_ids.device:
        raise ValueError(f"continuation_ids must be on input_ids' device {input_ids.device}, got "
                         f"{continuation_ids.device}")
    if int(continuation_ids.min()) < 0 or int(continuation_ids.max()) >= model.vocab_size:
        raise ValueError(f"continuation_ids must lie in [0, vocab_size={model.vocab_size}), got "
                         f"[{int(continuation_ids.min())}, {int(continuation_ids.max())}]")
    mask_id = getattr(model, "mask_token_id", None)
    if is_diffusion_model(model) and bool((continuation_ids == mask_id).any()):
        raise ValueError(f"continuation_ids must not contain the mask token (id {mask_id}): the chain never emits it")
    _check_temperature(temperature)
    check_int("top_logprobs", top_logprobs, minimum=0)
    if call_tokens is not None:
        check_int("call_tokens", call_tokens, minimum=1)
    new = continuation_ids.shape[1]
    attention_mask = _check_attention_mask(attention_mask, input_ids, model)
    stop_ids = resolve(model, eos_token_id)
    options, canvas = {}, new
    if is_diffusion_model(model):
        if cache not in ("auto", "none", "block"):
            raise ValueError(f"cache must be 'auto', 'none' or 'block' (the exact sessions), got {cache!r}")
        if block_length is not None:
            check_int("block_length", block_length, minimum=1)
        block = block_length or capabilities(model).block_size or new
        # whole blocks (the positions past N stay masked while N is scored), except on a model whose blocks start at
        # position 0: its canvas follows the prompt to a block's end by itself (Canvas.lead, tail), as generate's
        absolute = capabilities(model).block_anchor == "absolute"
        canvas = new if absolute else -(-new // block) * block
        config = spec.configure({"cache": cache, "block_length": block}, model=model, max_new_tokens=canvas)
        if not config.exact:
            raise ValueError(f"cache={cache!r} with block_length={block} is not an exact session on this model; "
                             "score reads the exact chain only")
        options = {key: config.values()[key] for key in ("block_length", "cache")}
    elif block_length is not None:
        raise ValueError("block_length is for a diffusion model's chain; a causal model has no blocks")
    _check_context(model, input_ids, attention_mask, canvas)
    record = Emissions.empty(input_ids.shape[0], new, max(1, top_logprobs), input_ids.shape[1], temperature,
                             "sampled", input_ids.device)
    stats = DecodeStats()
    start = time.perf_counter()
    forced = continuation_ids
    if canvas > new:  # the canvas' last positions: masked while the continuation is scored, never read after
        forced = torch.cat([continuation_ids, continuation_ids[:, -1:].expand(-1, canvas - new)], dim=1)
    if not isinstance(grad, bool):
        raise TypeError(f"grad must be True or False, got {grad!r}")
    with torch.enable_grad() if grad else torch.no_grad():
        scored = score_chain(model, input_ids, forced, temperature=temperature, stats=stats, record=record,
                             attention_mask=attention_mask, eos_token_id=stop_ids, call_tokens=call_tokens,
                             block_length=options.get("block_length", new), cache=options.get("cache", "none"))
    scored = scored[:, : input_ids.shape[1] + new]
    stats.wall_time_s = time.perf_counter() - start
    stats.settle()
    lengths = torch.full((input_ids.shape[0],), new, dtype=torch.long, device=input_ids.device)
    if stop_ids is not None:
        lengths = answer_lengths(continuation_ids, stop_ids)
        record.clear_after(lengths)
        impossible = scored[:, input_ids.shape[1]:] != continuation_ids  # after a stop, anything but the fill
        record.buffer[:, :-1] = record.logprobs.masked_fill(impossible, float("-inf"))
    logprobs = record.logprobs
    scored_part = torch.arange(new, device=logprobs.device)[None, :] < lengths[:, None]
    greedy = (logprobs >= record.top_logprobs[..., 0]) | ~scored_part
    top = {} if not top_logprobs else {"top_logprobs": record.top_logprobs[..., :top_logprobs],
                                       "top_token_ids": record.top_ids[..., :top_logprobs]}
    return ScoreOutput(logprobs, logprobs.double().sum(dim=1), greedy.all(dim=1), lengths, stats, **top,
                       options=options)


def _check_logprobs(spec: SamplerSpec, logprobs, top_logprobs, mode, model) -> None:
    if not isinstance(logprobs, bool):
        raise TypeError(f"logprobs must be True or False, got {logprobs!r}")
    check_int("top_logprobs", top_logprobs, minimum=0)
    if top_logprobs > model.vocab_size:
        raise ValueError(f"top_logprobs must be at most the vocabulary ({model.vocab_size}), got {top_logprobs}")
    if mode not in LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode must be one of {list(LOGPROBS_MODES)}, got {mode!r}")
    if top_logprobs and not logprobs:
        raise ValueError(f"top_logprobs={top_logprobs} needs logprobs=True")
    if logprobs and spec.name == "native":
        raise ValueError("logprobs: sampler 'native' runs the checkpoint's own loop, which hands back no logits; "
                         "use one of dllm's samplers")


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
