"""Draft trees (``ar_spec`` with ``draft_candidates`` > 1) keep ``ar``'s law exactly.

At every depth the chain's draft and further candidates drawn without replacement from the same draft law
are verified in one call by the recursive rule (``dllm.kernels.verify.verify_tree_logits``). Tested: the
rule alone against a known three-token chain, and a power test where the alternatives are drawn WITH
replacement (what the rule does not assume) fails; ar_spec end to end by chi-square against the law
enumerated from a small target (diffusion, causal and EAGLE-head drafters, T=1 and 0.7); greedy equals
``ar`` token for token (padding, EOS, with and without cache); the tree call's logits equal plain calls;
refusals name the option.
"""

import pytest
import torch
from scipy import stats as scipy_stats

import dllm
from dllm.kernels.verify import Continuations, Noise, verify_tree_logits
from dllm.models.ar_heads import EagleHead, HeadConfig
from dllm.models.oracle import HMMOracle
from dllm.models.transformer import TransformerConfig, TransformerLM
from dllm.numerics import sample_from_logits, sample_more
from dllm.samplers import sequential_distribution
from dllm.samplers.ar_spec.decode import _target_rows, _tree_rows
from dllm.samplers.calling import Caller
from dllm.samplers.drafting import Draft
from dllm.samplers.verify import rejection_sample
from dllm.stats import DecodeStats

from stat_tools import ALPHA, chi_square_pvalue, sharp

VOCAB = 4
N_SAMPLES = 12000
PROMPT = torch.tensor([0, 2])
GEN = 4


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    config = TransformerConfig(vocab_size=VOCAB, dim=16, n_layers=2, n_heads=2, max_seq_len=32)
    return sharp(TransformerLM(config), 4.0)


@pytest.fixture(scope="module")
def drafters():
    """A block-causal diffusion drafter (mask id appended), a causal drafter and an EAGLE head, all random."""
    torch.manual_seed(2)
    small = dict(dim=16, n_layers=1, n_heads=2, max_seq_len=32)
    diffusion = sharp(TransformerLM(TransformerConfig(vocab_size=VOCAB + 1, layout="block_causal", block_size=2,
                                                      mask_token_id=VOCAB, **small)), 4.0)
    causal = sharp(TransformerLM(TransformerConfig(vocab_size=VOCAB, **small)), 3.0)
    eagle = EagleHead(HeadConfig("eagle", 16, VOCAB, 32)).eval()
    return {"diffusion": dict(drafter=diffusion), "causal": dict(drafter=causal),
            "eagle": dict(drafter="head", draft_head=eagle)}


def _rule_round(temperature: float, with_replacement: bool, n: int = 200_000, seed: int = 0):
    """One tree round of depth 2 on a known chain p(x0), p(x1 | x0), p(x2 | x0, x1) -> (result, first two
    laws), the candidates drawn as ar_spec draws them (or, for the power test, with replacement)."""
    torch.manual_seed(seed)
    laws = [torch.randn(VOCAB) * 2, torch.randn(VOCAB, VOCAB) * 2, torch.randn(VOCAB, VOCAB, VOCAB) * 2]
    draft_logits = (torch.randn(2, VOCAB) * 2).expand(n, -1, -1).contiguous()
    generator = torch.Generator().manual_seed(seed + 1)
    flat = draft_logits.reshape(-1, VOCAB)
    drafts = sample_from_logits(flat, temperature, generator).view(n, 2)
    if with_replacement:  # independent draws from the full law: duplicates of the draft included
        alternatives = torch.stack([sample_from_logits(flat, temperature, generator) for _ in range(2)], -1)
    else:
        alternatives = sample_more(flat, drafts.reshape(-1), 2, temperature, generator)
    alternatives = alternatives.view(n, 2, 2)
    d0, d1 = drafts[:, 0], drafts[:, 1]
    target = torch.stack([laws[0].expand(n, -1), laws[1][d0], laws[2][d0, d1]], dim=1)
    leaves = torch.stack([laws[1][alternatives[:, 0].clamp(min=0)],
                          laws[2][d0[:, None].expand(-1, 2), alternatives[:, 1].clamp(min=0)]], dim=1)
    result = verify_tree_logits(drafts, alternatives, draft_logits, target, leaves, temperature=temperature,
                                noise=Noise(generator=generator))
    return result, laws


