"""Tests for dllm.models.hf: logits, padding, Dream's shift, LLaDA's mask probe and the causal KV cache.

Every checkpoint is a tiny random model written to a temporary folder (tests/fixtures/hf/builders.py).
"""

import pytest
import torch
from fixtures.hf import builders
from fixtures.hf.modeling_standin import marker

from dllm.models.chat import apply_chat_template, has_chat_template
from dllm.models.diffusion_gemma import DiffusionGemmaAdapter
from dllm.models.hf import CausalLMAdapter, DreamAdapter, LLaDAAdapter, MaskedLMAdapter
from dllm.models.loading import load as _load
from dllm.protocols import is_causal_model, is_diffusion_model


def load(path, **kw):
    """These tests exercise the remote-code adapters, so the stand-ins' own code runs (native: test_native_models)."""
    return _load(path, trust_remote_code=True, **kw)


V = builders.VOCAB
MASK = V - 1  # the stand-ins' mask id


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Build each checkpoint once per module, on first use."""
    made = {}
    recipes = {
        "llama": lambda p: builders.save_causal(p, "llama"),
        "qwen3": lambda p: builders.save_causal(p, "qwen3"),
        "bert": lambda p: builders.save_mlm(p, "bert"),
        "modernbert": lambda p: builders.save_mlm(p, "modernbert"),
        "llada": builders.save_llada,
        "llada_ignores_mask": lambda p: builders.save_llada(p, honours_attention_mask=False),
        "dream": builders.save_dream,
        "diffusion_gemma": builders.save_diffusion_gemma,
    }

    def get(name):
        if name not in made:
            made[name] = recipes[name](tmp_path_factory.mktemp(name))
        return made[name]

    return get


def _ids(batch, length, seed=0, high=MASK):
    """Random ids below ``high`` (so never a stand-in's mask token).  # [B, L]"""
    return torch.randint(3, high, (batch, length), generator=torch.Generator().manual_seed(seed))


def _left_pad(rows: list[torch.Tensor], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad 1-D id tensors to one length.  # -> ids [B, L], mask [B, L]"""
    length = max(len(r) for r in rows)
    ids = torch.full((len(rows), length), pad_id)
    mask = torch.zeros(len(rows), length, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, length - len(row):], mask[i, length - len(row):] = row, 1
    return ids, mask


# ------------------------------------------------------------------ causal LMs and the KV cache


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def causal(request, folders):
    return load(folders(request.param))


def test_causal_adapter_follows_the_causal_protocol(causal):
    assert isinstance(causal, CausalLMAdapter)
    assert is_causal_model(causal) and not hasattr(causal, "mask_token_id")
    assert causal.vocab_size == V and causal.eos_token_id == 1 and causal.pad_token_id == 0
    assert causal.accepts_attention_mask and causal.cache_exact
    logits = causal(_ids(2, 5))
    assert logits.shape == (2, 5, V) and logits.dtype == torch.float32 and torch.isfinite(logits).all()


def test_cached_forward_equals_uncached(causal):
    ids = _ids(2, 9)
    full = causal(ids)
    cache = causal.new_cache()
    pieces = [causal.forward_cached(ids[:, a:b], cache) for a, b in ((0, 5), (5, 6), (6, 9))]
    assert cache.length == 9
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-4, rtol=0)


def test_crop_then_reextend_equals_uncached(causal):
    """Append four drafts, reject the last three, append a correction and more: same as recomputing."""
    prompt, drafts, redo = _ids(2, 5, seed=1), _ids(2, 4, seed=2), _ids(2, 3, seed=3)
    cache = causal.new_cache()
    causal.forward_cached(prompt, cache)
    causal.forward_cached(drafts, cache)
    cache.crop(6)
    assert cache.length == 6
    logits = causal.forward_cached(redo, cache)
    sequence = torch.cat((prompt, drafts[:, :1], redo), dim=1)
    torch.testing.assert_close(logits, causal(sequence)[:, 6:], atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="crop length"):
        cache.crop(99)


def test_left_padding_gives_the_unpadded_logits(causal):
    long, short = _ids(1, 7, seed=4)[0], _ids(1, 4, seed=5)[0]
    ids, mask = _left_pad([long, short])
    logits = causal(ids, attention_mask=mask)
    torch.testing.assert_close(logits[0], causal(long[None])[0], atol=1e-4, rtol=0)
    torch.testing.assert_close(logits[1, 3:], causal(short[None])[0], atol=1e-4, rtol=0)


def test_cached_calls_continue_each_rows_positions(causal):
    """A padded prefill, then new tokens without a mask: positions go on from each row's real-token count."""
    long, short, new = _ids(1, 6, seed=6)[0], _ids(1, 3, seed=7)[0], _ids(2, 2, seed=8)
    ids, mask = _left_pad([long, short])
    cache = causal.new_cache()
    prefill = causal.forward_cached(ids, cache, attention_mask=mask)
    step = causal.forward_cached(new, cache)
    assert cache.length == 8
    for row, real in enumerate((long, short)):
        expected = causal(torch.cat((real, new[row]))[None])[0]
        torch.testing.assert_close(prefill[row, -len(real):], expected[:len(real)], atol=1e-4, rtol=0)
        torch.testing.assert_close(step[row], expected[len(real):], atol=1e-4, rtol=0)


def test_rows_read_the_cache_without_growing_it(causal):
    """append=False: several copies may share a cache row, and the cache is left as it was."""
    prefix, new = _ids(2, 5, seed=9), _ids(3, 2, seed=10)
    cache = causal.new_cache()
    causal.forward_cached(prefix, cache)
    rows = torch.tensor([1, 1, 0])
    logits = causal.forward_cached(new, cache, rows=rows, append=False)
    assert cache.length == 5 and cache.batch_size == 2
    expected = causal(torch.cat((prefix[rows], new), dim=1))[:, 5:]
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(cache.select(rows).key_mask, torch.ones(3, 5, dtype=torch.long))


def test_forward_cached_rejects_bad_arguments(causal):
    cache = causal.new_cache()
    causal.forward_cached(_ids(2, 3), cache)
    with pytest.raises(ValueError, match="rows must be None"):
        causal.forward_cached(_ids(2, 1), cache, rows=torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="needs rows"):
        causal.forward_cached(_ids(2, 1), cache, append=False)
    with pytest.raises(ValueError, match="cached \\+ new keys"):
        causal.forward_cached(_ids(2, 1), cache, attention_mask=torch.ones(2, 1))
    with pytest.raises(ValueError, match="cache holds 2 rows"):
        causal.forward_cached(_ids(3, 1), cache)


def test_causal_keeps_a_tokenizer_mask_id_under_another_name(folders):
    tokenizer = load(folders("bert")).tokenizer  # has [MASK]
    adapter = CausalLMAdapter(load(folders("llama")).model, tokenizer)
    assert adapter.tokenizer_mask_token_id == tokenizer.mask_token_id
    assert is_causal_model(adapter) and not is_diffusion_model(adapter)


# ------------------------------------------------------------------ masked LMs


@pytest.mark.parametrize("arch", ["bert", "modernbert"])
def test_mlm_logits_mask_and_padding(folders, arch):
    model = load(folders(arch))
    assert isinstance(model, MaskedLMAdapter) and is_diffusion_model(model)
    assert model.mask_token_id == model.tokenizer.mask_token_id and model.vocab_size == V
    long, short = _ids(1, 7, seed=11, high=V)[0], _ids(1, 4, seed=12, high=V)[0]
    logits = model(long[None])
    assert logits.shape == (1, 7, V) and logits.dtype == torch.float32
    assert torch.isneginf(logits[..., model.mask_token_id]).all()
    assert torch.isfinite(logits[..., :model.mask_token_id]).all()
    ids, mask = _left_pad([long, short])
    padded = model(ids, attention_mask=mask)
    torch.testing.assert_close(padded[1, 3:], model(short[None])[0], atol=1e-4, rtol=0)
    torch.testing.assert_close(padded[0], logits[0], atol=1e-4, rtol=0)


# ------------------------------------------------------------------ LLaDA and Dream stand-ins


def test_llada_reads_the_mask_id_from_config(folders):
    model = load(folders("llada"))
    assert isinstance(model, LLaDAAdapter) and model.mask_token_id == MASK
    assert model.tokenizer.mask_token is None  # like LLaDA's tokenizer: the id comes from config.json
    assert model.eos_token_id == 1 and model.stop_token_ids == (1, model.tokenizer.convert_tokens_to_ids("<|eot_id|>"))
    logits = model(_ids(2, 6))
    assert logits.shape == (2, 6, V) and torch.isneginf(logits[..., MASK]).all()


def test_llada_padding_when_the_code_honours_the_mask(folders):
    model = load(folders("llada"))
    assert model.accepts_attention_mask
    long, short = _ids(1, 6, seed=13)[0], _ids(1, 4, seed=14)[0]
    ids, mask = _left_pad([long, short])
    torch.testing.assert_close(model(ids, attention_mask=mask)[1, 2:], model(short[None])[0], atol=1e-4, rtol=0)


def test_llada_refuses_padding_when_the_code_ignores_the_mask(folders):
    model = load(folders("llada_ignores_mask"))
    assert not model.accepts_attention_mask
    ids, mask = _left_pad([_ids(1, 6)[0], _ids(1, 4)[0]])
    with pytest.raises(ValueError, match="ignores attention_mask"):
        model(ids, attention_mask=mask)
    unpadded = model(ids, attention_mask=torch.ones_like(ids))  # a mask that hides nothing is fine
    torch.testing.assert_close(unpadded, model(ids))


def test_dream_logits_are_shifted_back(folders):
    """The stand-in's raw logits at p favour marker(p + 1); after the shift position i favours marker(i)."""
    model = load(folders("dream"))
    assert isinstance(model, DreamAdapter) and model.mask_token_id == model.tokenizer.mask_token_id == MASK
    ids = _ids(2, 8)
    logits = model(ids)
    positions = torch.arange(8)
    assert torch.equal(logits[:, 1:].argmax(-1), marker(positions[1:], V).expand(2, -1))
    raw = model.model(input_ids=ids).logits
    torch.testing.assert_close(logits[:, 0, :MASK], raw[:, 0, :MASK])  # position 0 keeps raw[:, 0], as Dream does
    assert torch.isneginf(logits[..., MASK]).all()


def test_dream_padding_gives_the_unpadded_logits(folders):
    model = load(folders("dream"))
    long, short = _ids(1, 7, seed=15)[0], _ids(1, 4, seed=16)[0]
    ids, mask = _left_pad([long, short])
    padded = model(ids, attention_mask=mask)
    torch.testing.assert_close(padded[1, 4:], model(short[None])[0, 1:], atol=1e-4, rtol=0)
    torch.testing.assert_close(padded[0], model(long[None])[0], atol=1e-4, rtol=0)


def test_attention_mask_must_match_input_ids(folders):
    model = load(folders("dream"))
    with pytest.raises(ValueError, match="shape of input_ids"):
        model(_ids(2, 4), attention_mask=torch.ones(2, 5))


# ------------------------------------------------------------------ chat templates


def test_chat_template(folders):
    tokenizer = load(folders("llada")).tokenizer
    assert has_chat_template(tokenizer)
    text = apply_chat_template(tokenizer, "the cat sat")
    assert text == "<|start|>user the cat sat<|eot|><|start|>assistant "
    assert not has_chat_template(load(folders("bert")).tokenizer) and not has_chat_template(None)
    with pytest.raises(ValueError, match="no chat template"):
        apply_chat_template(load(folders("bert")).tokenizer, "hi")


# ------------------------------------------------------------------ DiffusionGemma


def test_diffusion_gemma_loads_as_a_block_causal_diffusion_model(folders):
    model = load(folders("diffusion_gemma"))
    assert isinstance(model, DiffusionGemmaAdapter) and is_diffusion_model(model)
    assert (model.mask_token_id, model.vocab_size, model.block_size) == (V, V + 1, 4)
    assert model.tokenizer is not None
    with pytest.raises(ValueError, match="DiffusionGemma has no mask token; its stand-in id is 48"):
        load(folders("diffusion_gemma"), mask_token_id=3)


def test_diffusion_gemma_logits_cover_each_rows_active_block(folders):
    """Rows whose active blocks differ, one left-padded, in one call: each row's block logits equal the
    row alone and equal a direct encoder/decoder call; elsewhere zeros; the mask's logit -inf."""
    model = load(folders("diffusion_gemma"))
    m = model.mask_token_id
    # Row 0: prompt of 3, answer block [3, 7) with 2 revealed; row 1: prompt of 2 (2 pads), first block done.
    rows = torch.tensor([[5, 6, 7, 9, 10, m, m, m, m, m, m],
                         [0, 0, 8, 9, 11, 12, 13, 14, m, m, m]])
    mask = torch.tensor([[1] * 11, [0, 0] + [1] * 9])
    offsets = torch.tensor([3, 2])  # answer start in position-id coordinates
    logits = model(rows, attention_mask=mask, block_offset=offsets)
    assert logits.shape == (2, 11, V + 1) and bool((logits[..., m] == float("-inf")).all())
    alone = model(rows[1:, 2:], block_offset=offsets[1:])
    assert torch.allclose(logits[1, 2:], alone[0], atol=1e-5)
    assert bool((logits[0, :3, :V] == 0).all()) and bool((logits[0, 7:, :V] == 0).all())  # outside [3, 7)
    assert bool((logits[1, :8, :V] == 0).all())  # row 1's active block is [8, 11): 6 answer tokens done
    # The block as the checkpoint itself sees it: masks become fixed filler tokens of their positions.
    canvas = rows[:1, 3:7].clone()
    filler = model._fill[torch.arange(3, 7)]
    canvas[canvas == m] = filler[canvas[0] == m]
    direct = model.model(input_ids=rows[:1, :3], decoder_input_ids=canvas).logits
    assert torch.allclose(logits[0, 3:7, :V], direct[0], atol=1e-5)
    assert torch.equal(logits, model(rows, attention_mask=mask, block_offset=offsets))  # deterministic


def test_diffusion_gemma_fef_greedy_is_sequential(folders):
    import dllm

    model = load(folders("diffusion_gemma"))
    prompts = torch.tensor([[5, 6, 7], [8, 9, 10]])
    common = dict(max_new_tokens=8, temperature=0.0, eos_token_id=None)
    fef = dllm.generate(model, prompts, sampler="fef", window=3, **common)
    seq = dllm.generate(model, prompts, sampler="sequential", **common)
    assert torch.equal(fef.sequences, seq.sequences) and fef.options["block_length"] == 4
    assert fef.stats.accepted > 0  # drafts verified and kept: the exact path ran, not a one-token fallback


@pytest.mark.parametrize("sampler,options", [("fef", {"window": 3}), ("fef", {"window": 2, "draft": "stale"}),
                                             ("sequential", {"order": "confidence"}), ("llada", {"steps": 6})])
def test_diffusion_gemma_block_cache_changes_nothing(folders, sampler, options):
    """The encoder cache of the prompt and finished blocks (cache="auto") gives the uncached tokens, with
    left padding, greedy and sampled, and encodes fewer tokens."""
    import dllm

    model = load(folders("diffusion_gemma"))
    prompts, mask = torch.tensor([[5, 6, 7, 8], [0, 0, 9, 10]]), torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]])
    for temperature in (0.0, 1.0):
        runs = [dllm.generate(model, prompts, sampler=sampler, max_new_tokens=12, attention_mask=mask,
                              temperature=temperature, eos_token_id=None, cache=cache,
                              generator=torch.Generator().manual_seed(3), **options) for cache in ("none", "auto")]
        assert torch.equal(runs[0].sequences, runs[1].sequences), temperature
        assert runs[1].exact == runs[0].exact  # the block cache is exact: it changes no label
        assert runs[1].stats.forward_tokens < runs[0].stats.forward_tokens


