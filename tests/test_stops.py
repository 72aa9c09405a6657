"""The stop-token rule (dllm.stops) in every sampler, its exactness with several stop ids, empty prompts
under every cache mode, and stop ids that cannot be stops."""

import pytest
import torch

import dllm
from dllm import stops
from dllm.models.oracle import HMMOracle
from dllm.models.transformer import TransformerConfig, TransformerLM
from dllm.samplers import sequential_distribution

from stat_tools import ALPHA, chi_square_pvalue

# ----------------------------------------------------------------------------- the rule, by hand

def test_rule_on_hand_built_rows():
    answers = torch.tensor([[5, 3, 6, 9], [5, 6, 7, 8], [9, 3, 3, 4], [5, 6, 7, 3]])
    ids = (9, 3)  # the fill is 9; 3 is a stop too, and must stay where it was emitted
    assert stops.first_stop(answers, ids).tolist() == [1, 4, 0, 3]
    assert stops.answer_lengths(answers, ids).tolist() == [2, 4, 1, 4]
    assert stops.fill_after_stop(answers, ids).tolist() == [[5, 3, 9, 9], [5, 6, 7, 8], [9, 9, 9, 9], [5, 6, 7, 3]]
    assert stops.answer_lengths(answers, None).tolist() == [4, 4, 4, 4]
    assert torch.equal(stops.fill_after_stop(answers, None), answers)
    # Several tokens at once (ar_spec): only the first num_emitted count, a stop past them is no stop.
    counts, stopped = stops.emitted_until_stop(answers, torch.tensor([4, 4, 3, 3]), ids)
    assert counts.tolist() == [2, 4, 1, 3] and stopped.tolist() == [True, False, True, False]


def test_fit_output_pads_cuts_and_fills():
    short = torch.tensor([[1, 2, 5, 3], [1, 2, 9, 0]])  # prompt [1, 2]; transformers stopped both rows early
    fitted, lengths = stops.fit_output(short, 2, 4, (9, 3), pad=0)
    assert fitted.tolist() == [[1, 2, 5, 3, 9, 9], [1, 2, 9, 9, 9, 9]] and lengths.tolist() == [2, 1]
    long = torch.tensor([[1, 2, 5, 6, 7, 8, 3]])
    fitted, lengths = stops.fit_output(long, 2, 4, (9, 3), pad=0)
    assert fitted.tolist() == [[1, 2, 5, 6, 7, 8]] and lengths.tolist() == [4]


# ----------------------------------------------------------------------------- every sampler keeps the stop

SCRIPT = [5, 6, 3, 4, 9, 5]  # answer token i of the stubs below; 3 and 9 are stops, 3 comes first


class Scripted:
    """Diffusion stub: answer position i (the prompt is one token) holds SCRIPT[i]; stop ids (9, 3)."""

    vocab_size, mask_token_id, stop_token_ids = 11, 10, (9, 3)

    def __call__(self, ids):
        target = torch.tensor([0] + SCRIPT)[: ids.shape[1]]
        logits = torch.full((*ids.shape, 11), -10.0)
        logits.scatter_(-1, target.expand_as(ids)[..., None], 10.0)
        logits[..., 10] = float("-inf")
        return logits


class ScriptedCausal:
    """Causal stub emitting SCRIPT after a one-token prompt; stop ids (9, 3)."""

    vocab_size, stop_token_ids = 11, (9, 3)

    def __call__(self, ids):
        target = torch.tensor(SCRIPT + [0])[: ids.shape[1]]
        logits = torch.full((*ids.shape, 11), -10.0)
        logits.scatter_(-1, target.expand_as(ids)[..., None], 10.0)
        return logits


@pytest.mark.parametrize("sampler,options", [
    ("sequential", {}), ("sequential", {"order": "confidence"}), ("fef", {"window": 3}),
    ("fef", {"window": 2, "draft": "stale"}), ("llada", {"steps": 3}), ("dream", {"steps": 3}),
    ("fast_dllm", {"threshold": 0.5}), ("eb", {}), ("ar", {}), ("ar_spec", {"num_draft_tokens": 3}),
])
@pytest.mark.parametrize("eos", ["model", [9, 3]])
def test_second_stop_id_is_kept(sampler, options, eos):
    """The first stop emitted is 3, the second stop id: it stays, the tail holds 9, three tokens count."""
    model = ScriptedCausal() if sampler.startswith("ar") else Scripted()
    out = dllm.generate(model, torch.tensor([[0], [0]]), sampler=sampler, max_new_tokens=6, temperature=0.0,
                        eos_token_id=eos, **options)
    assert out.sequences[:, 1:].tolist() == [[5, 6, 3, 9, 9, 9]] * 2
    assert out.stats.new_tokens == 2 * 3


