"""Oracle language models whose every conditional is known exactly: the ground truth for exactness tests.

``HMMOracle`` is a hidden Markov model over ``num_tokens`` observable tokens. Used as a
``DiffusionModel`` it returns, at every position, the exact distribution of that token given all other
revealed tokens (forward-backward with masked positions unobserved); ``as_causal()`` gives the exact
next-token distribution. ``exact_joint`` enumerates the distribution of a continuation. Token id
``num_tokens`` is the mask token; both views share ``vocab_size = num_tokens + 1`` and give it -inf.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class HMMOracle:
    """A hidden Markov model LM answering every conditional exactly (float64 inside)."""

    prior: torch.Tensor  # [S]
    transition: torch.Tensor  # [S, S], rows sum to 1
    emission: torch.Tensor  # [S, T], rows sum to 1 (T observable tokens)

    @classmethod
    def random(cls, num_states: int = 3, num_tokens: int = 4, seed: int = 0, stickiness: float = 0.0,
               sharpness: float = 1.0) -> HMMOracle:
        """A random HMM; ``stickiness`` > 0 makes states persist and ``sharpness`` > 1 makes emissions
        near-deterministic, which together create strong dependence between tokens."""
        g = torch.Generator().manual_seed(seed)
        rand = lambda *shape: torch.rand(shape, generator=g, dtype=torch.float64)  # noqa: E731
        transition = rand(num_states, num_states) + stickiness * torch.eye(num_states, dtype=torch.float64)
        emission = rand(num_states, num_tokens) ** sharpness
        prior = rand(num_states)
        return cls(prior / prior.sum(), transition / transition.sum(1, keepdim=True),
                   emission / emission.sum(1, keepdim=True))

    @property
    def num_tokens(self) -> int:
        return self.emission.shape[1]

    @property
    def vocab_size(self) -> int:
        return self.num_tokens + 1

    @property
    def mask_token_id(self) -> int:
        return self.num_tokens

    def perturbed(self, scale: float = 0.3, seed: int = 1) -> HMMOracle:
        """Another HMM near this one (log-parameters jittered by ``scale``): an imperfect drafter."""
        g = torch.Generator().manual_seed(seed)
        jitter = lambda t: t * torch.exp(scale * torch.randn(t.shape, generator=g, dtype=torch.float64))  # noqa: E731
        prior, transition, emission = jitter(self.prior), jitter(self.transition), jitter(self.emission)
        return HMMOracle(prior / prior.sum(), transition / transition.sum(1, keepdim=True),
                         emission / emission.sum(1, keepdim=True))

    def _likelihood(self, input_ids: torch.Tensor) -> torch.Tensor:
        """P(observation | state) per position: [B, L] -> [B, L, S]; masked positions observe nothing."""
        ids = input_ids.long()
        if bool(((ids < 0) | (ids > self.mask_token_id)).any()):
            raise ValueError(f"input_ids must lie in [0, {self.mask_token_id}] (mask id {self.mask_token_id})")
        observed = ids != self.mask_token_id
        lik = self.emission.T[ids.clamp(max=self.num_tokens - 1)]  # [B, L, S]
        return torch.where(observed[..., None], lik, torch.ones_like(lik))

    def _forward(self, lik: torch.Tensor) -> torch.Tensor:
        """Normalised predictive state distributions P(z_t | x_<t) -> [B, L, S]."""
        batch, length, states = lik.shape
        alpha = torch.empty_like(lik)
        current = self.prior.expand(batch, states)
        for t in range(length):
            alpha[:, t] = current
            posterior = current * lik[:, t]
            posterior = posterior / posterior.sum(-1, keepdim=True)
            current = posterior @ self.transition
        return alpha

    def _backward(self, lik: torch.Tensor) -> torch.Tensor:
        """Normalised P(x_>t | z_t) up to a constant per position -> [B, L, S]."""
        beta = torch.ones_like(lik)
        for t in range(lik.shape[1] - 2, -1, -1):
            nxt = (lik[:, t + 1] * beta[:, t + 1]) @ self.transition.T
            beta[:, t] = nxt / nxt.sum(-1, keepdim=True)
        return beta

    def conditionals(self, input_ids: torch.Tensor) -> torch.Tensor:
        """P(x_t = v | every other revealed token) at every position, float64 -> [B, L, T]."""
        lik = self._likelihood(input_ids)
        state = self._forward(lik) * self._backward(lik)
        probs = state @ self.emission
        return probs / probs.sum(-1, keepdim=True)

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        """DiffusionModel view: log-conditionals [B, L, V] in float32, mask token at -inf."""
        return _with_mask_column(torch.log(self.conditionals(input_ids))).float()

    def next_token_probs(self, input_ids: torch.Tensor) -> torch.Tensor:
        """P(x_{t+1} | x_<=t) at every position t, float64 -> [B, L, T]."""
        lik = self._likelihood(input_ids)
        alpha = self._forward(lik)  # P(z_t | x_<t)
        posterior = alpha * lik[..., :]
        posterior = posterior / posterior.sum(-1, keepdim=True)
        return (posterior @ self.transition) @ self.emission

    def as_causal(self) -> OracleCausalView:
        """The same HMM as a CausalModel (exact next-token distributions)."""
        return OracleCausalView(self)

    def exact_joint(self, prompt: torch.Tensor, n: int) -> dict[tuple[int, ...], float]:
        """Exact distribution of the ``n`` tokens following ``prompt`` [P], enumerated (T^n outcomes)."""
        outcomes = torch.tensor(list(itertools.product(range(self.num_tokens), repeat=n)), dtype=torch.long)
        seqs = torch.cat([prompt.long().expand(outcomes.shape[0], -1), outcomes], dim=1)
        probs = self.next_token_probs(seqs)  # position t predicts t + 1
        p = prompt.numel()
        steps = probs[:, p - 1 : p + n - 1].gather(-1, outcomes[..., None]).squeeze(-1)
        joint = steps.prod(-1) if p > 0 else _first_token_fallback(self, outcomes)
        return {tuple(o.tolist()): float(v) for o, v in zip(outcomes, joint)}


def _first_token_fallback(oracle: HMMOracle, outcomes: torch.Tensor) -> torch.Tensor:
    """Joint of whole sequences without a prompt: the prior's emission, then next-token steps."""
    first = (oracle.prior @ oracle.emission)[outcomes[:, 0]]
    rest = oracle.next_token_probs(outcomes)[:, :-1].gather(-1, outcomes[:, 1:, None]).squeeze(-1)
    return first * rest.prod(-1)


