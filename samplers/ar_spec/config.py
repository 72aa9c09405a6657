"""``ar`` and ``ar_spec``'s options: plain next-token sampling and speculative decoding of a causal target."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from dllm.defaults import SAMPLER_DEFAULTS
from dllm.protocols import capabilities, is_causal_model, is_diffusion_model

from ..options import SamplerConfig, choice, int_at_least, is_tree, no_check, number, option
from .drafters import Drafter
from .heads import check_drafter_head

AR = SAMPLER_DEFAULTS["ar"]
AR_SPEC = SAMPLER_DEFAULTS["ar_spec"]


DRAFTER_KINDS = ("'ngram', 'head', a CausalModel, a DiffusionModel, a model folder or shipped model's name, or a "
                 "Drafter (samplers/ar_spec/drafters.py)")


def _load_named_drafter(values: dict[str, Any], model) -> None:
    """A drafter given by name (a shipped model such as ``"ar_diffusion_drafter"``, or a model folder) is loaded,
    once per process, on the target's device and in its dtype; so a checkpoint's ``sampler_defaults.json`` can name
    its measured-fastest drafter and ``generate``, ``dllm generate`` and ``dllm bench`` all draft with it."""
    drafter = values["drafter"]
    if not isinstance(drafter, str | Path) or drafter in ("ngram", "head"):
        return
    from dllm.models.loading import shipped_or_path

    folder = shipped_or_path(drafter)
    if not (folder / "config.json").is_file():
        raise ValueError(f"drafter must be {DRAFTER_KINDS}; {str(drafter)!r} is none of them (no model folder there)")
    weight = next(iter(getattr(model, "parameters", lambda: iter(()))()), None)
    device, dtype = (None, None) if weight is None else (weight.device, weight.dtype)
    values["drafter"] = _loaded(str(folder.resolve()), device, dtype)


@functools.lru_cache(maxsize=8)
def _loaded(folder: str, device, dtype):
    from dllm.models.loading import load

    return load(folder, device=device, dtype=dtype).eval()


def _check_drafter(values: dict[str, Any], model) -> None:
    """ar_spec's drafter: a name, a model sharing the target's token ids, or a ready Drafter object."""
    drafter = values["drafter"]
    if values.get("draft_confidence") is not None and not (isinstance(drafter, str) and drafter == "head"):
        raise ValueError("draft_confidence is EAGLE-2's dynamic draft length for drafter='head'; got drafter="
                         f"{drafter if isinstance(drafter, str) else type(drafter).__name__!r}")
    if values.get("draft_cutoff") is not None and isinstance(drafter, str) and drafter == "ngram":
        raise ValueError("draft_cutoff reads the drafter's probabilities of its drafts; the 'ngram' drafter proposes "
                         "point masses: use a model or head drafter, or draft_cutoff=None")
    if isinstance(drafter, Drafter):
        return  # a ready proposer (samplers/ar_spec/drafters.py states its contract); ar_spec uses it as it is
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


def _check_tree(values: dict[str, Any], model) -> None:
    """draft_candidates > 1 verifies a draft tree in one call: a target with tree attention and a drafter
    whose drafts come from logits (the further candidates are drawn from them)."""
    if not is_tree(values):
        return
    if not capabilities(model).tree_attention:
        raise ValueError(f"draft_candidates={values['draft_candidates']} verifies a draft tree in one call, which "
                         f"needs a target with tree attention (Capabilities.tree_attention: dllm's causal "
                         f"TransformerLM); {type(model).__name__} has none: use draft_candidates=1")
    if isinstance(values["drafter"], str) and values["drafter"] == "ngram":
        raise ValueError("draft_candidates > 1 draws further candidates from the drafter's logits; the 'ngram' "
                         "drafter proposes point masses: use a model or head drafter, or draft_candidates=1")


@dataclass(frozen=True)
class ArConfig(SamplerConfig):
    """``ar``: plain next-token sampling, with the model's exact KV cache when it has one."""

    EXACT: ClassVar[bool] = True
    cache: str = option(AR["cache"], choice(("auto", "none")), "str")


@dataclass(frozen=True)
class ArSpecConfig(ArConfig):
    """``ar_spec``: speculative decoding of a causal target from an n-gram, causal or diffusion drafter."""

    drafter: Any = option(AR_SPEC["drafter"], no_check, "drafter")
    num_draft_tokens: int = option(AR_SPEC["num_draft_tokens"], int_at_least(1), "int")
    max_ngram: int = option(AR_SPEC["max_ngram"], int_at_least(1), "int")
    # a head folder or module (samplers/ar_spec/heads.py)
    draft_head: Any = option(AR_SPEC["draft_head"], no_check, "str")
    # drafter="head"
    draft_confidence: float | None = option(AR_SPEC["draft_confidence"], number(0.0, 1.0, optional=True), "float")
    # > 1: a draft tree (samplers/ar_spec/decode.py)
    draft_candidates: int = option(AR_SPEC["draft_candidates"], int_at_least(1), "int")
    # tree: where unsure
    candidates_below: float | None = option(AR_SPEC["candidates_below"], number(0.0, 1.0, optional=True), "float")
    # adaptive k: a row's drafts end where the drafter's estimate that they all survive falls below it
    # (samplers/drafting.py); drafters that give logits only
    draft_cutoff: float | None = option(AR_SPEC["draft_cutoff"], number(0.0, 1.0, low_open=True, optional=True),
                                        "float")
    CHECKS: ClassVar[tuple] = (_load_named_drafter, _check_drafter, _check_tree)