# ----------------------------------------------------------------------------- exactness with two stop ids

N_SAMPLES = 8000
PROMPT = torch.tensor([0, 2])
GEN = 4


def stopped_law(law: dict, stop_ids: tuple[int, ...]) -> dict:
    """The enumerated law of the unstopped chain pushed through the rule, written out on plain tuples."""
    out = {}
    for answer, prob in law.items():
        cut = next((i for i, token in enumerate(answer) if token in stop_ids), len(answer) - 1)
        key = tuple(answer[: cut + 1]) + (stop_ids[0],) * (len(answer) - cut - 1)
        out[key] = out.get(key, 0.0) + prob
    return out


def old_rule(answers: torch.Tensor, stop_ids: tuple[int, ...]) -> torch.Tensor:
    """What the canvas did before dllm.stops: the first stop position itself took the first stop id."""
    first = stops.first_stop(answers, stop_ids)
    return answers.masked_fill(torch.arange(answers.shape[1])[None, :] >= first[:, None], stop_ids[0])


@pytest.fixture(scope="module")
def oracle():
    return HMMOracle.random(num_states=3, num_tokens=4, seed=0, stickiness=2.0, sharpness=2.0)


@pytest.fixture(scope="module")
def block_model():
    """A random block-causal transformer over tokens 0, 1, 3, 4, 5 (2 is the mask), spread out."""
    torch.manual_seed(4)
    config = TransformerConfig(vocab_size=6, dim=32, n_layers=2, n_heads=2, max_seq_len=64, layout="block_causal",
                               block_size=2, mask_token_id=2, eos_token_id=None)
    model = TransformerLM(config).eval()
    with torch.no_grad():
        model.output.weight.mul_(2.0)
    return model


CHAINS = [("sequential", {}), ("sequential", {"order": "confidence"}), ("fef", {"window": 2, "draft": "marginal"}),
          ("fef", {"window": 3, "draft": "stale"})]


@pytest.mark.parametrize("sampler,options", CHAINS)
def test_exact_with_two_stop_ids(oracle, sampler, options):
    """Stop ids (2, 3) on the HMM: every exact sampler follows the chain's law pushed through the rule; the
    old rule (every stop 3 written as 2) is rejected by the same test on the same samples."""
    ids = (2, 3)
    law = stopped_law(sequential_distribution(oracle, PROMPT, GEN, order=options.get("order", "left_to_right")), ids)
    out = dllm.generate(oracle, PROMPT.expand(N_SAMPLES, -1), sampler=sampler, max_new_tokens=GEN, eos_token_id=ids,
                        temperature=1.0, generator=torch.Generator().manual_seed(1), **options)
    answers = out.sequences[:, PROMPT.numel():]
    assert chi_square_pvalue(answers, law) > ALPHA
    assert chi_square_pvalue(old_rule(answers, ids), law) < 1e-6
    assert sampler != "fef" or out.stats.accepted < out.stats.drafted  # the residual path ran
    assert out.stats.new_tokens == int(stops.answer_lengths(answers, ids).sum()) < N_SAMPLES * GEN


@pytest.mark.parametrize("sampler,options", CHAINS)
def test_exact_with_two_stop_ids_under_the_block_cache(block_model, sampler, options):
    """The same on a block-causal transformer decoded with the exact block cache, stop ids (4, 5)."""
    ids, prompt = (4, 5), torch.tensor([0, 3])
    with torch.no_grad():
        law = stopped_law(sequential_distribution(block_model, prompt, GEN, block_length=2,
                                                  order=options.get("order", "left_to_right")), ids)
        out = dllm.generate(block_model, prompt.expand(N_SAMPLES, -1), sampler=sampler, max_new_tokens=GEN,
                            block_length=2, cache="block", eos_token_id=ids, temperature=1.0,
                            generator=torch.Generator().manual_seed(2), **options)
    answers = out.sequences[:, prompt.numel():]
    assert out.options["cache"] == "block"
    assert chi_square_pvalue(answers, law) > ALPHA
    assert chi_square_pvalue(old_rule(answers, ids), law) < 1e-6
    assert sampler != "fef" or out.stats.accepted < out.stats.drafted


# ----------------------------------------------------------------------------- empty prompts

def tiny_block_causal():
    torch.manual_seed(0)
    config = TransformerConfig(vocab_size=40, dim=32, n_layers=2, n_heads=2, max_seq_len=64, layout="block_causal",
                               block_size=4, mask_token_id=2, eos_token_id=None)
    model = TransformerLM(config).eval()
    with torch.no_grad():  # sharpen the random model so greedy paths are not decided by float noise
        model.output.weight.mul_(20.0)
    return model


