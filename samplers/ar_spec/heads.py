"""Trained-head drafters for ``ar_spec`` (heads in ``dllm/models/ar_heads.py``), behind the ``Drafter`` interface.

- ``EagleDrafter`` (``drafter="head"``): k steps of an EAGLE head (or one call of a DFlash head) on the
  target's features of the last ``context`` positions (``DraftContext.features``), no model call. Its
  first round proposes nothing (the target has not yet computed a feature), so that round is plain
  ``ar``'s first step, and its verification call yields the features of every later round.
- ``RepairDrafter`` (a DiffusionModel drafter with ``draft_head=`` a repair head): the diffusion
  drafter's one call gives the block's marginals and features, then the repair head rewrites the block
  left to right, each draft sampled from the head's logits given the drafts before it.

Both return the very logits each draft was sampled from, so verification keeps ``ar``'s law exactly
whatever the head's weights.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from dllm.models.ar_heads import (
    DEFAULT_EAGLE,
    FEATURE_KINDS,
    DFlashHead,
    EagleHead,
    RepairHead,
    backbone_parts,
    check_head,
    feature_draft,
    load_head,
)
from dllm.models.loading import shipped_or_path
from dllm.numerics import bind_rows, sample_from_logits
from dllm.protocols import capabilities, is_diffusion_model

from ..drafting import Draft, draft_survival
from .drafters import DiffusionDrafter, Drafter, block_draft_logits, diffusion_draft_logits


def _sample(logits: torch.Tensor, ctx) -> torch.Tensor:
    """One token per row from logits [R, V], each row from its own generator stream."""
    return sample_from_logits(logits, ctx.temperature, bind_rows(ctx.generator, ctx.rows))


@dataclass
class EagleDrafter(Drafter):
    """Drafts k tokens with an EAGLE head (k steps) or a DFlash head (one call) on the target's recent
    features (``DraftContext.features``)."""

    head: torch.nn.Module
    target: object  # the AR target: its embeddings, final norm and output projection, frozen
    # EAGLE-2's dynamic draft length: a row's drafts end at the first one the head gave a probability
    # (at temperature 1) below this; None: always k. The rule reads the drafter's own draws only, so
    # verification stays exact (a draft count chosen by the drafter is a stopping time of its own sampling).
    confidence: float | None = None
    # draft_cutoff (samplers/drafting.py): the head's steps stop once every row's survival estimate is below it
    cutoff: float | None = None

    wants_features = True

    def __post_init__(self) -> None:
        self.feature_context = self.head.config.context

    def propose(self, sequences, lengths, k, ctx) -> Draft:
        rows = torch.arange(sequences.shape[0], device=sequences.device)
        if ctx.features is None:  # the first round: no verified feature yet, so no drafts
            tokens = torch.zeros((len(rows), k), dtype=torch.long, device=sequences.device)
            logits = torch.zeros((len(rows), k, ctx.vocab_size), device=sequences.device)
            return Draft(tokens, logits, torch.zeros_like(ctx.num_drafts))
        width = ctx.features.shape[1]  # positions length - 1 - width .. length - 2; the tokens after them
        after = (lengths[:, None] - width + torch.arange(width, device=sequences.device)).clamp(min=0)
        features = ctx.features.to(next(self.head.parameters()).dtype)
        unsure = []  # per step [R]: the draft's probability is below ``confidence``
        survival = []  # per step [R]: the drafts so far all survive, by the head's own estimate

        def done(step_logits, step_drafts):
            finished = torch.zeros_like(step_drafts, dtype=torch.bool)
            if self.confidence is not None:
                unsure.append(_unsure(step_logits[:, : ctx.vocab_size], step_drafts, self.confidence))
                finished = unsure[-1]
            if self.cutoff is not None:
                own = draft_survival(step_logits[:, None, : ctx.vocab_size], step_drafts[:, None])[:, 0]
                survival.append(own * survival[-1] if survival else own)
                finished = finished | (survival[-1] < self.cutoff)
            return finished

        with torch.no_grad():
            logits, tokens = feature_draft(self.head, self.target, features, sequences[rows[:, None], after],
                                         ctx.feature_valid, k, lambda step: _sample(step[:, : ctx.vocab_size], ctx),
                                         None if self.confidence is None and self.cutoff is None else done)
        logits, count = logits[..., : ctx.vocab_size].float(), ctx.num_drafts
        if unsure:
            unsure = torch.stack(unsure, dim=1)
            first = torch.where(unsure.any(1), unsure.float().argmax(1), unsure.shape[1] - 1)  # the first unsure draft
            count = torch.minimum(count, first + 1)
        made = tokens.shape[1]
        if made < k:  # every row stopped early: placeholders past ``count``
            tokens = torch.cat([tokens, tokens.new_zeros((len(rows), k - made))], dim=1)
            logits = torch.cat([logits, logits.new_zeros((len(rows), k - made, logits.shape[-1]))], dim=1)
        return Draft(tokens, logits, count)


@dataclass
class RepairDrafter(DiffusionDrafter):
    """A diffusion drafter's block (one call: marginals and features) rewritten left to right by a repair head."""

    head: torch.nn.Module | None = None

    def propose(self, sequences, lengths, k, ctx) -> Draft:
        model = self.caller.model
        if self.block_size:
            _, features = block_draft_logits(model, self.caller, sequences, ctx.rows, lengths, k, self.prompt_len,
                                             self.kv, features=True)
        else:
            _, features = diffusion_draft_logits(model, self.caller, sequences, ctx.rows, lengths, k, features=True)
        embed, _, project = backbone_parts(model)
        rows = torch.arange(sequences.shape[0], device=sequences.device)
        tokens = torch.zeros((len(rows), k), dtype=torch.long, device=sequences.device)
        logits = torch.zeros((len(rows), k, ctx.vocab_size), device=sequences.device)
        previous = sequences[rows, lengths - 1]  # the last confirmed token
        with torch.no_grad():
            state = torch.zeros_like(features[:, 0])
            for j in range(k):
                repaired, state = self.head(features[:, j], embed(previous), state)
                logits[:, j] = project(repaired)[:, : ctx.vocab_size]  # the mask id (forbidden) may lie past it
                previous = tokens[:, j] = _sample(logits[:, j], ctx)
        return Draft(tokens, logits, ctx.num_drafts)


