"""Every sampler's name, model kind, options with defaults, and validation (done once, at the door)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from dllm.defaults import FEF_DRAFT, FEF_WINDOW
from dllm.protocols import has_cache, is_causal_model, is_diffusion_model

from . import ar, diffusion, fef, masked, native
from .canvas import CACHE_MODES
from .order import ORDERS

MAX_NEW = object()  # default: the value of max_new_tokens


KINDS = ("int", "float", "str", "dict", "drafter")  # what an option's value is; text is parsed by it


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
        if self.kind == "dict":
            try:
                value = json.loads(text)
            except json.JSONDecodeError:
                value = text
            if not isinstance(value, dict):
                raise ValueError(f"{name} expects a JSON object such as '{{\"steps\": 64}}', got {text!r}")
            return value
        cast = int if self.kind == "int" else float
        try:
            return cast(text)
        except ValueError:
            raise ValueError(f"{name} expects {'an int' if cast is int else 'a number'}, got {text!r}") from None


def typed_options(sampler: str, values: Mapping[str, Any]) -> dict[str, Any]:
    """Options of ``sampler`` with every text value parsed by its option's kind; typed values pass as they
    are (TOML, Python) and unknown names are left for ``SamplerSpec.resolve`` to refuse with the list."""
    if sampler not in SAMPLERS:
        raise ValueError(f"sampler must be one of {sorted(SAMPLERS)}, got {sampler!r}")
    options = SAMPLERS[sampler].options
    return {name: options[name].parse(name, value) if isinstance(value, str) and name in options else value
            for name, value in values.items()}


def parse_options(sampler: str, items: Iterable[str], flag: str = "--option") -> dict[str, Any]:
    """``["window=4", "cache=none"]`` -> ``{"window": 4, "cache": "none"}``: the one parser of option text
    (``dllm generate/eval/bench --option``, bench ``--config``, the lm-eval plugin's model_args)."""
    pairs = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{flag} expects KEY=VALUE, got {item!r}")
        pairs[key.strip()] = value.strip()
    try:
        return typed_options(sampler, pairs)
    except ValueError as error:
        raise ValueError(f"{flag} {error}") from None


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
    if not callable(getattr(model, "native_loop", None)):
        raise TypeError(f"sampler='native' runs a checkpoint's own sampler through native_loop(); "
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


BLOCK = {"block_length": Option(MAX_NEW, _int_at_least(1), "int"), "cache": Option("auto", _choice(CACHE_MODES), "str")}
AR_CACHE = {"cache": Option("auto", _choice(("auto", "none")), "str")}

SAMPLERS: dict[str, SamplerSpec] = {
    spec.name: spec
    for spec in [
        SamplerSpec("ar", ar.ar, "causal", True, {**AR_CACHE}),
        SamplerSpec("ar_spec", ar.ar_spec, "causal", True, {
            **AR_CACHE,
            "drafter": Option("ngram", _no_check, "drafter"),
            "num_draft_tokens": Option(4, _int_at_least(1), "int"),
            "max_ngram": Option(3, _int_at_least(1), "int"),
        }),
        SamplerSpec("llada", diffusion.llada, "diffusion", False, {
            **BLOCK,
            "steps": Option(MAX_NEW, _int_at_least(1), "int"),
            "remasking": Option("low_confidence", _choice(masked.REMASKING), "str"),
            "cfg_scale": Option(0.0, _number(0.0), "float"),
        }),
        SamplerSpec("dream", diffusion.dream, "diffusion", False, {
            **BLOCK,
            "steps": Option(MAX_NEW, _int_at_least(1), "int"),
            "alg": Option("maskgit_plus", _choice(masked.DREAM_ALGORITHMS), "str"),
            "alg_temp": Option(None, _number(0.0, optional=True), "float"),
            "top_p": Option(None, _number(0.0, 1.0, low_open=True, optional=True), "float"),
            "top_k": Option(None, _optional_int(1), "int"),
        }),
        SamplerSpec("fast_dllm", diffusion.fast_dllm, "diffusion", False, {
            **BLOCK,
            "threshold": Option(None, _number(0.0, 1.0, optional=True), "float"),
            "factor": Option(None, _number(0.0, low_open=True, optional=True), "float"),
        }),
        SamplerSpec("eb", diffusion.eb, "diffusion", False, {**BLOCK, "gamma": Option(0.01, _number(0.0), "float")}),
        SamplerSpec("sequential", diffusion.sequential, "diffusion", True, {
            **BLOCK, "order": Option("left_to_right", _choice(ORDERS), "str"),
        }),
        SamplerSpec("native", native.native, "any", False, {
            "generate_kwargs": Option(None, _optional_dict, "dict"),
            "drafter": Option(None, _no_check, "drafter"),
        }),
        SamplerSpec("fef", diffusion.fef, "diffusion", True, {
            **BLOCK,
            "order": Option("left_to_right", _choice(ORDERS), "str"),
            "window": Option(FEF_WINDOW, _int_at_least(1), "int"),
            "draft": Option(FEF_DRAFT, _choice(fef.DRAFT_SOURCES), "str"),
            "verifier": Option("copies", _choice(fef.VERIFIERS), "str"),
        }),
    ]
}
