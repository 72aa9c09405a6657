"""Adaptive draft length (``draft_cutoff``, samplers/drafting.py) keeps every exact sampler exact.

A row's drafts end where the drafter's own estimate that they all survive falls below the cutoff. The rule
reads the draft side only, so the law is unchanged: chi-square tests against the enumerated chain for fef's
copies verifier (marginal and stale drafts, both orders), the two-stream layout (marginal drafts, a random head,
a draft tree) and ar_spec (causal, diffusion and EAGLE drafters), each with rounds really cut short. The power
test: the same stopping rule reading the target instead of the drafter is rejected by the same test.
"""

import pytest
import torch

import dllm
from dllm.models.ar_heads import EagleHead, HeadConfig
from dllm.models.transformer import TransformerConfig, TransformerLM
from dllm.numerics import bind_rows, sample_from_logits
from dllm.samplers import sequential_distribution
from dllm.samplers.ar_spec.drafters import Draft, Drafter
from dllm.samplers.drafting import cut_count, cut_draft, draft_survival

from stat_tools import ALPHA, chi_square_pvalue, sharp
from test_exactness import GEN, PROMPT, inconsistent, oracle, sample  # noqa: F401  (the module's fixtures)
from test_two_stream import PROMPT as TS_PROMPT
from test_two_stream import _random_head, _sample, enumerated_law
from test_two_stream import model as two_stream  # noqa: F401  (the module's fixture)


def test_the_rule_keeps_a_prefix_of_at_least_one_draft():
    logits = torch.log(torch.tensor([[[0.9, 0.1], [0.5, 0.5], [0.9, 0.1]],
                                     [[0.2, 0.8], [0.9, 0.1], [0.9, 0.1]]]))
    tokens = torch.tensor([[0, 0, 0], [0, 1, 0]])
    survival = draft_survival(logits, tokens)
    assert torch.allclose(survival, torch.tensor([[0.9, 0.45, 0.405], [0.2, 0.02, 0.018]]))
    count = torch.tensor([3, 2])
    # A row's drafts end at its first draft below the cutoff, that draft included (drafting j + 1 is decided
    # from drafts 0..j): row 1's first draft is below 0.4 and is still verified.
    assert cut_count(logits, tokens, count, 0.4).tolist() == [3, 1]
    assert cut_count(logits, tokens, count, 0.5).tolist() == [2, 1]
    assert cut_count(logits, tokens, count, 0.95).tolist() == [1, 1]
    assert cut_count(logits, tokens, count, None).tolist() == [3, 2]
    cut = cut_draft(Draft(tokens, logits, count), 0.95)
    assert cut.tokens.shape == (2, 1) and cut.count.tolist() == [1, 1]  # the call feeds the longest row's drafts


def test_power_dropping_the_draft_that_crossed_the_cutoff_is_not_exact(inconsistent, monkeypatch):  # noqa: F811
    """The rule must decide on draft j + 1 before drawing it: cutting the draft that crossed the cutoff too
    conditions the kept drafts on their own values, and the chi-square test sees the bias."""
    import dllm.samplers.fef.round as fef_round

    def drop_the_crossing_draft(logits, tokens, count, cutoff):
        above = (draft_survival(logits, tokens) >= cutoff).long().sum(dim=1)
        return torch.minimum(count, above.clamp(min=1))

    monkeypatch.setattr(fef_round, "cut_count", drop_the_crossing_draft)
    expected = sequential_distribution(inconsistent, PROMPT, GEN, order="left_to_right")
    answers, _ = sample(inconsistent, "fef", window=4, seed=7, draft_cutoff=0.3)
    assert chi_square_pvalue(answers, expected) < 1e-6


