"""Every sampler: its name, model kind, run function and frozen config (options, defaults, validate at the door)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, ClassVar

from dllm.defaults import FEF_DRAFT, FEF_WINDOW, default_draft_head
from dllm.models.draft_head import load_draft_head
from dllm.protocols import capabilities, is_causal_model, is_diffusion_model

from . import ar, diffusion, fef, masked, native
from .canvas import CACHE_MODES, session_exact
from .drafters import Drafter
from .head_drafters import check_drafter_head
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
        # then matches training and the exact block cache applies.
        caps = capabilities(model)
        block_size = caps.block_size
        nested = caps.block_logits_only and bool(block_size)
        if "block_length" in values and values["block_length"] in (MAX_NEW, None) and block_size:
            if max_new_tokens % block_size == 0:
                values["block_length"] = block_size
            elif nested:  # blocks must nest in the model's: the largest size dividing both
                values["block_length"] = math.gcd(block_size, max_new_tokens)
        values = {name: max_new_tokens if v is MAX_NEW or (v is None and options[name].default is MAX_NEW)
                  else v for name, v in values.items()}
        for name, opt in options.items():
            opt.check(name, values[name])
        if nested and "block_length" in values and block_size % values["block_length"]:
            raise ValueError(f"block_length={values['block_length']} must divide this model's block_size={block_size}: "
                             f"{type(model).__name__} gives logits only inside its own blocks, so a sampler's "
                             "block may not straddle two of them")
        _check_schedule(values, max_new_tokens)
        _check_cache(values, model)
        for check in self.CHECKS:
            check(values, model)
        return replace(self, **values)


@dataclass(frozen=True)
class SamplerSpec:
    """A sampler: the function that runs it, the model protocol it needs, and its config class."""

    name: str
    run: Callable[..., Any]
    model_kind: str  # "diffusion", "causal" or "any"
    config: type[SamplerConfig]

    @property
    def exact(self) -> bool:
        return self.config.EXACT

    @property
    def options(self) -> dict[str, Option]:
        return self.config.options()

    def configure(self, given: Mapping[str, Any], *, model, max_new_tokens: int) -> SamplerConfig:
        """The validated config of ``given`` options (``callback`` aside); unknown names raise with the list."""
        unknown = sorted(set(given) - set(self.options) - {"callback"})
        if unknown:
            raise TypeError(f"unknown option(s) {unknown} for sampler {self.name!r}; "
                            f"allowed: {sorted(self.options) + ['callback']}")
        merged = {**self._preferred(model, given), **{k: v for k, v in given.items() if k != "callback"}}
        config = self.config(**merged)
        return config.validate(model, max_new_tokens)

    def _preferred(self, model, given: Mapping[str, Any]) -> dict[str, Any]:
        """The model's measured-fastest settings for this sampler (``Capabilities.sampler_defaults``) whose
        conditions hold for the caller's options (or their defaults), less those the caller overrides: a
        caller's ``draft`` drops a declared ``draft_head`` too."""
        if model is None:
            return {}
        rules = [(option, value, dict(when)) for sampler, option, value, when in capabilities(model).sampler_defaults
                 if sampler == self.name]
        named = {option for option, _, when in rules for option in (option, *when)}
        unknown = sorted(named - set(self.options))
        if unknown:
            raise ValueError(f"{type(model).__name__} declares sampler_defaults {unknown} for {self.name!r}, "
                             f"which has no such option(s); allowed: {sorted(self.options)}")
        options = self.options

        def holds(when: dict) -> bool:
            return all(given.get(name, options[name].default) == value for name, value in when.items())

        preferred = {option: value for option, value, when in rules if holds(when)}
        if "draft" in given:
            preferred.pop("draft_head", None)
        return {k: v for k, v in preferred.items() if k not in given}

    def resolve(self, given: dict[str, Any], *, model, max_new_tokens: int) -> dict[str, Any]:
        """Fill defaults and validate; unknown names and bad values raise naming the option."""
        config = self.configure(given, model=model, max_new_tokens=max_new_tokens)
        return {**config.values(), "callback": check_callback(given.get("callback"))}


def check_callback(callback):
    """The callback option: a callable or None."""
    if callback is not None and not callable(callback):
        raise TypeError(f"callback must be callable or None, got {type(callback).__name__}")
    return callback


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


DRAFTER_KINDS = "'ngram', 'head', a CausalModel, a DiffusionModel or a Drafter (samplers/drafters.py)"


