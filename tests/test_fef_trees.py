"""fef's draft trees with the copies verifier (``draft_candidates`` > 1 on a model that verifies with block
copies: ``samplers/fef/trees.py: CopyTree``): each sibling roots a branch drafted after it, and every branch depth
brings one copy of the block with its path revealed. The law stays ``sequential``'s.

Chi-square against the enumerated chain on an order-dependent model (so a copy that reveals the wrong tokens
is seen) with marginal, stale and random-head drafts, c = 2 and 3, T = 1 and 0.7, in blocks, and on a real
block-causal transformer with the block cache; a power test where the branch copies do not reveal their
continuation fails; greedy equals ``sequential`` token for token (ragged batch, EOS, windows longer than the
answer, EOS); rows are batch-invariant with per-row generators; refusals name the option.
"""

import itertools

import pytest
import torch
from test_fef_head import WithFeatures, random_head, tiny_block_causal

import dllm
import dllm.samplers.fef.round as fef_module
from dllm.models.oracle import HMMOracle, InconsistentModel
from dllm.samplers import sequential_distribution

from stat_tools import ALPHA, chi_square_pvalue

N_SAMPLES = 12000
PROMPT = torch.tensor([0, 2])
GEN = 4


@pytest.fixture(scope="module")
def model():
    oracle = HMMOracle.random(num_states=3, num_tokens=3, seed=0, stickiness=2.0, sharpness=2.0)
    return WithFeatures(InconsistentModel(oracle, scale=1.0, seed=3))


def _spy(monkeypatch):
    """Rows that took a sibling, and those that also accepted continuation drafts after it (appended per round)."""
    taken, continued, real = [], [], fef_module.rejection_sample

    def spy(*args, **kwargs):
        outcome = real(*args, **kwargs)
        if outcome.branch is not None:
            took = outcome.branch > 0
            taken.append(int(took.sum()))
            continued.append(int((outcome.num_accepted > outcome.branch_depth + 1)[took].sum()))
        return outcome

    monkeypatch.setattr(fef_module, "rejection_sample", spy)
    return taken, continued


def _sample(model, temperature, n=N_SAMPLES, seed=0, **options):
    with torch.no_grad():
        out = dllm.generate(model, PROMPT.expand(n, -1), sampler="fef", max_new_tokens=GEN, temperature=temperature,
                            generator=torch.Generator().manual_seed(seed), **options)
    return out


@pytest.mark.parametrize("draft,candidates,below,window,block,temperature", [
    ("marginal", 2, None, 4, 4, 1.0),
    ("marginal", 3, None, 3, 4, 0.7),
    ("stale", 2, 0.8, 4, 2, 1.0),
    ("head", 2, None, 4, 4, 0.7),
    ("head", 3, None, 4, 2, 1.0),
])
def test_copy_trees_are_exact(model, monkeypatch, draft, candidates, below, window, block, temperature):
    taken, continued = _spy(monkeypatch)
    head = {"draft_head": random_head(model.vocab_size, model.mask_token_id, 8)} if draft == "head" else {}
    out = _sample(model, temperature, window=window, block_length=block, draft=draft, draft_candidates=candidates,
                  candidates_below=below, **head)
    law = sequential_distribution(model, PROMPT, GEN, temperature=temperature, block_length=block)
    assert out.exact and out.stats.siblings_taken == sum(taken) > 500
    assert sum(continued) >= (100 if window > 2 and block > 2 else 0)
    assert chi_square_pvalue(out.sequences[:, PROMPT.numel():], law) > ALPHA


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_copy_trees_exact_with_block_cache(temperature):
    """A real (random) block-causal transformer (blocks of 4) through the block cache, with a random head."""
    model = tiny_block_causal(block_size=4)
    head = random_head(5, 2, 32, seed=1, scale=1.0)
    prompt = torch.tensor([0, 3])
    with torch.no_grad():
        expected = sequential_distribution(model, prompt, 4, block_length=4, temperature=temperature)
        out = dllm.generate(model, prompt.expand(6000, -1), sampler="fef", max_new_tokens=4, block_length=4,
                            window=3, cache="block", draft="head", draft_head=head, temperature=temperature,
                            draft_candidates=2, generator=torch.Generator().manual_seed(0))
    assert out.options["cache"] == "block" and out.stats.siblings_taken > 100
    assert chi_square_pvalue(out.sequences[:, 2:], expected) > ALPHA


