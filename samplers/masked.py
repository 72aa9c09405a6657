"""Parallel masked-diffusion samplers people compare against (approximate: they sample factorized
marginals for several positions at once, so their joint is not the model's sequential chain).

- ``llada``: LLaDA's reference sampler (Nie et al. 2025, Alg. "low_confidence"/"random" remasking,
  semi-autoregressive blocks, float64 Gumbel-max sampling, unsupervised classifier-free guidance).
- ``dream``: Dream-7B's sampler (Ye et al. 2025): ``origin`` (reveal each masked position with
  probability 1 - s/t) and the confidence rules ``maskgit_plus`` (sampled-token probability),
  ``topk_margin`` (top-1 minus top-2) and ``entropy`` (negative entropy), with ``top_p``/``top_k``
  filtering and optional stochastic position choice at ``alg_temp``.
- ``fast_dllm``: Fast-dLLM's confidence-aware parallel decoding (Wu et al. 2025): reveal every position
  whose confidence exceeds ``threshold`` (at least the most confident one), or the ``factor`` rule:
  the largest n whose n-th highest confidence c_n satisfies (n + 1)(1 - c_n) < factor.
- ``eb``: the entropy-bounded sampler (Ben-Hamu et al. 2025): reveal the lowest-entropy positions while
  sum(H) - max(H) <= ``gamma`` (at least one).
"""

from __future__ import annotations

import math

import torch
from dllm.kernels import SampleConfidence, sample_confidence

from dllm.numerics import forbid_token, gumbel, uniform
from dllm.stats import DecodeStats

from .canvas import Canvas, call_model

DREAM_ALGORITHMS = ("origin", "maskgit_plus", "topk_margin", "entropy")
REMASKING = ("low_confidence", "random")
DREAM_EPS = 1e-3  # Dream's final timestep: its schedule runs t = linspace(1, eps, steps + 1)


def llada(
    model, prompt, gen_length, *, temperature, generator, stats: DecodeStats, block_length, steps,
    remasking="low_confidence", cfg_scale=0.0, callback=None,
) -> torch.Tensor:
    """LLaDA's semi-autoregressive sampler: ``steps`` spread evenly over blocks, fixed tokens per step."""
    canvas = Canvas.start(prompt, gen_length, block_length, model.mask_token_id)
    steps_per_block = steps // canvas.num_blocks
    schedule = _transfer_schedule(block_length, steps_per_block)
    for _block in range(canvas.num_blocks):
        for k in schedule:
            rows = canvas.active_rows()
            x = canvas.x[rows]
            logits = _guided_logits(model, x, canvas.prompt_length, cfg_scale, stats)
            candidates = canvas.candidates(x)
            where, proposal = _propose(logits, candidates, model.mask_token_id, temperature, generator)
            if remasking == "random":
                score = uniform(generator, (len(where[0]),), x.device)
            else:
                score = proposal.token_prob.double()
            chosen = _top_k(_scatter(score, where, x.shape), torch.full_like(rows, k))
            _reveal(canvas, rows, where, proposal.tokens, chosen, stats, callback, "llada")
    return canvas.x


def dream(
    model, prompt, gen_length, *, temperature, generator, stats: DecodeStats, block_length, steps,
    alg="maskgit_plus", alg_temp=None, top_p=None, top_k=None, callback=None,
) -> torch.Tensor:
    """Dream's sampler; with ``block_length`` < gen_length its schedule restarts in every block."""
    canvas = Canvas.start(prompt, gen_length, block_length, model.mask_token_id)
    steps_per_block = steps // canvas.num_blocks
    times = torch.linspace(1.0, DREAM_EPS, steps_per_block + 1, dtype=torch.float64).tolist()
    for _block in range(canvas.num_blocks):
        for i in range(steps_per_block):
            last = i == steps_per_block - 1
            fraction = 1.0 if last else 1.0 - times[i + 1] / times[i]
            rows = canvas.active_rows()
            x = canvas.x[rows]
            logits = call_model(model, x, stats)
            candidates = canvas.candidates(x)
            filtered = _filter_logits(logits, temperature, top_p, top_k)
            # Filtering already applied the temperature; sample the filtered distribution as it stands.
            where, proposal = _propose(filtered, candidates, model.mask_token_id, 1.0 if temperature else 0.0,
                                       generator)
            if alg == "origin":
                chosen = candidates.clone()
                if not last:
                    chosen[where] = uniform(generator, (len(where[0]),), x.device) < fraction
            else:
                score = {"maskgit_plus": proposal.token_prob, "topk_margin": proposal.margin,
                         "entropy": -proposal.entropy}[alg].double()
                counts = candidates.sum(1)
                k = counts if last else (counts.double() * fraction).long()
                chosen = _top_k(_scatter(score, where, x.shape), k, alg_temp, generator)
            _reveal(canvas, rows, where, proposal.tokens, chosen, stats, callback, "dream")
    return canvas.x


def fast_dllm(
    model, prompt, gen_length, *, temperature, generator, stats: DecodeStats, block_length,
    threshold=None, factor=None, callback=None,
) -> torch.Tensor:
    """Fast-dLLM parallel decoding: confidence threshold (default 0.9) or the ``factor`` rule."""
    if threshold is None and factor is None:
        threshold = 0.9
    canvas = Canvas.start(prompt, gen_length, block_length, model.mask_token_id)
    while (rows := canvas.active_rows()).numel():
        x = canvas.x[rows]
        logits = call_model(model, x, stats)
        where, proposal = _propose(logits, canvas.candidates(x), model.mask_token_id, temperature, generator)
        confidence = _scatter(proposal.token_prob.double(), where, x.shape)  # -inf off candidates
        ranked = confidence.sort(dim=1, descending=True).values
        n = torch.arange(1, x.shape[1] + 1, device=x.device, dtype=torch.float64)
        if threshold is not None:
            passes = ranked > threshold
        else:
            passes = (n + 1) * (1 - ranked) < factor
        passes[:, 0] = True  # at least one token per step
        k = (passes.long().cumprod(dim=1).sum(dim=1)).clamp(max=(confidence > -math.inf).sum(1))
        _reveal(canvas, rows, where, proposal.tokens, _top_k(confidence, k), stats, callback, "fast_dllm")
    return canvas.x


