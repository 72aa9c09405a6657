"""Samplers (installed as dllm.samplers): one module per family, one shared verification core."""

from .registry import SAMPLERS, SamplerSpec
from .sequential import sequential_distribution
from .verify import VerifyResult, verify

__all__ = ["SAMPLERS", "SamplerSpec", "VerifyResult", "sequential_distribution", "verify"]
