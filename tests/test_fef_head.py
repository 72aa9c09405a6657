"""fef with a draft head (draft="head"): the output law is sequential's for any head, trained or random.

Chi-square tests at fixed seeds (as tests/test_exactness.py) on an oracle model that also returns features
(a fixed random embedding of the state) and on a small random block-causal transformer with the block
cache; a power test shows the same test rejects a head source that reports other logits than it sampled
from. Plus save/load, the checks at the door, and greedy == sequential token for token.
"""

from dataclasses import dataclass

import pytest
import torch

import dllm
import dllm.samplers.fef.round as fef_module
from dllm.models.draft_head import DraftHead, DraftHeadConfig
from dllm.models.oracle import HMMOracle, InconsistentModel, Wrapper
from dllm.models.transformer import TransformerConfig, TransformerLM
from dllm.protocols import Capabilities
from dllm.samplers import sequential_distribution
from dllm.samplers.fef.sources import HeadDrafts

from stat_tools import ALPHA, chi_square_pvalue

N_SAMPLES = 12000
PROMPT = torch.tensor([0, 2])
GEN = 4


@dataclass(frozen=True)
class WithFeatures(Wrapper):
    """A logits function that also returns features: a fixed random embedding of each state."""

    base: object
    dim: int = 8
    seed: int = 0
    capabilities = Capabilities(hidden_states=True)

    def __call__(self, input_ids: torch.Tensor, return_hidden: bool = False):
        logits = self.base(input_ids)
        if not return_hidden:
            return logits
        g = torch.Generator().manual_seed(self.seed)
        token, context = torch.randn((2, self.vocab_size, self.dim), generator=g)
        position = torch.randn((input_ids.shape[1], self.dim), generator=g)
        features = token[input_ids] + position[None] + context[input_ids].mean(dim=1, keepdim=True)  # [B, L, D]
        return logits, features


def random_head(vocab: int, mask_id: int, feature_dim: int, seed: int = 0, scale: float = 0.3) -> DraftHead:
    """A head with a random (non-zero) correction, so its drafts are not the marginals."""
    torch.manual_seed(seed)
    head = DraftHead(DraftHeadConfig(vocab_size=vocab, backbone_dim=feature_dim, dim=16, n_heads=2,
                                     mask_token_id=mask_id))
    with torch.no_grad():
        torch.nn.init.normal_(head.out.weight, std=scale)
    return head.eval()


@pytest.fixture(scope="module")
def model():
    oracle = HMMOracle.random(num_states=3, num_tokens=3, seed=0, stickiness=2.0, sharpness=2.0)
    return WithFeatures(InconsistentModel(oracle, scale=1.0, seed=3))


@pytest.fixture(scope="module")
def head(model):
    return random_head(model.vocab_size, model.mask_token_id, 8)


def sample(model, temperature=1.0, seed=0, n=N_SAMPLES, **options):
    out = dllm.generate(model, PROMPT.expand(n, -1), sampler="fef", max_new_tokens=GEN, temperature=temperature,
                        generator=torch.Generator().manual_seed(seed), draft="head", **options)
    return out.sequences[:, PROMPT.numel():], out.stats


def test_random_head_drafts_differ_from_the_marginals(model, head):
    """The head really changes the draft law (else the tests below would only re-test marginal drafts),
    while an untrained (zero-initialised) head drafts exactly the marginals."""
    features = torch.randn(2, 3, 8)
    base = torch.randn(2, 3, model.vocab_size)
    previous, offsets = torch.tensor([[0, 1, 2], [2, 2, 0]]), torch.ones(2, 3, dtype=torch.long)
    drafted = head(features, base, previous, offsets)
    assert torch.equal(drafted[:, 0], base[:, 0].masked_fill(torch.arange(model.vocab_size) == model.mask_token_id,
                                                             float("-inf")))
    assert (drafted[:, 1:] - base[:, 1:]).abs()[..., :3].max() > 0.5
    fresh = DraftHead(DraftHeadConfig(vocab_size=model.vocab_size, backbone_dim=8, dim=16, n_heads=2))
    assert torch.equal(fresh(features, base, previous, offsets), base)