def _unsure(logits: torch.Tensor, drafts: torch.Tensor, confidence: float) -> torch.Tensor:
    """Drafts [R] whose temperature-1 probability under their logits [R, V] is below ``confidence``."""
    return torch.softmax(logits.float(), -1).gather(-1, drafts[..., None]).squeeze(-1) < confidence


def head_drafter(drafter, draft_head, target, caller, block_size, prompt_len, kv, confidence=None,
                 cutoff=None) -> Drafter:
    """The Drafter for ``drafter="head"`` (an EAGLE or DFlash head on ``target``; ``confidence``: its dynamic draft
    length) or a diffusion ``drafter`` with a repair ``draft_head``; ``draft_head`` a head module or folder
    (None: the shipped EAGLE head)."""
    if isinstance(drafter, str):
        head = draft_head if draft_head is not None else DEFAULT_EAGLE
        check_head(head, FEATURE_KINDS, target)
        return EagleDrafter(_decoding_head(head, _dtype(target)), target, confidence, cutoff)
    check_head(draft_head, "repair", drafter)
    return RepairDrafter(caller, block_size, prompt_len, kv, head=_decoding_head(draft_head, _dtype(drafter)))


def _decoding_head(head, dtype: torch.dtype):
    """``load_head`` for decoding: a head folder is read once per folder, modification time and dtype (loading the
    shipped EAGLE head took 14 ms, more than a round of ``ar_spec`` at batch 1, in every ``generate`` call). A
    module is used as it is; training loads its own copy (``dllm.training.ar_heads``), so none is shared with it."""
    if not isinstance(head, str | Path):
        return load_head(head, dtype=dtype)
    folder = (shipped_or_path(head) if isinstance(head, str) else Path(head)).resolve()
    weights = folder / "model.safetensors"
    return _cached_head(str(folder), weights.stat().st_mtime_ns if weights.is_file() else 0, dtype)


@functools.lru_cache(maxsize=8)
def _cached_head(folder: str, stamp: int, dtype: torch.dtype):
    return load_head(folder, dtype=dtype)


def check_drafter_head(drafter, draft_head, target, num_draft_tokens: int | None = None) -> None:
    """At the door: ``drafter="head"`` with an EAGLE head fitting ``target``, or a DiffusionModel drafter with
    a repair head fitting it; a ValueError/TypeError naming the parameter otherwise."""
    if draft_head is not None and not isinstance(draft_head, str | Path | EagleHead | DFlashHead | RepairHead):
        raise TypeError(f"draft_head must be a head folder or a head module (dllm.models.ar_heads), "
                        f"got {type(draft_head).__name__}")
    if isinstance(drafter, str) and drafter == "head":
        if draft_head is None and not DEFAULT_EAGLE.is_dir():
            raise ValueError(f"drafter='head' without draft_head uses the shipped EAGLE head {DEFAULT_EAGLE}, "
                             "which is missing; pass draft_head=")
        if not capabilities(target).hidden_states:
            raise TypeError(f"drafter='head' reads the target's features; {type(target).__name__} does not "
                            "declare Capabilities.hidden_states")
        config = check_head(draft_head if draft_head is not None else DEFAULT_EAGLE, FEATURE_KINDS, target)
        if config.kind == "dflash" and num_draft_tokens is not None and num_draft_tokens > config.max_drafts:
            raise ValueError(f"num_draft_tokens ({num_draft_tokens}) exceeds the dflash draft_head's max_drafts "
                             f"({config.max_drafts})")
        return
    if not is_diffusion_model(drafter):
        shown = drafter if isinstance(drafter, str) else type(drafter).__name__
        raise ValueError("draft_head is for drafter='head' (an 'eagle' head) or a DiffusionModel drafter (a "
                         f"'repair' head), got drafter={shown!r}")
    if not capabilities(drafter).hidden_states:
        raise TypeError(f"a repair draft_head reads the drafter's features; {type(drafter).__name__} does not "
                        "declare Capabilities.hidden_states")
    check_head(draft_head, "repair", drafter)
    if drafter.vocab_size < target.vocab_size:
        raise ValueError(f"drafter vocabulary ({drafter.vocab_size}) is smaller than the model's ({target.vocab_size})")


def _dtype(model) -> torch.dtype:
    return next(model.parameters()).dtype
