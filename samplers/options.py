"""Sampler options: the frozen config every sampler family declares, its option fields and their checks.

A family's config (``samplers/<family>/config.py``) is a frozen dataclass of ``option`` fields, each with its
default (from the one table, ``dllm.defaults.SAMPLER_DEFAULTS``), a check that raises a message naming it and
its kind (how command-line text is parsed); ``SamplerConfig.validate`` fills the defaults that depend on the
model and runs every check once, at the door (``generate``, the CLI, the lm-eval backend).
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from typing import Any, ClassVar

from dllm.defaults import MAX_NEW, SAMPLER_DEFAULTS
from dllm.numerics import check_int
from dllm.protocols import capabilities, run_block_size

from .sessions import CACHE_MODES, session_exact

MASKED = SAMPLER_DEFAULTS["masked"]


KINDS = ("int", "float", "str", "dict", "drafter", "bool", "ints")  # what an option's value is; text is parsed by it


@dataclass(frozen=True)
class Option:
    """One sampler option: its default, a check that raises a message naming it, and its kind (KINDS)."""

    default: Any
    check: Callable[[str, Any], None]
    kind: str

    def parse(self, name: str, text: str) -> Any:
        """The value that command-line text stands for, read as this option's kind ("none" only where
        the option takes None: a string option keeps "none", "true", "1e3" as strings)."""
        if self.kind in ("str", "drafter"):
            return text
        if text.strip().lower() in ("none", "null"):
            return None
        if self.kind == "bool":
            word = text.strip().lower()
            if word not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(f"{name} expects true or false, got {text!r}")
            return word in ("true", "1", "yes")
        if self.kind == "dict":
            try:
                value = json.loads(text)
            except json.JSONDecodeError:
                value = text
            if not isinstance(value, dict):
                raise ValueError(f"{name} expects a JSON object such as '{{\"steps\": 64}}', got {text!r}")
            return value
        if self.kind == "ints":  # "1,2", "[1, 2]" or "1"
            try:
                return [int(item) for item in text.strip().strip("[]").split(",") if item.strip()]
            except ValueError:
                raise ValueError(f"{name} expects ints separated by commas such as '1,2', got {text!r}") from None
        cast = int if self.kind == "int" else float
        try:
            return cast(text)
        except ValueError:
            raise ValueError(f"{name} expects {'an int' if cast is int else 'a number'}, got {text!r}") from None


def option(default: Any, check: Callable[[str, Any], None], kind: str) -> Any:
    """A config field that is a sampler option: its default is written here, once."""
    return field(default=default, metadata={"option": Option(default, check, kind)})


@dataclass(frozen=True)
class SamplerConfig:
    """A sampler's options; ``validate`` fills the defaults that depend on the model and checks everything once."""

    EXACT: ClassVar[bool] = False  # the sampler samples exactly the sequential chain (of the causal target)
    # The sampler's own rules, run last by validate as check(values, model) on the filled options: each
    # raises a message naming the option.
    CHECKS: ClassVar[tuple[Callable[[dict[str, Any], Any], None], ...]] = ()

    @classmethod
    def options(cls) -> dict[str, Option]:
        return {f.name: f.metadata["option"] for f in fields(cls)}

    def values(self) -> dict[str, Any]:
        """The options by name (not dataclasses.asdict, which would deep-copy a drafter model)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @property
    def exact(self) -> bool:
        """Whether this run samples the exact law (an approximate cache or verifier makes it drift): what
        ``generate`` reports; the call path's part is its session's declared ``exact`` (``session_exact``)."""
        return self.EXACT

    def validate(self, model, max_new_tokens: int) -> SamplerConfig:
        """This config with defaults filled; bad values raise naming the option."""
        options, values = self.options(), self.values()
        # block_length / steps default to max_new_tokens (also when passed as None), except that a
        # block-causal model's blocks are its own block_size when that divides max_new_tokens: decoding
        # then matches training and the exact block cache applies. On a model whose blocks are a run's choice
        # (Capabilities.run_blocks) a block_length also sets the run's attention blocks (run_block_size).
        caps = capabilities(model)
        block_size = caps.block_size
        absolute = bool(block_size) and caps.block_anchor == "absolute"  # blocks from position 0 (Canvas.lead)
        nested = (caps.block_logits_only or absolute) and bool(block_size)
        if "block_length" in values and values["block_length"] in (MAX_NEW, None) and block_size:
            if max_new_tokens % block_size == 0 or absolute:  # (an absolute canvas ends at a block's end itself)
                values["block_length"] = block_size
            elif nested:  # blocks must nest in the model's: the largest size dividing both
                values["block_length"] = math.gcd(block_size, max_new_tokens)
        values = {name: max_new_tokens if v is MAX_NEW or (v is None and options[name].default is MAX_NEW)
                  else v for name, v in values.items()}
        for name, opt in options.items():
            opt.check(name, values[name])
        if block_size and "block_length" in values:
            _check_run_blocks(values["block_length"], model, nested, absolute)
        if not absolute:  # an absolute canvas's blocks follow the prompt, not max_new_tokens (Canvas.lead, tail)
            _check_schedule(values, max_new_tokens)
        _check_cache(values, model)
        for check in self.CHECKS:
            check(values, model)
        return replace(self, **values)




def _check_run_blocks(block_length: int, model, nested: bool, absolute: bool) -> None:
    """A sampler's blocks nest in the run's attention blocks (``run_block_size``); a run whose attention blocks are
    not the checkpoint's (its block_length, on a model that takes blocks per run) says so in one UserWarning."""
    block_size, size = capabilities(model).block_size, run_block_size(model, block_length)
    if nested and size % block_length:
        why = ("its blocks start at position 0, so a sampler's blocks nest in them" if absolute else
               f"{type(model).__name__} gives logits only inside its own blocks, so a sampler's block may not "
               "straddle two of them")
        raise ValueError(f"block_length={block_length} must divide this model's block_size={block_size}: " + why)
    if size != block_size:
        warnings.warn(f"block_length={block_length} sets this run's attention blocks ({size} positions), not "
                      f"{type(model).__name__}'s block_size={block_size}: the block-causal mask follows block_length, "
                      "as the family's official decoder builds it", UserWarning, stacklevel=3)


