"""Caches, ragged prompts and EOS on the project's transformer: exact caches change nothing."""

import pytest
import torch
from structured_checks import assert_structured_equals_copies

import dllm
from dllm.models.transformer import TransformerConfig, TransformerLM
from dllm.samplers import sequential_distribution

from stat_tools import ALPHA, chi_square_pvalue


def tiny(layout, vocab=40, block_size=4, seed=0, eos=1):
    torch.manual_seed(seed)
    config = TransformerConfig(vocab_size=vocab, dim=32, n_layers=2, n_heads=2, max_seq_len=64, layout=layout,
                               block_size=block_size if layout == "block_causal" else None,
                               mask_token_id=None if layout == "causal" else 2, eos_token_id=eos)
    model = TransformerLM(config).eval()
    with torch.no_grad():  # sharpen the random model so greedy paths are not decided by float noise
        model.output.weight.mul_(20.0)
    return model


PROMPTS = torch.tensor([[5, 9, 7, 11, 3], [0, 0, 8, 4, 6], [0, 12, 13, 14, 15]])
MASK = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1], [0, 1, 1, 1, 1]])


@pytest.mark.parametrize("sampler,options", [
    ("sequential", {}), ("sequential", {"order": "confidence"}), ("fef", {"window": 3}),
    ("fef", {"window": 4, "draft": "stale", "order": "confidence"}), ("llada", {"steps": 6}),
    ("fast_dllm", {"threshold": 0.5}), ("eb", {}), ("dream", {"steps": 6}),
])
def test_block_cache_equals_uncached_at_temperature_zero(sampler, options):
    model = tiny("block_causal")
    common = dict(sampler=sampler, max_new_tokens=12, temperature=0.0, block_length=4, attention_mask=MASK,
                  eos_token_id=None, **options)
    with torch.no_grad():
        plain = dllm.generate(model, PROMPTS, cache="none", **common)
        cached = dllm.generate(model, PROMPTS, cache="block", **common)
        auto = dllm.generate(model, PROMPTS, **common)
    assert torch.equal(plain.sequences, cached.sequences) and torch.equal(plain.sequences, auto.sequences)
    assert cached.stats.forward_tokens < plain.stats.forward_tokens and cached.exact == plain.exact
    assert auto.options["cache"] == "auto"


def test_block_cache_logits_match_uncached():
    model = tiny("block_causal")
    x = torch.cat([PROMPTS[:1], torch.full((1, 8), 2)], dim=1)
    x[0, 5:9] = torch.tensor([20, 21, 22, 23])  # first answer block done, second masked
    offset = torch.tensor([5])
    with torch.no_grad():
        full = model(x, block_offset=offset)
        cache = model.new_cache()
        model.forward_cached(x[:, :9], cache, block_offset=offset)
        copies = x[:, 9:13].repeat(3, 1)
        copies[1, 0], copies[2, :2] = 30, torch.tensor([30, 31])
        cached = model.forward_cached(copies, cache, rows=torch.zeros(3, dtype=torch.long), append=False,
                                      block_offset=offset.repeat(3))
        reference = torch.stack([model(torch.cat([x[:, :9], c[None]], 1), block_offset=offset)[0, 9:] for c in copies])
    assert torch.allclose(cached, reference, atol=1e-4)
    assert torch.allclose(cached[0], full[0, 9:], atol=1e-4)


@pytest.mark.parametrize("sampler,options", [("ar", {}), ("ar_spec", {}), ("ar_spec", {"num_draft_tokens": 2})])
def test_causal_cache_equals_uncached(sampler, options):
    model = tiny("causal")
    drafter = tiny("causal", seed=1)
    if sampler == "ar_spec" and options:
        options = {**options, "drafter": drafter}
    common = dict(sampler=sampler, max_new_tokens=14, temperature=0.0, attention_mask=MASK, eos_token_id=None,
                  **options)
    with torch.no_grad():
        plain = dllm.generate(model, PROMPTS, cache="none", **common)
        cached = dllm.generate(model, PROMPTS, **common)
        reference = dllm.generate(model, PROMPTS, sampler="ar", max_new_tokens=14, temperature=0.0,
                                  attention_mask=MASK, eos_token_id=None, cache="none")
    assert torch.equal(plain.sequences, cached.sequences)
    assert torch.equal(cached.sequences, reference.sequences)
    assert cached.stats.forward_tokens < plain.stats.forward_tokens


