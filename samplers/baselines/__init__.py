"""The samplers people compare against: ``llada``, ``dream``, ``fast_dllm``, ``eb`` (approximate: several
positions at once from factorized marginals), the official block decoders of LLaDA2 (``llada2``) and SDAR
(``sdar``), and ``native`` (a checkpoint's own loop, counted in our harness).

``config.py`` holds their options, ``steppers.py`` their steps, ``native.py`` the native harness.
Tests: ``tests/test_backends.py`` (every sampler on every backend kind, ragged batches), ``tests/test_dream_filter.py``
(Dream's top-p / top-k against its own code), ``tests/test_llada2_samplers.py`` and ``tests/test_sdar_samplers.py``
(token for token against the official decoders), ``tests/test_remote.py`` (``native``).
"""

import functools

from ..loop import Stepping, options_stepper, run
from .config import (
    DreamConfig,
    EbConfig,
    FastDllmConfig,
    Llada2Config,
    LladaConfig,
    NativeConfig,
    SdarConfig,
    stop_names,
)
from .native import native
from .steppers import DreamStepper, EbStepper, FastDllmStepper, Llada2Stepper, LladaStepper, SdarStepper


def _llada(temperature, generator, stats, blocks, block_length, *, steps, remasking, cfg_scale) -> LladaStepper:
    return LladaStepper(temperature, generator, stats, _per_block(steps, blocks), block_length, remasking, cfg_scale)


def _dream(temperature, generator, stats, blocks, block_length, *, steps, alg, alg_temp, top_p, top_k) -> DreamStepper:
    return DreamStepper(temperature, generator, stats, _per_block(steps, blocks), alg, alg_temp, top_p, top_k)


def _per_block(steps: int, blocks: int) -> int:
    """Steps per block. The configs check ``steps`` against max_new_tokens / block_length; on a model whose blocks
    start at position 0 the canvas may hold a block more (the prompt's tail opens the first one), known here."""
    if steps < blocks:
        raise ValueError(f"steps={steps} must be at least the number of blocks this canvas decodes ({blocks}: the "
                         "model's blocks start at position 0, so the prompt's tail and the answer span that many)")
    return steps // blocks


# The official decoders' names for generate's own parameters, checked at the door (SdarConfig, Llada2Config) or
# against the run's stop ids (stop_names); the steppers never read them.
_SDAR_NAMES = ("eb_threshold", "mask_id", "gen_length", "stopping_criteria_idx")
_LLADA2_NAMES = ("minimal_topk", "eos_early_stop", "eos_id", "mask_id", "gen_length")  # minimal_topk: in steps


def _sdar(temperature, generator, stats, blocks, block_length, **options) -> SdarStepper:
    return SdarStepper(temperature, generator, stats, block_length, **_without(options, _SDAR_NAMES))


def _llada2(temperature, generator, stats, blocks, block_length, **options) -> Llada2Stepper:
    return Llada2Stepper(temperature, generator, stats, block_length, **_without(options, _LLADA2_NAMES))


def _without(options: dict, names: tuple[str, ...]) -> dict:
    return {name: value for name, value in options.items() if name not in names}


def _stops(name: str, options: dict, stop_ids: tuple[int, ...] | None) -> None:
    stop_names(name, options[name], stop_ids)


llada = functools.partial(run, Stepping(_llada))
llada2 = functools.partial(run, Stepping(_llada2, check=functools.partial(_stops, "eos_id")))
sdar = functools.partial(run, Stepping(_sdar, check=functools.partial(_stops, "stopping_criteria_idx")))
dream = functools.partial(run, Stepping(_dream))
fast_dllm = functools.partial(run, Stepping(options_stepper(FastDllmStepper)))
eb = functools.partial(run, Stepping(options_stepper(EbStepper)))

__all__ = ["DreamConfig", "EbConfig", "FastDllmConfig", "Llada2Config", "LladaConfig", "NativeConfig", "SdarConfig",
           "dream", "eb", "fast_dllm", "llada", "llada2", "native", "sdar"]
