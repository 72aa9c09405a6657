"""Stop tokens: the one rule every sampler, adapter and the eval runner follows.

The rule: a row's answer ends at its first stop token, which is kept; every position after it holds the
fill token (the first stop id); ``new_tokens`` counts each row's generated tokens up to and including its
stop (all of them when it has none). Tokens after the first stop are not part of the answer, so a sampler
may stop the row there (or fill its tail) without changing the law of the answer.

Stop ids are a tuple of ints (``None``: rows never stop); ``resolve`` turns what a user passes into one.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

StopIds = tuple[int, ...] | None


def model_stop_ids(model) -> StopIds:
    """A model's default stop ids: its ``stop_token_ids``, else its ``eos_token_id`` (one or several)."""
    ids = getattr(model, "stop_token_ids", None) or getattr(model, "eos_token_id", None)
    if ids is None:
        return None
    return (ids,) if isinstance(ids, int) else tuple(ids)


def resolve(model, eos_token_id: int | Sequence[int] | str | None = "model") -> StopIds:
    """Normalise ``eos_token_id`` (one id, several, None, or "model" for the model's own) to stop ids.

    Raises naming ``eos_token_id`` when an id is not an int in [0, vocab_size) or is the mask token
    (no sampler may emit the mask token, so a row could never stop there and its output would hold masks).
    """
    source = "eos_token_id"
    if isinstance(eos_token_id, str):
        if eos_token_id != "model":
            raise ValueError(f"eos_token_id must be an int, a sequence of ints, None or 'model', got {eos_token_id!r}")
        eos_token_id, source = model_stop_ids(model), f"eos_token_id ('model': {type(model).__name__}'s stop ids)"
    if eos_token_id is None:
        return None
    if not isinstance(eos_token_id, int | Sequence):
        raise TypeError(f"{source} must be an int, a sequence of ints, None or 'model', got "
                        f"{type(eos_token_id).__name__}")
    ids = (eos_token_id,) if isinstance(eos_token_id, int) else tuple(eos_token_id)
    if not ids:
        raise ValueError(f"{source} must name at least one id (None disables stopping), got []")
    for value in ids:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{source} must hold ints, got {type(value).__name__} ({value!r})")
    vocab = model.vocab_size
    if min(ids) < 0 or max(ids) >= vocab:
        raise ValueError(f"{source} must name ids in [0, vocab_size={vocab}), got {list(ids)}")
    mask_id = getattr(model, "mask_token_id", None)
    if mask_id is not None and mask_id in ids:
        raise ValueError(f"{source} must not contain the mask token id {mask_id}: no sampler emits the mask "
                         f"token, so rows could not stop there; got {list(ids)}")
    return tuple(dict.fromkeys(ids))  # order kept: the first id is the fill token


def fill_token(stop_ids: StopIds, default: int = 0) -> int:
    """What positions after a row's stop hold: the first stop id (``default`` when rows never stop)."""
    return stop_ids[0] if stop_ids else default


def is_stop(tokens: torch.Tensor, stop_ids: Sequence[int]) -> torch.Tensor:
    """Which entries of ``tokens`` are stop tokens -> bool, same shape."""
    return torch.isin(tokens, _stop_tensor(tuple(stop_ids), tokens.dtype, tokens.device))


@functools.lru_cache(maxsize=64)
def _stop_tensor(stop_ids: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The stop ids as a tensor on ``device``, built once: a host-to-device copy every step would make the host
    wait on a GPU (samplers check for stops after each round). Only read (``isin``), never written."""
    return torch.tensor(stop_ids, dtype=dtype, device=device)


def first_stop(answers: torch.Tensor, stop_ids: StopIds) -> torch.Tensor:
    """Index of each row's first stop token in ``answers`` [B, N]; N for rows without one -> [B]."""
    if not stop_ids:
        return torch.full((answers.shape[0],), answers.shape[1], dtype=torch.long, device=answers.device)
    hit = is_stop(answers, stop_ids)
    return torch.where(hit.any(dim=1), hit.long().argmax(dim=1), answers.shape[1])


def answer_lengths(answers: torch.Tensor, stop_ids: StopIds) -> torch.Tensor:
    """Generated tokens per row of ``answers`` [B, N], up to and including the first stop -> [B]."""
    return (first_stop(answers, stop_ids) + 1).clamp(max=answers.shape[1])


def fill_after_stop(answers: torch.Tensor, stop_ids: StopIds) -> torch.Tensor:
    """``answers`` [B, N] with every position after each row's first stop set to the fill token (a copy)."""
    if not stop_ids:
        return answers.clone()
    after = torch.arange(answers.shape[1], device=answers.device)[None, :] > first_stop(answers, stop_ids)[:, None]
    return answers.masked_fill(after, fill_token(stop_ids))


def emitted_until_stop(tokens: torch.Tensor, num_emitted: torch.Tensor, stop_ids: StopIds):
    """Tokens [R, K] of which the first ``num_emitted`` [R] count, cut just after each row's first stop ->
    (counts kept [R], rows that stopped bool [R]); for samplers that emit several tokens at once."""
    if not stop_ids:
        return num_emitted, torch.zeros_like(num_emitted, dtype=torch.bool)
    live = torch.arange(tokens.shape[1], device=tokens.device)[None, :] < num_emitted[:, None]
    hit = is_stop(tokens, stop_ids) & live
    stopped = hit.any(dim=1)
    first = hit.long().argmax(dim=1)
    return torch.where(stopped, first + 1, num_emitted), stopped


def fit_output(sequences: torch.Tensor, prompt_length: int, max_new_tokens: int, stop_ids: StopIds,
               pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Another loop's output (transformers' ``generate``, remote code) brought to the rule: cut or padded
    to [B, P + N] with ``pad``, then filled after each row's stop -> (sequences, answer lengths [B])."""
    total = prompt_length + max_new_tokens
    if sequences.shape[1] < total:  # every row stopped early
        sequences = torch.cat((sequences, sequences.new_full((sequences.shape[0], total - sequences.shape[1]),
                                                             pad)), dim=1)
    answers = fill_after_stop(sequences[:, prompt_length:total], stop_ids)
    return torch.cat((sequences[:, :prompt_length], answers), dim=1), answer_lengths(answers, stop_ids)