@pytest.mark.parametrize("layout,sampler", [("block_causal", "fef"), ("bidirectional", "sequential"),
                                            ("causal", "ar"), ("causal", "ar_spec")])
def test_left_padded_row_equals_row_alone(layout, sampler):
    model = tiny(layout)
    options = {"block_length": 4} if sampler == "fef" else {}
    with torch.no_grad():
        batch = dllm.generate(model, PROMPTS, sampler=sampler, max_new_tokens=8, temperature=0.0,
                              attention_mask=MASK, eos_token_id=None, **options)
        alone = dllm.generate(model, PROMPTS[1:2, 2:], sampler=sampler, max_new_tokens=8, temperature=0.0,
                              eos_token_id=None, **options)
    assert torch.equal(batch.sequences[1, 5:], alone.sequences[0, 3:])


def test_approximate_caches_are_labelled():
    model = tiny("bidirectional")
    for cache in ("prefix", "dual"):
        with torch.no_grad():
            out = dllm.generate(model, PROMPTS, sampler="fef", max_new_tokens=8, block_length=4, cache=cache,
                                generator=torch.Generator().manual_seed(0))
        assert out.exact is False and out.options["cache"] == cache
    with pytest.raises(ValueError, match="cache='block' is exact only for a block-causal model"):
        dllm.generate(model, PROMPTS, sampler="fef", max_new_tokens=8, block_length=4, cache="block")
    with pytest.raises(ValueError, match="cache='prefix' needs a model with new_cache"):
        dllm.generate(dllm.HMMOracle.random(), torch.tensor([[0, 1]]), max_new_tokens=4, cache="prefix")


class Counting:
    """Causal stub: the next token is the last one plus one (mod 10); token 7 is EOS."""

    vocab_size, eos_token_id = 10, 7

    def __call__(self, ids):
        logits = torch.full((*ids.shape, 10), -10.0)
        logits.scatter_(-1, ((ids + 1) % 10)[..., None], 10.0)
        return logits


class Positional:
    """Diffusion stub: position i (from the answer start at 2) holds token i % 6 + 3, and 9 (EOS) at 7."""

    vocab_size, mask_token_id, eos_token_id = 11, 10, 9

    def __call__(self, ids):
        positions = torch.arange(ids.shape[1])
        target = torch.where(positions == 7, 9, positions % 6 + 3)
        logits = torch.full((*ids.shape, 11), -10.0)
        logits[..., 10] = float("-inf")
        logits.scatter_(-1, target.expand_as(ids)[..., None], 10.0)
        return logits


@pytest.mark.parametrize("sampler", ["ar", "ar_spec"])
def test_eos_stops_causal_rows_and_is_not_counted(sampler):
    out = dllm.generate(Counting(), torch.tensor([[2, 3], [7, 8]]), sampler=sampler, max_new_tokens=6,
                        temperature=0.0)
    assert out.sequences[:, 2:].tolist() == [[4, 5, 6, 7, 7, 7], [9, 0, 1, 2, 3, 4]]
    assert out.stats.new_tokens == 4 + 6
    if sampler == "ar":
        assert out.stats.row_calls == 4 + 6  # the stopped row costs nothing after its EOS


