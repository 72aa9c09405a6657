"""Autoregressive decoding of a CausalModel: plain sampling (``ar``) and speculative decoding (``ar_spec``).

Rows may hold different lengths (ragged acceptance). They share one right-padded buffer: a causal model's
logits at position i depend only on tokens <= i, so whatever follows a row's end cannot change them.

``ar_spec`` drafters:
- a CausalModel: ``num_draft_tokens`` sequential calls, each draft sampled from softmax(logits / T);
- a DiffusionModel: one call on the sequence followed by mask tokens up to a fixed length
  (prompt + max_new_tokens + num_draft_tokens, so a row's drafts never depend on the rest of the
  batch); drafts sampled independently from its marginals at the next positions;
- ``"ngram"``: prompt lookup: the continuation of the latest earlier occurrence of the sequence's last
  n tokens (n = ``max_ngram`` .. 1), proposed as point masses.
The shared ``verify`` makes the output distributed exactly as ``ar`` at the same temperature.
"""

from __future__ import annotations

import torch

from dllm.numerics import forbid_token, sample_from_logits, softmax
from dllm.protocols import is_diffusion_model
from dllm.stats import DecodeStats

from .canvas import call_model
from .verify import verify


def ar(model, prompt, gen_length, *, temperature, generator, stats: DecodeStats, callback=None) -> torch.Tensor:
    """One token per call from the next-token distribution -> [B, P + N]."""
    seq = prompt.long()
    for _ in range(gen_length):
        logits = call_model(model, seq, stats)[:, -1]
        token = sample_from_logits(logits, temperature, generator)
        seq = torch.cat([seq, token[:, None]], dim=1)
        stats.count_round(torch.ones_like(token))
        if callback is not None:
            callback({"sampler": "ar", "rows": torch.arange(seq.shape[0]), "x": seq})
    return seq


def ar_spec(
    model, prompt, gen_length, *, temperature, generator, stats: DecodeStats, drafter="ngram",
    num_draft_tokens=4, max_ngram=3, callback=None,
) -> torch.Tensor:
    """Speculative decoding against the causal target ``model`` -> [B, P + N]."""
    batch, prompt_len = prompt.shape
    total = prompt_len + gen_length
    seq = torch.zeros((batch, total), dtype=torch.long, device=prompt.device)
    seq[:, :prompt_len] = prompt
    lengths = torch.full((batch,), prompt_len, dtype=torch.long, device=prompt.device)
    while (rows := (lengths < total).nonzero().squeeze(-1)).numel():
        length = lengths[rows]
        num_drafts = torch.clamp(total - length - 1, max=num_draft_tokens)  # leave room for the bonus
        drafts, draft_probs, num_drafts = _draft(
            drafter, seq[rows], length, num_drafts, num_draft_tokens, temperature, generator, stats, max_ngram
        )
        target = _target_rows(model, seq[rows], length, drafts, stats)  # [R, K + 1, V]
        greedy = temperature == 0
        outcome = verify(drafts, draft_probs, target if greedy else softmax(target, temperature), num_drafts,
                         generator=generator, greedy=greedy)
        stats.count_verification(num_drafts, outcome.num_accepted, outcome.num_emitted)
        offsets = torch.arange(outcome.tokens.shape[1], device=seq.device)
        hit = outcome.tokens >= 0
        row_index = rows[:, None].expand_as(hit)[hit]
        seq[row_index, (length[:, None] + offsets)[hit]] = outcome.tokens[hit]
        lengths[rows] += outcome.num_emitted
        if callback is not None:
            callback({"sampler": "ar_spec", "rows": rows, "x": seq[rows], "drafts": drafts,
                      "num_drafts": num_drafts, "num_accepted": outcome.num_accepted})
    return seq


def _target_rows(model, seq: torch.Tensor, length: torch.Tensor, drafts: torch.Tensor, stats) -> torch.Tensor:
    """Target logits for each draft position and the bonus: one call on sequence + drafts -> [R, K + 1, V]."""
    width = drafts.shape[1]
    extended = _append(seq, length, drafts)
    logits = call_model(model, extended[:, : int(length.max()) + width], stats)
    at = length[:, None] - 1 + torch.arange(width + 1, device=seq.device)  # position t predicts t + 1
    return logits[torch.arange(seq.shape[0], device=seq.device)[:, None], at]


