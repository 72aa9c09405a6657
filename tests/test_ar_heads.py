"""ar_spec with trained-head drafters (EAGLE, DFlash, diffusion drafter + repair head) keeps ``ar``'s law exactly.

Chi-square tests against the enumerated law of small models, as in test_exactness.py, with random heads
(exactness must hold for any weights); a power test shows the same test rejects a head drafter that
verifies with other logits than it sampled from; greedy decoding equals ``ar`` token for token.
"""

import pytest
import torch

import dllm
from dllm.models.ar_heads import (
    DFlashHead,
    EagleHead,
    HeadConfig,
    RepairHead,
    dflash_draft,
    dflash_train_logits,
    eagle_draft,
    eagle_train_logits,
    load_head,
    new_head,
    save_head,
)
from dllm.models.oracle import HMMOracle
from dllm.models.transformer import TransformerConfig, TransformerLM
from dllm.samplers import sequential_distribution
from dllm.samplers.ar_spec import ar_spec
from dllm.samplers.ar_spec.drafters import DiffusionDrafter, Draft, DraftContext
from dllm.samplers.ar_spec.heads import EagleDrafter, RepairDrafter
from dllm.samplers.calling import Caller
from dllm.stats import DecodeStats

from stat_tools import ALPHA, chi_square_pvalue, sharp

N_SAMPLES = 12000
PROMPT = torch.tensor([0, 2])
GEN = 4


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    return sharp(TransformerLM(TransformerConfig(vocab_size=3, dim=16, n_layers=1, n_heads=2, max_seq_len=32)), 5.0)


@pytest.fixture(scope="module")
def eagle():
    torch.manual_seed(1)
    return EagleHead(HeadConfig("eagle", 16, 3, 32)).eval()


@pytest.fixture(scope="module")
def dflash():
    torch.manual_seed(6)
    head = DFlashHead(HeadConfig("dflash", 16, 3, 32, layers=2, context=8)).eval()  # 8 covers these answers
    with torch.no_grad():
        head.slot.normal_()  # slots far from the context's inputs: drafts that differ from the first one's law
    return head


@pytest.fixture(scope="module")
def oracle():
    return HMMOracle.random(num_states=3, num_tokens=3, seed=0, stickiness=2.0, sharpness=2.0)


@pytest.fixture(scope="module")
def diffusion():
    """A random block-causal diffusion drafter over the oracle's 3 tokens plus a mask id appended (3)."""
    torch.manual_seed(2)
    config = TransformerConfig(vocab_size=4, dim=16, n_layers=1, n_heads=2, max_seq_len=32, layout="block_causal",
                               block_size=2, mask_token_id=3)
    return sharp(TransformerLM(config), 5.0)


@pytest.fixture(scope="module")
def repair():
    torch.manual_seed(3)
    head = RepairHead(HeadConfig("repair", 16, 4, 32))
    torch.nn.init.normal_(head.out.weight, std=1.0)  # a head that changes the marginals
    return head.eval()


def sample(model, temperature, seed=5, **options):
    out = dllm.generate(model, PROMPT.expand(N_SAMPLES, -1), sampler="ar_spec", max_new_tokens=GEN,
                        temperature=temperature, generator=torch.Generator().manual_seed(seed),
                        num_draft_tokens=3, **options)
    return out.sequences[:, PROMPT.numel():], out.stats


