"""Exact samplers reproduce the enumerated distribution of the sequential chain on oracle models.

Each test draws thousands of answers at a fixed seed and applies a chi-square goodness-of-fit test at
ALPHA. The power tests show the same test rejects samplers that are not exact.
"""

import pytest
import torch

import dllm
from dllm.models.oracle import HMMOracle, InconsistentModel
from dllm.samplers import sequential_distribution

from model_stubs import Replaying
from stat_tools import ALPHA, chi_square_pvalue

N_SAMPLES = 12000
PROMPT = torch.tensor([0, 2])
GEN = 4


@pytest.fixture(scope="module")
def oracle():
    return HMMOracle.random(num_states=3, num_tokens=3, seed=0, stickiness=2.0, sharpness=2.0)


@pytest.fixture(scope="module")
def inconsistent(oracle):
    return InconsistentModel(oracle, scale=1.0, seed=3)


def sample(model, sampler, temperature=1.0, seed=0, n=N_SAMPLES, **options):
    out = dllm.generate(model, PROMPT.expand(n, -1), sampler=sampler, max_new_tokens=GEN, temperature=temperature,
                        generator=torch.Generator().manual_seed(seed), **options)
    return out.sequences[:, PROMPT.numel():], out.stats


def test_sequential_distribution_matches_hmm_joint(oracle):
    """Enumeration through the float32 logits interface agrees with the float64 joint to float32 precision."""
    joint = oracle.exact_joint(PROMPT, GEN)
    for order in ("left_to_right", "confidence"):
        chain = sequential_distribution(oracle, PROMPT, GEN, order=order)
        assert max(abs(joint[k] - chain.get(k, 0.0)) for k in joint) < 1e-6
    causal_chain = sequential_distribution(oracle.as_causal(), PROMPT, GEN)
    assert max(abs(joint[k] - causal_chain.get(k, 0.0)) for k in joint) < 1e-6


def test_inconsistent_model_orders_disagree(inconsistent):
    """The inconsistent model really defines different laws per order, so it tests the order check."""
    left = sequential_distribution(inconsistent, PROMPT, GEN, order="left_to_right")
    conf = sequential_distribution(inconsistent, PROMPT, GEN, order="confidence")
    assert 0.5 * sum(abs(left.get(k, 0) - conf.get(k, 0)) for k in set(left) | set(conf)) > 0.05


def test_sequential_is_exact(oracle):
    answers, _ = sample(oracle, "sequential")
    assert chi_square_pvalue(answers, oracle.exact_joint(PROMPT, GEN)) > ALPHA


@pytest.mark.parametrize("window", [1, 2, 4])
@pytest.mark.parametrize("draft", ["marginal", "stale"])
def test_fef_exact_on_hmm(oracle, window, draft):
    answers, stats = sample(oracle, "fef", window=window, draft=draft, seed=window)
    assert chi_square_pvalue(answers, oracle.exact_joint(PROMPT, GEN)) > ALPHA
    assert stats.drafted > 0