def test_diffusion_gemma_refuses_an_empty_prompt(folders):
    """Its encoder reads the prompt (needs_prompt): generate says so for every cache mode, before decoding."""
    import dllm

    model = load(folders("diffusion_gemma"))
    for cache in ("none", "auto", "block"):
        with pytest.raises(ValueError, match="input_ids must hold at least one token for DiffusionGemmaAdapter"):
            dllm.generate(model, torch.zeros((1, 0), dtype=torch.long), sampler="fef", max_new_tokens=4,
                          cache=cache)


def test_diffusion_gemma_sampler_blocks_nest_in_its_blocks(folders):
    import dllm

    model = load(folders("diffusion_gemma"))  # block_size 4
    prompts = torch.tensor([[5, 6, 7], [8, 9, 10]])
    common = dict(max_new_tokens=6, temperature=0.0, eos_token_id=None)  # 6 is no multiple of 4: blocks of 2
    fef = dllm.generate(model, prompts, sampler="fef", window=2, **common)
    seq = dllm.generate(model, prompts, sampler="sequential", **common)
    llada = dllm.generate(model, prompts, sampler="llada", steps=3, **common)
    assert fef.options["block_length"] == 2 and torch.equal(fef.sequences, seq.sequences)
    assert llada.options["block_length"] == 2  # 2 tokens per step, each step inside one model block
    with pytest.raises(ValueError, match="block_length=6 must divide this model's block_size=4"):
        dllm.generate(model, prompts, sampler="llada", max_new_tokens=12, block_length=6)
    with pytest.raises(ValueError, match="cache='prefix' needs a cache with crop"):
        dllm.generate(model, prompts, sampler="fef", max_new_tokens=8, cache="prefix")