@pytest.mark.parametrize("kind", ["eagle", "dflash"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_feature_head_exact(target, kind, temperature, request):
    answers, stats = sample(target, temperature, drafter="head", draft_head=request.getfixturevalue(kind))
    assert chi_square_pvalue(answers, sequential_distribution(target, PROMPT, GEN, temperature=temperature)) > ALPHA
    assert 0 < stats.accepted < stats.drafted


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_eagle_dynamic_draft_length_exact(target, eagle, temperature):
    """EAGLE-2's confidence stop (draft_confidence) chooses each round's draft count from the head's own
    draws: the law is still the target's, and rounds do end early."""
    answers, stats = sample(target, temperature, drafter="head", draft_head=eagle, draft_confidence=0.6)
    assert chi_square_pvalue(answers, sequential_distribution(target, PROMPT, GEN, temperature=temperature)) > ALPHA
    full = sample(target, temperature, drafter="head", draft_head=eagle)[1]
    assert 0 < stats.accepted and stats.drafted < full.drafted


def test_eagle_dynamic_draft_length_greedy_and_refusals(target, eagle):
    prompts = torch.tensor([[0, 2, 1, 0, 2], [1, 1, 1, 1, 1]])
    common = dict(max_new_tokens=9, temperature=0.0)
    spec = dllm.generate(target, prompts, sampler="ar_spec", drafter="head", draft_head=eagle, num_draft_tokens=3,
                         draft_confidence=0.9, **common)
    assert torch.equal(spec.sequences, dllm.generate(target, prompts, sampler="ar", **common).sequences)
    with pytest.raises(ValueError, match="draft_confidence"):
        dllm.generate(target, prompts, sampler="ar_spec", drafter="ngram", draft_confidence=0.5, **common)
    with pytest.raises(ValueError, match="draft_confidence"):
        dllm.generate(target, prompts, sampler="ar_spec", drafter="head", draft_head=eagle, draft_confidence=1.5,
                      **common)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_repair_head_exact(oracle, diffusion, repair, temperature):
    answers, stats = sample(oracle.as_causal(), temperature, drafter=diffusion, draft_head=repair)
    expected = sequential_distribution(oracle.as_causal(), PROMPT, GEN, temperature=temperature)
    assert chi_square_pvalue(answers, expected) > ALPHA
    assert 0 < stats.accepted < stats.drafted


class _ArgmaxEagle(EagleDrafter):
    """A buggy head drafter: drafts the argmax but reports the softmax it did not sample from."""

    def propose(self, sequences, lengths, k, ctx):
        draft = super().propose(sequences, lengths, k, ctx)
        return Draft(draft.logits.argmax(-1), draft.logits, draft.count)


@pytest.mark.parametrize("kind", ["eagle", "dflash"])
def test_power_head_drafter_with_wrong_logits_fails(target, kind, request):
    stats = DecodeStats()
    head = request.getfixturevalue(kind)
    seq = ar_spec(target, PROMPT.expand(N_SAMPLES, -1), GEN, temperature=1.0,
                  generator=torch.Generator().manual_seed(5), stats=stats, drafter=_ArgmaxEagle(head, target),
                  num_draft_tokens=3)
    expected = sequential_distribution(target, PROMPT, GEN, temperature=1.0)
    assert chi_square_pvalue(seq[:, PROMPT.numel():], expected) < 1e-6


@pytest.mark.parametrize("cache", ["auto", "none"])
def test_head_drafters_greedy_equal_ar(target, eagle, dflash, oracle, diffusion, repair, cache):
    prompts = torch.tensor([[0, 2, 1, 0, 2], [1, 1, 1, 1, 1], [2, 0, 2, 0, 2]])
    common = dict(max_new_tokens=9, temperature=0.0)
    for model, options in ((target, dict(drafter="head", draft_head=eagle)),
                           (target, dict(drafter="head", draft_head=dflash)),
                           (target, dict(drafter="head", draft_head=dflash, draft_confidence=0.5)),
                           (oracle.as_causal(), dict(drafter=diffusion, draft_head=repair))):
        spec = dllm.generate(model, prompts, sampler="ar_spec", num_draft_tokens=3, cache=cache, **options, **common)
        plain = dllm.generate(model, prompts, sampler="ar", **common)
        assert torch.equal(spec.sequences, plain.sequences)


class _Recording(EagleDrafter):
    """Checks each round's context against the target's own features at length - 1 - C .. length - 2."""

    def propose(self, sequences, lengths, k, ctx):
        if ctx.features is not None:
            width = self.feature_context
            assert ctx.features.shape[1] == width
            for r, row in enumerate(ctx.rows.tolist()):
                first = self.first[row]  # the row's first real token (left padding before it)
                ids = sequences[r : r + 1, first : lengths[r] - 1]
                _, feats = self.target(ids, return_hidden=True)
                at = lengths[r] - 1 - width + torch.arange(width)
                torch.testing.assert_close(ctx.feature_valid[r], at >= first)
                real = at[at >= first] - first
                torch.testing.assert_close(ctx.features[r][at >= first], feats[0, real], rtol=1e-4, atol=1e-5)
            self.checked += 1
        return super().propose(sequences, lengths, k, ctx)


@pytest.mark.parametrize("cache", ["auto", "none"])
@pytest.mark.parametrize("context", [2, 64])
def test_eagle_drafter_reads_the_last_features(target, cache, context):
    """The context is the target's features of the tokens so far, padding and positions < 0 marked invalid."""
    torch.manual_seed(1)
    drafter = _Recording(EagleHead(HeadConfig("eagle", 16, 3, 32, context=context)).eval(), target)
    drafter.checked = 0
    prompts = torch.tensor([[0, 2, 1], [0, 1, 0]])
    mask = torch.tensor([[1, 1, 1], [0, 1, 1]])  # row 1 left-padded: a position-0 pad
    drafter.first = [0, 1]
    ar_spec(target, prompts, 10, temperature=1.0, generator=torch.Generator().manual_seed(0), stats=DecodeStats(),
            drafter=drafter, num_draft_tokens=3, cache=cache, attention_mask=mask)
    assert drafter.checked >= 2


def test_eagle_training_unroll_is_the_drafting_loop(target):
    """eagle_train_logits[t, :, i] is what eagle_draft computes from the context ending at i - t, with the
    sequence's own tokens as the drafts (the training-time test trains exactly the steps that draft)."""
    torch.manual_seed(4)
    head = EagleHead(HeadConfig("eagle", 16, 3, 32, context=3)).eval()
    ids = torch.randint(0, 3, (2, 12))
    _, features = target(ids, return_hidden=True)
    valid = torch.ones_like(ids, dtype=torch.bool)
    valid[1, :2] = False  # padding in row 1
    tokens = torch.cat([ids[:, 1:], ids[:, -1:]], dim=1)  # token i + 1 at i
    depth = 4
    with torch.no_grad():
        train = eagle_train_logits(head, target, features, tokens, valid, depth)
        for c in (2, 4, 6):  # context ending at position c: positions c - 2 .. c
            ctx = slice(c - 2, c + 1)
            script = iter(ids[:, c + 2 : c + 2 + depth].T)  # the drafts: the sequence's own tokens
            logits, drafts = eagle_draft(head, target, features[:, ctx], tokens[:, ctx], valid[:, ctx], depth,
                                         lambda step, script=script: next(script))
            for t in range(depth):
                torch.testing.assert_close(logits[:, t], train[t, :, c + t], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("layers,context", [(1, 3), (2, 12)])
def test_dflash_training_pass_is_the_drafting_call(target, layers, context):
    """dflash_train_logits[t, :, i] is slot t of what dflash_draft computes from the context ending at i - t
    (one training pass trains exactly the calls that draft), with padding; one layer with a context shorter
    than the run, two layers with contexts from the start (deeper, the earliest context positions see less
    of the past when drafting than in training: ar_heads' module docstring)."""
    torch.manual_seed(7)
    head = DFlashHead(HeadConfig("dflash", 16, 3, 32, context=context, layers=layers)).eval()
    ids = torch.randint(0, 3, (2, 12))
    _, features = target(ids, return_hidden=True)
    valid = torch.ones_like(ids, dtype=torch.bool)
    valid[1, :2] = False  # padding in row 1
    tokens = torch.cat([ids[:, 1:], ids[:, -1:]], dim=1)
    depth = 4
    with torch.no_grad():
        train = dflash_train_logits(head, target, features, tokens, valid, depth)
        for c in (2, 4, 6):
            ctx = slice(c - 2 if layers == 1 else 0, c + 1)
            logits, _ = dflash_draft(head, target, features[:, ctx], tokens[:, ctx], valid[:, ctx], depth,
                                     lambda step: step.argmax(-1))
            for t in range(depth):
                torch.testing.assert_close(logits[:, t], train[t, :, c + t], rtol=1e-4, atol=1e-5)
    assert not torch.allclose(train[1], train[2])  # slots differ by position


def test_untrained_repair_head_drafts_the_marginals(oracle, diffusion):
    head = new_head(HeadConfig("repair", 16, 4, 32)).eval()  # out projection zero: no correction
    seq = torch.tensor([[0, 2, 1, 0, 0, 0, 0, 0, 0]])
    lengths, rows = torch.tensor([3]), torch.tensor([0])
    drafts = []
    for cls, extra in ((DiffusionDrafter, {}), (RepairDrafter, {"head": head})):
        drafter = cls(Caller(diffusion, DecodeStats(), draft=True), 2, 2, None, **extra)
        ctx = DraftContext(rows, torch.tensor([3]), 1.0, torch.Generator().manual_seed(4), 3)
        drafts.append(drafter.propose(seq, lengths, 3, ctx))
    assert torch.equal(drafts[0].tokens, drafts[1].tokens)
    torch.testing.assert_close(drafts[0].logits[..., :3], drafts[1].logits)


@pytest.mark.parametrize("kind", ["eagle", "dflash"])
def test_head_round_trip(tmp_path, kind, request):
    head = request.getfixturevalue(kind)
    save_head(head, tmp_path / "h")
    loaded = load_head(tmp_path / "h")
    assert loaded.config == head.config and type(loaded) is type(head)
    x, e = torch.randn(2, 5, 16), torch.randn(2, 5, 16)
    positions = torch.arange(5).expand(2, 5)
    mask = torch.ones((5, 5), dtype=torch.bool).tril().expand(2, 1, 5, 5)
    torch.testing.assert_close(loaded(x, e, positions, mask), head(x, e, positions, mask))


def test_bad_draft_heads_are_refused_with_the_parameter_named(target, eagle, oracle, diffusion, repair, tmp_path):
    run = lambda model, **o: dllm.generate(model, PROMPT[None], sampler="ar_spec", max_new_tokens=2, **o)  # noqa: E731
    with pytest.raises(ValueError, match="draft_head is a 'repair' head"):
        run(target, drafter="head", draft_head=repair)
    with pytest.raises(ValueError, match="draft_head is a 'eagle' head"):
        run(oracle.as_causal(), drafter=diffusion, draft_head=eagle)
    with pytest.raises(ValueError, match="draft_head is for drafter='head'"):
        run(target, drafter="ngram", draft_head=eagle)
    with pytest.raises(ValueError, match="draft_head has dim 8"):
        run(target, drafter="head", draft_head=EagleHead(HeadConfig("eagle", 8, 3, 16)))
    with pytest.raises(ValueError, match="draft_head must be .* folder"):
        run(target, drafter="head", draft_head=str(tmp_path / "missing"))
    with pytest.raises(TypeError, match="draft_head must be a head folder or a head module"):
        run(target, drafter="head", draft_head=3)
    with pytest.raises(ValueError, match="draft head kind must be one of"):
        HeadConfig("medusa", 16, 3, 32)
    with pytest.raises(ValueError, match="layers=2 is for a dflash head"):
        HeadConfig("eagle", 16, 3, 32, layers=2)
    with pytest.raises(ValueError, match="num_draft_tokens .9. exceeds the dflash draft_head's max_drafts .8."):
        run(target, drafter="head", draft_head=DFlashHead(HeadConfig("dflash", 16, 3, 32, max_drafts=8)),
            num_draft_tokens=9)
    with pytest.raises(ValueError, match="draft_head is a 'dflash' head"):
        run(oracle.as_causal(), drafter=diffusion, draft_head=DFlashHead(HeadConfig("dflash", 16, 4, 32)))


def test_head_drafters_accept_counting_wrappers(oracle, diffusion, repair):
    """dllm bench wraps drafters in CountingModel; the head must still find the drafter's output layer."""
    from dllm.counting import CountingModel

    prompts = torch.tensor([[0, 2, 1, 0, 2]])
    common = dict(max_new_tokens=6, temperature=0.0)
    wrapped = CountingModel(diffusion, lambda call: None, draft=True)
    spec = dllm.generate(oracle.as_causal(), prompts, sampler="ar_spec", drafter=wrapped, draft_head=repair,
                         num_draft_tokens=3, **common)
    assert torch.equal(spec.sequences, dllm.generate(oracle.as_causal(), prompts, sampler="ar", **common).sequences)


def test_shipped_heads_greedy_equal_ar():
    """drafter='head' defaults to dllm/weights/ar_eagle; the shipped repair head fits the shipped diffusion model."""
    from dllm.models.ar_heads import DEFAULT_EAGLE, SHIPPED

    target = TransformerLM.from_pretrained(SHIPPED / "ar")
    diffusion = TransformerLM.from_pretrained(SHIPPED / "diffusion")
    prompt = torch.tensor([[10, 20, 30, 40, 50]])
    common = dict(max_new_tokens=12, temperature=0.0)
    plain = dllm.generate(target, prompt, sampler="ar", **common).sequences
    for options in (dict(drafter="head"), dict(drafter=diffusion, draft_head=str(SHIPPED / "ar_repair"))):
        spec = dllm.generate(target, prompt, sampler="ar_spec", num_draft_tokens=8, **options, **common)
        assert torch.equal(spec.sequences, plain)
    assert DEFAULT_EAGLE.is_dir()
