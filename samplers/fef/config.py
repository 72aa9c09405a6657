"""``fef``'s options: the window, the draft source, the verifier, draft trees and the forward's bound."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, ClassVar

from dllm.defaults import SAMPLER_DEFAULTS, default_draft_head
from dllm.models.draft_head import load_draft_head
from dllm.protocols import capabilities

from ..options import boolean, choice, int_at_least, is_tree, no_check, number, option, optional_int
from ..sequential.config import SequentialConfig
from ..sessions import session_exact

FEF = SAMPLER_DEFAULTS["fef"]
DRAFT_SOURCES = ("marginal", "stale", "head")
VERIFIERS = ("copies", "structured")


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


def _check_compile(values: dict[str, Any], model) -> None:
    """compile=True compiles the draft head's steps: it needs draft="head"."""
    if values["compile"] and values["draft"] != "head":
        raise ValueError(f"compile=True compiles the draft head's steps; it needs draft='head', got "
                         f"draft={values['draft']!r}")


def _check_fef_tree(values: dict[str, Any], model) -> None:
    """fef's draft trees verify the siblings and their branches in the round's one call (the two-stream
    layout's, or the copies verifier's, with one block copy per branch depth), left to right (every fef draft
    source samples from logits, so each can give siblings)."""
    if not is_tree(values):
        return
    if values.get("verifier") == "structured" and not capabilities(model).reveal_order_cache:
        raise ValueError(f"draft_candidates={values['draft_candidates']} verifies a draft tree with copies of the "
                         "block (verifier='copies') or on a two-stream model; verifier='structured' verifies a "
                         "chain only")
    if values["order"] != "left_to_right":
        raise ValueError(f"draft_candidates={values['draft_candidates']} runs with order='left_to_right' only, "
                         f"got order={values['order']!r}")


def _say_window_capped(values: dict[str, Any], model) -> None:
    """A window asked for that is longer than a block drafts at most the block's positions a round: said in one
    line (a ``UserWarning``), not silently. The default window is read as "up to FEF["window"]" and says nothing;
    on a two-stream model left to right, windows run across blocks and are never capped."""
    across = capabilities(model).reveal_order_cache and values["order"] == "left_to_right"
    if not across and values["window"] > values["block_length"] and values["window"] != FEF["window"]:
        warnings.warn(f"window={values['window']} is longer than block_length={values['block_length']}: fef drafts "
                      f"at most {values['block_length']} tokens a round (the window is capped at the block)",
                      UserWarning, stacklevel=2)


@dataclass(frozen=True)
class FefConfig(SequentialConfig):
    """``fef``: exact speculative denoising, a window of drafts verified per call."""

    window: int = option(FEF["window"], int_at_least(1), "int")
    draft: str = option(FEF["draft"], choice(DRAFT_SOURCES), "str")
    verifier: str = option(FEF["verifier"], choice(VERIFIERS), "str")
    # draft="head": a folder or DraftHead; None: the shipped one
    draft_head: Any = option(FEF["draft_head"], no_check, "str")
    draft_candidates: int = option(FEF["draft_candidates"], int_at_least(1), "int")  # > 1: a draft tree, left to right
    # tree: where unsure
    candidates_below: float | None = option(FEF["candidates_below"], number(0.0, 1.0, optional=True), "float")
    # the most token positions (inputs x length) one forward holds: the verification call of W copies runs in
    # parts of whole copies, bounding the forward's activations at a real width (same answer, more forwards)
    call_tokens: int | None = option(FEF["call_tokens"], optional_int(1), "int")
    # adaptive windows: a row's drafts end where the drafter's estimate that they all survive (the product of its
    # probabilities of its drafts) falls below it; None: every round drafts the whole window (samplers/drafting.py)
    draft_cutoff: float | None = option(FEF["draft_cutoff"], number(0.0, 1.0, low_open=True, optional=True), "float")
    # draft="head": the head's steps through torch.compile (CUDA graphs on a GPU); off: slower on the measured CPU
    compile: bool = option(FEF["compile"], boolean, "bool")
    CHECKS: ClassVar[tuple] = (_check_verifier, _check_draft_head, _check_compile, _check_fef_tree,
                               _say_window_capped)

    @property
    def exact(self) -> bool:
        return self.EXACT and session_exact(cache=self.cache, verifier=self.verifier)
