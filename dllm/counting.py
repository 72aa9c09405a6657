"""Counting model calls: what a native loop declares for the harness to count, and the hooks that count.

Ground floor: adapters build a ``NativeLoop`` (their checkpoint's own loop plus the modules it calls);
``samplers/native.py`` runs it, counting every call in ``DecodeStats`` under the definitions our samplers
use, so the reference loop and ours compare directly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from dllm.stats import DecodeStats

ROUND_RULES = ("steps", "tokens", "calls")


@dataclass(frozen=True)
class Counted:
    """A module whose forward calls are model calls: ``draft`` ones count as the drafter's; the ids are the
    keyword ``key`` (or the first positional argument); ``steps``: its calls are the loop's steps."""

    module: torch.nn.Module
    draft: bool = False
    key: str = "input_ids"
    steps: bool = False


@dataclass(frozen=True)
class NativeLoop:
    """A checkpoint's own generation loop, ready to run, and what the harness needs to count it.

    ``rounds`` says what a round is (``DecodeStats.rounds``): ``steps``, one step of one row (rows x step
    calls, for denoising loops); ``tokens``, one row's call while it runs (answer tokens per row, for plain
    AR loops); ``calls``, one step call (assisted generation, one row).
    """

    run: Callable[[], torch.Tensor]  # -> sequences [B, P + N'] (or an output with ``.sequences``)
    counted: list[Counted] = field(default_factory=list)
    rounds: str = "steps"
    pad_token_id: int = 0
    device: torch.device = torch.device("cpu")

    def __post_init__(self):
        if self.rounds not in ROUND_RULES:
            raise ValueError(f"NativeLoop rounds must be one of {ROUND_RULES}, got {self.rounds!r}")


def count_calls(module, stats: DecodeStats, draft: bool = False, key: str = "input_ids",
                calls: list | None = None):
    """A forward pre-hook on ``module`` counting each call in ``stats`` (the ids under ``key``, or the first
    positional argument, as checkpoints' own loops pass them), also appended to ``calls`` -> the handle."""
    def hook(module, args, kwargs):
        stats.count_call(kwargs.get(key, args[0] if args else None), draft=draft)
        if calls is not None:
            calls.append(1)

    return module.register_forward_pre_hook(hook, with_kwargs=True)