def test_diffusion_gemma_unconditional_call_reads_masked_prompt_as_noise(folders):
    """Classifier-free guidance masks the prompt: the active block is still the answer's first, and the
    encoder reads the masked prompt as filler tokens."""
    model = load(folders("diffusion_gemma"))
    m = model.mask_token_id
    uncond = torch.tensor([[m, m, m, m, m, m, m]])
    logits = model(uncond, block_offset=torch.tensor([3]))
    fill = model._fill[:7][None]
    direct = model.model(input_ids=fill[:, :3], decoder_input_ids=fill[:, 3:7]).logits
    assert torch.allclose(logits[0, 3:7, :V], direct[0], atol=1e-5)
    assert bool((logits[0, :3, :V] == 0).all())
    with pytest.raises(ValueError, match="at least one real token before each row's active block"):
        model(uncond, block_offset=torch.tensor([0]))


def test_diffusion_gemma_drafts_for_a_causal_target(folders):
    """Its vocabulary is the target's plus the appended mask id: accepted as an ar_spec drafter."""
    import dllm

    target, drafter = load(folders("llama")), load(folders("diffusion_gemma"))
    assert drafter.vocab_size == target.vocab_size + 1
    prompts = torch.tensor([[5, 6, 7], [8, 9, 10]])
    with pytest.warns(UserWarning, match="cannot roll back"):  # its encoder cache keeps no rejected drafts
        spec = dllm.generate(target, prompts, sampler="ar_spec", drafter=drafter, num_draft_tokens=3,
                             max_new_tokens=8, temperature=0.0, eos_token_id=None)
    plain = dllm.generate(target, prompts, sampler="ar", max_new_tokens=8, temperature=0.0, eos_token_id=None)
    assert torch.equal(spec.sequences, plain.sequences) and spec.stats.nfe_draft > 0