@pytest.mark.parametrize("sampler,options", [("sequential", {}), ("fef", {"window": 3}), ("llada", {"steps": 4})])
def test_eos_stops_diffusion_rows(sampler, options):
    out = dllm.generate(Positional(), torch.tensor([[0, 1]]), sampler=sampler, max_new_tokens=8, temperature=0.0,
                        **options)
    assert out.sequences[0, 2:].tolist() == [5, 6, 7, 8, 3, 9, 9, 9]
    assert out.stats.new_tokens == 6
    off = dllm.generate(Positional(), torch.tensor([[0, 1]]), sampler=sampler, max_new_tokens=8, temperature=0.0,
                        eos_token_id=None, **options)
    assert off.sequences[0, 2:].tolist() == [5, 6, 7, 8, 3, 9, 5, 6] and off.stats.new_tokens == 8


def test_attention_mask_validation():
    model = tiny("block_causal")
    with pytest.raises(ValueError, match="left padding"):
        dllm.generate(model, PROMPTS, max_new_tokens=4, attention_mask=torch.tensor([[1, 0, 1, 1, 1]] * 3))
    with pytest.raises(ValueError, match="shaped like input_ids"):
        dllm.generate(model, PROMPTS, max_new_tokens=4, attention_mask=MASK[:2])
    with pytest.raises(ValueError, match="HMMOracle declares no accepts_attention_mask"):
        dllm.generate(dllm.HMMOracle.random(), torch.tensor([[0, 1]]), max_new_tokens=4,
                      attention_mask=torch.tensor([[0, 1]]))


@pytest.mark.parametrize("draft", ["marginal", "stale"])
def test_fef_with_block_cache_is_exact(draft):
    """Statistical exactness of cached verification on a real (random) block-causal transformer; stale
    drafts also carry the next block's logits over (lookahead)."""
    model = tiny("block_causal", vocab=5, block_size=2, seed=4, eos=None)
    with torch.no_grad():
        model.output.weight.mul_(0.1)  # back to a spread-out distribution over the 4 tokens
        prompt = torch.tensor([0, 3])
        expected = sequential_distribution(model, prompt, 4, block_length=2)
        out = dllm.generate(model, prompt.expand(6000, -1), sampler="fef", max_new_tokens=4, block_length=2,
                            window=2, cache="block", draft=draft, temperature=1.0,
                            generator=torch.Generator().manual_seed(0))
    assert out.options["cache"] == "block"
    assert chi_square_pvalue(out.sequences[:, 2:], expected) > ALPHA
    assert out.stats.accepted < out.stats.drafted


@pytest.mark.parametrize("layout", ["bidirectional", "block_causal"])
def test_structured_verifier_equals_copies_for_one_layer(layout):
    """For a one-layer model the one-pass verifier sees exactly copy j's context."""
    torch.manual_seed(0)
    config = TransformerConfig(vocab_size=30, dim=32, n_layers=1, n_heads=2, layout=layout, mask_token_id=2,
                               block_size=4 if layout == "block_causal" else None, max_seq_len=64)
    model = TransformerLM(config).eval()
    x = torch.tensor([[5, 6, 7, 8, 2, 2, 2, 2, 2, 2, 2, 2], [9, 9, 9, 9, 11, 2, 2, 2, 2, 2, 2, 2]])
    positions, drafts = torch.tensor([[4, 5, 6], [5, 6, 7]]), torch.tensor([[10, 11, 12], [13, 14, 15]])
    count, bonus, offset = torch.tensor([3, 2]), torch.tensor([7, 7]), torch.tensor([4, 4])
    assert_structured_equals_copies(model, x, positions, drafts, count, bonus, offset)


