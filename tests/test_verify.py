"""Hand-built cases, a distribution test and properties of the shared verification core."""

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats as scipy_stats

from dllm.numerics import softmax
from dllm.samplers import verify

from stat_tools import ALPHA


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def one_hot(index, size=4):
    row = torch.zeros(size)
    row[index] = 1.0
    return row


def test_all_accepted_plus_bonus():
    draft_probs = torch.tensor([[[0.5, 0.5, 0, 0], [0.25, 0.25, 0.25, 0.25]]])
    target = torch.cat([draft_probs, one_hot(3)[None, None]], dim=1)  # identical targets, bonus row = token 3
    out = verify(torch.tensor([[1, 2]]), draft_probs, target, generator=gen())
    assert out.tokens.tolist() == [[1, 2, 3]]
    assert out.num_accepted.tolist() == [2] and out.num_emitted.tolist() == [3]


def test_first_rejected_draws_from_residual():
    draft_probs = torch.tensor([[[0.5, 0.5, 0, 0], [1, 0, 0, 0]]])
    target = torch.tensor([[[0, 0.5, 0.5, 0], [1, 0, 0, 0], [1, 0, 0, 0]]])
    # target(0) = 0: draft 0 is always rejected; residual max(0, target - draft) = [0, 0, 0.5, 0] -> token 2.
    out = verify(torch.tensor([[0, 0]]), draft_probs, target, generator=gen())
    assert out.tokens.tolist() == [[2, -1, -1]]
    assert out.num_accepted.tolist() == [0] and out.num_emitted.tolist() == [1]


def test_zero_drafts_emit_the_bonus_from_row_zero():
    target = one_hot(1)[None, None].repeat(2, 1, 1)
    out = verify(torch.zeros((2, 0), dtype=torch.long), torch.zeros((2, 0, 4)), target, generator=gen())
    assert out.tokens.tolist() == [[1], [1]] and out.num_emitted.tolist() == [1, 1]


def test_single_draft_without_bonus_row():
    out = verify(torch.tensor([[2]]), one_hot(2)[None, None], one_hot(2)[None, None], generator=gen())
    assert out.tokens.tolist() == [[2, -1]] and out.num_emitted.tolist() == [1]


def test_ragged_rows_take_their_bonus_at_row_n():
    uniform = torch.full((3, 4), 0.25)
    target = torch.stack([uniform, uniform, uniform])  # [B=3, K+1=3, V]
    target[0, 2] = one_hot(3)  # row 0: 2 drafts, bonus row 2
    target[1, 0] = one_hot(0)  # row 1: 0 drafts, bonus row 0
    target[2, 1] = one_hot(1)  # row 2: 1 draft, bonus row 1
    drafts = torch.tensor([[1, 2], [3, 3], [0, 3]])
    out = verify(drafts, target[:, :2].clone(), target, torch.tensor([2, 0, 1]), generator=gen())
    assert out.tokens.tolist() == [[1, 2, 3], [0, -1, -1], [0, 1, -1]]
    assert out.num_emitted.tolist() == [3, 1, 2]


def test_zero_draft_probability_is_a_rejection():
    draft_probs = torch.tensor([[[0.0, 1.0, 0, 0]]])  # the drafted token 0 has draft probability 0
    target = torch.tensor([[[1.0, 0, 0, 0], [0, 0, 0, 1.0]]])
    out = verify(torch.tensor([[0]]), draft_probs, target, generator=gen())
    assert out.num_accepted.tolist() == [0]
    assert out.tokens[0, 0].item() == 0  # the correction comes from the residual [1, 0, 0, 0]


def test_point_mass_drafts():
    target = torch.tensor([[[0, 1.0, 0, 0], [0, 0, 0.5, 0.5], [1.0, 0, 0, 0]]])
    out = verify(torch.tensor([[1, 0]]), None, target, generator=gen())
    # draft 1 has target probability 1 -> accepted; draft 0 has target probability 0 -> rejected and the
    # correction comes from the target without token 0.
    assert out.num_accepted.tolist() == [1]
    assert out.tokens[0, 1].item() in (2, 3)