def test_diffusion_gemma_native_sampler_runs_transformers_generate(folders):
    """sampler="native": the checkpoint's own loop, seeded from the generator, every call counted."""
    import dllm

    model = load(folders("diffusion_gemma"))
    prompts = torch.tensor([[5, 6, 7], [8, 9, 10]])
    runs = [dllm.generate(model, prompts, sampler="native", temperature=1.0, max_new_tokens=6, eos_token_id=None,
                          generator=torch.Generator().manual_seed(1)) for _ in range(2)]
    assert torch.equal(runs[0].sequences, runs[1].sequences) and runs[0].sequences.shape == (2, 9)
    assert runs[0].exact is False and runs[0].stats.new_tokens == 12
    # two canvases (6 tokens in blocks of 4): two encoder calls and at least one denoising step each
    assert runs[0].stats.nfe >= 4 and runs[0].stats.rounds >= 4 and runs[0].stats.forward_tokens > 0
    other = dllm.generate(model, prompts, sampler="native", temperature=1.0, max_new_tokens=6, eos_token_id=None,
                          generator=torch.Generator().manual_seed(2))
    assert not torch.equal(other.sequences, runs[0].sequences)
    with pytest.raises(ValueError, match="temperature must be 1.0"):
        dllm.generate(model, prompts, sampler="native", max_new_tokens=4, temperature=0.0)
    with pytest.raises(TypeError, match="sampler='native' runs a checkpoint's own sampler"):
        dllm.generate(load(folders("bert")), prompts, sampler="native", temperature=1.0, max_new_tokens=4)


