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
    pvalue = float(scipy_stats.chisquare(observed, [p * scale for p in predicted]).pvalue)
    if pvalue > ALPHA:  # the law holds: so must the probability generate reported for each answer
        check_logprobs(answers, expected)
    return pvalue


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


# Every exact run of an exactness test also returns its log-probabilities (tests/conftest.py asks generate for
# them in the modules that use chi_square_pvalue): when the test finds a run's answers distributed as the law, each
# answer's probability must also be exp(sum of the logprobs generate returned), and dllm.score must give the same
# numbers on those answers. So every configuration the chi-square suites cover checks out.logprobs too.
RECENT_RUNS: list[tuple] = []  # (GenerateOutput, model, input_ids, generate's keyword arguments), newest last
LOG_TOLERANCE = 1e-4  # |sum of logprobs - log(law)|: float32 log-softmax over a few positions
SCORE_ROWS = 32  # rows of a run re-scored by dllm.score (the score equals generate's logprobs to 1e-5)
LOGPROB_CHECKS: list[str] = []  # what was checked, for tests/test_logprobs.py to see the mechanism works


def remember_run(out, model, input_ids, kwargs) -> None:
    RECENT_RUNS.append((out, model, input_ids, kwargs))
    del RECENT_RUNS[:-8]


def check_logprobs(answers: torch.Tensor, expected: dict[tuple[int, ...], float]) -> None:
    """For the recent run whose sequences ``answers`` is a column slice of: exp(sum of logprobs over those columns)
    equals the law's probability of each answer, and dllm.score gives the same per-token numbers."""
    import math

    import dllm
    import dllm.stops

    for out, model, input_ids, kwargs in reversed(RECENT_RUNS):
        sequences = out.sequences
        if out.logprobs is None or not out.exact or answers.shape[0] != sequences.shape[0] \
                or answers.untyped_storage().data_ptr() != sequences.untyped_storage().data_ptr():
            continue
        first = (answers.storage_offset() - sequences.storage_offset()) % sequences.shape[1]
        start = input_ids.shape[1]
        low, high = max(first, start) - start, min(first + answers.shape[1], sequences.shape[1]) - start
        sums = out.logprobs[:, low:high].double().sum(dim=1).tolist()
        # In another order than left to right, a discarded draw (after a stop, in an anchored model's tail) may
        # condition a kept token: the sum is then the answer's joint with it (samplers/likelihood.py); not checked
        discards = out.options.get("order", "left_to_right") != "left_to_right" and (
            dllm.capabilities(model).block_anchor == "absolute" or dllm.stops.resolve(model, kwargs.get(
                "eos_token_id", "model")) is not None)
        for row, total in zip(map(tuple, answers.tolist()), sums):
            if not discards:
                assert abs(total - math.log(expected[row])) <= LOG_TOLERANCE, (row, math.exp(total), expected[row])
        if out.options.get("order", "left_to_right") == "left_to_right":  # score reads the left-to-right chain
            rows = slice(0, SCORE_ROWS)
            mask = kwargs.get("attention_mask")
            extra = {"block_length": out.options["block_length"]} if "block_length" in out.options else {}
            scored = dllm.score(model, input_ids[rows], sequences[rows, start:],
                                attention_mask=None if mask is None else mask[rows],
                                temperature=kwargs.get("temperature", 0.0),
                                eos_token_id=kwargs.get("eos_token_id", "model"), **extra)
            assert torch.allclose(scored.logprobs, out.logprobs[rows], atol=1e-5, rtol=0), \
                (scored.logprobs - out.logprobs[rows]).abs().max()
        LOGPROB_CHECKS.append(f"{out.sampler} {sorted(out.options.items(), key=str)}")
        return