def int_at_least(minimum: int) -> Callable[[str, Any], None]:
    return lambda name, value: check_int(name, value, minimum)


def number(low: float, high: float = math.inf, *, low_open: bool = False, optional: bool = False):
    def check(name: str, value: Any) -> None:
        if value is None and optional:
            return
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise TypeError(f"{name} must be a finite number{' or None' if optional else ''}, got {value!r}")
        if value < low or (low_open and value == low) or value > high:
            interval = f"{'(' if low_open else '['}{low}, {high}]"
            raise ValueError(f"{name} must lie in {interval}, got {value}")
    return check


def boolean(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")


def optional_ints(name: str, value: Any) -> None:
    """None, one int >= 0 or a sequence of them (token ids)."""
    if value is None:
        return
    for item in value if isinstance(value, list | tuple) else [value]:
        check_int(name, item, 0)


def optional_int(minimum: int):
    inner = int_at_least(minimum)
    return lambda name, value: None if value is None else inner(name, value)


def choice(choices: tuple[str, ...]):
    def check(name: str, value: Any) -> None:
        if value not in choices:
            raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")
    return check


def optional_dict(name: str, value: Any) -> None:
    if value is not None and not isinstance(value, dict):
        raise TypeError(f"{name} must be a dict of keyword arguments or None, got {type(value).__name__}")


def no_check(name: str, value: Any) -> None:
    return None


def is_tree(values: dict[str, Any]) -> bool:
    """Whether draft_candidates asks for a draft tree; candidates_below without one is refused."""
    if values["draft_candidates"] == 1 and values.get("candidates_below") is not None:
        raise ValueError("candidates_below limits a draft tree's siblings to unsure drafts; it needs "
                         "draft_candidates > 1, got draft_candidates=1")
    return values["draft_candidates"] > 1


def _check_schedule(values: dict[str, Any], max_new_tokens: int) -> None:
    """block_length must divide max_new_tokens; steps must split evenly over the blocks."""
    block = values.get("block_length")
    if block is None:
        return
    if max_new_tokens % block:
        raise ValueError(f"block_length={block} must divide max_new_tokens={max_new_tokens}")
    blocks = max_new_tokens // block
    steps = values.get("steps")
    if steps is not None and (steps < blocks or steps % blocks):
        raise ValueError(f"steps={steps} must be a positive multiple of the number of blocks "
                         f"(max_new_tokens / block_length = {blocks})")


def _check_cache(values: dict[str, Any], model) -> None:
    """An explicit cache must be one the model offers; ``block`` must also be exact for these blocks."""
    cache = values.get("cache", "auto")
    if cache in ("auto", "none"):
        return
    caps = capabilities(model)
    if not caps.cache:
        raise ValueError(f"cache={cache!r} needs a model with new_cache() and forward_cached(); "
                         f"{type(model).__name__} has none (use cache='none')")
    if cache == "prefix" and not caps.cache_crop:
        raise ValueError(f"cache='prefix' needs a cache with crop(length); {type(model).__name__}'s has none "
                         "(use cache='auto')")
    if cache == "dual" and not caps.cache_drop:
        raise ValueError(f"cache='dual' needs a cache with drop(start, end); {type(model).__name__}'s has none")
    if cache == "block":
        block = values.get("block_length")
        size, exact = run_block_size(model, block), caps.cache_exact
        if not exact or size != block:
            raise ValueError(f"cache='block' is exact only for a block-causal model whose block_size equals "
                             f"block_length={block}; this model has block_size={size}, cache_exact={exact}. "
                             "Use cache='prefix' for the approximate Fast-dLLM prefix cache")


@dataclass(frozen=True)
class BlockConfig(SamplerConfig):
    """Options of every masked-diffusion sampler: blocks and the cache mode."""

    block_length: int = option(MASKED["block_length"], int_at_least(1), "int")
    cache: str = option(MASKED["cache"], choice(CACHE_MODES), "str")

    @property
    def exact(self) -> bool:
        return self.EXACT and session_exact(cache=self.cache)
