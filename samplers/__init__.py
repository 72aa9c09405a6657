"""Samplers (installed as dllm.samplers): one module per family, one shared verification core."""

from .registry import SAMPLERS, SamplerSpec, parse_options, typed_options
from .sequential import sequential_distribution
from .verify import VerifyResult, verify

__all__ = ["SAMPLERS", "SamplerSpec", "VerifyResult", "parse_options", "sequential_distribution", "typed_options",
           "verify"]