def _check_draft_head(values: dict[str, Any], model) -> None:
    """draft="head" needs a model that returns features and a head for its vocabulary (loaded here once)."""
    if values["draft"] != "head":
        if values["draft_head"] is not None:
            raise ValueError(f"draft_head is used only with draft='head', got draft={values['draft']!r}")
        return
    if not capabilities(model).hidden_states:
        raise ValueError(f"draft='head' needs a model that returns its features (Capabilities.hidden_states); "
                         f"{type(model).__name__} declares none: use draft='marginal' or 'stale'")
    head = values["draft_head"] if values["draft_head"] is not None else default_draft_head(model)
    try:
        loaded = load_draft_head(head)
    except FileNotFoundError as error:
        raise ValueError(f"draft_head={str(head)!r}: {error}") from None
    loaded.check_backbone(model.vocab_size)
    two_stream = capabilities(model).reveal_order_cache
    if loaded.config.condition_first != two_stream:  # each layout's step 0 means something else
        raise ValueError(f"draft_head={str(head)!r} is a head for the "
                         f"{'two-stream' if loaded.config.condition_first else 'block-diffusion'} layout "
                         f"(condition_first={loaded.config.condition_first}); {type(model).__name__} needs one "
                         f"with condition_first={two_stream}")


def _is_tree(values: dict[str, Any]) -> bool:
    """Whether draft_candidates asks for a draft tree; candidates_below without one is refused."""
    if values["draft_candidates"] == 1 and values.get("candidates_below") is not None:
        raise ValueError("candidates_below limits a draft tree's siblings to unsure drafts; it needs "
                         "draft_candidates > 1, got draft_candidates=1")
    return values["draft_candidates"] > 1


def _check_tree(values: dict[str, Any], model) -> None:
    """draft_candidates > 1 verifies a draft tree in one call: a target with tree attention and a drafter
    whose drafts come from logits (the further candidates are drawn from them)."""
    if not _is_tree(values):
        return
    if not capabilities(model).tree_attention:
        raise ValueError(f"draft_candidates={values['draft_candidates']} verifies a draft tree in one call, which "
                         f"needs a target with tree attention (Capabilities.tree_attention: dllm's causal "
                         f"TransformerLM); {type(model).__name__} has none: use draft_candidates=1")
    if isinstance(values["drafter"], str) and values["drafter"] == "ngram":
        raise ValueError("draft_candidates > 1 draws further candidates from the drafter's logits; the 'ngram' "
                         "drafter proposes point masses: use a model or head drafter, or draft_candidates=1")


def _check_fef_tree(values: dict[str, Any], model) -> None:
    """fef's draft trees verify the siblings and their branches in the round's one call (the two-stream
    layout's, or the copies verifier's, with one block copy per branch depth), left to right (every fef draft
    source samples from logits, so each can give siblings)."""
    if not _is_tree(values):
        return
    if values.get("verifier") == "structured" and not capabilities(model).reveal_order_cache:
        raise ValueError(f"draft_candidates={values['draft_candidates']} verifies a draft tree with copies of the "
                         "block (verifier='copies') or on a two-stream model; verifier='structured' verifies a "
                         "chain only")
    if values["order"] != "left_to_right":
        raise ValueError(f"draft_candidates={values['draft_candidates']} runs with order='left_to_right' only, "
                         f"got order={values['order']!r}")


def _check_drafter(values: dict[str, Any], model) -> None:
    """ar_spec's drafter: a name, a model sharing the target's token ids, or a ready Drafter object."""
    drafter = values["drafter"]
    if values.get("draft_confidence") is not None and not (isinstance(drafter, str) and drafter == "head"):
        raise ValueError("draft_confidence is EAGLE-2's dynamic draft length for drafter='head'; got drafter="
                         f"{drafter if isinstance(drafter, str) else type(drafter).__name__!r}")
    if isinstance(drafter, Drafter):
        return  # a ready proposer (samplers/drafters.py states its contract); ar_spec uses it as it is
    if drafter == "head" or values.get("draft_head") is not None:
        check_drafter_head(drafter, values.get("draft_head"), model, values.get("num_draft_tokens"))
        return
    if isinstance(drafter, str):
        if drafter != "ngram":
            raise ValueError(f"drafter must be {DRAFTER_KINDS}, got {drafter!r}")
        return
    if not (is_diffusion_model(drafter) or is_causal_model(drafter)):
        raise TypeError(f"drafter must be {DRAFTER_KINDS}, got {type(drafter).__name__}")
    virtual_mask = is_diffusion_model(drafter) and drafter.vocab_size == model.vocab_size + 1 \
        and drafter.mask_token_id == model.vocab_size  # a mask id appended past the shared vocabulary
    if drafter.vocab_size != model.vocab_size and not virtual_mask:
        raise ValueError(f"drafter vocabulary ({drafter.vocab_size}) differs from the model's ({model.vocab_size}); "
                         "drafts and targets must share token ids")


