"""Training recipes beyond the default one: ``python -m dllm.train --recipe NAME [its own arguments]``.

The default recipe (no ``--recipe``) trains a model from a TOML config (``dllm.training.loop``). Every other
recipe is a module with ``main(argv: list[str]) -> int`` that parses its own arguments; this table names
them, imported only when chosen so that ``dllm train --help`` stays fast.
"""

from __future__ import annotations

import importlib
import sys

RECIPES: dict[str, str] = {
    # name: module with main(argv) -> int, or "module:function"
    "prefix-conditioned": "dllm.training.prefix",  # the two-stream layout's any-order objective
    "fef-head": "dllm.training.fef_head",  # fef draft head on a frozen block-diffusion backbone
    "fef-head-chain": "dllm.training.fef_chain",  # the same head on the backbone's own chains (shipped head)
    "two-stream-head": "dllm.training.two_stream_head",  # a fef head on a two-stream model, from fef's rounds
    "eagle-head": "dllm.training.ar_heads:eagle_main",
    "dflash-head": "dllm.training.ar_heads:dflash_main",
    "repair-head": "dllm.training.ar_heads:repair_main",
    "distill-drafter": "dllm.training.ar_heads:drafter_main",  # the diffusion drafter's own weights, for ar_spec
    "sdar": "dllm.training.sdar",  # the shipped SDAR-layout model: start point, hub export, evaluation
    "grpo": "dllm.training.grpo",  # policy-gradient steps with exact rollouts (fef + logprobs) and their study
}


def run_recipe(name: str, argv: list[str]) -> int:
    """Run recipe ``name`` on its own arguments ``argv``."""
    if name not in RECIPES:
        known = ", ".join(sorted(RECIPES)) or "none yet"
        print(f"dllm train: --recipe must be one of: {known}; got {name!r}", file=sys.stderr)
        return 2
    module, _, function = RECIPES[name].partition(":")
    return getattr(importlib.import_module(module), function or "main")(argv)
