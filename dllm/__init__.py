"""dllm: decoding diffusion language models with exact speculative denoising.

    out = dllm.generate(model, input_ids, sampler="fef", max_new_tokens=64, temperature=1.0,
                        generator=torch.Generator().manual_seed(0), window=4)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# Public name -> the module defining it. Imported on first use (PEP 562) so that `import dllm` (and the
# console script's `from dllm.cli import main`) costs no torch/transformers import: the CLI's guard is
# then in place before the seconds of heavy imports, and Ctrl-C there ends in one line, not a traceback.
_PUBLIC = {
    "Capabilities": "dllm.protocols",
    "CausalModel": "dllm.protocols",
    "DecodeStats": "dllm.stats",
    "DiffusionModel": "dllm.protocols",
    "GenerateOutput": "dllm.api",
    "HMMOracle": "dllm.models.oracle",
    "InconsistentModel": "dllm.models.oracle",
    "ScoreOutput": "dllm.api",
    "StepEvent": "dllm.stats",
    "apply_chat_template": "dllm.models.chat",
    "capabilities": "dllm.protocols",
    "generate": "dllm.api",
    "load": "dllm.models.loading",
    "score": "dllm.api",
}

__all__ = [  # written out (not sorted(_PUBLIC)) so linters and IDEs see the names
    "Capabilities",
    "CausalModel",
    "DecodeStats",
    "DiffusionModel",
    "GenerateOutput",
    "HMMOracle",
    "InconsistentModel",
    "ScoreOutput",
    "StepEvent",
    "apply_chat_template",
    "capabilities",
    "generate",
    "load",
    "score",
]

if TYPE_CHECKING:
    from dllm.api import GenerateOutput, ScoreOutput, generate, score
    from dllm.models.chat import apply_chat_template
    from dllm.models.loading import load
    from dllm.models.oracle import HMMOracle, InconsistentModel
    from dllm.protocols import Capabilities, CausalModel, DiffusionModel, capabilities
    from dllm.stats import DecodeStats, StepEvent


def __getattr__(name: str):
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'dllm' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
