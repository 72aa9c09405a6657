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
from dataclasses import dataclass

import torch

from dllm.kernels import sample_confidence
from dllm.numerics import bind_rows, forbid_token, gumbel, uniform
from dllm.stats import DecodeStats

from ..canvas import View

DREAM_ALGORITHMS = ("origin", "maskgit_plus", "topk_margin", "entropy")


REMASKING = ("low_confidence", "random")
# SDAR's remasking strategies; its "entropy_bounded" is left out: in the official function it fails (the
# selection it writes into is never created in that branch) and scores entropy from the sampled token's
# probability alone; ``eb`` is the entropy-bounded sampler
SDAR_STRATEGIES = ("low_confidence_dynamic", "low_confidence_static", "sequential")


DREAM_EPS = 1e-3  # Dream's final timestep: its schedule runs t = linspace(1, eps, steps + 1)


@dataclass
class _Stepper:
    """Shared parts of the parallel samplers: proposing tokens and revealing the chosen ones."""

    temperature: float
    generator: torch.Generator
    stats: DecodeStats

    lookahead = False  # (samplers.loop.Stepper) calls need not score the next block

    def begin_block(self, block: int) -> None:
        self.step_index = 0

    def logits(self, view: View) -> torch.Tensor:
        """The model at the view's state, over the active block only -> [R, block, V], what the step reveals from."""
        return view.call(view.x, torch.arange(view.x.shape[0], device=view.x.device), at=view.block_band().at())

    def _propose(self, view: View, logits: torch.Tensor, temperature: float | None = None):
        """Sample a token and its confidences at every candidate position (only there); ``logits`` [R, block, V]
        cover the active block (``View.block``)."""
        where = view.candidates(view.x).nonzero(as_tuple=True)
        temperature = self.temperature if temperature is None else temperature
        chosen = forbid_token(logits[where[0], where[1] - view.block[0]], view.mask_token_id)
        return where, sample_confidence(chosen, temperature, self._rng(view, where[0]))

    def _rng(self, view: View, index: torch.Tensor):
        """The generator bound to the batch rows of ``index`` (positions into the view's rows)."""
        return bind_rows(self.generator, view.rows[index])

    def _reveal(self, view: View, where, tokens, chosen: torch.Tensor, name: str,
                logits: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """The view's tokens with the proposals written at the chosen positions; counts the step. ``logits`` [R,
        block, V]: the model's marginals the step drew from (before temperature and filters), the event's
        ``emitted_logits``."""
        proposed = torch.full_like(view.x, -1)
        proposed[where] = tokens
        hit = chosen & (proposed >= 0)
        self.stats.count_round(hit.sum(dim=1))
        self.step_index += 1
        return torch.where(hit, proposed, view.x), {"sampler": name, "revealed": hit, "emitted_logits": logits}


@dataclass
class LladaStepper(_Stepper):
    """LLaDA's semi-autoregressive sampler: a fixed number of tokens per step, ``steps_per_block`` steps."""

    steps_per_block: int = 1
    block_length: int = 1
    remasking: str = "low_confidence"
    cfg_scale: float = 0.0

    def logits(self, view: View) -> torch.Tensor:
        """Logits, with unsupervised classifier-free guidance when cfg_scale > 0 (the prompt masked as the
        unconditional input; both halves in one batched call)."""
        rows = torch.arange(view.x.shape[0], device=view.x.device)
        if self.cfg_scale <= 0:
            return view.call(view.x, rows, at=view.block_band().at())
        unconditional = view.x.clone()
        unconditional[:, : view.prompt_length] = view.mask_token_id
        both = view.call(torch.cat([view.x, unconditional]), torch.cat([rows, rows]),
                         at=view.block_band().at(torch.cat([rows, rows])))
        cond, uncond = both.float().chunk(2)
        return uncond + (self.cfg_scale + 1) * (cond - uncond)

    def step(self, view: View, logits: torch.Tensor) -> tuple[torch.Tensor, dict]:
        where, proposal = self._propose(view, logits)
        if self.remasking == "random":
            score = uniform(self._rng(view, where[0]), (len(where[0]),), view.x.device)
        else:
            score = proposal.token_prob.double()
        schedule = _transfer_schedule(self.block_length, self.steps_per_block)
        k = torch.full_like(view.rows, schedule[min(self.step_index, len(schedule) - 1)])
        chosen = _top_k(_scatter(score, where, view.x.shape), k)
        return self._reveal(view, where, proposal.tokens, chosen, "llada", logits)


@dataclass
class DreamStepper(_Stepper):
    """Dream's sampler; with ``block_length`` < gen_length its schedule restarts in every block."""

    steps_per_block: int = 1
    alg: str = "maskgit_plus"
    alg_temp: float | None = None
    top_p: float | None = None
    top_k: int | None = None

    def step(self, view: View, logits: torch.Tensor) -> tuple[torch.Tensor, dict]:
        times = torch.linspace(1.0, DREAM_EPS, self.steps_per_block + 1, dtype=torch.float64).tolist()
        i = self.step_index
        last = i >= self.steps_per_block - 1
        fraction = 1.0 if last else 1.0 - times[i + 1] / times[i]
        filtered = _filter_logits(logits, self.temperature, self.top_p, self.top_k)
        # Filtering already applied the temperature: sample the filtered distribution as it stands.
        where, proposal = self._propose(view, filtered, 1.0 if self.temperature else 0.0)
        candidates = view.candidates(view.x)
        if self.alg == "origin":
            chosen = candidates.clone()
            if not last:
                chosen[where] = uniform(self._rng(view, where[0]), (len(where[0]),), view.x.device) < fraction
        else:
            score = {"maskgit_plus": proposal.token_prob, "topk_margin": proposal.margin,
                     "entropy": -proposal.entropy}[self.alg].double()
            counts = candidates.sum(1)
            k = counts if last else (counts.double() * fraction).long()
            rows = torch.arange(view.x.shape[0], device=view.x.device)
            chosen = _top_k(_scatter(score, where, view.x.shape), k, self.alg_temp, self._rng(view, rows))
        return self._reveal(view, where, proposal.tokens, chosen, "dream", logits)


@dataclass
class FastDllmStepper(_Stepper):
    """Fast-dLLM parallel decoding: confidence ``threshold`` (default 0.9) or the ``factor`` rule."""

    threshold: float | None = None
    factor: float | None = None

    def step(self, view: View, logits: torch.Tensor) -> tuple[torch.Tensor, dict]:
        where, proposal = self._propose(view, logits)
        confidence = _scatter(proposal.token_prob.double(), where, view.x.shape)  # -inf off candidates
        ranked = confidence.sort(dim=1, descending=True).values
        if self.factor is not None:
            n = torch.arange(1, view.x.shape[1] + 1, device=view.x.device, dtype=torch.float64)
            passes = (n + 1) * (1 - ranked) < self.factor
        else:
            passes = ranked > (0.9 if self.threshold is None else self.threshold)
        passes[:, 0] = True  # at least one token per step
        k = passes.long().cumprod(dim=1).sum(dim=1).clamp(max=(confidence > -math.inf).sum(1))
        return self._reveal(view, where, proposal.tokens, _top_k(confidence, k), "fast_dllm", logits)


@dataclass
class EbStepper(_Stepper):
    """Entropy-bounded unmasking: the lowest-entropy positions while sum(H) - max(H) <= gamma."""

    gamma: float = 0.01

    def step(self, view: View, logits: torch.Tensor) -> tuple[torch.Tensor, dict]:
        where, proposal = self._propose(view, logits)
        entropy = _scatter(proposal.entropy.double(), where, view.x.shape, fill=math.inf)
        ranked = entropy.sort(dim=1).values  # ascending; +inf off candidates
        finite = torch.where(torch.isfinite(ranked), ranked, torch.zeros_like(ranked))
        # Sorted ascending, the running max is the newest entry: sum(H) - max(H) = cumsum - H_n.
        bound = finite.cumsum(dim=1) - finite
        k = ((bound <= self.gamma) & torch.isfinite(ranked)).long().cumprod(dim=1).sum(dim=1).clamp(min=1)
        return self._reveal(view, where, proposal.tokens, _top_k(-entropy, k), "eb", logits)


@dataclass
class SdarStepper(_Stepper):
    """SDAR's official decoder (``block_diffusion_generate``, JetAstra/SDAR ``generate.py``): per block up to
    ``denoising_steps`` steps, each sampling every masked position from softmax(logits / T) after top-k then
    top-p filtering, and revealing by ``remasking_strategy``: the ``n`` most confident (``low_confidence_static``),
    every one above ``confidence_threshold`` when there are at least ``n`` such, else the ``n`` most confident
    (``low_confidence_dynamic``), or the ``n`` leftmost (``sequential``); ``n`` follows LLaDA's even schedule of
    ``block_length`` over the steps; the model's attention blocks are ``block_length`` (the run's,
    ``dllm.protocols.run_block_size``), as the official function builds its mask. Where the official function
    differs, on purpose: T = 0 is greedy (it divides by T), the mask token is never proposed (it may draw it,
    leaving the position masked), a step never reveals more than the masked positions left (its top-k would
    overwrite revealed or prompt tokens: in a first block that holds prompt tokens, when ``n`` exceeds the masks
    left, e.g. ``block_length=8`` over 4 steps), and rows leave a batch when their block is done (its batch runs
    in lockstep)."""

    block_length: int = 4
    denoising_steps: int = 4
    remasking_strategy: str = "low_confidence_dynamic"
    confidence_threshold: float = 0.85
    top_k: int = 0
    top_p: float = 1.0

    def step(self, view: View, logits: torch.Tensor) -> tuple[torch.Tensor, dict]:
        filtered = _filter_logits(logits, self.temperature, self.top_p if self.top_p < 1.0 else None,
                                  self.top_k or None, top_k_first=True)
        where, proposal = self._propose(view, filtered, 1.0 if self.temperature else 0.0)
        candidates = view.candidates(view.x)
        schedule = _transfer_schedule(self.block_length, self.denoising_steps)
        n = torch.full_like(view.rows, schedule[min(self.step_index, len(schedule) - 1)])
        if self.remasking_strategy == "sequential":
            score = -torch.arange(view.x.shape[1], device=view.x.device, dtype=torch.float64).expand(view.x.shape)
            score = torch.where(candidates, score, -math.inf)
        else:
            score = _scatter(proposal.token_prob.double(), where, view.x.shape)  # -inf off candidates
            if self.remasking_strategy == "low_confidence_dynamic":
                high = (score > self.confidence_threshold).sum(dim=1)
                n = torch.where(high >= n, high, n)
        chosen = _top_k(score, torch.minimum(n, candidates.sum(dim=1)))
        return self._reveal(view, where, proposal.tokens, chosen, "sdar", logits)


@dataclass
class Llada2Stepper(_Stepper):
    """LLaDA2's official decoder (``LLaDA2MoeModelLM.generate``): per block, each step draws every position of the
    block (greedy at T = 0, else softmax(logits / T) after top-k then top-p) and reveals every masked position
    whose probability passes ``threshold``, or, when fewer than ``n`` do, the ``n`` most confident (``n`` from
    LLaDA's even schedule of the block over ``steps``). With ``editing_threshold`` it is LLaDA2.1's: ``n`` is
    ``num_to_transfer`` and a step also rewrites any revealed answer token of the block whose new draw differs
    and passes ``editing_threshold``; once the block has no mask, up to ``max_post_steps`` more calls edit it
    while edits happen, and a row stops at a stop token only once its block is done (``edits``). The model's
    attention blocks are ``block_length`` (the run's, ``dllm.protocols.run_block_size``), as the official function
    builds its mask. Differences from the official function, on purpose: the mask token is never proposed, and
    rows leave a batch when their block is done (it decodes one prompt)."""

    block_length: int = 32
    steps: int = 32
    threshold: float = 0.95
    top_k: int | None = None
    top_p: float | None = None
    editing_threshold: float | None = None
    max_post_steps: int = 16
    num_to_transfer: int = 1

    @property
    def edits(self) -> bool:
        """2.1 may rewrite revealed tokens of the active block: a row stops only at the block's end (the loop reads
        it), where its answer up to the stop is what the official function returns."""
        return self.editing_threshold is not None

    def step(self, view: View, logits: torch.Tensor) -> tuple[torch.Tensor, dict]:
        x, start = view.x, view.block[0]
        tokens, prob = self._draw(view, logits)
        masked = view.candidates(x)[:, start : view.block[1]]  # [R, block]
        if self.editing_threshold is None:
            schedule = _transfer_schedule(self.block_length, self.steps)
            n = schedule[min(self.step_index, len(schedule) - 1)]
        else:
            n = self.num_to_transfer
        confidence = torch.where(masked, prob.double(), -math.inf)
        high = (confidence > self.threshold).sum(dim=1)
        k = torch.where(high >= n, high, torch.clamp(masked.sum(dim=1), max=n))
        reveal = _top_k(confidence, k)
        block = x[:, start : view.block[1]]
        if self.editing_threshold is not None:
            answer = torch.arange(start, view.block[1], device=x.device) >= view.prompt_length
            reveal |= ~masked & answer & (prob > self.editing_threshold) & (tokens != block)
        block = torch.where(reveal, tokens, block)
        if self.editing_threshold is not None:
            block = self._post_steps(view, block)
        x = x.clone()
        x[:, start : view.block[1]] = block
        self.stats.count_round(reveal.sum(dim=1))
        self.step_index += 1
        revealed = torch.zeros_like(x, dtype=torch.bool)
        revealed[:, start : view.block[1]] = reveal
        return x, {"sampler": "llada2", "revealed": revealed, "emitted_logits": logits}

    def _draw(self, view: View, logits: torch.Tensor, which: torch.Tensor | None = None):
        """A token and its probability at every position of the block [N, block] for view rows ``which`` [N] (None:
        all): greedy from the raw logits at T = 0 (its probability theirs), else drawn after temperature, top-k and
        top-p."""
        count, width = logits.shape[0], logits.shape[1]
        which = torch.arange(count, device=logits.device) if which is None else which
        chosen = forbid_token(logits.float(), view.mask_token_id)
        if self.temperature:
            chosen = _filter_logits(chosen, self.temperature, self.top_p, self.top_k or None, top_k_first=True)
        drawn = sample_confidence(chosen.reshape(count * width, -1), 1.0 if self.temperature else 0.0,
                                  self._rng(view, which.repeat_interleave(width)))
        return drawn.tokens.reshape(count, width), drawn.token_prob.reshape(count, width)

    def _post_steps(self, view: View, block: torch.Tensor) -> torch.Tensor:
        """LLaDA2.1's edits once a row's block has no mask: one more call at a time, while it changes a token, at
        most ``max_post_steps`` (rows that still hold masks go on in the loop's next step)."""
        start, stop = view.block
        answer = torch.arange(start, stop, device=block.device) >= view.prompt_length
        editing = ~(block == view.mask_token_id).any(dim=1)
        for _ in range(self.max_post_steps):
            rows = editing.nonzero().squeeze(1)
            if not rows.numel():
                break
            x = view.x[rows].clone()
            x[:, start:stop] = block[rows]
            tokens, prob = self._draw(view, view.call(x, rows, at=view.block_band().at(rows)), rows)
            edit = answer & (prob > self.editing_threshold) & (tokens != block[rows])
            block[rows] = torch.where(edit, tokens, block[rows])
            editing[rows] = edit.any(dim=1)
        return block


def _transfer_schedule(block_length: int, steps: int) -> list[int]:
    """Tokens revealed at each step of a block: even split, remainder on the first steps (as LLaDA)."""
    base, extra = divmod(block_length, steps)
    return [base + (1 if i < extra else 0) for i in range(steps)]


def _filter_logits(logits: torch.Tensor, temperature: float, top_p: float | None, top_k: int | None,
                   top_k_first: bool = False):
    """Dream's logit processing (its ``sample_tokens``): temperature, then nucleus (top_p), then top_k
    truncation of what is left; ``top_k_first``: top_k before top_p (SDAR's order).
    # [..., V] -> [..., V], dropped tokens at -inf"""
    out = logits.float() / temperature if temperature > 0 else logits.float()
    if top_k_first and top_k is not None:
        kth = out.topk(min(top_k, out.shape[-1]), dim=-1).values[..., -1:]
        out = out.masked_fill(out < kth, float("-inf"))
        top_k = None
    if top_p is not None and top_p < 1.0:
        # Dream's tie rule (not transformers' TopPLogitsWarper, which keeps by cumulative <= 1 - top_p from
        # the bottom): a token is dropped when the tokens ranked above it already hold more than top_p.
        sorted_logits, order = out.sort(dim=-1, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = torch.zeros_like(cumulative, dtype=torch.bool)
        drop_sorted[..., 1:] = cumulative[..., :-1] > top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        out = out.masked_fill(drop, float("-inf"))
    if top_k is not None:
        kth = out.topk(min(top_k, out.shape[-1]), dim=-1).values[..., -1:]
        out = out.masked_fill(out < kth, float("-inf"))
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