def _with_mask_column(log_probs: torch.Tensor) -> torch.Tensor:
    """Append the mask token's column at -inf -> [..., T + 1]."""
    pad = torch.full((*log_probs.shape[:-1], 1), -math.inf, dtype=log_probs.dtype, device=log_probs.device)
    return torch.cat([log_probs, pad], dim=-1)


@dataclass(frozen=True)
class OracleCausalView:
    """CausalModel view of an HMMOracle: ``logits[:, t]`` = log P(x_{t+1} | x_<=t)."""

    oracle: HMMOracle

    @property
    def vocab_size(self) -> int:
        return self.oracle.vocab_size

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        if bool((input_ids == self.oracle.mask_token_id).any()):
            raise ValueError("a causal model's input_ids must not contain the mask token")
        return _with_mask_column(torch.log(self.oracle.next_token_probs(input_ids))).float()


class Wrapper:
    """A model around another (``self.base``), with the base's vocabulary and mask id."""

    @property
    def vocab_size(self) -> int:
        return self.base.vocab_size

    @property
    def mask_token_id(self) -> int:
        return self.base.mask_token_id


@dataclass(frozen=True)
class InconsistentModel(Wrapper):
    """A DiffusionModel whose conditionals come from no single joint distribution.

    The wrapped oracle's logits get a fixed random bias that depends on the position and on how many
    tokens are still masked, so different unmasking orders define different distributions. Exact
    samplers must still match ``sequential`` on it: fef's guarantee holds for any model.
    """

    base: HMMOracle
    scale: float = 1.0
    seed: int = 0

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        logits = self.base(input_ids)
        length, tokens = input_ids.shape[1], self.base.num_tokens
        g = torch.Generator().manual_seed(self.seed)
        bias = self.scale * torch.randn((length + 1, length, tokens), generator=g)  # [masked count, L, T]
        masked = (input_ids == self.mask_token_id).sum(1)  # [B]
        logits[..., :tokens] += bias[masked]
        return logits