def _chain_pvalue(result, laws, temperature: float) -> float:
    """Smallest p-value of: x0 against p(x0), and x1 given x0 (rows that emitted two tokens) against p(x1 | x0)."""
    tokens = result.tokens
    observed = torch.bincount(tokens[:, 0], minlength=VOCAB).double()
    expected = torch.softmax(laws[0].double() / temperature, -1) * observed.sum()
    pvalues = [scipy_stats.chisquare(observed, expected).pvalue]
    two = result.num_emitted >= 2
    for first in range(VOCAB):
        rows = two & (tokens[:, 0] == first)
        observed = torch.bincount(tokens[rows, 1], minlength=VOCAB).double()
        expected = torch.softmax(laws[1][first].double() / temperature, -1) * observed.sum()
        pvalues.append(scipy_stats.chisquare(observed, expected).pvalue)
    return min(pvalues) * len(pvalues)  # Bonferroni over the tests


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_tree_rule_exact(temperature):
    result, laws = _rule_round(temperature, with_replacement=False)
    assert _chain_pvalue(result, laws, temperature) > ALPHA
    taken = torch.bincount(result.branch, minlength=3)
    assert taken[1] > 0 and taken[2] > 0  # both alternatives were accepted somewhere


def test_power_tree_rule_with_candidates_drawn_with_replacement_fails():
    """The rule's proposal for candidate i is the draft law without candidates 0..i-1; candidates drawn with
    replacement break that, and the same test sees it."""
    result, laws = _rule_round(1.0, with_replacement=True)
    assert _chain_pvalue(result, laws, 1.0) < 1e-6


def test_tree_rule_without_alternatives_is_the_chain_rule():
    torch.manual_seed(3)
    drafts, draft_logits = torch.randint(0, VOCAB, (50, 3)), torch.randn(50, 3, VOCAB)
    target = torch.randn(50, 4, VOCAB)
    noise = dict(uniforms=torch.rand(50, 3, dtype=torch.float64), gumbels=torch.rand(50, VOCAB, dtype=torch.float64))
    tree = verify_tree_logits(drafts, drafts.new_zeros((50, 3, 0)), draft_logits, target, None, temperature=1.0,
                              noise=Noise(**noise))
    chain = rejection_sample(drafts, draft_logits, target, temperature=1.0, noise=Noise(**noise))
    assert torch.equal(tree.tokens, chain.tokens) and torch.equal(tree.num_accepted, chain.num_accepted)


def _branch_round(temperature: float, blind: bool = False, n: int = 120_000, seed: int = 7):
    """One tree round of depth 3 with continuations (``Continuations``) on a known chain p(x0), p(x1 | x0),
    p(x2 | x0 x1), p(x3 | x0 x1 x2) -> (result, laws). Drafts are causal (q_i given the token before), two
    alternatives per depth, and each alternative's continuation is drafted after it. ``blind``: the
    continuation is tested against the chain's targets instead of its own (the power case)."""
    torch.manual_seed(seed)
    laws = [torch.randn(*(VOCAB,) * (i + 1)) * 2 for i in range(4)]
    q = [torch.randn(VOCAB) * 2] + [torch.randn(VOCAB, VOCAB) * 2 for _ in range(2)]  # q_i[token before]
    generator = torch.Generator().manual_seed(seed + 1)

    def draft(i, before):  # -> (tokens [n], logits [n, V]) at depth i given the token before
        logits = q[0].expand(n, -1) if i == 0 else q[i][before]
        return sample_from_logits(logits, temperature, generator), logits

    def target(path):  # the target at depth len(path) after ``path`` (list of [n] tokens)
        return laws[len(path)][tuple(path)] if path else laws[0].expand(n, -1)

    width, count = 3, 2
    chain, chain_logits, alternatives = [], [], []
    for i in range(width):
        token, logits = draft(i, chain[-1] if chain else None)
        chain.append(token)
        chain_logits.append(logits)
        alternatives.append(sample_more(logits, token, count, temperature, generator))
    targets = torch.stack([target(chain[:i]) for i in range(width + 1)], dim=1)
    cont_tokens = torch.full((n, width, count, width), -1, dtype=torch.long)
    cont_logits = torch.zeros(n, width, count, width, VOCAB)
    cont_targets = torch.zeros(n, width, count, width + 1, VOCAB)
    for j in range(width):
        for a in range(count):
            path = chain[:j] + [alternatives[j][:, a].clamp(min=0)]
            for i in range(j + 1, width + 1):
                cont_targets[:, j, a, i] = targets[:, i] if blind else target(path)
                if i < width:
                    token, logits = draft(i, path[-1])
                    cont_tokens[:, j, a, i], cont_logits[:, j, a, i] = token, logits
                    path = path + [token]
    slot = torch.arange(n * width * count).view(n, width, count)  # every alternative has its entry
    packed = Continuations(slot, cont_tokens.flatten(0, 2), cont_logits.flatten(0, 2), cont_targets.flatten(0, 2))
    result = verify_tree_logits(torch.stack(chain, 1), torch.stack(alternatives, 1), torch.stack(chain_logits, 1),
                                targets, None, temperature=temperature, noise=Noise(generator=generator),
                                continuations=packed)
    return result, laws


