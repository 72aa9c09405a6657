"""The public API: every sampler runs, outputs and stats are well formed, and bad input is refused clearly."""

import pytest
import torch

import dllm
from dllm.samplers import SAMPLERS

ORACLE = dllm.HMMOracle.random(num_states=3, num_tokens=5, seed=1)
PROMPTS = torch.tensor([[0, 1, 2], [3, 3, 4]])

RUNS = [
    ("ar", {}),
    ("ar_spec", {}),
    ("ar_spec", {"drafter": ORACLE.perturbed().as_causal(), "num_draft_tokens": 2}),
    ("ar_spec", {"drafter": ORACLE.perturbed()}),
    ("llada", {"steps": 4, "block_length": 4}),
    ("llada", {"remasking": "random", "cfg_scale": 1.0}),
    ("dream", {"alg": "origin"}),
    ("dream", {"alg": "maskgit_plus", "steps": 4}),
    ("dream", {"alg": "topk_margin", "top_p": 0.9, "top_k": 3}),
    ("dream", {"alg": "entropy", "alg_temp": 0.5}),
    ("fast_dllm", {"threshold": 0.5, "block_length": 4}),
    ("fast_dllm", {"factor": 1.0}),
    ("eb", {"gamma": 0.1}),
    ("sequential", {"order": "confidence", "block_length": 2}),
    ("fef", {}),
    ("fef", {"window": 3, "draft": "stale", "order": "confidence", "block_length": 4}),
]


def model_for(sampler):
    return ORACLE.as_causal() if sampler.startswith("ar") else ORACLE


@pytest.mark.parametrize("sampler,options", RUNS)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_sampler_runs(sampler, options, temperature):
    out = dllm.generate(model_for(sampler), PROMPTS, sampler=sampler, max_new_tokens=8, temperature=temperature,
                        generator=torch.Generator().manual_seed(0), **options)
    assert out.sequences.shape == (2, 11)
    assert torch.equal(out.sequences[:, :3], PROMPTS)
    answer = out.sequences[:, 3:]
    assert bool((answer >= 0).all()) and bool((answer < ORACLE.mask_token_id).all())  # never the mask token
    stats = out.stats
    assert stats.new_tokens == 16 and stats.nfe >= 1 and stats.wall_time_s > 0
    assert stats.forward_tokens >= stats.nfe * 11 // 2
    assert stats.tokens_per_call == pytest.approx(16 / stats.nfe)
    assert stats.mean_acceptance_length == pytest.approx(stats.new_tokens / stats.rounds)
    assert stats.undrafted_tokens <= stats.new_tokens and stats.draft_rounds <= stats.rounds
    assert out.exact == SAMPLERS[sampler].exact


def test_tokens_per_draft_round_leaves_out_rounds_without_drafts():
    """EAGLE's tau: a round with nothing to verify (a first call after the prompt) is not a drafting round."""
    stats = dllm.DecodeStats()
    stats.count_verification(torch.tensor([0, 0]), torch.tensor([0, 0]), torch.tensor([1, 1]))  # first calls
    stats.count_verification(torch.tensor([4, 4]), torch.tensor([4, 1]), torch.tensor([5, 2]))
    assert (stats.rounds, stats.draft_rounds, stats.undrafted_tokens) == (4, 2, 2)
    assert stats.mean_acceptance_length == pytest.approx(9 / 4)
    assert stats.tokens_per_draft_round == pytest.approx(7 / 2)
    assert (stats + stats).tokens_per_draft_round == pytest.approx(7 / 2)
    assert stats.to_dict()["tokens_per_draft_round"] == pytest.approx(7 / 2)


def test_tokens_per_draft_round_counts_the_answer_only():
    """Tokens a round emits past a row's EOS are not tokens of the answer (``new_tokens``), nor of tau."""
    from dllm.data.synthetic import format_example, heldout_set
    from dllm.data.tokenizer import load_tokenizer

    model = dllm.load("two_stream")
    tokenizer = load_tokenizer(dllm.models.loading.SHIPPED / "two_stream" / "tokenizer.json")
    ids = tokenizer(format_example(heldout_set()[1]["question"]), add_special_tokens=False)["input_ids"]
    out = dllm.generate(model, torch.tensor([ids]), sampler="fef", max_new_tokens=64, temperature=0.0, window=8)
    stats = out.stats
    assert stats.new_tokens < 64  # the answer stops at EOS inside a round (that round emitted 9 tokens)
    assert stats.draft_rounds == stats.rounds - 1  # the first call has nothing to verify
    assert stats.tokens_per_draft_round == pytest.approx((stats.new_tokens - 1) / (stats.rounds - 1))
    assert stats.tokens_per_draft_round <= 9  # window 8 + the correction