@pytest.mark.parametrize("order", ["left_to_right", "confidence"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fef_head_exact(model, head, order, temperature):
    expected = sequential_distribution(model, PROMPT, GEN, temperature=temperature, order=order)
    answers, stats = sample(model, temperature, seed=7, order=order, window=3, draft_head=head)
    assert chi_square_pvalue(answers, expected) > ALPHA
    assert 0 < stats.accepted < stats.drafted  # rejections happened, so the residual path was exercised


def test_fef_head_exact_in_blocks(model, head):
    expected = sequential_distribution(model, PROMPT, GEN, order="confidence", block_length=2)
    answers, _ = sample(model, seed=11, order="confidence", block_length=2, window=2, draft_head=head)
    assert chi_square_pvalue(answers, expected) > ALPHA


class _ReportsMarginals(HeadDrafts):
    """Not exact: samples from the head but tells the verifier the marginals' logits."""

    def sample(self, view, draft_logits, positions, temperature, generator):
        tokens, _ = super().sample(view, draft_logits, positions, temperature, generator)
        rows = torch.arange(positions.shape[0])[:, None]
        return tokens, dllm.numerics.forbid_token(draft_logits[rows, positions], view.mask_token_id)


def test_power_head_reporting_other_logits_fails(model, head, monkeypatch):
    expected = sequential_distribution(model, PROMPT, GEN)
    answers, _ = sample(model, seed=7, window=3, draft_head=head)
    assert chi_square_pvalue(answers, expected) > ALPHA  # the honest source, same seed
    monkeypatch.setattr(fef_module, "HeadDrafts", _ReportsMarginals)
    answers, _ = sample(model, seed=7, window=3, draft_head=head)
    assert chi_square_pvalue(answers, expected) < 1e-6


def tiny_block_causal(seed=4, block_size=2):
    torch.manual_seed(seed)
    config = TransformerConfig(vocab_size=5, dim=32, n_layers=2, n_heads=2, max_seq_len=64, layout="block_causal",
                               block_size=block_size, mask_token_id=2, eos_token_id=None)
    model = TransformerLM(config).eval()
    with torch.no_grad():
        model.output.weight.mul_(0.1)  # a spread-out distribution over the 4 tokens
    return model


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fef_head_exact_with_block_cache(temperature):
    """A real (random) block-causal transformer, features through the block cache, a random head."""
    model = tiny_block_causal()
    head = random_head(5, 2, 32, seed=1, scale=1.0)
    prompt = torch.tensor([0, 3])
    with torch.no_grad():
        expected = sequential_distribution(model, prompt, 4, block_length=2, temperature=temperature)
        out = dllm.generate(model, prompt.expand(6000, -1), sampler="fef", max_new_tokens=4, block_length=2,
                            window=2, cache="block", draft="head", draft_head=head, temperature=temperature,
                            generator=torch.Generator().manual_seed(0))
    assert out.options["cache"] == "block"
    assert chi_square_pvalue(out.sequences[:, 2:], expected) > ALPHA
    assert 0 < out.stats.accepted < out.stats.drafted


@pytest.mark.parametrize("order", ["left_to_right", "confidence"])
@pytest.mark.parametrize("block", [6, 3, 2])
def test_fef_head_greedy_equals_sequential(model, head, order, block):
    prompts = torch.tensor([[0, 2], [1, 1], [2, 0], [0, 0]])
    common = dict(max_new_tokens=6, temperature=0.0, order=order, block_length=block)
    with_head = dllm.generate(model, prompts, sampler="fef", window=4, draft="head", draft_head=head, **common)
    seq = dllm.generate(model, prompts, sampler="sequential", **common)
    assert torch.equal(with_head.sequences, seq.sequences)


def test_fef_head_greedy_equals_sequential_with_block_cache():
    torch.manual_seed(0)
    config = TransformerConfig(vocab_size=40, dim=32, n_layers=2, n_heads=2, max_seq_len=64, layout="block_causal",
                               block_size=4, mask_token_id=2)
    model = TransformerLM(config).eval()
    with torch.no_grad():
        model.output.weight.mul_(20.0)  # sharp, so greedy paths are not decided by float noise
    head = random_head(40, 2, 32, seed=2, scale=1.0)
    prompts = torch.tensor([[5, 9, 7, 11, 3], [0, 4, 8, 4, 6]])
    common = dict(max_new_tokens=12, temperature=0.0, block_length=4, eos_token_id=None)
    with torch.no_grad():
        with_head = dllm.generate(model, prompts, sampler="fef", window=4, draft="head", draft_head=head,
                                  cache="block", **common)
        seq = dllm.generate(model, prompts, sampler="sequential", cache="block", **common)
    assert torch.equal(with_head.sequences, seq.sequences)
    assert with_head.stats.drafted > 0


def test_save_and_load_round_trip(tmp_path, model, head):
    head.save_pretrained(tmp_path / "head")
    loaded = DraftHead.from_pretrained(tmp_path / "head")
    inputs = (torch.randn(1, 3, 8), torch.randn(1, 3, model.vocab_size), torch.tensor([[0, 1, 2]]),
              torch.tensor([[0, 1, 1]]))
    assert torch.equal(loaded(*inputs), head(*inputs))
    common = dict(max_new_tokens=4, temperature=1.0, window=3, draft="head")
    by_folder = dllm.generate(model, PROMPT.expand(64, -1), sampler="fef", draft_head=str(tmp_path / "head"),
                              generator=torch.Generator().manual_seed(3), **common)
    by_module = dllm.generate(model, PROMPT.expand(64, -1), sampler="fef", draft_head=head,
                              generator=torch.Generator().manual_seed(3), **common)
    assert torch.equal(by_folder.sequences, by_module.sequences)


def test_door_refuses_bad_heads(tmp_path, model, head):
    run = dict(sampler="fef", max_new_tokens=4, temperature=0.0)
    with pytest.raises(ValueError, match="draft='head' needs a model that returns its features"):
        dllm.generate(model.base, PROMPT[None], draft="head", draft_head=head, **run)
    with pytest.raises(ValueError, match="draft_head is used only with draft='head'"):
        dllm.generate(model, PROMPT[None], draft="marginal", draft_head=head, **run)
    other = random_head(model.vocab_size + 3, 0, 8)
    with pytest.raises(ValueError, match="vocabulary of 7 tokens; this model has 4"):
        dllm.generate(model, PROMPT[None], draft="head", draft_head=other, **run)
    wide = random_head(model.vocab_size, model.mask_token_id, 12)
    with pytest.raises(ValueError, match="features of width 12; this model's features are 8"):
        dllm.generate(model, PROMPT[None], draft="head", draft_head=wide, **run)
    with pytest.raises(ValueError, match="is not a draft-head folder"):
        dllm.generate(model, PROMPT[None], draft="head", draft_head=str(tmp_path / "missing"), **run)
    tiny_block_causal().save_pretrained(tmp_path / "lm")  # a model folder, not a head
    with pytest.raises(ValueError, match="not a fef draft head"):
        dllm.generate(model, PROMPT[None], draft="head", draft_head=str(tmp_path / "lm"), **run)


def test_shipped_head_drafts_for_the_shipped_model():
    """draft="head" without draft_head= loads dllm/weights/fef_head, which fits the shipped diffusion model;
    greedy output is sequential's; bench-style option text parses to the same options."""
    from pathlib import Path

    from dllm.samplers import parse_options

    model = TransformerLM.from_pretrained(Path(dllm.__file__).parent / "weights" / "diffusion")
    prompt = torch.tensor([[3, 10, 11, 12, 13, 14]])
    options = parse_options("fef", ["draft=head", "window=8"])
    with torch.no_grad():
        with_head = dllm.generate(model, prompt, sampler="fef", max_new_tokens=16, temperature=0.0, **options)
        seq = dllm.generate(model, prompt, sampler="sequential", max_new_tokens=16, temperature=0.0)
    assert torch.equal(with_head.sequences, seq.sequences)
    assert with_head.stats.drafted > 0


@pytest.mark.parametrize("condition_first", [False, True])
@pytest.mark.parametrize("n_layers", [1, 2])
def test_cached_head_steps_equal_the_full_pass(condition_first, n_layers):
    """DraftHead.start(...).next(...) (one cached step per slot, what the samplers run) gives forward's
    logits on each prefix, for a random head with a non-zero correction."""
    torch.manual_seed(0)
    head = DraftHead(DraftHeadConfig(vocab_size=11, backbone_dim=12, dim=16, n_layers=n_layers, n_heads=4,
                                     mask_token_id=10, condition_first=condition_first)).eval()
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(std=0.3)
    features, base = torch.randn(3, 6, 12), torch.randn(3, 6, 11)
    previous, offsets = torch.randint(0, 10, (3, 6)), torch.randint(-20, 20, (3, 6))
    with torch.no_grad():
        full = head(features, base, previous, offsets)
        steps = head.start(features, base)
        stepped = torch.stack([steps.next(previous[:, j], offsets[:, j]) for j in range(6)], dim=1)
    assert torch.allclose(stepped, full, atol=1e-5)
    assert not torch.allclose(full, base)  # the correction is not zero
    with pytest.raises(IndexError, match="6 steps"):
        steps.next(previous[:, 0], offsets[:, 0])