def test_minus_inf_logits_are_never_emitted():
    logits = torch.tensor([[[0.0, -math.inf, 0.0, -math.inf]] * 3])
    target = softmax(logits)
    drafts = torch.tensor([[1, 3]])  # impossible under the target
    for seed in range(20):
        out = verify(drafts, softmax(torch.zeros(1, 2, 4)), target, generator=gen(seed))
        assert out.num_accepted.item() == 0 and out.tokens[0, 0].item() in (0, 2)


def test_greedy_accepts_while_argmax_matches():
    target_logits = torch.tensor([[[0.0, 5.0, 0, 0], [3.0, 0, 0, 0], [0, 0, 0, 9.0]]])
    out = verify(torch.tensor([[1, 2]]), None, target_logits, greedy=True)
    assert out.tokens.tolist() == [[1, 0, -1]]
    out = verify(torch.tensor([[1, 0]]), None, target_logits, greedy=True)
    assert out.tokens.tolist() == [[1, 0, 3]]


def test_explicit_noise_matches_generator():
    draft_probs = softmax(torch.randn(5, 3, 6, generator=gen(1)))
    target = softmax(torch.randn(5, 4, 6, generator=gen(2)))
    drafts = torch.randint(0, 6, (5, 3), generator=gen(3))
    uniforms = torch.rand((5, 3), generator=gen(4), dtype=torch.float64)
    gumbels = -torch.log(-torch.log(torch.rand((5, 6), generator=gen(5), dtype=torch.float64)))
    a = verify(drafts, draft_probs, target, uniforms=uniforms, gumbels=gumbels)
    b = verify(drafts, draft_probs, target, uniforms=uniforms, gumbels=gumbels)
    assert torch.equal(a.tokens, b.tokens)
    # The uniforms decide acceptance exactly as the rule says.
    expected_accept = uniforms[:, 0] * draft_probs[:, 0].gather(-1, drafts[:, :1]).squeeze(-1).double() < (
        target[:, 0].gather(-1, drafts[:, :1]).squeeze(-1).double())
    assert torch.equal(a.num_accepted > 0, expected_accept)


def _first_token_pvalue(verify_fn, n=40000):
    """Chi-square p-value of the first emitted token against the target, drafts drawn from the proposal."""
    target_row = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    draft_row = torch.tensor([0.1, 0.2, 0.3, 0.2, 0.2])
    g = gen(123)
    drafts = torch.multinomial(draft_row, n, replacement=True, generator=g)[:, None]
    tokens = verify_fn(drafts, draft_row.expand(n, 1, 5), target_row.expand(n, 2, 5), g)
    counts = torch.bincount(tokens, minlength=5)
    assert counts[4] == 0  # zero target probability is never emitted
    return scipy_stats.chisquare(counts[:4].numpy(), (target_row[:4] * n).numpy()).pvalue


def test_first_token_distributed_as_target():
    pvalue = _first_token_pvalue(lambda d, q, p, g: verify(d, q, p, generator=g).tokens[:, 0])
    assert pvalue > ALPHA


def test_power_wrong_correction_is_detected():
    """A verifier that corrects from the target instead of the residual is biased; the test must see it."""

    def broken(d, q, p, g):
        out = verify(d, q, p, generator=g).tokens[:, 0]
        rejected = verify(d, q, p, generator=gen(123)).num_accepted == 0
        from_target = torch.multinomial(p[:, 0], 1, generator=g).squeeze(-1)
        return torch.where(rejected, from_target, out)

    assert _first_token_pvalue(broken) < 1e-6