DIFFUSION_SAMPLERS = [
    ("sequential", {}), ("sequential", {"order": "confidence"}), ("fef", {"window": 3}),
    ("fef", {"window": 2, "draft": "stale"}), ("llada", {"steps": 6}), ("dream", {"steps": 6}),
    ("fast_dllm", {"threshold": 0.5}), ("eb", {}),
]


@pytest.mark.parametrize("sampler,options", DIFFUSION_SAMPLERS)
def test_empty_prompt_under_every_cache_mode(sampler, options):
    """Three blocks after an empty prompt: every cache mode decodes what the uncached call decodes (all of
    them are exact for a block-causal model); the block cache used to fail at the second block."""
    model = tiny_block_causal()
    empty = torch.zeros((2, 0), dtype=torch.long)
    common = dict(sampler=sampler, max_new_tokens=12, block_length=4, temperature=0.0, eos_token_id=None, **options)
    with torch.no_grad():
        plain = dllm.generate(model, empty, cache="none", **common)
        assert plain.sequences.shape == (2, 12) and not bool((plain.sequences == model.mask_token_id).any())
        for cache in ("auto", "block", "prefix", "dual"):
            out = dllm.generate(model, empty, cache=cache, **common)
            assert torch.equal(out.sequences, plain.sequences), cache
        # With stop ids, rows end early and the rest of each row follows the rule: greedy decisions before
        # a row's stop are the unstopped ones, so the output is the unstopped output, filled after the stop.
        ids = tuple(dict.fromkeys((int(plain.sequences[1, 6]), int(plain.sequences[0, 2]))))
        for cache in ("none", "block", "dual"):
            out = dllm.generate(model, empty, cache=cache, **{**common, "eos_token_id": ids})
            assert torch.equal(out.sequences, stops.fill_after_stop(plain.sequences, ids)), cache
            assert out.stats.new_tokens == int(stops.answer_lengths(plain.sequences, ids).sum()) < 24
        sampled = dllm.generate(model, empty, cache="block", **{**common, "temperature": 1.0})
    assert not bool((sampled.sequences == model.mask_token_id).any())


def test_empty_prompt_with_the_structured_verifier():
    torch.manual_seed(0)
    config = TransformerConfig(vocab_size=40, dim=32, n_layers=1, n_heads=2, max_seq_len=64, layout="block_causal",
                               block_size=4, mask_token_id=2)
    model = TransformerLM(config).eval()
    empty = torch.zeros((2, 0), dtype=torch.long)
    common = dict(sampler="fef", max_new_tokens=12, block_length=4, temperature=0.0, eos_token_id=None)
    with torch.no_grad():
        plain = dllm.generate(model, empty, cache="none", **common)
        for cache in ("none", "block"):
            out = dllm.generate(model, empty, cache=cache, verifier="structured", draft="stale", **common)
            assert torch.equal(out.sequences, plain.sequences), cache  # one layer: the copies' conditionals


def test_empty_prompt_on_a_model_without_a_cache():
    oracle = HMMOracle.random(num_states=3, num_tokens=3, seed=0)
    law = sequential_distribution(oracle, torch.zeros(0, dtype=torch.long), 2)
    out = dllm.generate(oracle, torch.zeros((4000, 0), dtype=torch.long), sampler="fef", max_new_tokens=2,
                        window=2, temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert chi_square_pvalue(out.sequences, law) > ALPHA


# ----------------------------------------------------------------------------- ids that cannot be stops

class MaskIsEos(Scripted):
    eos_token_id = 10
    stop_token_ids = None


@pytest.mark.parametrize("eos,source", [(10, "eos_token_id must"), ([9, 10], "eos_token_id must"),
                                        ("model", r"eos_token_id \('model': MaskIsEos")])
def test_mask_id_as_stop_is_refused(eos, source):
    with pytest.raises(ValueError, match=source + ".*mask token id 10"):
        dllm.generate(MaskIsEos(), torch.tensor([[0]]), sampler="sequential", max_new_tokens=4, eos_token_id=eos)


@pytest.mark.parametrize("eos,error,match", [
    ([], ValueError, "at least one id"), ([1, 11], ValueError, r"\[0, vocab_size=11\)"),
    ([1.0], TypeError, "must hold ints"), (True, TypeError, "must hold ints"), ("eos", ValueError, "'model'"),
    (1.0, TypeError, "eos_token_id must be an int, a sequence of ints, None or 'model', got float"),
])
def test_bad_stop_ids_are_named(eos, error, match):
    with pytest.raises(error, match=match):
        dllm.generate(Scripted(), torch.tensor([[0]]), sampler="sequential", max_new_tokens=4, eos_token_id=eos)
