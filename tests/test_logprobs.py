"""The probability of what was sampled: ``generate(logprobs=True)`` and ``dllm.score``.

Every exact sampler's per-token log-probabilities sum to the log-probability of its answer under the enumerated law
of the chain it samples (per sample, not in distribution), ``score`` gives the same numbers on the same sequences,
and an approximate sampler's numbers (the marginals it committed from) do not. The chi-square suites check the same
on every configuration they cover (``stat_tools.check_logprobs``, asked for by tests/conftest.py).
"""

import math

import pytest
import torch

import dllm
from dllm.models.oracle import HMMOracle, InconsistentModel
from dllm.models.transformer import TransformerConfig, TransformerLM
from dllm.samplers import sequential_distribution

import stat_tools
from stat_tools import ALPHA, chi_square_pvalue

PROMPT = torch.tensor([0, 2])
GEN = 4
ROWS = 48


@pytest.fixture(scope="module")
def oracle():
    return HMMOracle.random(num_states=3, num_tokens=3, seed=0, stickiness=2.0, sharpness=2.0)


class Float64(InconsistentModel):
    """The inconsistent oracle (orders disagree) answering in float64, so the law enumerated from it is exact to
    float64 and the logprobs' own float32 rounding is what the comparison measures."""

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().__call__(input_ids).double()


def _relative_errors(out, laws: list[dict], start: int, gen: int) -> list[float]:
    """|exp(sum of a row's logprobs) / law(its answer) - 1| for every row (laws: one per row)."""
    answers = out.sequences[:, start : start + gen].tolist()
    sums = out.logprobs[:, :gen].double().sum(dim=1).tolist()
    return [abs(math.exp(total) / law[tuple(answer)] - 1) for answer, total, law in zip(answers, sums, laws)]


EXACT = [
    ("sequential", {}), ("sequential", {"order": "confidence"}),
    ("fef", {"window": 2}), ("fef", {"window": 4, "draft": "stale"}), ("fef", {"window": 3, "order": "confidence"}),
    ("fef", {"window": 3, "draft": "stale", "order": "confidence", "block_length": 2}),
    ("fef", {"window": 3, "draft_cutoff": 0.5}),
]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("sampler,options", EXACT)
def test_each_sample_has_the_chains_probability(oracle, sampler, options, temperature):
    model = Float64(oracle, scale=1.0, seed=3)
    law = sequential_distribution(model, PROMPT, GEN, temperature=temperature, block_length=options.get("block_length"),
                                  order=options.get("order", "left_to_right"))
    out = dllm.generate(model, PROMPT.expand(ROWS, -1), sampler=sampler, max_new_tokens=GEN, temperature=temperature,
                        generator=torch.Generator().manual_seed(1), logprobs=True, **options)
    assert out.exact and out.logprobs.dtype == torch.float32 and out.logprobs.shape == (ROWS, GEN)
    assert max(_relative_errors(out, [law] * ROWS, 2, GEN)) <= 1e-5


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("sampler,drafter", [("ar", None), ("ar_spec", "ngram"), ("ar_spec", "causal"),
                                             ("ar_spec", "diffusion")])
def test_each_ar_sample_has_the_chains_probability(oracle, sampler, drafter, temperature):
    target = oracle.as_causal()
    drafters = {"ngram": "ngram", "causal": oracle.perturbed(0.5).as_causal(), "diffusion": oracle.perturbed(0.5)}
    options = {} if drafter is None else {"drafter": drafters[drafter], "num_draft_tokens": 3}
    law = sequential_distribution(target, PROMPT, GEN, temperature=temperature)
    out = dllm.generate(target, PROMPT.expand(ROWS, -1), sampler=sampler, max_new_tokens=GEN, temperature=temperature,
                        generator=torch.Generator().manual_seed(2), logprobs=True, **options)
    assert max(_relative_errors(out, [law] * ROWS, 2, GEN)) <= 1e-5