def _path_pvalue(result, laws, temperature: float, depth: int) -> float:
    """Bonferroni-corrected smallest p-value of x_i given x_<i against p(x_i | x_<i), for i < depth, over the
    rows that emitted i + 1 tokens (each prefix with at least 50 such rows)."""
    tokens, pvalues = result.tokens, []
    for i in range(depth):
        emitted = result.num_emitted > i
        prefixes = torch.unique(tokens[emitted, :i], dim=0) if i else torch.zeros(1, 0, dtype=torch.long)
        for prefix in prefixes:
            rows = emitted & (tokens[:, :i] == prefix).all(dim=1)
            if int(rows.sum()) < 50:
                continue
            observed = torch.bincount(tokens[rows, i], minlength=VOCAB).double()
            law = laws[i][tuple(prefix.tolist())] if i else laws[0]
            expected = torch.softmax(law.double() / temperature, -1) * observed.sum()
            pvalues.append(scipy_stats.chisquare(observed, expected).pvalue)
    return min(pvalues) * len(pvalues)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_tree_rule_with_continuations_exact(temperature):
    """An accepted alternative's continuation is verified against its own targets: every emitted token follows
    the chain, through the bonus after a full branch; continuations did run (tokens after an alternative)."""
    result, laws = _branch_round(temperature)
    assert _path_pvalue(result, laws, temperature, 4) > ALPHA
    took = result.branch > 0
    assert bool((result.num_accepted[took] > result.branch_depth[took] + 1).any())  # continuation drafts accepted
    assert bool((result.num_emitted == 4).any())


def test_tree_rule_refuses_what_it_cannot_verify():
    """Alternatives without leaves or continuations (or without their entry in them), and explicit noise tensors
    for a tree with continuations (they cover one verification; a branch needs a second), are refused whatever
    the draws."""
    drafts, draft_logits = torch.zeros(2, 2, dtype=torch.long), torch.zeros(2, 2, VOCAB)
    target = torch.zeros(2, 3, VOCAB)
    alternatives = torch.ones(2, 2, 1, dtype=torch.long)
    with pytest.raises(ValueError, match="leaf_logits .* or continuations"):
        verify_tree_logits(drafts, alternatives, draft_logits, target, None, temperature=1.0,
                           noise=Noise(generator=torch.Generator()))
    branches = Continuations(torch.full((2, 2, 1), -1), torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2, VOCAB),
                             torch.zeros(0, 3, VOCAB))
    explicit = Noise(uniforms=torch.zeros(2, 4, dtype=torch.float64),
                     gumbels=torch.zeros(2, VOCAB, dtype=torch.float64))
    with pytest.raises(ValueError, match="explicit uniforms/gumbels"):
        verify_tree_logits(drafts, alternatives, draft_logits, target, None, temperature=1.0, noise=explicit,
                           continuations=branches)
    # An alternative without an entry would leave its token in the later candidates' proposal: refused.
    with pytest.raises(ValueError, match="every alternative"):
        verify_tree_logits(drafts, alternatives, draft_logits, target, None, temperature=1.0,
                           noise=Noise(generator=torch.Generator()), continuations=branches)


def test_power_tree_rule_with_continuations_on_the_chain_targets_fails():
    result, laws = _branch_round(1.0, blind=True)
    assert _path_pvalue(result, laws, 1.0, 4) < 1e-6