def test_same_generator_seed_replays():
    a = dllm.generate(ORACLE, PROMPTS, sampler="fef", max_new_tokens=8, generator=torch.Generator().manual_seed(5))
    b = dllm.generate(ORACLE, PROMPTS, sampler="fef", max_new_tokens=8, generator=torch.Generator().manual_seed(5))
    assert torch.equal(a.sequences, b.sequences)
    c = dllm.generate(ORACLE, PROMPTS, sampler="fef", max_new_tokens=8)
    assert c.seed is not None
    d = dllm.generate(ORACLE, PROMPTS, sampler="fef", max_new_tokens=8,
                      generator=torch.Generator().manual_seed(c.seed))
    assert torch.equal(c.sequences, d.sequences)


def test_fef_stats_show_verification_cost():
    out = dllm.generate(ORACLE, PROMPTS, sampler="fef", max_new_tokens=8, window=4,
                        generator=torch.Generator().manual_seed(0))
    s = out.stats
    # marginal drafts: every row-round costs one call on the state plus one verification call
    assert s.row_calls == 2 * s.rounds
    assert s.forward_tokens > s.nfe * 11  # verification copies are counted, not hidden
    assert len(s.acceptance_per_position) == 4 and s.acceptance_per_position[0] == 1.0
    assert s.accepted <= s.drafted


def test_stats_add_and_dict():
    a = dllm.generate(ORACLE, PROMPTS, sampler="fef", max_new_tokens=8, generator=torch.Generator().manual_seed(0))
    b = dllm.generate(ORACLE, PROMPTS, sampler="sequential", max_new_tokens=8)
    total = a.stats + b.stats
    assert total.new_tokens == 32 and total.nfe == a.stats.nfe + b.stats.nfe
    d = total.to_dict()
    for key in ("nfe", "nfe_draft", "forward_tokens", "new_tokens", "rounds", "drafted", "accepted",
                "mean_acceptance_length", "acceptance_per_position", "tokens_per_call", "wall_time_s"):
        assert key in d


BAD = [
    (dict(sampler="nope"), ValueError, "sampler must be one of"),
    (dict(sampler="fef", window=0), ValueError, "window must be >= 1"),
    (dict(sampler="fef", windw=2), TypeError, "unknown option"),
    (dict(sampler="fef", order="random"), ValueError, "order must be one of"),
    (dict(sampler="llada", block_length=3), ValueError, "block_length=3 must divide max_new_tokens=8"),
    (dict(sampler="llada", block_length=2, steps=2), ValueError, "steps=2 must be a positive multiple"),
    (dict(sampler="llada", remasking="high"), ValueError, "remasking must be one of"),
    (dict(sampler="dream", top_p=1.5), ValueError, "top_p must lie in"),
    (dict(sampler="fast_dllm", threshold=0.9, factor=1.0), ValueError, "either threshold or factor"),
    (dict(sampler="fef", temperature=-1.0), ValueError, "temperature must be finite and >= 0"),
    (dict(sampler="fef", max_new_tokens=0), ValueError, "max_new_tokens must be >= 1"),
    (dict(sampler="fef", max_new_tokens=2.5), TypeError, "max_new_tokens must be an int"),
    (dict(sampler="fef", generator=0), TypeError, "generator must be a torch.Generator"),
    (dict(sampler="ar"), TypeError, "needs a CausalModel"),
    (dict(sampler="ar_spec", drafter="lookup"), TypeError, "needs a CausalModel"),
]


@pytest.mark.parametrize("kwargs,error,message", BAD)
def test_bad_arguments(kwargs, error, message):
    kwargs = {"max_new_tokens": 8, **kwargs}
    with pytest.raises(error, match=message):
        dllm.generate(ORACLE, PROMPTS, **kwargs)