def tiny(layout: str, seed: int = 4) -> TransformerLM:
    """A random transformer with 5 tokens (one the mask), spread out enough that every answer is likely."""
    torch.manual_seed(seed)
    config = TransformerConfig(vocab_size=5, dim=16, n_layers=2, n_heads=2, max_seq_len=32, layout=layout,
                               block_size=2 if layout == "block_causal" else None,
                               mask_token_id=None if layout == "causal" else 2, eos_token_id=None)
    return TransformerLM(config).eval()


RAGGED = torch.tensor([[0, 3, 4], [0, 0, 3]])  # the second row left-padded
RAGGED_MASK = torch.tensor([[1, 1, 1], [0, 1, 1]])


@pytest.mark.parametrize("layout,sampler,options", [
    ("bidirectional", "fef", {"window": 3}), ("block_causal", "fef", {"window": 2, "block_length": 2}),
    ("block_causal", "sequential", {"block_length": 2}), ("block_causal", "fef", {"draft": "stale", "block_length": 2}),
    ("causal", "ar", {}), ("causal", "ar_spec", {"drafter": "ngram", "num_draft_tokens": 2}),
])
def test_ragged_rows_each_have_their_own_chains_probability(layout, sampler, options):
    model = tiny(layout)
    gen = 4
    with torch.no_grad():
        laws = [sequential_distribution(model, RAGGED[i][RAGGED_MASK[i].bool()], gen,
                                        block_length=options.get("block_length"), temperature=0.8) for i in range(2)]
        out = dllm.generate(model, RAGGED.repeat(16, 1), attention_mask=RAGGED_MASK.repeat(16, 1), sampler=sampler,
                            max_new_tokens=gen, temperature=0.8, generator=torch.Generator().manual_seed(0),
                            logprobs=True, **options)
        assert max(_relative_errors(out, laws * 16, 3, gen)) <= 1e-4  # a float32 model
        scored = dllm.score(model, RAGGED.repeat(16, 1), out.sequences[:, 3:], attention_mask=RAGGED_MASK.repeat(16, 1),
                            temperature=0.8, **({"block_length": 2} if layout == "block_causal" else {}))
    assert torch.allclose(scored.logprobs, out.logprobs, atol=1e-5, rtol=0)


def test_an_approximate_sampler_reports_marginals_that_are_not_the_samples_probability(oracle):
    """The adversarial case: LLaDA with two tokens a step samples the product of marginals. Its logprobs are the
    marginals it drew from (their sum is its own sample's probability), not the chain's: against the chain's law
    they are off, and generate says the run is approximate."""
    law = oracle.exact_joint(PROMPT, GEN)
    out = dllm.generate(oracle, PROMPT.expand(ROWS, -1), sampler="llada", steps=2, max_new_tokens=GEN, temperature=1.0,
                        generator=torch.Generator().manual_seed(0), logprobs=True)
    assert not out.exact
    assert max(_relative_errors(out, [law] * ROWS, 2, GEN)) > 0.05


def test_the_chi_square_suites_check_logprobs_too(oracle):
    """conftest asks every generate of a chi-square module for logprobs, and a passing chi-square test checks them:
    an exact run is checked (and re-scored), a wrong law is not judged on them."""
    stat_tools.LOGPROB_CHECKS.clear()
    out = dllm.generate(oracle, PROMPT.expand(4000, -1), sampler="fef", window=3, max_new_tokens=GEN, temperature=1.0,
                        generator=torch.Generator().manual_seed(0))
    assert out.logprobs is not None  # asked for by the fixture
    assert chi_square_pvalue(out.sequences[:, 2:], oracle.exact_joint(PROMPT, GEN)) > ALPHA
    assert len(stat_tools.LOGPROB_CHECKS) == 1 and stat_tools.LOGPROB_CHECKS[0].startswith("fef")
    tampered = out.logprobs.clone()
    out.logprobs[:, 0] = out.logprobs[:, 1]  # a record that reports the wrong position's number fails the check
    with pytest.raises(AssertionError):
        stat_tools.check_logprobs(out.sequences[:, 2:], oracle.exact_joint(PROMPT, GEN))
    out.logprobs.copy_(tampered)