def _sample(model, temperature, candidates, **options):
    out = dllm.generate(model, PROMPT.expand(N_SAMPLES, -1), sampler="ar_spec", max_new_tokens=GEN,
                        temperature=temperature, generator=torch.Generator().manual_seed(5), num_draft_tokens=3,
                        draft_candidates=candidates, **options)
    return out.sequences[:, PROMPT.numel():], out.stats


@pytest.mark.parametrize("kind,candidates,below", [("diffusion", 2, None), ("causal", 2, None), ("eagle", 2, None),
                                                   ("diffusion", 3, None), ("causal", 3, 0.8)])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_ar_spec_tree_exact(target, drafters, kind, candidates, below, temperature):
    """The law is ar's; ``candidates_below`` gives siblings only to unsure drafts (a choice of the proposal's own).
    The diffusion drafter's drafts are independent, so its siblings carry branches (the chain's drafts after
    them), and drafts after a taken sibling were accepted; the other drafters' siblings are leaves."""
    events = []
    answers, stats = _sample(target, temperature, candidates, candidates_below=below, callback=events.append,
                             **drafters[kind])
    assert chi_square_pvalue(answers, sequential_distribution(target, PROMPT, GEN, temperature=temperature)) > ALPHA
    assert 0 < stats.accepted < stats.drafted and stats.siblings_taken > 0  # the siblings took part
    continued = sum(int(((e.branch > 0) & (e.num_accepted > e.branch_depth + 1)).sum()) for e in events)
    assert continued > 100 if kind == "diffusion" else continued == 0


@pytest.mark.parametrize("temperature", [1.0, 0.3])
def test_full_vocabulary_tree_never_corrects(temperature):
    """With every token a candidate, some candidate is accepted at each depth (the residual is spent): a
    round ends only after a full chain or an accepted alternative, never with a correction."""
    torch.manual_seed(4)
    n, width = 5000, 3
    draft_logits, target = torch.randn(n, width, VOCAB) * 3, torch.randn(n, width + 1, VOCAB) * 3
    generator = torch.Generator().manual_seed(0)
    flat = draft_logits.reshape(-1, VOCAB)
    drafts = sample_from_logits(flat, temperature, generator).view(n, width)
    alternatives = sample_more(flat, drafts.reshape(-1), VOCAB - 1, temperature, generator).view(n, width, -1)
    leaves = torch.randn(n, width, VOCAB - 1, VOCAB)
    result = verify_tree_logits(drafts, alternatives, draft_logits, target, leaves, temperature=temperature,
                                noise=Noise(generator=generator))
    assert bool(((result.branch > 0) | (result.num_accepted == width)).all())
    assert bool((result.branch > 0).any())


def test_more_candidates_than_tokens_are_none():
    """Asking for more draws than the vocabulary holds gives every other token once, then -1 (no error)."""
    logits = torch.randn(3, VOCAB)
    more = sample_more(logits, torch.tensor([0, 1, 2]), VOCAB + 2, 1.0, torch.Generator().manual_seed(0))
    assert more.shape == (3, VOCAB + 2) and bool((more[:, VOCAB - 1 :] == -1).all())
    for row, taken in enumerate([0, 1, 2]):
        assert sorted(more[row, : VOCAB - 1].tolist()) == [t for t in range(VOCAB) if t != taken]


@pytest.mark.parametrize("cache", ["auto", "none"])
@pytest.mark.parametrize("candidates", [2, 3])
def test_tree_greedy_equals_ar(target, drafters, cache, candidates):
    prompts = torch.tensor([[0, 2, 1, 0, 2], [3, 1, 1, 1, 1], [0, 0, 2, 0, 3]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1], [0, 1, 1, 1, 1]])
    common = dict(max_new_tokens=11, temperature=0.0, attention_mask=mask, eos_token_id=3)
    plain = dllm.generate(target, prompts, sampler="ar", **common).sequences
    for options, below in [(options, None) for options in drafters.values()] + [(drafters["causal"], 0.9)]:
        spec = dllm.generate(target, prompts, sampler="ar_spec", num_draft_tokens=3, draft_candidates=candidates,
                             candidates_below=below, cache=cache, **options, **common)
        assert torch.equal(spec.sequences, plain)


