"""The options of the samplers people compare against: ``llada``, ``dream``, ``fast_dllm``, ``eb`` and ``native``."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar

from dllm.defaults import SAMPLER_DEFAULTS
from dllm.protocols import capabilities, is_causal_model

from ..options import (
    BlockConfig,
    SamplerConfig,
    choice,
    int_at_least,
    no_check,
    number,
    option,
    optional_dict,
    optional_int,
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
    """``sdar``: SDAR's official block decoder, its option names and command-line defaults."""

    denoising_steps: int = option(SDAR["denoising_steps"], int_at_least(1), "int")
    remasking_strategy: str = option(SDAR["remasking_strategy"], choice(SDAR_STRATEGIES), "str")
    confidence_threshold: float = option(SDAR["confidence_threshold"], number(0.0, 1.0), "float")
    top_k: int = option(SDAR["top_k"], int_at_least(0), "int")  # 0: no top-k filter
    top_p: float = option(SDAR["top_p"], number(0.0, 1.0, low_open=True), "float")  # 1.0: no nucleus filter


@dataclass(frozen=True)
class Llada2Config(BlockConfig):
    """``llada2``: LLaDA2's official block decoder (2.0's threshold decoding; 2.1's token editing when
    ``editing_threshold`` is given), its option names and defaults."""

    steps: int = option(LLADA2["steps"], int_at_least(1), "int")  # per block; at most max_new_tokens // minimal_topk
    threshold: float = option(LLADA2["threshold"], number(0.0, 1.0), "float")
    top_k: int | None = option(LLADA2["top_k"], optional_int(1), "int")
    top_p: float | None = option(LLADA2["top_p"], number(0.0, 1.0, low_open=True, optional=True), "float")
    minimal_topk: int = option(LLADA2["minimal_topk"], int_at_least(1), "int")
    editing_threshold: float | None = option(LLADA2["editing_threshold"], number(0.0, 1.0, optional=True), "float")
    max_post_steps: int = option(LLADA2["max_post_steps"], int_at_least(0), "int")  # 2.1: edit calls after a block
    # 2.1: the tokens a step reveals when fewer pass the threshold
    num_to_transfer: int = option(LLADA2["num_to_transfer"], int_at_least(1), "int")

    def validate(self, model, max_new_tokens: int) -> Llada2Config:
        """As the official function does, the steps per block are at most max_new_tokens // minimal_topk (shown in
        ``GenerateOutput.options``)."""
        config = super().validate(model, max_new_tokens)
        return replace(config, steps=max(1, min(config.steps, max_new_tokens // config.minimal_topk)))


@dataclass(frozen=True)
class NativeConfig(SamplerConfig):
    """``native``: the checkpoint's own loop (``native_loop``)."""

    generate_kwargs: dict | None = option(NATIVE["generate_kwargs"], optional_dict, "dict")
    drafter: Any = option(NATIVE["drafter"], no_check, "drafter")  # a transformers assistant, checked by _check_native
    CHECKS: ClassVar[tuple] = (_check_native,)