def test_modes_temperature_zero_and_top_logprobs(oracle):
    model = Float64(oracle, scale=1.0, seed=3)
    prompts = PROMPT.expand(8, -1)
    seeded = dict(max_new_tokens=GEN, generator=torch.Generator().manual_seed(0), logprobs=True, top_logprobs=3)
    sampled = dllm.generate(model, prompts, temperature=0.7, **seeded)
    seeded["generator"] = torch.Generator().manual_seed(0)
    raw = dllm.generate(model, prompts, temperature=0.7, logprobs_mode="raw", **seeded)
    assert torch.equal(sampled.sequences, raw.sequences) and raw.logprobs_mode == "raw"
    assert not torch.allclose(sampled.logprobs, raw.logprobs)
    assert torch.allclose(raw.logprobs, dllm.score(model, prompts, raw.sequences[:, 2:], temperature=1.0).logprobs,
                          atol=1e-6)  # raw: the model's own law, the chain at temperature 1
    # top-K: sorted, a distribution's K largest (3 tokens and the mask, which is never a candidate)
    assert torch.all(sampled.top_logprobs[..., :-1] >= sampled.top_logprobs[..., 1:])
    assert torch.allclose(sampled.top_logprobs.exp().sum(-1), torch.ones(8, GEN), atol=1e-5)
    assert not (sampled.top_token_ids == model.mask_token_id).any()
    # T = 0: the law sampled is a point mass; the record reports the temperature-1 law, whose argmax is the token
    greedy = dllm.generate(model, prompts, temperature=0.0, max_new_tokens=GEN, logprobs=True, top_logprobs=1)
    answer = greedy.sequences[:, 2:]
    assert torch.equal(greedy.top_token_ids[..., 0], answer)
    assert torch.allclose(greedy.logprobs, greedy.top_logprobs[..., 0])
    scored = dllm.score(model, prompts, answer, temperature=0.0)
    assert scored.is_greedy.all() and torch.allclose(scored.logprobs, greedy.logprobs, atol=1e-6)
    other = answer.clone()
    other[:, 1] = (other[:, 1] + 1) % 3
    assert not dllm.score(model, prompts, other).is_greedy.any()


def test_stops_end_the_logprobs_and_the_score_checks_the_fill():
    model = tiny("bidirectional", seed=1)
    with torch.no_grad():
        out = dllm.generate(model, RAGGED[:1].expand(64, -1), sampler="fef", window=3, max_new_tokens=4,
                            temperature=1.0, eos_token_id=[3, 4], generator=torch.Generator().manual_seed(0),
                            logprobs=True, top_logprobs=2)
        answers = out.sequences[:, 3:]
        lengths = dllm.stops.answer_lengths(answers, (3, 4))
        assert (lengths < 4).any()  # some rows stopped early
        past = torch.arange(4)[None, :] >= lengths[:, None]
        assert torch.all(out.logprobs[past] == 0) and torch.all(out.top_token_ids[past] == -1)
        assert torch.all(out.logprobs[~past] < 0)
        scored = dllm.score(model, RAGGED[:1].expand(64, -1), answers, eos_token_id=[3, 4], temperature=1.0)
        assert torch.allclose(scored.logprobs, out.logprobs, atol=1e-5) and torch.equal(scored.lengths, lengths)
        assert torch.allclose(scored.total, out.logprobs.double().sum(1), atol=1e-5)
        row = int(lengths.argmin())
        wrong = answers[row : row + 1].clone()
        wrong[0, -1] = 0  # not the fill after the stop: the chain cannot produce it
        assert dllm.score(model, RAGGED[:1], wrong, eos_token_id=[3, 4]).logprobs[0, -1] == float("-inf")