def _check_native(values: dict[str, Any], model) -> None:
    """The model must bring its own loop; a drafter (transformers' assisted generation) only for a causal one."""
    if not capabilities(model).native_loop:
        raise TypeError(f"sampler='native' runs a checkpoint's own sampler through native_loop(); "
                        f"{type(model).__name__} has none (DiffusionGemma, Dream and causal adapters do; Dream's "
                        "diffusion_generate is its hub code: dllm.load(..., trust_remote_code=True))")
    drafter = values.get("drafter")
    # A drafter with its own native loop is a loaded causal checkpoint, the assistant transformers takes.
    if drafter is not None and not (is_causal_model(model) and is_causal_model(drafter)
                                    and capabilities(drafter).native_loop):
        raise TypeError("sampler='native' takes a drafter only for a causal model, as a loaded causal "
                        "checkpoint (transformers' assisted generation)")


def _check_verifier(values: dict[str, Any], model) -> None:
    """The structured verifier needs the model's one-pass method, left-to-right order and an exact view."""
    if values.get("verifier", "copies") == "copies":
        return
    if not capabilities(model).structured_verify:
        raise ValueError(f"verifier='structured' needs a model with structured_verify(); "
                         f"{type(model).__name__} has none (use verifier='copies')")
    if values["order"] != "left_to_right":
        raise ValueError("verifier='structured' supports order='left_to_right' only")
    if not session_exact(cache=values["cache"]):  # an approximate (prefix or dual) cache
        raise ValueError("verifier='structured' runs with cache='auto', 'none' or 'block'")


def _check_guidance(values: dict[str, Any], model) -> None:
    if values["cache"] not in ("auto", "none") and values["cfg_scale"] > 0:
        raise ValueError("cfg_scale > 0 needs full-sequence calls: use cache='none' (or 'auto')")


def _check_threshold_or_factor(values: dict[str, Any], model) -> None:
    if values["threshold"] is not None and values["factor"] is not None:
        raise ValueError("fast_dllm takes either threshold or factor, not both")


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
        size, exact = caps.block_size, caps.cache_exact
        if not exact or size != block:
            raise ValueError(f"cache='block' is exact only for a block-causal model whose block_size equals "
                             f"block_length={block}; this model has block_size={size}, cache_exact={exact}. "
                             "Use cache='prefix' for the approximate Fast-dLLM prefix cache")


@dataclass(frozen=True)
class ArConfig(SamplerConfig):
    """``ar``: plain next-token sampling, with the model's exact KV cache when it has one."""

    EXACT: ClassVar[bool] = True
    cache: str = option("auto", _choice(("auto", "none")), "str")


@dataclass(frozen=True)
class ArSpecConfig(ArConfig):
    """``ar_spec``: speculative decoding of a causal target from an n-gram, causal or diffusion drafter."""

    drafter: Any = option("ngram", _no_check, "drafter")
    num_draft_tokens: int = option(4, _int_at_least(1), "int")
    max_ngram: int = option(3, _int_at_least(1), "int")
    draft_head: Any = option(None, _no_check, "str")  # a head folder or module (samplers/head_drafters.py)
    draft_confidence: float | None = option(None, _number(0.0, 1.0, optional=True), "float")  # drafter="head"
    draft_candidates: int = option(1, _int_at_least(1), "int")  # > 1: a draft tree (samplers/ar.py)
    candidates_below: float | None = option(None, _number(0.0, 1.0, optional=True), "float")  # tree: where unsure
    CHECKS: ClassVar[tuple] = (_check_drafter, _check_tree)


@dataclass(frozen=True)
class _BlockConfig(SamplerConfig):
    """Options of every masked-diffusion sampler: blocks and the cache mode."""

    block_length: int = option(MAX_NEW, _int_at_least(1), "int")
    cache: str = option("auto", _choice(CACHE_MODES), "str")

    @property
    def exact(self) -> bool:
        return self.EXACT and session_exact(cache=self.cache)


