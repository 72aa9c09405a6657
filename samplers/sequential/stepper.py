"""``sequential``: the exact prefix-conditioned sampler, one token per model call (fef's reference)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dllm.numerics import bind_rows, forbid_token, sample_from_logits
from dllm.protocols import capabilities, is_diffusion_model, run_block_size
from dllm.stats import DecodeStats

from ..canvas import Band, Canvas, View, block_candidates
from ..order import pick_next, read_band


@dataclass
class SequentialStepper:
    """Reveal one position per call: the next in ``order``, sampled from softmax(logits / T).

    Its output distribution is the chain of prefix conditionals, each token given every token revealed
    before it: the target that ``fef`` reproduces exactly.
    """

    temperature: float
    generator: torch.Generator
    stats: DecodeStats
    order: str  # the option (SequentialConfig)

    lookahead = False  # (samplers.loop.Stepper) calls need not score the next block

    def begin_block(self, block: int) -> None:
        pass

    def logits(self, view: View) -> tuple[torch.Tensor, Band]:
        """The model at the view's state where the step reads it -> (logits [R, K, V], the band they cover): the
        next position left to right, the active block otherwise."""
        band = read_band(self.order, view, 1)
        return view.call(view.x, torch.arange(view.x.shape[0], device=view.x.device), at=band.at()), band

    def step(self, view: View, logits: tuple[torch.Tensor, Band]) -> tuple[torch.Tensor, dict]:
        logits, band = logits
        which = torch.arange(view.x.shape[0], device=view.x.device)
        slot = pick_next(self.order, logits, band.candidates(view, view.x), view.mask_token_id)  # [R]
        chosen = forbid_token(logits[which, slot], view.mask_token_id)  # [R, V]
        position = band.positions(slot[:, None])[:, 0]
        x = view.x.clone()
        x[which, position] = sample_from_logits(chosen, self.temperature, bind_rows(self.generator, view.rows))
        self.stats.count_round(torch.ones_like(position))
        return x, {"sampler": "sequential", "revealed": position[:, None] + view.offset,
                   "emitted_logits": chosen[:, None]}


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
    each answer (a tuple of token ids) to its probability. The ground truth for exactness tests; written
    independently of the samplers' loop on purpose.
    """
    if capabilities(model).reveal_order_cache and order != "left_to_right":
        raise ValueError("sequential_distribution reads revealed tokens in position order; a two-stream model's "
                         f"order={order!r} chain reads them in reveal order (see tests/test_two_stream.py)")
    causal = not is_diffusion_model(model)
    mask_id = -1 if causal else model.mask_token_id
    p, caps = prompt.numel(), capabilities(model)
    block_length = block_length or gen_length
    # Block-causal models line their blocks up with the answer, as the samplers call them, or with position 0
    # (``block_anchor="absolute"``): the prompt's tail then opens the first block, and the canvas runs on with
    # masks to the end of a model block; those positions are decoded too (the chain's law over the first
    # gen_length tokens is summed over them). The model's blocks are the run's (``run_block_size``: block_length
    # on a model whose blocks are a run's choice, passed with each call as the sessions pass it).
    lead = tail = 0
    size = run_block_size(model, block_length)
    if size is not None and caps.block_anchor == "absolute":
        lead, tail = p % block_length, -(p + gen_length) % size
    canvas = Canvas.start(prompt[None], gen_length, block_length, mask_id, lead=lead, tail=tail)
    positions = torch.arange(canvas.x.shape[1]) - canvas.span(0)[0]
    block_ids = torch.where(positions >= 0, positions // canvas.block_length, -1)
    states, probs = canvas.x, torch.ones(1, dtype=torch.float64)
    offset = 0 if caps.block_anchor == "absolute" else p
    extra = {"block_offset": torch.tensor([offset])} if size is not None else {}
    if caps.run_blocks and size is not None:
        extra["block_size"] = size
    for step in range(gen_length + tail):
        if causal:
            logits = model(states[:, : p + step])[:, -1]
            position = torch.full((states.shape[0],), p + step)
        else:
            logits_all = model(states, **extra)
            position = pick_next(order, logits_all, block_candidates(states, block_ids, mask_id), mask_id)
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
    out: dict[tuple[int, ...], float] = {}
    for answer, prob in zip(states[:, p : p + gen_length].tolist(), probs.tolist()):
        out[tuple(answer)] = out.get(tuple(answer), 0.0) + prob
    return out