def test_causal_native_sampler_is_transformers_generate(folders):
    """sampler="native" on a causal LM: transformers' generate, greedy == ar (also left-padded), sampled
    replays from the seed; with a drafter, transformers' assisted generation (batch 1) == ar at T = 0."""
    import dllm

    target = load(folders("llama"))
    prompts, mask = torch.tensor([[5, 6, 7], [0, 9, 10]]), torch.tensor([[1, 1, 1], [0, 1, 1]])
    greedy = dict(max_new_tokens=8, temperature=0.0, eos_token_id=None, attention_mask=mask)
    native = dllm.generate(target, prompts, sampler="native", generator=torch.Generator().manual_seed(0), **greedy)
    ar = dllm.generate(target, prompts, sampler="ar", **greedy)
    assert torch.equal(native.sequences, ar.sequences)
    assert native.stats.nfe == 8 and native.stats.new_tokens == 16 and native.exact is False
    sampled = [dllm.generate(target, prompts, sampler="native", max_new_tokens=8, eos_token_id=None,
                             generator=torch.Generator().manual_seed(4)).sequences for _ in range(2)]
    assert torch.equal(*sampled)
    assistant = load(builders.save_causal(folders("llama").parent / "assistant", "llama", seed=1))
    assisted = dllm.generate(target, prompts[:1], sampler="native", drafter=assistant, max_new_tokens=8,
                             temperature=0.0, eos_token_id=None, generator=torch.Generator().manual_seed(0))
    assert torch.equal(assisted.sequences, ar.sequences[:1]) and assisted.stats.nfe_draft > 0
    with pytest.raises(ValueError, match="assisted generation takes batch size 1"):
        dllm.generate(target, prompts, sampler="native", drafter=assistant, max_new_tokens=4, attention_mask=mask)
    with pytest.raises(TypeError, match="takes a drafter only for a causal model"):
        dllm.generate(load(folders("diffusion_gemma")), prompts[:1], sampler="native", drafter=assistant,
                      max_new_tokens=4)