def test_bad_inputs():
    with pytest.raises(ValueError, match="must not contain the mask token"):
        dllm.generate(ORACLE, torch.tensor([[0, ORACLE.mask_token_id]]), max_new_tokens=4)
    with pytest.raises(ValueError, match="shape \\[batch, prompt_length\\]"):
        dllm.generate(ORACLE, torch.tensor([0, 1]), max_new_tokens=4)
    with pytest.raises(TypeError, match="integer token ids"):
        dllm.generate(ORACLE, torch.zeros(1, 2), max_new_tokens=4)
    with pytest.raises(ValueError, match="must lie in \\[0, vocab_size=6\\)"):
        dllm.generate(ORACLE, torch.tensor([[0, 9]]), max_new_tokens=4)
    with pytest.raises(ValueError, match="at least one token for a causal model"):
        dllm.generate(ORACLE.as_causal(), torch.zeros((1, 0), dtype=torch.long), sampler="ar", max_new_tokens=4)
    with pytest.raises(ValueError, match="drafter must be 'ngram'"):
        dllm.generate(ORACLE.as_causal(), PROMPTS, sampler="ar_spec", drafter="lookup", max_new_tokens=4)
    other = dllm.HMMOracle.random(num_states=2, num_tokens=3)
    with pytest.raises(ValueError, match="drafter vocabulary \\(4\\) differs"):
        dllm.generate(ORACLE.as_causal(), PROMPTS, sampler="ar_spec", drafter=other, max_new_tokens=4)
    with pytest.raises(TypeError, match="needs a DiffusionModel"):
        dllm.generate(ORACLE.as_causal(), PROMPTS, sampler="fef", max_new_tokens=4)


def test_model_returning_wrong_shape_is_reported():
    class Broken:
        mask_token_id, vocab_size = 5, 6

        def __call__(self, ids):
            return torch.zeros(ids.shape[0], 6)

    with pytest.raises(ValueError, match="expected \\[B, L, V\\]"):
        dllm.generate(Broken(), PROMPTS, max_new_tokens=4)


def test_protocols_are_runtime_checkable():
    assert isinstance(ORACLE, dllm.DiffusionModel)
    assert isinstance(ORACLE.as_causal(), dllm.CausalModel)


@pytest.mark.parametrize("sampler,options", [
    ("fef", {"window": 3}), ("fef", {"draft": "stale", "order": "confidence", "block_length": 4}),
    ("sequential", {}), ("llada", {"steps": 4}), ("dream", {"alg": "origin"}), ("dream", {"alg_temp": 0.5}),
    ("fast_dllm", {"threshold": 0.5}), ("eb", {}), ("ar", {}), ("ar_spec", {}),
    ("ar_spec", {"drafter": ORACLE.perturbed()}), ("ar_spec", {"drafter": ORACLE.perturbed().as_causal()}),
])
def test_per_row_generators_make_rows_batch_invariant(sampler, options):
    """With one generator per row, a row's sample does not depend on what else is in the batch."""
    model = model_for(sampler)
    rows = torch.tensor([[0, 1, 2], [3, 3, 4], [2, 2, 1]])
    seeds = [11, 22, 33]
    batch = dllm.generate(model, rows, sampler=sampler, max_new_tokens=8, **options,
                          generator=[torch.Generator().manual_seed(s) for s in seeds])
    for i in (0, 2):
        alone = dllm.generate(model, rows[i : i + 1], sampler=sampler, max_new_tokens=8, **options,
                              generator=[torch.Generator().manual_seed(seeds[i])])
        assert torch.equal(batch.sequences[i], alone.sequences[0]), (sampler, i)
    with pytest.raises(TypeError, match="one torch.Generator per row"):
        dllm.generate(model, rows, sampler=sampler, max_new_tokens=8, generator=[torch.Generator()])


def test_generate_builds_no_autograd_graph():
    """Decoding runs without autograd whatever the caller's mode (and leaves the caller's mode alone)."""
    oracle = dllm.HMMOracle.random(num_states=3, num_tokens=6, seed=0)
    modes = []

    class Spy:  # a DiffusionModel that notes the grad mode of each call
        mask_token_id, vocab_size = oracle.mask_token_id, oracle.vocab_size

        def __call__(self, *args, **kwargs):
            modes.append(torch.is_grad_enabled())
            return oracle(*args, **kwargs)

    assert torch.is_grad_enabled()
    dllm.generate(Spy(), torch.tensor([[0, 1]]), sampler="sequential", max_new_tokens=3)
    assert modes and not any(modes) and torch.is_grad_enabled()