def test_structured_verifier_in_fef():
    one_layer = TransformerConfig(vocab_size=40, dim=32, n_layers=1, n_heads=2, layout="block_causal", block_size=4,
                                  mask_token_id=2, max_seq_len=64)
    torch.manual_seed(0)
    model = TransformerLM(one_layer).eval()
    common = dict(sampler="fef", max_new_tokens=12, temperature=0.0, block_length=4, attention_mask=MASK,
                  eos_token_id=None)
    with torch.no_grad():
        plain = dllm.generate(model, PROMPTS, **common)
        for cache in ("none", "block"):
            for draft in ("marginal", "stale"):
                one_pass = dllm.generate(model, PROMPTS, verifier="structured", cache=cache, draft=draft, **common)
                assert torch.equal(one_pass.sequences, plain.sequences)  # one layer: same conditionals
                assert one_pass.exact is False  # labelled: deeper models need training for this pass
    with pytest.raises(ValueError, match="order='left_to_right' only"):
        dllm.generate(model, PROMPTS, verifier="structured", order="confidence", **common)
    with pytest.raises(ValueError, match="needs a model with structured_verify"):
        dllm.generate(dllm.HMMOracle.random(), torch.tensor([[0, 1]]), max_new_tokens=4, verifier="structured")


def test_structured_verifier_is_exact_for_one_layer():
    """At T=1 the one-pass verifier samples the sequential chain when its conditionals are the copies'."""
    torch.manual_seed(5)
    config = TransformerConfig(vocab_size=5, dim=16, n_layers=1, n_heads=2, layout="block_causal", block_size=2,
                               mask_token_id=2, max_seq_len=16)
    model = TransformerLM(config).eval()
    prompt = torch.tensor([0, 3])
    with torch.no_grad():
        expected = sequential_distribution(model, prompt, 4, block_length=2)
        out = dllm.generate(model, prompt.expand(6000, -1), sampler="fef", max_new_tokens=4, block_length=2,
                            window=2, verifier="structured", draft="stale", eos_token_id=None,
                            temperature=1.0, generator=torch.Generator().manual_seed(1))
    assert chi_square_pvalue(out.sequences[:, 2:], expected) > ALPHA
    assert out.stats.accepted < out.stats.drafted


def small_pair():
    """A causal target and a block-causal drafter over 12 tokens (11 = the drafter's mask, 10 = EOS), left
    unsharpened so that sampled drafts are often accepted."""
    models = []
    for layout, seed in (("causal", 0), ("block_causal", 1)):
        torch.manual_seed(seed)
        config = TransformerConfig(vocab_size=12, dim=16, n_layers=2, n_heads=2, max_seq_len=64, layout=layout,
                                   block_size=4 if layout == "block_causal" else None,
                                   mask_token_id=None if layout == "causal" else 11, eos_token_id=10)
        models.append(TransformerLM(config).eval())
    return models


def small_causal_drafter():
    torch.manual_seed(2)
    config = TransformerConfig(vocab_size=12, dim=16, n_layers=2, n_heads=2, max_seq_len=64, layout="causal",
                               eos_token_id=10)
    return TransformerLM(config).eval()


@pytest.mark.parametrize("kind", ["block_causal", "causal"])
def test_drafter_cache_equals_uncached(kind):
    """ar_spec sampled with left padding and rows stopping at EOS at different times: with and without
    the drafter's cache (block cache or KV cache) every round drafts the same tokens, outputs agree."""
    model, block_drafter = small_pair()
    drafter = block_drafter if kind == "block_causal" else small_causal_drafter()
    prompts = torch.tensor([[0, 1, 2, 0, 1], [9, 9, 2, 5, 0], [9, 1, 7, 2, 1], [6, 2, 8, 0, 4]])
    mask = (torch.arange(5)[None, :] >= torch.tensor([0, 2, 1, 0])[:, None]).long()
    runs = {}
    for cache in ("none", "auto"):
        rounds = []
        with torch.no_grad():
            out = dllm.generate(model, prompts, sampler="ar_spec", temperature=1.0, drafter=drafter, num_draft_tokens=3,
                                max_new_tokens=16, attention_mask=mask, eos_token_id=10, cache=cache,
                                generator=[torch.Generator().manual_seed(s) for s in range(4)],
                                callback=lambda event, seen=rounds: seen.append((event["rows"].tolist(),
                                                                                 event["drafts"].clone())))
        runs[cache] = out, rounds
    (plain, plain_rounds), (cached, cached_rounds) = runs["none"], runs["auto"]
    assert torch.equal(plain.sequences, cached.sequences)
    assert [r for r, _ in plain_rounds] == [r for r, _ in cached_rounds]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(plain_rounds, cached_rounds))
    assert 0 < cached.stats.accepted < cached.stats.drafted
    active = [len(r) for r, _ in cached_rounds]
    assert active[0] == 4 and 0 < active[-1] < 4  # some rows stopped (EOS) while others went on
    assert cached.stats.forward_tokens_draft < plain.stats.forward_tokens_draft


