"""Training the small default models: configs, objectives, the loop and held-out evaluation.

``python -m dllm.train --config configs/ar.toml`` is the entry point (``dllm.train.main``).
"""

from dllm.training.config import DataConfig, OptimConfig, RunConfig, config_from_dict, load_config
from dllm.training.loop import build_model, ensure_tokenizer, heldout_loss, train

__all__ = [
    "DataConfig",
    "OptimConfig",
    "RunConfig",
    "build_model",
    "config_from_dict",
    "ensure_tokenizer",
    "heldout_loss",
    "load_config",
    "train",
]
