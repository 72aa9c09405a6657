"""The samplers people compare against: ``llada``, ``dream``, ``fast_dllm``, ``eb`` (approximate: several
positions at once from factorized marginals) and ``native`` (a checkpoint's own loop, counted in our harness).

``config.py`` holds their options, ``steppers.py`` their steps, ``native.py`` the native harness.
Tests: ``tests/test_samplers.py`` (llada, dream, fast_dllm, eb against the reference loops), ``tests/test_backends.py``.
"""

import functools

from ..loop import Stepping, options_stepper, run
from .config import DreamConfig, EbConfig, FastDllmConfig, Llada2Config, LladaConfig, NativeConfig, SdarConfig
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


def _sdar(temperature, generator, stats, blocks, block_length, **options) -> SdarStepper:
    return SdarStepper(temperature, generator, stats, block_length, **options)


def _llada2(temperature, generator, stats, blocks, block_length, **options) -> Llada2Stepper:
    options.pop("minimal_topk")  # (applied to steps by Llada2Config.validate)
    return Llada2Stepper(temperature, generator, stats, block_length, **options)


llada = functools.partial(run, Stepping(_llada))
llada2 = functools.partial(run, Stepping(_llada2))
sdar = functools.partial(run, Stepping(_sdar))
dream = functools.partial(run, Stepping(_dream))
fast_dllm = functools.partial(run, Stepping(options_stepper(FastDllmStepper)))
eb = functools.partial(run, Stepping(options_stepper(EbStepper)))

__all__ = ["DreamConfig", "EbConfig", "FastDllmConfig", "Llada2Config", "LladaConfig", "NativeConfig", "SdarConfig",
           "dream", "eb", "fast_dllm", "llada", "llada2", "native", "sdar"]
