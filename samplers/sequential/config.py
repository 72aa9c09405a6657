"""``sequential``'s options: the reveal order over the blocks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from dllm.defaults import SAMPLER_DEFAULTS

from ..options import BlockConfig, choice, option
from ..order import ORDERS

SEQUENTIAL = SAMPLER_DEFAULTS["sequential"]


@dataclass(frozen=True)
class SequentialConfig(BlockConfig):
    """``sequential``: one position per call, the reference chain fef reproduces."""

    EXACT: ClassVar[bool] = True
    order: str = option(SEQUENTIAL["order"], choice(ORDERS), "str")