@settings(max_examples=60, deadline=None)
@given(
    batch=st.integers(1, 4), width=st.integers(0, 5), vocab=st.integers(2, 7), seed=st.integers(0, 10_000),
    bonus=st.booleans(), point_mass=st.booleans(), greedy=st.booleans(),
)
def test_properties(batch, width, vocab, seed, bonus, point_mass, greedy):
    g = gen(seed)
    logits = torch.randn(batch, width + 1, vocab, generator=g)
    logits[torch.rand(logits.shape, generator=g) < 0.2] = -math.inf
    logits[..., 0] = 0.0  # keep at least one finite logit per row
    target = softmax(logits if bonus else logits[:, :width])
    draft_probs = None if point_mass else softmax(torch.randn(batch, width, vocab, generator=g))
    drafts = torch.randint(0, vocab, (batch, width), generator=g)
    num_drafts = torch.randint(0, width + 1, (batch,), generator=g)
    if not bonus:
        num_drafts = torch.minimum(num_drafts, torch.full_like(num_drafts, max(width - 1, 0)))
    out = verify(drafts, draft_probs, target, num_drafts, generator=g, greedy=greedy)
    assert out.tokens.shape == (batch, width + 1)
    assert bool((out.num_accepted <= num_drafts).all())
    extra = (out.num_accepted < num_drafts) | torch.tensor(bonus)
    assert torch.equal(out.num_emitted, out.num_accepted + extra.long())
    for b in range(batch):
        row, a, e = out.tokens[b], int(out.num_accepted[b]), int(out.num_emitted[b])
        assert torch.equal(row[:a], drafts[b, :a])
        assert bool((row[e:] == -1).all()) and bool((row[:e] >= 0).all()) and bool((row[:e] < vocab).all())
        if e > a:  # the correction/bonus never has target probability 0
            assert target[b, a, row[a]] > 0


def _logits_case(batch=6, width=3, vocab=7, seed=0):
    g = gen(seed)
    drafts = torch.randint(0, vocab, (batch, width), generator=g)
    return drafts, torch.randn(batch, width, vocab, generator=g), torch.randn(batch, width + 1, vocab, generator=g)


def test_rejection_sample_noise_replays_each_source():
    from dllm.kernels import verify_logits_reference
    from dllm.kernels.noise import STREAM_RESIDUAL, counter_gumbels
    from dllm.samplers.verify import Noise, rejection_sample

    drafts, draft_logits, target_logits = _logits_case()
    by_generator = rejection_sample(drafts, draft_logits, target_logits, temperature=0.8, noise=Noise(generator=gen(3)))
    old = verify_logits_reference(drafts, draft_logits, target_logits, temperature=0.8, generator=gen(3))
    assert torch.equal(by_generator.tokens, old.tokens)
    # Explicit uniforms win over the seed for acceptance; the seed still gives the residual Gumbels.
    uniforms = torch.rand(drafts.shape, generator=gen(4), dtype=torch.float64)
    mixed = rejection_sample(drafts, draft_logits, target_logits, temperature=0.8,
                             noise=Noise(seed=9, uniforms=uniforms))
    explicit = verify(drafts, softmax(draft_logits, 0.8), softmax(target_logits, 0.8), uniforms=uniforms,
                      gumbels=counter_gumbels(9, STREAM_RESIDUAL, torch.arange(6), 7))
    assert torch.equal(mixed.tokens, explicit.tokens) and torch.equal(mixed.num_emitted, explicit.num_emitted)
    # Different noise must be able to change the outcome, or the comparisons above prove nothing.
    others = {tuple(rejection_sample(drafts, draft_logits, target_logits, temperature=0.8,
                                     noise=Noise(seed=s)).tokens.flatten().tolist()) for s in range(5)}
    assert len(others) > 1


def test_rejection_sample_bad_noise_names_the_parameter():
    import pytest

    from dllm.kernels import verify_logits
    from dllm.samplers.verify import Noise, rejection_sample

    drafts, draft_logits, target_logits = _logits_case()
    with pytest.raises(ValueError, match="noise must be"):
        rejection_sample(drafts, draft_logits, target_logits, temperature=1.0, noise=gen())
    with pytest.raises(ValueError, match="seed must be an integer"):
        Noise(seed=-1)
    with pytest.raises(ValueError, match="uniforms must be a 2-D"):
        Noise(uniforms=torch.rand(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="gumbels must be a 2-D float64"):
        Noise(gumbels=torch.zeros(2, 7))
    with pytest.raises(ValueError, match="not both"):
        verify_logits(drafts, draft_logits, target_logits, temperature=1.0, noise=Noise(seed=1), generator=gen())
    with pytest.raises(ValueError, match="generator"):
        rejection_sample(drafts, draft_logits, target_logits, temperature=1.0, noise=Noise())
