"""Evaluation presets: the generation settings a model family's own card or evaluation scripts use, by name.

``dllm eval TASK --preset NAME --model ...`` takes the preset's sampler, options, temperature, chat template and
answer length; any flag given explicitly wins over it, and the preset's name is written into the run's identity
(``run.json``), so a folder says which settings produced it. Each preset names where its values come from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Preset:
    """One family's published decoding: the sampler (its official decoder), its options, temperature, whether
    prompts go through the chat template, new tokens per answer, and the source of the values."""

    sampler: str
    options: dict[str, Any] = field(default_factory=dict)
    temperature: float = 0.0
    chat: bool = True
    max_new_tokens: int | None = None
    source: str = ""


PRESETS: dict[str, Preset] = {
    # SDAR's card reports its benchmarks with blocks of 4, 4 denoising steps and greedy decoding; its examples use
    # low_confidence_dynamic at threshold 0.9 through the chat template.
    "sdar": Preset("sdar", {"denoising_steps": 4, "remasking_strategy": "low_confidence_dynamic",
                            "confidence_threshold": 0.9}, source="JetLM/SDAR-*-Chat model card (Performance; "
                                                                  "Inference with JetEngine)"),
    # LLaDA2.0's generate defaults (threshold 0.95, 32 steps per block of 32, greedy), chat template.
    "llada2": Preset("llada2", {"steps": 32, "threshold": 0.95}, max_new_tokens=256,
                     source="LLaDA2MoeModelLM.generate's defaults (shared/remote_code/llada2)"),
    # LLaDA2.1's two published modes.
    "llada2.1-quality": Preset("llada2", {"steps": 32, "threshold": 0.7, "editing_threshold": 0.5,
                                          "max_post_steps": 16}, max_new_tokens=256,
                               source="diffusers LLaDA2 pipeline docs, recommended parameters: Quality"),
    "llada2.1-speed": Preset("llada2", {"steps": 32, "threshold": 0.5}, max_new_tokens=256,
                             source="diffusers LLaDA2 pipeline docs, recommended parameters: Speed"),
}


def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise ValueError(f"--preset must be one of {sorted(PRESETS)}, got {name!r}")
    return PRESETS[name]