def hmm_and_block_drafter():
    oracle = dllm.HMMOracle.random(num_states=3, num_tokens=3, seed=0, stickiness=2.0, sharpness=2.0)
    torch.manual_seed(7)
    config = TransformerConfig(vocab_size=oracle.vocab_size, dim=16, n_layers=1, n_heads=2, max_seq_len=32,
                               layout="block_causal", block_size=2, mask_token_id=oracle.mask_token_id)
    return oracle, TransformerLM(config).eval()


def test_block_causal_drafter_rows_are_batch_invariant():
    """Sampled with one generator per row, a row's output is the row's output alone, though rows accept
    different numbers of drafts and the drafter's canvas spans the batch's longest row."""
    oracle, drafter = hmm_and_block_drafter()
    rows = torch.tensor([[0, 1, 2], [2, 2, 1], [1, 0, 0]])
    common = dict(sampler="ar_spec", drafter=drafter, num_draft_tokens=3, max_new_tokens=12)
    seeds = [4, 5, 6]
    with torch.no_grad():
        batch = dllm.generate(oracle.as_causal(), rows, **common,
                              generator=[torch.Generator().manual_seed(s) for s in seeds])
        for i in range(3):
            alone = dllm.generate(oracle.as_causal(), rows[i : i + 1], **common,
                                  generator=[torch.Generator().manual_seed(seeds[i])])
            assert torch.equal(batch.sequences[i], alone.sequences[0]), i
    assert 0 < batch.stats.accepted < batch.stats.drafted


def test_ar_spec_with_block_causal_drafter_is_exact():
    """The HMM target with a cached block-causal transformer drafting: the law of ar at T = 1."""
    oracle, drafter = hmm_and_block_drafter()
    prompt = torch.tensor([0, 2])
    with torch.no_grad():
        out = dllm.generate(oracle.as_causal(), prompt.expand(12000, -1), sampler="ar_spec", drafter=drafter,
                            num_draft_tokens=3, max_new_tokens=4, temperature=1.0,
                            generator=torch.Generator().manual_seed(9))
    expected = sequential_distribution(oracle.as_causal(), prompt, 4)
    assert chi_square_pvalue(out.sequences[:, 2:], expected) > ALPHA
    assert 0 < out.stats.accepted < out.stats.drafted