def test_causal_native_ignores_the_checkpoints_generation_config(folders):
    """A checkpoint's generation_config (penalties, banned tokens, its EOS) must not change what native
    samples; prompts holding the pad id are not masked; after a stop token rows hold it, as with ar."""
    import dllm

    target = load(folders("llama"))
    prompts = torch.tensor([[0, 11, 12, 13], [12, 0, 0, 14]])  # id 0 is the pad id: real tokens here
    greedy = dict(max_new_tokens=8, temperature=0.0, eos_token_id=None)
    ar = dllm.generate(target, prompts, sampler="ar", **greedy)
    first = int(ar.sequences[0, 4])
    config = target.model.generation_config
    config.repetition_penalty, config.no_repeat_ngram_size, config.eos_token_id = 1.8, 2, first
    config.suppress_tokens = [int(ar.sequences[1, 4])]
    native = dllm.generate(target, prompts, sampler="native", generator=torch.Generator().manual_seed(0), **greedy)
    assert torch.equal(native.sequences, ar.sequences)
    assert target.model.generation_config is config and config.repetition_penalty == 1.8  # restored
    stop = int(ar.sequences[0, 6])
    stopped = dict(max_new_tokens=8, temperature=0.0, eos_token_id=stop)
    native_stopped = dllm.generate(target, prompts, sampler="native", generator=torch.Generator(), **stopped)
    assert torch.equal(native_stopped.sequences, dllm.generate(target, prompts, sampler="ar", **stopped).sequences)