@dataclass(frozen=True)
class LladaConfig(_BlockConfig):
    """``llada``: LLaDA's low-confidence remasking over a fixed number of steps, optional classifier-free guidance."""

    steps: int = option(MAX_NEW, _int_at_least(1), "int")
    remasking: str = option("low_confidence", _choice(masked.REMASKING), "str")
    cfg_scale: float = option(0.0, _number(0.0), "float")
    CHECKS: ClassVar[tuple] = (_check_guidance,)


@dataclass(frozen=True)
class DreamConfig(_BlockConfig):
    """``dream``: Dream's unmasking algorithms with its top-p / top-k filters."""

    steps: int = option(MAX_NEW, _int_at_least(1), "int")
    alg: str = option("maskgit_plus", _choice(masked.DREAM_ALGORITHMS), "str")
    alg_temp: float | None = option(None, _number(0.0, optional=True), "float")
    top_p: float | None = option(None, _number(0.0, 1.0, low_open=True, optional=True), "float")
    top_k: int | None = option(None, _optional_int(1), "int")


@dataclass(frozen=True)
class FastDllmConfig(_BlockConfig):
    """``fast_dllm``: parallel unmasking above a confidence threshold (or by a factor)."""

    threshold: float | None = option(None, _number(0.0, 1.0, optional=True), "float")
    factor: float | None = option(None, _number(0.0, low_open=True, optional=True), "float")
    CHECKS: ClassVar[tuple] = (_check_threshold_or_factor,)


@dataclass(frozen=True)
class EbConfig(_BlockConfig):
    """``eb``: entropy-bounded parallel unmasking."""

    gamma: float = option(0.01, _number(0.0), "float")


@dataclass(frozen=True)
class SequentialConfig(_BlockConfig):
    """``sequential``: one position per call, the reference chain fef reproduces."""

    EXACT: ClassVar[bool] = True
    order: str = option("left_to_right", _choice(ORDERS), "str")


@dataclass(frozen=True)
class FefConfig(SequentialConfig):
    """``fef``: exact speculative denoising, a window of drafts verified per call."""

    window: int = option(FEF_WINDOW, _int_at_least(1), "int")
    draft: str = option(FEF_DRAFT, _choice(fef.DRAFT_SOURCES), "str")
    verifier: str = option("copies", _choice(fef.VERIFIERS), "str")
    draft_head: Any = option(None, _no_check, "str")  # draft="head": a folder or DraftHead; None: the shipped one
    draft_candidates: int = option(1, _int_at_least(1), "int")  # > 1: a draft tree, left to right
    candidates_below: float | None = option(None, _number(0.0, 1.0, optional=True), "float")  # tree: where unsure
    # the most token positions (inputs x length) one forward holds: the verification call of W copies runs in
    # parts of whole copies, bounding the forward's activations at a real width (same answer, more forwards)
    call_tokens: int | None = option(None, _optional_int(1), "int")
    CHECKS: ClassVar[tuple] = (_check_verifier, _check_draft_head, _check_fef_tree)

    @property
    def exact(self) -> bool:
        return self.EXACT and session_exact(cache=self.cache, verifier=self.verifier)


@dataclass(frozen=True)
class NativeConfig(SamplerConfig):
    """``native``: the checkpoint's own loop (``native_loop``)."""

    generate_kwargs: dict | None = option(None, _optional_dict, "dict")
    drafter: Any = option(None, _no_check, "drafter")  # a transformers assistant, checked by _check_native
    CHECKS: ClassVar[tuple] = (_check_native,)


SAMPLERS: dict[str, SamplerSpec] = {
    spec.name: spec
    for spec in [
        SamplerSpec("ar", ar.ar, "causal", ArConfig),
        SamplerSpec("ar_spec", ar.ar_spec, "causal", ArSpecConfig),
        SamplerSpec("llada", diffusion.llada, "diffusion", LladaConfig),
        SamplerSpec("dream", diffusion.dream, "diffusion", DreamConfig),
        SamplerSpec("fast_dllm", diffusion.fast_dllm, "diffusion", FastDllmConfig),
        SamplerSpec("eb", diffusion.eb, "diffusion", EbConfig),
        SamplerSpec("sequential", diffusion.sequential, "diffusion", SequentialConfig),
        SamplerSpec("native", native.native, "any", NativeConfig),
        SamplerSpec("fef", diffusion.fef, "diffusion", FefConfig),
    ]
}