def test_branch_copies_that_hide_their_continuation_fail(model, monkeypatch):
    """The test has power: branch copies that reveal the sibling but not the continuation drafts after it (so
    the targets there condition on the wrong prefix) are not the chain."""
    real = fef_module.CopyTree.add_copies

    def hiding(self, x, positions, count, copies, row_of):
        path = self.path.clone()
        steps = torch.arange(path.shape[1])
        self.path = torch.where(steps[None, :] > self.slot_depth[:, None], model.mask_token_id, path)
        try:
            return real(self, x, positions, count, copies, row_of)
        finally:
            self.path = path

    monkeypatch.setattr(fef_module.CopyTree, "add_copies", hiding)
    out = _sample(model, 1.0, window=4, block_length=4, draft_candidates=3)
    law = sequential_distribution(model, PROMPT, GEN, block_length=4)
    assert chi_square_pvalue(out.sequences[:, PROMPT.numel():], law) < ALPHA


@pytest.mark.parametrize("options", [{"draft_candidates": 3}, {"draft_candidates": 3, "draft": "stale"},
                                     {"draft_candidates": 2, "draft": "head"}, {"draft_candidates": 9}])
@pytest.mark.parametrize("window,new", [(3, 9), (8, 5)])
def test_greedy_copy_trees_equal_greedy_sequential(model, monkeypatch, options, window, new):
    """Token for token, with EOS stops in the batch (the rows finish apart), and windows longer than the
    answer; siblings were taken (the spy); more candidates than tokens is every token."""
    taken, _ = _spy(monkeypatch)
    ids = torch.tensor(list(itertools.product(range(3), repeat=3)))  # every prompt of 3 tokens
    wants_head = options.get("draft") == "head"
    head = {"draft_head": random_head(model.vocab_size, model.mask_token_id, 8)} if wants_head else {}
    common = dict(max_new_tokens=new, temperature=0, eos_token_id=0)
    with torch.no_grad():
        reference = dllm.generate(model, ids, sampler="sequential", **common).sequences
        tree = dllm.generate(model, ids, sampler="fef", window=window, **options, **head, **common).sequences
    assert torch.equal(reference, tree)
    assert sum(taken) >= 3


def test_copy_tree_rows_are_batch_invariant(model):
    """With one generator per row, a row's draws (siblings, a head's branch drafts, both verification stages)
    do not depend on its batch mates."""
    prompts = [[1, 0, 0], [2, 1, 1], [0, 1, 1], [1, 2, 2], [2, 2, 1], [0, 0, 1]] * 3
    ids, width = torch.tensor(prompts), 3
    head = random_head(model.vocab_size, model.mask_token_id, 8)
    common = dict(sampler="fef", max_new_tokens=6, temperature=1.0, eos_token_id=None, window=3, draft="head",
                  draft_head=head, draft_candidates=3, candidates_below=0.9)
    with torch.no_grad():
        batch = dllm.generate(model, ids, **common,
                              generator=[torch.Generator().manual_seed(100 + i) for i in range(len(prompts))])
        for row, prompt in enumerate(prompts):
            alone = dllm.generate(model, torch.tensor([prompt]), **common,
                                  generator=[torch.Generator().manual_seed(100 + row)])
            assert torch.equal(batch.sequences[row, width:], alone.sequences[0, len(prompt):]), row


def test_copy_tree_refusals_name_the_option(model):
    with pytest.raises(ValueError, match="draft_candidates=2 runs with order='left_to_right' only"):
        _sample(model, 1.0, n=1, order="confidence", draft_candidates=2)
