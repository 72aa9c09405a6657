"""Every sampler by name: its run function, the model kind it needs and its config class (a table of names).

Each family's package holds the rest: ``samplers/fef/``, ``samplers/sequential/``, ``samplers/ar_spec/`` (``ar``
and ``ar_spec``) and ``samplers/baselines/`` (``llada``, ``dream``, ``fast_dllm``, ``eb``, ``llada2``, ``sdar``,
``native``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from dllm.protocols import capabilities

from . import ar_spec, baselines, fef, sequential
from .options import Option, SamplerConfig


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
    allowed = SAMPLERS[sampler].options if sampler in SAMPLERS else {}
    unknown = sorted(set(pairs) - set(allowed))
    if allowed and unknown:  # said before any model loads (the configs refuse them again at the door)
        raise ValueError(f"{flag} names unknown option(s) {unknown} for sampler {sampler!r}; "
                         f"allowed: {sorted(allowed)}")
    try:
        return typed_options(sampler, pairs)
    except ValueError as error:
        raise ValueError(f"{flag} {error}") from None


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
        merged = {**self.preferred(model, given), **{k: v for k, v in given.items() if k != "callback"}}
        config = self.config(**merged)
        return config.validate(model, max_new_tokens)

    def preferred(self, model, given: Mapping[str, Any]) -> dict[str, Any]:
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


SAMPLERS: dict[str, SamplerSpec] = {
    spec.name: spec
    for spec in [
        SamplerSpec("ar", ar_spec.ar, "causal", ar_spec.ArConfig),
        SamplerSpec("ar_spec", ar_spec.ar_spec, "causal", ar_spec.ArSpecConfig),
        SamplerSpec("llada", baselines.llada, "diffusion", baselines.LladaConfig),
        SamplerSpec("dream", baselines.dream, "diffusion", baselines.DreamConfig),
        SamplerSpec("fast_dllm", baselines.fast_dllm, "diffusion", baselines.FastDllmConfig),
        SamplerSpec("eb", baselines.eb, "diffusion", baselines.EbConfig),
        SamplerSpec("llada2", baselines.llada2, "diffusion", baselines.Llada2Config),
        SamplerSpec("sdar", baselines.sdar, "diffusion", baselines.SdarConfig),
        SamplerSpec("sequential", sequential.sequential, "diffusion", sequential.SequentialConfig),
        SamplerSpec("native", baselines.native, "any", baselines.NativeConfig),
        SamplerSpec("fef", fef.fef, "diffusion", fef.FefConfig),
    ]
}
