"""What every drafter hands the verifier, and the draws fef and ar_spec share.

A ``Draft`` is one round's proposal: the drafted tokens, the logits they were sampled from and how many are
valid. The output law stays exact for any drafter, provided ``Draft.logits`` are the very logits the tokens
were sampled from (softmax(logits / T), as ``dllm.numerics.sample_from_logits`` draws them): a drafter changes
speed only. ar_spec's drafters (``samplers/ar_spec/drafters.py``) propose at the end of sequences; fef's draft
sources (``samplers/fef/sources.py``) at positions of a canvas; both return a ``Draft``.

Adaptive draft length (``draft_cutoff``, fef and ar_spec alike): a row's drafts end at the first one where the
drafter's own estimate that all of them survive verification, the running product of each draft's
temperature-1 probability under the logits it was drawn from (``draft_survival``), falls below the cutoff
(``cut_count``), as DFlash's confidence cut-off and EAGLE-2's dynamic length do. Drafting one more position pays
when the chance it is reached and accepted beats its cost relative to a round's, so the cutoff is that cost ratio
(the speed study's cost model gives both costs). Exact for every cutoff because whether position j + 1 is drafted
is decided from drafts 0..j alone, before d_{j+1} is drawn (the draft that crosses the cutoff is still verified):
the count is a stopping time of the drafter's own sampling, and the rule never reads the target (whose call
has not been made). A rule that looks alike is not exact, and the tests show it (``tests/test_adaptive_drafts.py``):
one that also drops the draft that crossed the cutoff keeps or drops a draft by its own value, so the kept drafts
are biased toward tokens the judge likes (whether the judge is the drafter or the target), which the verifier,
told the drafter's logits, does not know.
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


def draft_survival(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The drafter's own estimate that drafts 0..j all survive: the running product over a window of each draft's
    temperature-1 probability under the logits it was drawn from, logits [R, K, V], tokens [R, K] -> [R, K]."""
    own = torch.softmax(logits.float(), dim=-1).gather(-1, tokens.clamp(min=0)[..., None])[..., 0]
    return own.cumprod(dim=1)


def cut_count(logits: torch.Tensor, tokens: torch.Tensor, count: torch.Tensor, cutoff: float | None) -> torch.Tensor:
    """The adaptive draft length (see the module docstring): each row's ``count`` [R] shortened to end at its first
    draft whose ``draft_survival`` is below ``cutoff``, that draft included (so at least one) -> [R]."""
    if cutoff is None or tokens.shape[1] == 0:
        return count
    above = (draft_survival(logits, tokens) >= cutoff).long().sum(dim=1)  # a prefix: the product only falls
    return torch.minimum(count, above + 1)


def cut_draft(draft: Draft, cutoff: float | None) -> Draft:
    """``draft`` with each row's count cut by ``cut_count`` and its columns trimmed to the longest row's (one host
    read), so the verification call feeds no draft that cannot be verified."""
    if cutoff is None or draft.logits is None:
        return draft
    count = cut_count(draft.logits, draft.tokens, draft.count, cutoff)
    width = min(draft.tokens.shape[1], max(int(count.max()), 1))
    return Draft(draft.tokens[:, :width], draft.logits[:, :width], count, draft.independent)


def independent_drafts(window_logits: torch.Tensor, mask_id: int, temperature: float,
                       generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Independent drafts from a window's marginals [R, W, V] -> (tokens [R, W], their logits with the
    mask token forbidden [R, W, V]), one per-row generator stream per row (``bind_rows``)."""
    logits = forbid_token(window_logits, mask_id)
    flat = logits.reshape(-1, logits.shape[-1])
    rows = torch.arange(logits.shape[0], device=logits.device).repeat_interleave(logits.shape[1])
    tokens = sample_from_logits(flat, temperature, bind_rows(generator, rows)).reshape(logits.shape[:2])
    return tokens, logits
