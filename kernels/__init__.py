"""Hot-path kernels, each beside a torch reference with the same signature (installed as dllm.kernels)."""

from .sampling import SampleConfidence, sample_confidence, sample_confidence_reference

__all__ = ["SampleConfidence", "sample_confidence", "sample_confidence_reference"]