@pytest.mark.parametrize("order", ["left_to_right", "confidence"])
@pytest.mark.parametrize("draft", ["marginal", "stale"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fef_exact_on_inconsistent_model(inconsistent, order, draft, temperature):
    if order == "confidence" and temperature != 1.0 and draft == "stale":
        pytest.skip("covered by the marginal-draft case; keeps the suite short")
    expected = sequential_distribution(inconsistent, PROMPT, GEN, temperature=temperature, order=order)
    answers, stats = sample(inconsistent, "fef", temperature=temperature, order=order, draft=draft, window=3, seed=7)
    assert chi_square_pvalue(answers, expected) > ALPHA
    assert stats.accepted < stats.drafted  # rejections happened, so the residual path was exercised


def test_fef_semi_autoregressive_blocks(inconsistent):
    expected = sequential_distribution(inconsistent, PROMPT, GEN, order="confidence", block_length=2)
    answers, _ = sample(inconsistent, "fef", order="confidence", block_length=2, window=2, seed=11)
    assert chi_square_pvalue(answers, expected) > ALPHA


def test_ar_exact(oracle):
    answers, _ = sample(oracle.as_causal(), "ar", temperature=0.7)
    expected = sequential_distribution(oracle.as_causal(), PROMPT, GEN, temperature=0.7)
    assert chi_square_pvalue(answers, expected) > ALPHA


def drafters(oracle):
    causal = oracle.perturbed(0.5).as_causal()
    return {"ngram": "ngram", "causal": causal, "causal_cached": Replaying(causal), "diffusion": oracle.perturbed(0.5)}


@pytest.mark.parametrize("drafter_kind", ["ngram", "causal", "causal_cached", "diffusion"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_ar_spec_exact(oracle, drafter_kind, temperature):
    drafter = drafters(oracle)
    answers, stats = sample(oracle.as_causal(), "ar_spec", temperature=temperature,
                            drafter=drafter[drafter_kind], num_draft_tokens=3, seed=5)
    expected = sequential_distribution(oracle.as_causal(), PROMPT, GEN, temperature=temperature)
    assert chi_square_pvalue(answers, expected) > ALPHA
    assert stats.accepted > 0 and stats.accepted < stats.drafted


def test_power_factorized_parallel_decoding_fails(oracle):
    """LLaDA with two tokens per step samples independent marginals: the test must reject it."""
    answers, _ = sample(oracle, "llada", steps=2)
    assert chi_square_pvalue(answers, oracle.exact_joint(PROMPT, GEN)) < 1e-6


def test_power_fef_with_wrong_target_fails(inconsistent):
    """fef with the left-to-right order does not sample the confidence-order chain, and the test sees it."""
    expected = sequential_distribution(inconsistent, PROMPT, GEN, order="confidence")
    answers, _ = sample(inconsistent, "fef", order="left_to_right", window=3, seed=7)
    assert chi_square_pvalue(answers, expected) < 1e-6


@pytest.mark.parametrize("order", ["left_to_right", "confidence"])
@pytest.mark.parametrize(
    "window,draft,block", [(1, "marginal", 6), (3, "stale", 6), (4, "marginal", 3), (2, "stale", 2)]
)
def test_fef_greedy_equals_sequential(inconsistent, order, window, draft, block):
    prompts = torch.tensor([[0, 2], [1, 1], [2, 0], [0, 0]])
    common = dict(max_new_tokens=6, temperature=0.0, order=order, block_length=block)
    fef = dllm.generate(inconsistent, prompts, sampler="fef", window=window, draft=draft, **common)
    seq = dllm.generate(inconsistent, prompts, sampler="sequential", **common)
    assert torch.equal(fef.sequences, seq.sequences)


@pytest.mark.parametrize("drafter_kind", ["ngram", "causal", "causal_cached", "diffusion"])
def test_ar_spec_greedy_equals_ar(oracle, drafter_kind):
    drafter = drafters(oracle)
    prompts = torch.tensor([[0, 2, 1, 0, 2], [1, 1, 1, 1, 1], [2, 0, 2, 0, 2]])
    spec = dllm.generate(oracle.as_causal(), prompts, sampler="ar_spec", max_new_tokens=9, temperature=0.0,
                         drafter=drafter[drafter_kind], num_draft_tokens=3)
    plain = dllm.generate(oracle.as_causal(), prompts, sampler="ar", max_new_tokens=9, temperature=0.0)
    assert torch.equal(spec.sequences, plain.sequences)


@pytest.mark.parametrize("num_draft_tokens,scale", [(1, 0.1), (3, 0.5)])
def test_cached_causal_drafter_replays_the_uncached_one(oracle, num_draft_tokens, scale):
    """The drafter's cache changes only the work: same drafts, same output, fewer tokens fed (ragged rows)."""
    causal = oracle.perturbed(scale).as_causal()
    cached = Replaying(causal)
    prompts = torch.tensor([[0, 2, 1], [1, 1, 1], [2, 0, 2], [0, 0, 1]]).repeat(4, 1)
    runs = [dllm.generate(oracle.as_causal(), prompts, sampler="ar_spec", max_new_tokens=12, drafter=drafter,
                          num_draft_tokens=num_draft_tokens, temperature=1.0,
                          generator=torch.Generator().manual_seed(3))
            for drafter in (causal, cached)]
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    assert runs[0].stats.drafted == runs[1].stats.drafted and runs[0].stats.accepted == runs[1].stats.accepted
    assert 0 < runs[1].stats.accepted < runs[1].stats.drafted  # rows accept different numbers: ragged
    assert runs[1].stats.forward_tokens_draft < runs[0].stats.forward_tokens_draft
    assert 0 < cached.fed_tokens == runs[1].stats.forward_tokens_draft