def test_dream_native_sampler_runs_its_diffusion_generate(folders):
    """sampler="native" on Dream: its remote code's diffusion_generate (the stand-in has the documented call
    shape and calls the model positionally), seeded from the generator, every call counted."""
    import dllm

    model = load(builders.save_dream(folders("dream").parent / "dream_unmarked", marker_scale=0.0))
    prompts, mask = torch.tensor([[5, 6, 7], [1, 9, 10]]), torch.tensor([[1, 1, 1], [0, 1, 1]])
    common = dict(max_new_tokens=8, eos_token_id=None, attention_mask=mask, generate_kwargs={"steps": 4})
    runs = [dllm.generate(model, prompts, sampler="native", temperature=1.0,
                          generator=torch.Generator().manual_seed(5), **common) for _ in range(2)]
    assert torch.equal(runs[0].sequences, runs[1].sequences) and runs[0].sequences.shape == (2, 11)
    assert not bool((runs[0].sequences == model.mask_token_id).any())
    assert runs[0].stats.nfe == 4 and runs[0].stats.forward_tokens == 4 * 2 * 11 and runs[0].exact is False
    greedy = dllm.generate(model, prompts, sampler="native", temperature=0.0, generator=torch.Generator(), **common)
    assert not torch.equal(greedy.sequences, runs[0].sequences)


def test_causal_adapter_logits_at_equal_the_full_logits(causal):
    """``logits_at`` (Capabilities.logits_at) runs transformers' own decoder and output layer on the positions
    asked: the same numbers as the full logits there, plain and cached, ragged rows included."""
    assert causal.capabilities.logits_at
    ids, mask = _left_pad([_ids(1, 5, seed=1)[0], _ids(1, 3, seed=2)[0]])
    at = torch.tensor([[4, 1], [2, 4]])
    full = causal(ids, attention_mask=mask)
    picked = causal(ids, attention_mask=mask, logits_at=at)
    assert picked.dtype == causal.dtype and picked.shape == (2, 2, V)
    torch.testing.assert_close(picked.float(), full.gather(1, at[..., None].expand(-1, -1, V)))
    cache = causal.new_cache()
    causal.forward_cached(ids[:, :3], cache, attention_mask=mask[:, :3])
    tail = causal.forward_cached(ids[:, 3:], cache, attention_mask=mask, logits_at=torch.tensor([[1], [0]]))
    torch.testing.assert_close(tail[:, 0].float(), full[torch.arange(2), torch.tensor([4, 3])])