@pytest.mark.parametrize("cached", [False, True])
def test_tree_call_equals_plain_calls(target, cached):
    """Chain rows equal the chain-only call's; leaf (j, a) equals the target's next-token logits after the
    prefix, d_<j and the alternative, from a plain call (left padding in row 1)."""
    seq = torch.tensor([[0, 2, 1, 3, 0, 0, 0, 0, 0, 0, 0, 0], [1, 1, 3, 2, 2, 0, 0, 0, 0, 0, 0, 0]])
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :1] = 0
    length, rows = torch.tensor([4, 5]), torch.tensor([0, 1])
    drafts = torch.tensor([[1, 2, 3], [0, 3, 1]])
    alternatives = torch.tensor([[[0, 3], [1, 2], [2, 0]], [[2, 1], [0, 1], [3, 2]]])
    caller = Caller(target, DecodeStats(), attention_mask=mask)

    def cache():
        if not cached:
            return None
        kv = target.new_cache()
        target.forward_cached(seq[:, :3], kv, attention_mask=mask[:, :3])  # the prompt's first 3 columns
        return kv

    with torch.no_grad():
        chain, _ = _target_rows(caller, cache(), seq, rows, length, drafts)
        tree, leaves, _ = _tree_rows(caller, cache(), seq, rows, length, drafts, alternatives)
        torch.testing.assert_close(tree, chain, rtol=1e-4, atol=1e-4)
        for r in range(2):
            first = int((mask[r] == 0).sum())
            for j in range(3):
                for a in range(2):
                    ids = torch.cat([seq[r, first : length[r]], drafts[r, :j], alternatives[r, j, a : a + 1]])
                    plain = target(ids[None])[0, -1]
                    torch.testing.assert_close(leaves[r, j, a], plain, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("cached", [False, True])
@pytest.mark.parametrize("blind", [False, True])
def test_tree_branch_targets_equal_plain_calls(target, cached, blind, monkeypatch):
    """With independent drafts (branches), the target at depth i after alternative (j, a) equals the target's
    next-token logits after the prefix, d_<j, the alternative and d_{j+1} .. d_{i-1}, from a plain call (left
    padding in row 1); rows and depths past a row's drafts are never compared. ``blind``: branch tokens that see
    only themselves (the power case) do not."""
    if blind:  # in the module _tree_rows was imported from
        monkeypatch.setitem(_tree_rows.__globals__, "_branch_mask",
                            lambda owner, depth: torch.eye(owner.numel(), dtype=torch.bool))
    seq = torch.tensor([[0, 2, 1, 3, 0, 0, 0, 0, 0, 0, 0, 0], [1, 1, 3, 2, 2, 0, 0, 0, 0, 0, 0, 0]])
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :1] = 0
    length, rows = torch.tensor([4, 5]), torch.tensor([0, 1])
    drafts = torch.tensor([[1, 2, 3], [0, 3, 1]])
    alternatives = torch.tensor([[[0, 3], [1, -1], [2, 0]], [[2, -1], [0, 1], [-1, -1]]])
    draft = Draft(drafts, torch.randn(2, 3, VOCAB), torch.tensor([3, 2]), independent=True)
    caller = Caller(target, DecodeStats(), attention_mask=mask)
    kv = None
    if cached:
        kv = target.new_cache()
        target.forward_cached(seq[:, :3], kv, attention_mask=mask[:, :3])
    with torch.no_grad():
        chain, _ = _target_rows(caller, None, seq, rows, length, drafts)
        tree, branches, _ = _tree_rows(caller, kv, seq, rows, length, drafts, alternatives, branches=draft)
        torch.testing.assert_close(tree, chain, rtol=1e-4, atol=1e-4)
        differ = 0
        for r in range(2):
            first = int((mask[r] == 0).sum())
            for j in range(3):
                for a in range(2):
                    slot = int(branches.slot[r, j, a])
                    assert (slot >= 0) == bool(alternatives[r, j, a] >= 0)
                    if slot < 0:
                        continue
                    assert torch.equal(branches.tokens[slot, j + 1:], drafts[r, j + 1:])
                    for i in range(j + 1, int(draft.count[r]) + 1):  # up to the bonus after the row's drafts
                        ids = torch.cat([seq[r, first : length[r]], drafts[r, :j], alternatives[r, j, a : a + 1],
                                         drafts[r, j + 1 : i]])
                        plain = target(ids[None])[0, -1]
                        same = torch.allclose(branches.targets[slot, i], plain, rtol=1e-4, atol=1e-4)
                        differ += not same
                        assert same or blind
    assert (differ > 0) == blind


