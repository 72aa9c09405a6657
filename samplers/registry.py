"""Every sampler's name, model kind, options with defaults, and validation (done once, at the door)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dllm.protocols import has_cache, is_causal_model, is_diffusion_model

from . import ar, diffusion, fef, masked, native
from .canvas import CACHE_MODES
from .order import ORDERS

MAX_NEW = object()  # default: the value of max_new_tokens


@dataclass(frozen=True)
class Option:
    """One sampler option: its default and a check that raises a message naming it."""

    default: Any
    check: Callable[[str, Any], None]


@dataclass(frozen=True)
class SamplerSpec:
    """A sampler: the function that runs it, the model protocol it needs, and its options."""

    name: str
    run: Callable[..., Any]
    model_kind: str  # "diffusion" or "causal"
    exact: bool  # samples exactly the sequential chain of the model (or of the causal target)
    options: dict[str, Option]

    def resolve(self, given: dict[str, Any], *, model, max_new_tokens: int) -> dict[str, Any]:
        """Fill defaults and validate; unknown names and bad values raise naming the option."""
        unknown = sorted(set(given) - set(self.options) - {"callback"})
        if unknown:
            raise TypeError(f"unknown option(s) {unknown} for sampler {self.name!r}; "
                            f"allowed: {sorted(self.options) + ['callback']}")
        values = {name: given.get(name, opt.default) for name, opt in self.options.items()}
        # block_length / steps default to max_new_tokens (also when passed as None), except that a
        # block-causal model's blocks are its own block_size when that divides max_new_tokens: decoding
        # then matches training and the exact block cache applies.
        block_size = getattr(model, "block_size", None)
        nested = bool(getattr(model, "block_logits_only", False)) and bool(block_size)
        if "block_length" in values and values["block_length"] in (MAX_NEW, None) and block_size:
            if max_new_tokens % block_size == 0:
                values["block_length"] = block_size
            elif nested:  # blocks must nest in the model's: the largest size dividing both
                values["block_length"] = math.gcd(block_size, max_new_tokens)
        values = {name: max_new_tokens if v is MAX_NEW or (v is None and self.options[name].default is MAX_NEW)
                  else v for name, v in values.items()}
        for name, opt in self.options.items():
            opt.check(name, values[name])
        if nested and "block_length" in values and block_size % values["block_length"]:
            raise ValueError(f"block_length={values['block_length']} must divide this model's block_size={block_size}: "
                             f"{type(model).__name__} gives logits only inside its own blocks, so a sampler's "
                             "block may not straddle two of them")
        _check_schedule(values, max_new_tokens)
        if self.name != "native":  # native's drafter is a transformers assistant, checked below
            _check_drafter(values, model)
        _check_cache(values, model)
        _check_verifier(values, model)
        if self.name == "native":
            _check_native(values, model)
        if values.get("threshold") is not None and values.get("factor") is not None:
            raise ValueError("fast_dllm takes either threshold or factor, not both")
        callback = given.get("callback")
        if callback is not None and not callable(callback):
            raise TypeError(f"callback must be callable or None, got {type(callback).__name__}")
        return {**values, "callback": callback}


def _int_at_least(minimum: int) -> Callable[[str, Any], None]:
    def check(name: str, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if value < minimum:
            raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return check


def _number(low: float, high: float = math.inf, *, low_open: bool = False, optional: bool = False):
    def check(name: str, value: Any) -> None:
        if value is None and optional:
            return
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise TypeError(f"{name} must be a finite number{' or None' if optional else ''}, got {value!r}")
        if value < low or (low_open and value == low) or value > high:
            interval = f"{'(' if low_open else '['}{low}, {high}]"
            raise ValueError(f"{name} must lie in {interval}, got {value}")
    return check


def _optional_int(minimum: int):
    inner = _int_at_least(minimum)
    return lambda name, value: None if value is None else inner(name, value)


def _choice(choices: tuple[str, ...]):
    def check(name: str, value: Any) -> None:
        if value not in choices:
            raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")
    return check


def _optional_dict(name: str, value: Any) -> None:
    if value is not None and not isinstance(value, dict):
        raise TypeError(f"{name} must be a dict of keyword arguments or None, got {type(value).__name__}")


def _no_check(name: str, value: Any) -> None:
    return None


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


def _check_drafter(values: dict[str, Any], model) -> None:
    if "drafter" not in values:
        return
    drafter = values["drafter"]
    if isinstance(drafter, str):
        if drafter != "ngram":
            raise ValueError(f"drafter must be 'ngram', a CausalModel or a DiffusionModel, got {drafter!r}")
        return
    if not (is_diffusion_model(drafter) or is_causal_model(drafter)):
        raise TypeError(f"drafter must be 'ngram', a CausalModel or a DiffusionModel, got {type(drafter).__name__}")
    virtual_mask = is_diffusion_model(drafter) and drafter.vocab_size == model.vocab_size + 1 \
        and drafter.mask_token_id == model.vocab_size  # a mask id appended past the shared vocabulary
    if drafter.vocab_size != model.vocab_size and not virtual_mask:
        raise ValueError(f"drafter vocabulary ({drafter.vocab_size}) differs from the model's ({model.vocab_size}); "
                         "drafts and targets must share token ids")


def _check_native(values: dict[str, Any], model) -> None:
    """The model must bring its own loop; a drafter (transformers' assisted generation) only for a causal one."""
    if not callable(getattr(model, "native_generate", None)):
        raise TypeError(f"sampler='native' runs a checkpoint's own sampler through native_generate(); "
                        f"{type(model).__name__} has none (DiffusionGemma, Dream and causal adapters do; Dream's "
                        "diffusion_generate is its hub code: dllm.load(..., trust_remote_code=True))")
    drafter = values.get("drafter")
    if drafter is not None and not (is_causal_model(model) and is_causal_model(drafter)
                                    and hasattr(drafter, "model")):
        raise TypeError("sampler='native' takes a drafter only for a causal model, as a loaded causal "
                        "checkpoint (transformers' assisted generation)")


def _check_verifier(values: dict[str, Any], model) -> None:
    """The structured verifier needs the model's one-pass method, left-to-right order and an exact view."""
    if values.get("verifier", "copies") == "copies":
        return
    if not callable(getattr(model, "structured_verify", None)):
        raise ValueError(f"verifier='structured' needs a model with structured_verify(); "
                         f"{type(model).__name__} has none (use verifier='copies')")
    if values["order"] != "left_to_right":
        raise ValueError("verifier='structured' supports order='left_to_right' only")
    if values.get("cache") in ("prefix", "dual"):
        raise ValueError("verifier='structured' runs with cache='auto', 'none' or 'block'")


def _check_cache(values: dict[str, Any], model) -> None:
    """An explicit cache must be one the model offers; ``block`` must also be exact for these blocks."""
    cache = values.get("cache", "auto")
    if cache in ("auto", "none"):
        return
    if not has_cache(model):
        raise ValueError(f"cache={cache!r} needs a model with new_cache() and forward_cached(); "
                         f"{type(model).__name__} has none (use cache='none')")
    if cache == "prefix" and not callable(getattr(model.new_cache(), "crop", None)):
        raise ValueError(f"cache='prefix' needs a cache with crop(length); {type(model).__name__}'s has none "
                         "(use cache='auto')")
    if cache == "dual" and not callable(getattr(model.new_cache(), "drop", None)):
        raise ValueError(f"cache='dual' needs a cache with drop(start, end); {type(model).__name__}'s has none")
    if cache == "block":
        block = values.get("block_length")
        size, exact = getattr(model, "block_size", None), getattr(model, "cache_exact", False)
        if not exact or size != block:
            raise ValueError(f"cache='block' is exact only for a block-causal model whose block_size equals "
                             f"block_length={block}; this model has block_size={size}, cache_exact={exact}. "
                             "Use cache='prefix' for the approximate Fast-dLLM prefix cache")
    if values.get("cfg_scale", 0.0) > 0:
        raise ValueError("cfg_scale > 0 needs full-sequence calls: use cache='none' (or 'auto')")


BLOCK = {"block_length": Option(MAX_NEW, _int_at_least(1)), "cache": Option("auto", _choice(CACHE_MODES))}
AR_CACHE = {"cache": Option("auto", _choice(("auto", "none")))}

SAMPLERS: dict[str, SamplerSpec] = {
    spec.name: spec
    for spec in [
        SamplerSpec("ar", ar.ar, "causal", True, {**AR_CACHE}),
        SamplerSpec("ar_spec", ar.ar_spec, "causal", True, {
            **AR_CACHE,
            "drafter": Option("ngram", _no_check),
            "num_draft_tokens": Option(4, _int_at_least(1)),
            "max_ngram": Option(3, _int_at_least(1)),
        }),
        SamplerSpec("llada", diffusion.llada, "diffusion", False, {
            **BLOCK,
            "steps": Option(MAX_NEW, _int_at_least(1)),
            "remasking": Option("low_confidence", _choice(masked.REMASKING)),
            "cfg_scale": Option(0.0, _number(0.0)),
        }),
        SamplerSpec("dream", diffusion.dream, "diffusion", False, {
            **BLOCK,
            "steps": Option(MAX_NEW, _int_at_least(1)),
            "alg": Option("maskgit_plus", _choice(masked.DREAM_ALGORITHMS)),
            "alg_temp": Option(None, _number(0.0, optional=True)),
            "top_p": Option(None, _number(0.0, 1.0, low_open=True, optional=True)),
            "top_k": Option(None, _optional_int(1)),
        }),
        SamplerSpec("fast_dllm", diffusion.fast_dllm, "diffusion", False, {
            **BLOCK,
            "threshold": Option(None, _number(0.0, 1.0, optional=True)),
            "factor": Option(None, _number(0.0, low_open=True, optional=True)),
        }),
        SamplerSpec("eb", diffusion.eb, "diffusion", False, {**BLOCK, "gamma": Option(0.01, _number(0.0))}),
        SamplerSpec("sequential", diffusion.sequential, "diffusion", True, {
            **BLOCK, "order": Option("left_to_right", _choice(ORDERS)),
        }),
        SamplerSpec("native", native.native, "any", False, {
            "generate_kwargs": Option(None, _optional_dict),
            "drafter": Option(None, _no_check),
        }),
        SamplerSpec("fef", diffusion.fef, "diffusion", True, {
            **BLOCK,
            "order": Option("left_to_right", _choice(ORDERS)),
            "window": Option(4, _int_at_least(1)),
            "draft": Option("marginal", _choice(fef.DRAFT_SOURCES)),
            "verifier": Option("copies", _choice(fef.VERIFIERS)),
        }),
    ]
}