def test_score_is_the_sum_of_the_sequential_conditionals_one_call_at_a_time():
    """Brute force, independent of the samplers: token j's conditional read from the model on the canvas with the
    prompt and c_<j revealed and the rest masked (bidirectional), or in blocks (block-causal)."""
    for layout in ("bidirectional", "block_causal"):
        model = tiny(layout, seed=2)
        prompt, cont = torch.tensor([[0, 3, 4]]), torch.tensor([[1, 4, 3, 0, 1, 3]])
        canvas = torch.cat([prompt, torch.full_like(cont, 2)], dim=1)
        extra = {"block_offset": torch.tensor([3])} if layout == "block_causal" else {}
        expected = []
        with torch.no_grad():
            for j in range(cont.shape[1]):
                logits = model(canvas, **extra)[0, 3 + j].double()
                logits[2] = -math.inf
                expected.append(torch.log_softmax(logits, -1)[cont[0, j]].item())
                canvas[0, 3 + j] = cont[0, j]
            got = dllm.score(model, prompt, cont, eos_token_id=None,
                             **({"block_length": 2} if layout == "block_causal" else {}))
        assert max(abs(a - b) for a, b in zip(got.logprobs[0].tolist(), expected)) <= 1e-5, layout
        calls = 1 if layout == "bidirectional" else 1 + 3  # one copies call; the prompt's fill + a call per block
        assert got.stats.nfe == calls, (layout, got.stats.nfe)


def test_score_on_the_shipped_block_causal_model_costs_a_call_per_block():
    model = dllm.load("diffusion", dtype=torch.float32)
    tokenizer = model.tokenizer
    texts = ["Question: Tom has 3 bags with 4 apples each. How many apples does Tom have?\nAnswer:",
             "Question: Zoe has 19 cards and gives away 4. How many cards does Zoe have now?\nAnswer:"]
    ids = [tokenizer(t)["input_ids"] for t in texts]
    width = max(map(len, ids))
    prompts = torch.tensor([[0] * (width - len(i)) + i for i in ids])
    mask = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids])
    out = dllm.generate(model, prompts, attention_mask=mask, max_new_tokens=32, temperature=1.0, logprobs=True,
                        generator=torch.Generator().manual_seed(0))
    scored = dllm.score(model, prompts, out.sequences[:, width:], attention_mask=mask)
    assert torch.allclose(scored.logprobs, out.logprobs, atol=1e-5)
    blocks = 32 // model.block_size
    assert scored.stats.nfe <= blocks + 1  # the prompt's fill, then one call per block for the whole batch


def test_bad_arguments_name_the_parameter(oracle):
    prompts = PROMPT[None]
    with pytest.raises(ValueError, match="top_logprobs=2 needs logprobs=True"):
        dllm.generate(oracle, prompts, logprobs=False, top_logprobs=2)
    with pytest.raises(ValueError, match="logprobs_mode must be one of"):
        dllm.generate(oracle, prompts, logprobs=True, logprobs_mode="processed")
    with pytest.raises(TypeError, match="logprobs must be True or False"):
        dllm.generate(oracle, prompts, logprobs=1)
    with pytest.raises(ValueError, match="top_logprobs must be at most the vocabulary"):
        dllm.generate(oracle, prompts, logprobs=True, top_logprobs=99)
    with pytest.raises(ValueError, match="logprobs: sampler 'native' runs the checkpoint's own loop"):
        dllm.generate(oracle, prompts, sampler="native", logprobs=True)
    with pytest.raises(ValueError, match="continuation_ids must be a tensor"):
        dllm.score(oracle, prompts, torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="must not contain the mask token"):
        dllm.score(oracle, prompts, torch.tensor([[oracle.mask_token_id]]))
    with pytest.raises(ValueError, match="cache must be 'auto', 'none' or 'block'"):
        dllm.score(oracle, prompts, torch.tensor([[1]]), cache="prefix")