@pytest.mark.parametrize("cached", [False, True])
def test_block_drafter_logits_equal_each_row_alone(cached):
    """Over rounds of ragged growth, with left padding and a row dropped midway, the drafter's logits at
    each row's draft positions equal one call on that row alone (padding stripped), blocks anchored at the
    answer start and the canvas ending with its last draft's block."""
    from dllm.samplers.ar_spec.drafters import block_draft_logits as _block_draft_logits
    from dllm.samplers.calling import Caller
    from dllm.stats import DecodeStats

    drafter = tiny("block_causal", seed=3)  # block_size 4
    with torch.no_grad():  # sharper attention, so a stale cache entry moves the logits well past float error
        for layer in drafter.layers:
            layer.attn.wqkv.weight.mul_(3.0)
            layer.attn.wo.weight.mul_(3.0)
    prompt_len, width, total = 5, 3, 5 + 20
    pads = torch.tensor([0, 2, 1])
    torch.manual_seed(0)
    seq = torch.randint(3, 40, (3, total))
    full_mask = (torch.arange(total + width + 1)[None, :] >= pads[:, None]).long()
    caller = Caller(drafter, DecodeStats(), attention_mask=full_mask, draft=True)
    kv = drafter.new_cache() if cached else None
    rows = torch.arange(3)
    schedule = ([5, 5, 5], [6, 8, 5], [9, 9, 7], [13, 10, 12], [15, None, 16], [18, None, 21])
    with torch.no_grad():
        for step, lengths in enumerate(schedule):
            if step == 4:  # row 1 finishes: the sampler drops it from the batch and from the cache
                rows = torch.tensor([0, 2])
                kv = kv.select(torch.tensor([0, 2])) if kv is not None else None
            length = torch.tensor([lengths[int(r)] for r in rows])
            logits = _block_draft_logits(drafter, caller, seq[rows], rows, length, width, prompt_len, kv)
            for i, r in enumerate(rows.tolist()):
                n = int(length[i])
                end = min(prompt_len + ((n + width - 1 - prompt_len) // 4 + 1) * 4, total - 1)
                canvas = torch.full((1, end), 2)
                canvas[0, :n] = seq[r, :n]
                canvas = canvas[:, int(pads[r]):]  # the row alone has no padding
                offset = torch.tensor([prompt_len - int(pads[r])])
                alone = drafter(canvas, block_offset=offset)[0, n - int(pads[r]) : n - int(pads[r]) + width]
                alone[:, 2] = float("-inf")  # the mask token is never drafted
                assert torch.allclose(logits[i], alone, atol=1e-4), (step, r)


@pytest.mark.parametrize("drafter_kind", ["ngram", "causal", "block_causal", "bidirectional"])
@pytest.mark.parametrize("cache", ["auto", "none"])
def test_ar_spec_fits_every_context_ar_fits(drafter_kind, cache):
    """prompt + max_new_tokens up to max_seq_len + 1 (ar's limit) with 8 drafts per round: no position
    past the context, same tokens as ar, with a full-length answer and left padding."""
    model = tiny("causal")  # max_seq_len 64
    drafter = {"ngram": "ngram", "causal": tiny("causal", seed=1), "block_causal": tiny("block_causal", seed=3),
               "bidirectional": tiny("bidirectional", seed=4)}[drafter_kind]
    new_tokens = 64 + 1 - PROMPTS.shape[1]
    common = dict(max_new_tokens=new_tokens, temperature=0.0, attention_mask=MASK, eos_token_id=None, cache=cache)
    with torch.no_grad():
        spec = dllm.generate(model, PROMPTS, sampler="ar_spec", drafter=drafter, num_draft_tokens=8, **common)
        plain = dllm.generate(model, PROMPTS, sampler="ar", **common)
        sampled = dllm.generate(model, PROMPTS, sampler="ar_spec", drafter=drafter, num_draft_tokens=8,
                                **{**common, "temperature": 1.0}, generator=torch.Generator().manual_seed(0))
    assert torch.equal(spec.sequences, plain.sequences)
    assert sampled.stats.new_tokens == 3 * new_tokens


def test_ar_spec_runs_uncached_when_a_cache_cannot_roll_back():
    """A model whose cache cannot crop (sliding-window layers in HF) still decodes, uncached, the same."""
    from dllm.models.cache import KVCache

    class Fixed(KVCache):
        croppable = False

        def crop(self, length):
            raise AssertionError("crop called on a cache that cannot roll back")

    model, drafter = tiny("causal"), tiny("causal", seed=1)
    plain = dllm.generate(model, PROMPTS, sampler="ar_spec", drafter=drafter, max_new_tokens=10, temperature=0.0,
                          attention_mask=MASK, eos_token_id=None, cache="none")
    for m in (model, drafter):
        m.new_cache = Fixed
    with pytest.warns(UserWarning, match="cannot roll back rejected drafts"):
        out = dllm.generate(model, PROMPTS, sampler="ar_spec", drafter=drafter, max_new_tokens=10, temperature=0.0,
                            attention_mask=MASK, eos_token_id=None)
    assert torch.equal(out.sequences, plain.sequences)
