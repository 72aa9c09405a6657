"""The options of the samplers people compare against: ``llada``, ``dream``, ``fast_dllm``, ``eb`` and ``native``."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar

from dllm.defaults import SAMPLER_DEFAULTS
from dllm.protocols import capabilities, is_causal_model

from ..options import (
    BlockConfig,
    SamplerConfig,
    boolean,
    choice,
    int_at_least,
    no_check,
    number,
    option,
    optional_dict,
    optional_int,
    optional_ints,
)
from .steppers import DREAM_ALGORITHMS, REMASKING, SDAR_STRATEGIES

LLADA = SAMPLER_DEFAULTS["llada"]
DREAM = SAMPLER_DEFAULTS["dream"]
FAST_DLLM = SAMPLER_DEFAULTS["fast_dllm"]
EB = SAMPLER_DEFAULTS["eb"]
SDAR = SAMPLER_DEFAULTS["sdar"]
LLADA2 = SAMPLER_DEFAULTS["llada2"]
NATIVE = SAMPLER_DEFAULTS["native"]


def _check_guidance(values: dict[str, Any], model) -> None:
    if values["cache"] not in ("auto", "none") and values["cfg_scale"] > 0:
        raise ValueError("cfg_scale > 0 needs full-sequence calls: use cache='none' (or 'auto')")


def _check_threshold_or_factor(values: dict[str, Any], model) -> None:
    if values["threshold"] is not None and values["factor"] is not None:
        raise ValueError("fast_dllm takes either threshold or factor, not both")


def _check_native(values: dict[str, Any], model) -> None:
    """The model must bring its own loop; a drafter (transformers' assisted generation) only for a causal one."""
    if not capabilities(model).native_loop:
        raise TypeError(f"sampler='native' runs a checkpoint's own sampler through native_loop(); "
                        f"{type(model).__name__} has none (DiffusionGemma, Dream and causal adapters do; Dream's "
                        "diffusion_generate is its hub code: dllm.load(..., trust_remote_code=True))")
    drafter = values.get("drafter")
    # A drafter with its own native loop is a loaded causal checkpoint, the assistant transformers takes.
    if drafter is not None and not (is_causal_model(model) and is_causal_model(drafter)
                                    and capabilities(drafter).native_loop):
        raise TypeError("sampler='native' takes a drafter only for a causal model, as a loaded causal "
                        "checkpoint (transformers' assisted generation)")


def _check_official_names(values: dict[str, Any], model, max_new_tokens: int) -> None:
    """An official decoder's names for ``generate``'s own parameters must agree with them: ``mask_id`` with the
    model's mask token, ``gen_length`` with max_new_tokens (None: not given). Its stop ids are checked where the run
    knows them (``stop_names``)."""
    mask_id, gen_length = values.get("mask_id"), values.get("gen_length")
    if mask_id is not None and mask_id != model.mask_token_id:
        raise ValueError(f"mask_id={mask_id} (the official decoder's mask token) differs from this model's "
                         f"mask_token_id={model.mask_token_id}: load it with dllm.load(..., mask_token_id={mask_id}) "
                         "or leave mask_id out")
    if gen_length is not None and gen_length != max_new_tokens:
        raise ValueError(f"gen_length={gen_length} (the official decoder's name for max_new_tokens) differs from "
                         f"max_new_tokens={max_new_tokens}: pass max_new_tokens={gen_length} (gen_length may then be "
                         "left out)")


def stop_names(name: str, given, stop_ids: tuple[int, ...] | None) -> None:
    """An official decoder's stop tokens (LLaDA2's ``eos_id``, SDAR's ``stopping_criteria_idx``; None: not given)
    must be the run's stop ids (``generate``'s ``eos_token_id``, by default the model's), so that rows stop where
    the official function stops them; a ValueError naming both otherwise."""
    if given is None:
        return
    ids = given if isinstance(given, list | tuple) else [given]
    if set(ids) != set(stop_ids or ()):
        run = list(stop_ids) if stop_ids else None
        fix = f"eos_token_id={ids[0] if len(ids) == 1 else list(ids)}" if ids else "eos_token_id=None"
        raise ValueError(f"{name}={given!r} (the official decoder's stop tokens) contradicts this run's stop ids "
                         f"{run} (generate's eos_token_id, by default the model's): pass {fix} or leave {name} out")


@dataclass(frozen=True)
class LladaConfig(BlockConfig):
    """``llada``: LLaDA's low-confidence remasking over a fixed number of steps, optional classifier-free guidance."""

    steps: int = option(LLADA["steps"], int_at_least(1), "int")
    remasking: str = option(LLADA["remasking"], choice(REMASKING), "str")
    cfg_scale: float = option(LLADA["cfg_scale"], number(0.0), "float")
    CHECKS: ClassVar[tuple] = (_check_guidance,)


@dataclass(frozen=True)
class DreamConfig(BlockConfig):
    """``dream``: Dream's unmasking algorithms with its top-p / top-k filters."""

    steps: int = option(DREAM["steps"], int_at_least(1), "int")
    alg: str = option(DREAM["alg"], choice(DREAM_ALGORITHMS), "str")
    alg_temp: float | None = option(DREAM["alg_temp"], number(0.0, optional=True), "float")
    top_p: float | None = option(DREAM["top_p"], number(0.0, 1.0, low_open=True, optional=True), "float")
    top_k: int | None = option(DREAM["top_k"], optional_int(1), "int")


@dataclass(frozen=True)
class FastDllmConfig(BlockConfig):
    """``fast_dllm``: parallel unmasking above a confidence threshold (or by a factor)."""

    threshold: float | None = option(FAST_DLLM["threshold"], number(0.0, 1.0, optional=True), "float")
    factor: float | None = option(FAST_DLLM["factor"], number(0.0, low_open=True, optional=True), "float")
    CHECKS: ClassVar[tuple] = (_check_threshold_or_factor,)


@dataclass(frozen=True)
class EbConfig(BlockConfig):
    """``eb``: entropy-bounded parallel unmasking."""

    gamma: float = option(EB["gamma"], number(0.0), "float")


@dataclass(frozen=True)
class SdarConfig(BlockConfig):
    """``sdar``: SDAR's official block decoder (``block_diffusion_generate``), its option names and command-line
    defaults. Its ``block_length`` is the run's attention block, as the official function builds its mask from it.
    Its names for ``generate``'s own parameters are accepted where they agree: ``mask_id`` (the model's mask token),
    ``gen_length`` (max_new_tokens), ``stopping_criteria_idx`` (the run's stop ids); ``eb_threshold`` is read only
    by its ``entropy_bounded`` strategy, which is refused (see ``SDAR_STRATEGIES``), so it changes nothing."""

    denoising_steps: int = option(SDAR["denoising_steps"], int_at_least(1), "int")
    remasking_strategy: str = option(SDAR["remasking_strategy"], choice(SDAR_STRATEGIES), "str")
    confidence_threshold: float = option(SDAR["confidence_threshold"], number(0.0, 1.0), "float")
    top_k: int = option(SDAR["top_k"], int_at_least(0), "int")  # 0: no top-k filter
    top_p: float = option(SDAR["top_p"], number(0.0, 1.0, low_open=True), "float")  # 1.0: no nucleus filter
    eb_threshold: float | None = option(SDAR["eb_threshold"], number(0.0, optional=True), "float")
    mask_id: int | None = option(SDAR["mask_id"], optional_int(0), "int")
    gen_length: int | None = option(SDAR["gen_length"], optional_int(1), "int")
    stopping_criteria_idx: list[int] | None = option(SDAR["stopping_criteria_idx"], optional_ints, "ints")

    def validate(self, model, max_new_tokens: int) -> SdarConfig:
        config = super().validate(model, max_new_tokens)
        _check_official_names(config.values(), model, max_new_tokens)
        return config


@dataclass(frozen=True)
class Llada2Config(BlockConfig):
    """``llada2``: LLaDA2's official block decoder (2.0's threshold decoding; 2.1's token editing when
    ``editing_threshold`` is given), its option names and defaults. Its ``block_length`` is the run's attention
    block, as the official ``generate`` builds its mask from it. Its names for ``generate``'s own parameters are
    accepted where they agree: ``eos_id`` (the run's one stop id), ``mask_id`` (the model's mask token),
    ``gen_length`` (max_new_tokens). ``eos_early_stop`` changes no token: rows always stop once their answer is
    settled up to their first stop (2.0 at the stop, 2.1 at the end of its block), which is what the official
    function returns either way."""

    steps: int = option(LLADA2["steps"], int_at_least(1), "int")  # per block; at most max_new_tokens // minimal_topk
    threshold: float = option(LLADA2["threshold"], number(0.0, 1.0), "float")
    top_k: int | None = option(LLADA2["top_k"], optional_int(0), "int")  # 0 or None: no top-k filter
    top_p: float | None = option(LLADA2["top_p"], number(0.0, 1.0, low_open=True, optional=True), "float")
    minimal_topk: int = option(LLADA2["minimal_topk"], int_at_least(1), "int")
    editing_threshold: float | None = option(LLADA2["editing_threshold"], number(0.0, 1.0, optional=True), "float")
    max_post_steps: int = option(LLADA2["max_post_steps"], int_at_least(0), "int")  # 2.1: edit calls after a block
    # 2.1: the tokens a step reveals when fewer pass the threshold
    num_to_transfer: int = option(LLADA2["num_to_transfer"], int_at_least(1), "int")
    eos_early_stop: bool = option(LLADA2["eos_early_stop"], boolean, "bool")
    eos_id: int | None = option(LLADA2["eos_id"], optional_int(0), "int")
    mask_id: int | None = option(LLADA2["mask_id"], optional_int(0), "int")
    gen_length: int | None = option(LLADA2["gen_length"], optional_int(1), "int")

    def validate(self, model, max_new_tokens: int) -> Llada2Config:
        """As the official function does, the steps per block are at most max_new_tokens // minimal_topk (shown in
        ``GenerateOutput.options``)."""
        config = super().validate(model, max_new_tokens)
        _check_official_names(config.values(), model, max_new_tokens)
        return replace(config, steps=max(1, min(config.steps, max_new_tokens // config.minimal_topk)))


@dataclass(frozen=True)
class NativeConfig(SamplerConfig):
    """``native``: the checkpoint's own loop (``native_loop``)."""

    generate_kwargs: dict | None = option(NATIVE["generate_kwargs"], optional_dict, "dict")
    drafter: Any = option(NATIVE["drafter"], no_check, "drafter")  # a transformers assistant, checked by _check_native
    CHECKS: ClassVar[tuple] = (_check_native,)
