"""The samplers people compare against: ``llada``, ``dream``, ``fast_dllm``, ``eb`` (approximate: several
positions at once from factorized marginals) and ``native`` (a checkpoint's own loop, counted in our harness).

``config.py`` holds their options, ``steppers.py`` their steps, ``native.py`` the native harness.
Tests: ``tests/test_samplers.py`` (llada, dream, fast_dllm, eb against the reference loops), ``tests/test_backends.py``.
"""

import functools

from ..loop import Stepping, options_stepper, run
from .config import DreamConfig, EbConfig, FastDllmConfig, LladaConfig, NativeConfig
from .native import native
from .steppers import DreamStepper, EbStepper, FastDllmStepper, LladaStepper


def _llada(temperature, generator, stats, blocks, block_length, *, steps, remasking, cfg_scale) -> LladaStepper:
    return LladaStepper(temperature, generator, stats, steps // blocks, block_length, remasking, cfg_scale)


def _dream(temperature, generator, stats, blocks, block_length, *, steps, alg, alg_temp, top_p, top_k) -> DreamStepper:
    return DreamStepper(temperature, generator, stats, steps // blocks, alg, alg_temp, top_p, top_k)


llada = functools.partial(run, Stepping(_llada))
dream = functools.partial(run, Stepping(_dream))
fast_dllm = functools.partial(run, Stepping(options_stepper(FastDllmStepper)))
eb = functools.partial(run, Stepping(options_stepper(EbStepper)))

__all__ = ["DreamConfig", "EbConfig", "FastDllmConfig", "LladaConfig", "NativeConfig", "dream", "eb", "fast_dllm",
           "llada", "native"]
