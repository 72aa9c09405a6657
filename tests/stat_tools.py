"""Statistical helpers for exactness tests: chi-square goodness of fit against an enumerated law."""

from __future__ import annotations

from collections import Counter

import torch
from scipy import stats as scipy_stats

ALPHA = 1e-3  # per-test false-alarm rate; every test runs at a fixed seed, so the outcome is deterministic
MIN_EXPECTED = 5.0  # chi-square needs about 5 expected counts per bin; rarer outcomes are pooled


def chi_square_pvalue(answers: torch.Tensor, expected: dict[tuple[int, ...], float]) -> float:
    """p-value of answers [N, n] against the distribution ``expected``; 0 if any answer is impossible."""
    counts = Counter(map(tuple, answers.tolist()))
    if any(expected.get(outcome, 0.0) <= 0 for outcome in counts):
        return 0.0
    total = answers.shape[0]
    observed, predicted = [], []
    pooled_obs, pooled_exp = 0, 0.0
    for outcome, prob in expected.items():
        if prob * total >= MIN_EXPECTED:
            observed.append(counts.get(outcome, 0))
            predicted.append(prob * total)
        else:
            pooled_obs += counts.get(outcome, 0)
            pooled_exp += prob * total
    if pooled_exp > 0:
        observed.append(pooled_obs)
        predicted.append(pooled_exp)
    scale = sum(observed) / sum(predicted)  # removes float rounding of the enumerated probabilities
    return float(scipy_stats.chisquare(observed, [p * scale for p in predicted]).pvalue)


def sharp(model, scale: float):
    """A small random TransformerLM's (tied) output projection scaled by ``scale``, so its next-token laws are
    far from uniform (tests of exactness then have outcomes of very different probabilities); eval mode."""
    with torch.no_grad():
        model.output.weight.mul_(scale)
    return model.eval()
