"""dllm: decoding diffusion language models with exact speculative denoising.

    out = dllm.generate(model, input_ids, sampler="fef", max_new_tokens=64, temperature=1.0,
                        generator=torch.Generator().manual_seed(0), window=4)
"""

from dllm.api import GenerateOutput, generate
from dllm.models.chat import apply_chat_template
from dllm.models.loading import load
from dllm.models.oracle import HMMOracle, InconsistentModel
from dllm.protocols import Capabilities, CausalModel, DiffusionModel, capabilities
from dllm.stats import DecodeStats, StepEvent

__version__ = "0.1.0"

__all__ = [
    "Capabilities",
    "CausalModel",
    "DecodeStats",
    "DiffusionModel",
    "GenerateOutput",
    "HMMOracle",
    "InconsistentModel",
    "StepEvent",
    "apply_chat_template",
    "capabilities",
    "generate",
    "load",
]