def eb(
    model, prompt, gen_length, *, temperature, generator, stats: DecodeStats, block_length, gamma=0.01,
    callback=None,
) -> torch.Tensor:
    """Entropy-bounded unmasking: the lowest-entropy positions while sum(H) - max(H) <= gamma."""
    canvas = Canvas.start(prompt, gen_length, block_length, model.mask_token_id)
    while (rows := canvas.active_rows()).numel():
        x = canvas.x[rows]
        logits = call_model(model, x, stats)
        candidates = canvas.candidates(x)
        where, proposal = _propose(logits, candidates, model.mask_token_id, temperature, generator)
        entropy = _scatter(proposal.entropy.double(), where, x.shape, fill=math.inf)
        ranked = entropy.sort(dim=1).values  # ascending; +inf off candidates
        finite = torch.where(torch.isfinite(ranked), ranked, torch.zeros_like(ranked))
        # Sorted ascending, the running max is the newest entry: sum(H) - max(H) = cumsum - H_n.
        bound = finite.cumsum(dim=1) - finite
        k = ((bound <= gamma) & torch.isfinite(ranked)).long().cumprod(dim=1).sum(dim=1).clamp(min=1)
        _reveal(canvas, rows, where, proposal.tokens, _top_k(-entropy, k), stats, callback, "eb")
    return canvas.x


def _transfer_schedule(block_length: int, steps: int) -> list[int]:
    """Tokens revealed at each step of a block: even split, remainder on the first steps (as LLaDA)."""
    base, extra = divmod(block_length, steps)
    return [base + (1 if i < extra else 0) for i in range(steps)]


def _guided_logits(model, x: torch.Tensor, prompt_length: int, cfg_scale: float, stats: DecodeStats):
    """Logits, with unsupervised classifier-free guidance when cfg_scale > 0 (prompt masked as the
    unconditional input; both halves in one batched call)."""
    if cfg_scale <= 0:
        return call_model(model, x, stats)
    unconditional = x.clone()
    unconditional[:, :prompt_length] = model.mask_token_id
    both = call_model(model, torch.cat([x, unconditional]), stats, rows=x.shape[0])
    cond, uncond = both.float().chunk(2)
    return uncond + (cfg_scale + 1) * (cond - uncond)


def _propose(
    logits: torch.Tensor, candidates: torch.Tensor, mask_id: int, temperature: float, generator: torch.Generator
) -> tuple[tuple[torch.Tensor, torch.Tensor], SampleConfidence]:
    """Sample a token and its confidences at every candidate position (only there)."""
    where = candidates.nonzero(as_tuple=True)
    return where, sample_confidence(forbid_token(logits[where], mask_id), temperature, generator)


def _filter_logits(logits: torch.Tensor, temperature: float, top_p: float | None, top_k: int | None):
    """Dream's logit processing: temperature, then nucleus (top_p) and top_k truncation."""
    out = logits.float() / temperature if temperature > 0 else logits.float()
    if top_k is not None:
        kth = out.topk(min(top_k, out.shape[-1]), dim=-1).values[..., -1:]
        out = out.masked_fill(out < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = out.sort(dim=-1, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = cumulative - sorted_logits.softmax(-1) >= top_p  # keep the token that crosses top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        out = out.masked_fill(drop, float("-inf"))
    return out


def _scatter(values: torch.Tensor, where, shape, fill: float = -math.inf) -> torch.Tensor:
    """Place per-candidate ``values`` [N] into a [R, L] float64 grid, ``fill`` elsewhere."""
    grid = torch.full(shape, fill, dtype=torch.float64, device=values.device)
    grid[where] = values.double()
    return grid


def _top_k(
    score: torch.Tensor, k: torch.Tensor, temperature: float | None = None, generator: torch.Generator | None = None
) -> torch.Tensor:
    """The k[r] best-scoring positions per row (or, at ``temperature`` > 0, k[r] positions sampled without
    replacement from softmax(score / temperature) by Gumbel-top-k) -> bool [R, L]."""
    if temperature:
        finite = torch.isfinite(score)
        noisy = score / temperature + gumbel(generator, tuple(score.shape), score.device)
        score = torch.where(finite, noisy, score)
    ranked = score.sort(dim=1, descending=True, stable=True).indices
    take = torch.arange(score.shape[1], device=score.device)[None, :] < k[:, None]
    chosen = torch.zeros_like(score, dtype=torch.bool)
    chosen.scatter_(1, ranked, take)
    return chosen & torch.isfinite(score)


def _reveal(canvas: Canvas, rows, where, tokens, chosen, stats: DecodeStats, callback, name: str) -> None:
    """Write the proposed tokens at the chosen positions of the active rows and count the step."""
    x = canvas.x[rows]
    proposed = torch.full_like(x, -1)
    proposed[where] = tokens
    hit = chosen & (proposed >= 0)
    x[hit] = proposed[hit]
    canvas.x[rows] = x
    stats.count_round(hit.sum(dim=1))
    if callback is not None:
        callback({"sampler": name, "rows": rows, "x": x, "revealed": hit})
