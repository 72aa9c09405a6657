"""``sequential``: the exact prefix-conditioned sampler, one token per model call (fef's reference)."""

from __future__ import annotations

import torch

from dllm.numerics import forbid_token, sample_from_logits
from dllm.stats import DecodeStats

from .canvas import Canvas, call_model
from .order import pick_next


def sequential(
    model,
    prompt: torch.Tensor,  # [B, P]
    gen_length: int,
    *,
    temperature: float,
    generator: torch.Generator,
    stats: DecodeStats,
    block_length: int,
    order: str = "left_to_right",
    callback=None,
) -> torch.Tensor:
    """Reveal one position per call: the next in ``order``, sampled from softmax(logits / T) -> [B, P + N].

    Its output distribution is the chain of prefix conditionals: each token given every token revealed
    before it. That chain is the target that ``fef`` reproduces exactly.
    """
    canvas = Canvas.start(prompt, gen_length, block_length, model.mask_token_id)
    while (rows := canvas.active_rows()).numel():
        x = canvas.x[rows]
        logits = call_model(model, x, stats)
        position = pick_next(order, logits, canvas.candidates(x), model.mask_token_id)  # [R]
        chosen = forbid_token(logits[torch.arange(len(rows)), position], model.mask_token_id)  # [R, V]
        canvas.x[rows, position] = sample_from_logits(chosen, temperature, generator)
        stats.count_round(torch.ones_like(rows))
        if callback is not None:
            callback({"sampler": "sequential", "rows": rows, "x": canvas.x[rows], "revealed": position[:, None]})
    return canvas.x


def sequential_distribution(
    model,
    prompt: torch.Tensor,  # [P]
    gen_length: int,
    *,
    temperature: float = 1.0,
    order: str = "left_to_right",
    block_length: int | None = None,
) -> dict[tuple[int, ...], float]:
    """Exact output distribution of ``sequential`` on ``model`` by enumerating its decision tree.

    Works for any DiffusionModel with a small vocabulary (cost: about V^gen_length model rows), or for a
    CausalModel (no ``mask_token_id``: then the chain is plain left-to-right next-token sampling). Maps
    each answer (a tuple of token ids) to its probability. The ground truth for exactness tests.
    """
    causal = getattr(model, "mask_token_id", None) is None
    mask_id = -1 if causal else model.mask_token_id
    canvas = Canvas.start(prompt[None], gen_length, block_length or gen_length, mask_id)
    states, probs = canvas.x, torch.ones(1, dtype=torch.float64)
    p = prompt.numel()
    for step in range(gen_length):
        if causal:
            logits = model(states[:, : p + step])[:, -1]
            position = torch.full((states.shape[0],), p + step)
        else:
            logits_all = model(states)
            position = pick_next(order, logits_all, canvas.candidates(states), mask_id)
            logits = forbid_token(logits_all[torch.arange(states.shape[0]), position], mask_id)
        if temperature == 0:
            step_probs = torch.zeros_like(logits, dtype=torch.float64)
            step_probs.scatter_(1, logits.argmax(-1, keepdim=True), 1.0)
        else:
            step_probs = torch.softmax(logits.double() / temperature, dim=-1)
        parent, token = (step_probs > 0).nonzero(as_tuple=True)
        states = states[parent].clone()
        states[torch.arange(parent.numel()), position[parent]] = token
        probs = probs[parent] * step_probs[parent, token]
    answers = states[:, p:]
    out: dict[tuple[int, ...], float] = {}
    for answer, prob in zip(answers.tolist(), probs.tolist()):
        out[tuple(answer)] = out.get(tuple(answer), 0.0) + prob
    return out
