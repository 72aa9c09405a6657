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


def check_native_chain(model, prompt, gen: int, block_length: int, sampler: str, options: dict, wrong: dict,
                       samples: int = 5000, order: str = "left_to_right") -> None:
    """An exact ``sampler`` on a small native model passes the chi-square test against the enumerated chain in blocks
    of ``block_length`` (its label says exact), and the ``wrong`` generate arguments (an approximate decoder) fail the
    same test; both run with ``block_length`` (on SDAR and LLaDA2 the run's attention blocks too); ``order``: the
    sampler's, which the chain follows."""
    import dllm
    from dllm.samplers import sequential_distribution

    expected = sequential_distribution(model, prompt, gen, block_length=block_length, temperature=1.0, order=order)
    runs = []
    with torch.no_grad():
        for arguments in ({"sampler": sampler, **options}, wrong):
            runs.append(dllm.generate(model, prompt.expand(samples, -1), max_new_tokens=gen, temperature=1.0,
                                      eos_token_id=None, generator=torch.Generator().manual_seed(0),
                                      block_length=block_length, **arguments))
    assert runs[0].exact
    assert chi_square_pvalue(runs[0].sequences[:, prompt.numel():], expected) > ALPHA, (sampler, options)
    assert chi_square_pvalue(runs[1].sequences[:, prompt.numel():], expected) < ALPHA, wrong