@pytest.mark.parametrize("order", ["left_to_right", "confidence"])
@pytest.mark.parametrize("draft", ["marginal", "stale"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fef_copies_with_adaptive_windows_are_exact(inconsistent, order, draft, temperature):  # noqa: F811
    expected = sequential_distribution(inconsistent, PROMPT, GEN, temperature=temperature, order=order)
    answers, stats = sample(inconsistent, "fef", temperature=temperature, order=order, draft=draft, window=4, seed=7,
                            draft_cutoff=0.3)
    assert chi_square_pvalue(answers, expected) > ALPHA
    _, full = sample(inconsistent, "fef", temperature=temperature, order=order, draft=draft, window=4, seed=7,
                     n=2000)
    assert stats.accepted < stats.drafted  # rejections happened
    assert stats.drafted / stats.rounds < full.drafted / full.rounds  # and windows were cut


@pytest.mark.parametrize("order", ["left_to_right", "confidence"])
@pytest.mark.parametrize("head", [False, True])
def test_two_stream_with_adaptive_windows_is_exact(two_stream, order, head):  # noqa: F811
    law = enumerated_law(two_stream, TS_PROMPT, 4, 1.0, order, 4)
    extra = {"draft": "head", "draft_head": _random_head(two_stream)} if head else {}
    cutoff = 0.999 if head else 0.7  # the random head is sharp: its drafts' survival stays high
    out = _sample(two_stream, "fef", 3000, 1.0, order, 4, window=4, draft_cutoff=cutoff, **extra)
    full = _sample(two_stream, "fef", 1000, 1.0, order, 4, window=4, **extra)
    assert out.exact and 0 < out.stats.accepted < out.stats.drafted
    assert out.stats.drafted / out.stats.rounds < full.stats.drafted / full.stats.rounds
    assert chi_square_pvalue(out.sequences[:, 3:], law) > ALPHA


def test_two_stream_tree_with_adaptive_windows_is_exact(two_stream):  # noqa: F811
    law = enumerated_law(two_stream, TS_PROMPT, 4, 0.7, "left_to_right", 4)
    out = _sample(two_stream, "fef", 3000, 0.7, "left_to_right", 4, window=4, draft="head",
                  draft_head=_random_head(two_stream), draft_candidates=2, candidates_below=0.8, draft_cutoff=0.2)
    assert out.stats.siblings_taken > 0
    assert chi_square_pvalue(out.sequences[:, 3:], law) > ALPHA


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    return sharp(TransformerLM(TransformerConfig(vocab_size=3, dim=16, n_layers=1, n_heads=2, max_seq_len=32)), 5.0)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_ar_spec_eagle_with_adaptive_k_is_exact(target, temperature):
    torch.manual_seed(1)
    eagle = EagleHead(HeadConfig("eagle", 16, 3, 32)).eval()
    answers, stats = sample(target, "ar_spec", temperature, seed=5, drafter="head", draft_head=eagle,
                            num_draft_tokens=3, draft_cutoff=0.5)
    assert chi_square_pvalue(answers, sequential_distribution(target, PROMPT, GEN, temperature=temperature)) > ALPHA
    _, full = sample(target, "ar_spec", temperature, seed=5, n=2000, drafter="head", draft_head=eagle,
                     num_draft_tokens=3)
    assert 0 < stats.accepted and stats.drafted / stats.rounds < full.drafted / full.rounds


@pytest.mark.parametrize("kind", ["causal", "diffusion"])
def test_ar_spec_model_drafters_with_adaptive_k_are_exact(oracle, kind):  # noqa: F811
    drafter = oracle.perturbed(0.5).as_causal() if kind == "causal" else oracle.perturbed(0.5)
    answers, stats = sample(oracle.as_causal(), "ar_spec", 1.0, seed=5, drafter=drafter, num_draft_tokens=3,
                            draft_cutoff=0.3)
    assert chi_square_pvalue(answers, sequential_distribution(oracle.as_causal(), PROMPT, GEN)) > ALPHA
    assert 0 < stats.accepted < stats.drafted and stats.drafted < 3 * stats.rounds


class JudgeFirstDraft(Drafter):
    """Drafts from fixed logits, and lets a judge's probability of the first draft d_0 decide the round's count:
    below ``floor``, ``itself`` drafts nothing (d_0 is dropped), else only d_0 is kept (d_1 on are not drafted).
    The judge is the drafter itself or the target (``peek``)."""

    def __init__(self, logits, target, peek: bool, itself: bool, floor=0.4):
        self.logits, self.target, self.peek, self.itself, self.floor = logits, target, peek, itself, floor

    def propose(self, sequences, lengths, k, ctx):
        logits = self.logits.expand(len(ctx.rows), k, -1)
        flat_rows = ctx.rows.repeat_interleave(k)
        tokens = sample_from_logits(logits.reshape(-1, logits.shape[-1]), ctx.temperature,
                                    bind_rows(ctx.generator, flat_rows)).reshape(len(ctx.rows), k)
        if self.peek:
            with torch.no_grad():
                judged = self.target(sequences)[torch.arange(len(ctx.rows)), lengths - 1]
        else:
            judged = logits[:, 0]
        unlikely = torch.softmax(judged.float(), -1).gather(-1, tokens[:, :1])[:, 0] < self.floor
        count = torch.where(unlikely, 0 if self.itself else ctx.num_drafts.clamp(max=1), ctx.num_drafts)
        return Draft(tokens, logits, count)


@pytest.mark.parametrize("peek", [False, True])
@pytest.mark.parametrize("itself", [False, True])
def test_power_a_draft_kept_or_dropped_by_its_own_value_is_not_exact(oracle, peek, itself):  # noqa: F811
    """What exactness needs of a stopping rule: whether d_j is verified must be decided before d_j is drawn, from
    the drafts before it. Deciding on d_1.. from d_0 is exact whoever judges d_0 (the drafter, as ``draft_cutoff``
    does, or even the target at the prefix); keeping or dropping d_0 by its own value is not, whoever judges it:
    the kept drafts are then not distributed as the logits the verifier is told."""
    causal = oracle.as_causal()
    own = torch.tensor([0.4, 0.0, 0.2, -float("inf")])  # close to uniform: the judges often find d_0 unlikely
    answers, stats = sample(causal, "ar_spec", 1.0, seed=5, drafter=JudgeFirstDraft(own, causal, peek, itself),
                            num_draft_tokens=3)
    pvalue = chi_square_pvalue(answers, sequential_distribution(causal, PROMPT, GEN))
    assert (pvalue < 1e-6) if itself else (pvalue > ALPHA)
    assert 0 < stats.accepted < stats.drafted


def test_greedy_with_adaptive_windows_equals_sequential(inconsistent, oracle):  # noqa: F811
    prompts = torch.tensor([[0, 2, 1], [1, 1, 0]])
    common = dict(max_new_tokens=6, temperature=0.0)
    for order in ("left_to_right", "confidence"):
        sequential = dllm.generate(inconsistent, prompts, sampler="sequential", order=order, **common).sequences
        fef = dllm.generate(inconsistent, prompts, sampler="fef", order=order, window=4, draft_cutoff=0.6, **common)
        assert torch.equal(fef.sequences, sequential)
    causal = oracle.as_causal()
    spec = dllm.generate(causal, prompts, sampler="ar_spec", drafter=oracle.perturbed(0.5), num_draft_tokens=3,
                         draft_cutoff=0.6, **common)
    assert torch.equal(spec.sequences, dllm.generate(causal, prompts, sampler="ar", **common).sequences)


def test_draft_cutoff_is_checked_by_name(oracle):  # noqa: F811
    causal = oracle.as_causal()
    with pytest.raises(ValueError, match="draft_cutoff"):
        dllm.generate(causal, PROMPT[None], sampler="ar_spec", drafter="ngram", draft_cutoff=0.5, max_new_tokens=2)
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="draft_cutoff"):
            dllm.generate(oracle, PROMPT[None], sampler="fef", draft_cutoff=bad, max_new_tokens=2)
    with pytest.raises(TypeError, match="draft_cutoff"):
        dllm.generate(oracle, PROMPT[None], sampler="fef", draft_cutoff="high", max_new_tokens=2)