def test_tree_refusals_name_the_option(target, drafters):
    run = lambda model, **o: dllm.generate(model, PROMPT[None], sampler="ar_spec", max_new_tokens=3, **o)  # noqa: E731
    with pytest.raises(ValueError, match="draft_candidates"):
        run(target, drafter="ngram", draft_candidates=2)
    with pytest.raises(ValueError, match="draft_candidates=2 .*tree attention"):
        oracle = HMMOracle.random(num_states=2, num_tokens=VOCAB, seed=0)
        run(oracle.as_causal(), drafter=oracle.perturbed().as_causal(), draft_candidates=2)
    with pytest.raises(ValueError, match="draft_candidates"):
        run(target, draft_candidates=0, **drafters["causal"])
    with pytest.raises(ValueError, match="candidates_below .*needs draft_candidates > 1"):
        run(target, candidates_below=0.5, **drafters["causal"])
    with pytest.raises(ValueError, match="candidates_below"):
        run(target, draft_candidates=2, candidates_below=1.5, **drafters["causal"])


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def hf_pair(request, tmp_path_factory):
    """A tiny random Hugging Face causal target (transformers' own modelling code) and a second one as its drafter."""
    from fixtures.hf import builders

    from dllm.models.loading import load

    target = load(builders.save_causal(tmp_path_factory.mktemp("target"), request.param, seed=0))
    drafter = load(builders.save_causal(tmp_path_factory.mktemp("drafter"), request.param, seed=1))
    return target, drafter


def test_hf_target_tree_call_and_greedy(hf_pair):
    """A transformers causal LM verifies a tree through a custom 4-D mask: leaf logits and branch targets equal
    plain calls, and greedy ar_spec with trees equals ar token for token (left padding, with and without cache)."""
    target, drafter = hf_pair
    assert target.capabilities.tree_attention
    seq = torch.randint(3, 40, (2, 14), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 14, dtype=torch.long)
    mask[1, :2] = 0
    length, rows = torch.tensor([5, 6]), torch.tensor([0, 1])
    drafts = torch.randint(3, 40, (2, 3), generator=torch.Generator().manual_seed(1))
    alternatives = torch.randint(3, 40, (2, 3, 2), generator=torch.Generator().manual_seed(2))
    kv = target.new_cache()
    target.forward_cached(seq[:, :4], kv, attention_mask=mask[:, :4])
    _, leaves, _ = _tree_rows(Caller(target, DecodeStats(), attention_mask=mask), kv, seq, rows, length, drafts,
                              alternatives)
    for r in range(2):
        first = int((mask[r] == 0).sum())
        for j in range(3):
            ids = torch.cat([seq[r, first : length[r]], drafts[r, :j], alternatives[r, j, 1:]])
            torch.testing.assert_close(leaves[r, j, 1], target(ids[None])[0, -1], rtol=1e-4, atol=1e-4)
    # Branches (independent drafts): the target at depth i after alternative (j, a) and d_{j+1} .. d_{i-1}.
    kv = target.new_cache()
    target.forward_cached(seq[:, :4], kv, attention_mask=mask[:, :4])
    draft = Draft(drafts, torch.zeros(2, 3, target.vocab_size), torch.tensor([3, 3]), independent=True)
    _, branches, _ = _tree_rows(Caller(target, DecodeStats(), attention_mask=mask), kv, seq, rows, length, drafts,
                                alternatives, branches=draft)
    for r in range(2):
        first = int((mask[r] == 0).sum())
        for j in range(3):
            slot = int(branches.slot[r, j, 1])
            for i in range(j + 1, 4):
                ids = torch.cat([seq[r, first : length[r]], drafts[r, :j], alternatives[r, j, 1:],
                                 drafts[r, j + 1 : i]])
                torch.testing.assert_close(branches.targets[slot, i], target(ids[None])[0, -1], rtol=1e-4,
                                           atol=1e-4)
    prompts, pmask = seq[:, :6], mask[:, :6]
    common = dict(max_new_tokens=10, temperature=0.0, attention_mask=pmask)
    plain = dllm.generate(target, prompts, sampler="ar", **common).sequences
    for cache in ("auto", "none"):
        spec = dllm.generate(target, prompts, sampler="ar_spec", drafter=drafter, num_draft_tokens=3,
                             draft_candidates=3, cache=cache, **common)
        assert torch.equal(spec.sequences, plain)
