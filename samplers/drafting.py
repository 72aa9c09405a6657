"""What every drafter hands the verifier, and the draws fef and ar_spec share.

A ``Draft`` is one round's proposal: the drafted tokens, the logits they were sampled from and how many are
valid. The output law stays exact for any drafter, provided ``Draft.logits`` are the very logits the tokens
were sampled from (softmax(logits / T), as ``dllm.numerics.sample_from_logits`` draws them): a drafter changes
speed only. ar_spec's drafters (``samplers/ar_spec/drafters.py``) propose at the end of sequences; fef's draft
sources (``samplers/fef/sources.py``) at positions of a canvas; both return a ``Draft``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dllm.numerics import bind_rows, forbid_token, sample_from_logits, sample_more


@dataclass(frozen=True)
class Draft:
    """One round's proposal for R rows."""

    tokens: torch.Tensor  # [R, K] drafted tokens (placeholders past ``count``)
    logits: torch.Tensor | None  # [R, K, V] the logits they were sampled from; None: point masses
    count: torch.Tensor  # [R] valid drafts per row
    # Each draft's law does not depend on the drafts before it (a diffusion drafter's marginals): the chain's
    # own drafts then continue any draft tree branch (ar_spec's trees give siblings branches)
    independent: bool = False


def more_candidates(draft: Draft, count: int, temperature: float, generator, rows: torch.Tensor,
                    below: float | None = None) -> torch.Tensor:
    """``count`` more candidates per draft position, drawn without replacement from the law the draft itself
    was drawn from, the draft removed -> [R, K, count] long (-1: none; past the row's valid drafts, where the
    law has no token left, or, with ``below``, where the draft's temperature-1 probability is not below it;
    point-mass drafts have none). Each row draws from its own generator stream (``bind_rows``), after its
    drafts. Which positions get candidates depends on the proposal alone, so verification stays exact."""
    if draft.logits is None:
        return torch.full((*draft.tokens.shape, count), -1, dtype=torch.long, device=draft.tokens.device)
    logits = draft.logits.reshape(-1, draft.logits.shape[-1])
    flat_rows = rows.repeat_interleave(draft.tokens.shape[1])
    more = sample_more(logits, draft.tokens.reshape(-1), count, temperature, bind_rows(generator, flat_rows))
    if below is not None:
        sure = torch.softmax(logits.float(), -1).gather(-1, draft.tokens.reshape(-1, 1)) >= below
        more = torch.where(sure, -1, more)
    valid = torch.arange(draft.tokens.shape[1], device=more.device) < draft.count[:, None]  # [R, K]
    return torch.where(valid[..., None], more.view(*draft.tokens.shape, count), -1)


def independent_drafts(window_logits: torch.Tensor, mask_id: int, temperature: float,
                       generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Independent drafts from a window's marginals [R, W, V] -> (tokens [R, W], their logits with the
    mask token forbidden [R, W, V]), one per-row generator stream per row (``bind_rows``)."""
    logits = forbid_token(window_logits, mask_id)
    flat = logits.reshape(-1, logits.shape[-1])
    rows = torch.arange(logits.shape[0], device=logits.device).repeat_interleave(logits.shape[1])
    tokens = sample_from_logits(flat, temperature, bind_rows(generator, rows)).reshape(logits.shape[:2])
    return tokens, logits
