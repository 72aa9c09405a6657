"""Training data for the project's own small models: synthetic GSM8K-style problems and a BPE tokenizer.

The tokenizer module (``dllm.data.tokenizer``) and the study helper (``dllm.data.study``) import
``transformers``; they are not imported here so that generating problems stays light.
"""

from dllm.data.calc import annotations, evaluate, final_answer, solution_errors
from dllm.data.gsm8k import load_gsm8k_train, mixed_stream
from dllm.data.synthetic import (
    HELDOUT_SEED,
    HELDOUT_SIZE,
    PRESETS,
    ProblemConfig,
    build_heldout,
    format_example,
    generate,
    heldout_set,
    make_problem,
    training_stream,
)

__all__ = [
    "HELDOUT_SEED",
    "HELDOUT_SIZE",
    "PRESETS",
    "ProblemConfig",
    "annotations",
    "build_heldout",
    "evaluate",
    "final_answer",
    "format_example",
    "generate",
    "heldout_set",
    "load_gsm8k_train",
    "make_problem",
    "mixed_stream",
    "solution_errors",
    "training_stream",
]