def _append(seq: torch.Tensor, length: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Each row's sequence with ``tokens`` [R, K] written after its end -> [R, max(len) + K] (right padded)."""
    width = tokens.shape[1]
    out = torch.zeros((seq.shape[0], int(length.max()) + width), dtype=torch.long, device=seq.device)
    out[:, : seq.shape[1]] = seq[:, : out.shape[1]]
    at = length[:, None] + torch.arange(width, device=seq.device)
    out.scatter_(1, at, tokens)
    return out


def _draft(drafter, seq, length, num_drafts, width, temperature, generator, stats, max_ngram):
    """Drafts [R, K], draft_probs [R, K, V] or None (point masses), valid drafts per row [R]."""
    if isinstance(drafter, str):
        drafts, found = _ngram_drafts(seq, length, num_drafts, width, max_ngram)
        return drafts, None, found
    if is_diffusion_model(drafter):
        logits = _diffusion_draft_logits(drafter, seq, length, width, stats)
        flat = logits.reshape(-1, logits.shape[-1])
        drafts = sample_from_logits(flat, temperature, generator).reshape(logits.shape[:2])
        return drafts, (None if temperature == 0 else softmax(logits, temperature)), num_drafts
    drafts, probs = _causal_drafts(drafter, seq, length, width, temperature, generator, stats)
    return drafts, probs, num_drafts


def _diffusion_draft_logits(drafter, seq, length, width, stats) -> torch.Tensor:
    """Marginals of a diffusion drafter at the next ``width`` positions, from one call -> [R, K, V]."""
    size = seq.shape[1] + width  # prompt + max_new_tokens + K: fixed, so a row's drafts ignore the batch
    canvas = torch.full((seq.shape[0], size), drafter.mask_token_id, dtype=torch.long, device=seq.device)
    keep = torch.arange(size, device=seq.device)[None, :] < length[:, None]
    canvas[:, : seq.shape[1]] = torch.where(keep[:, : seq.shape[1]], seq, canvas[:, : seq.shape[1]])
    logits = call_model(drafter, canvas, stats, draft=True)
    at = length[:, None] + torch.arange(width, device=seq.device)
    return forbid_token(logits[torch.arange(seq.shape[0], device=seq.device)[:, None], at], drafter.mask_token_id)


def _causal_drafts(drafter, seq, length, width, temperature, generator, stats):
    """``width`` sequential draft calls of a causal drafter -> (drafts [R, K], draft_probs [R, K, V] | None)."""
    rows = torch.arange(seq.shape[0], device=seq.device)
    drafts = torch.zeros((seq.shape[0], width), dtype=torch.long, device=seq.device)
    probs = []
    for j in range(width):
        extended = _append(seq, length, drafts[:, :j])
        logits = call_model(drafter, extended, stats, draft=True)[rows, length + j - 1]
        drafts[:, j] = sample_from_logits(logits, temperature, generator)
        if temperature > 0:
            probs.append(softmax(logits, temperature))
    return drafts, (torch.stack(probs, dim=1) if probs else None)


def _ngram_drafts(seq, length, num_drafts, width, max_ngram) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt-lookup drafts: continuation of the latest earlier match of the last n tokens."""
    drafts = torch.zeros((seq.shape[0], width), dtype=torch.long, device=seq.device)
    found = torch.zeros(seq.shape[0], dtype=torch.long, device=seq.device)
    for r, (row, n_tokens, limit) in enumerate(zip(seq.tolist(), length.tolist(), num_drafts.tolist())):
        continuation = _lookup(row[:n_tokens], max_ngram)[:limit]
        drafts[r, : len(continuation)] = torch.tensor(continuation, dtype=torch.long)
        found[r] = len(continuation)
    return drafts, found


def _lookup(tokens: list[int], max_ngram: int) -> list[int]:
    """Tokens that followed the latest earlier occurrence of the longest matching suffix n-gram."""
    for n in range(min(max_ngram, len(tokens) - 1), 0, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n :]
    return []
