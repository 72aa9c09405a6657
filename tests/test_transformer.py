"""Tests for dllm.models.transformer: layouts, padding, KV cache exactness, config, save/load, bf16."""

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dllm.models.cache import KVCache
from dllm.models.transformer import TransformerConfig, TransformerLM, layout_mask

VOCAB = 61
MASK_ID = 60
LAYOUT_KWARGS = {
    "causal": {},
    "bidirectional": {"mask_token_id": MASK_ID},
    "block_causal": {"mask_token_id": MASK_ID, "block_size": 4},
}


def _model(layout="causal", seed=0, **overrides) -> TransformerLM:
    """A tiny fp32 model with deterministic weights."""
    torch.manual_seed(seed)
    fields = dict(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, max_seq_len=64, layout=layout)
    return TransformerLM(TransformerConfig(**{**fields, **LAYOUT_KWARGS[layout], **overrides})).eval()


def _ids(batch, length, seed=1) -> torch.Tensor:
    """Random tokens that avoid the mask id.  # [B, L]"""
    return torch.randint(0, MASK_ID, (batch, length), generator=torch.Generator().manual_seed(seed))


def _changed(logits_a, logits_b, position) -> bool:
    """Whether any row's logits at one position differ beyond float noise."""
    return not torch.allclose(logits_a[:, position], logits_b[:, position], atol=1e-5)


@pytest.mark.parametrize("layout", list(LAYOUT_KWARGS))
def test_shapes_dtype_and_mask_logit(layout):
    model = _model(layout)
    logits = model(_ids(3, 10))
    assert logits.shape == (3, 10, VOCAB) and logits.dtype == torch.float32
    assert model.vocab_size == VOCAB and model.config.layout == layout
    if layout == "causal":
        assert not hasattr(model, "mask_token_id") and torch.isfinite(logits).all()
    else:
        assert model.mask_token_id == MASK_ID
        assert torch.isneginf(logits[..., MASK_ID]).all() and torch.isfinite(logits[..., :MASK_ID]).all()


@settings(max_examples=50, deadline=None)
@given(
    length=st.integers(1, 12),
    block_size=st.integers(1, 5),
    offset=st.integers(-3, 6),
    layout=st.sampled_from(list(LAYOUT_KWARGS)),
)
def test_layout_mask_matches_definition(length, block_size, offset, layout):
    positions = torch.arange(length)[None]
    mask = layout_mask(layout, positions, positions, block_size=block_size, block_offset=offset)[0]
    for q in range(length):
        for k in range(length):
            expected = {
                "causal": k <= q,
                "bidirectional": True,
                "block_causal": (k - offset) // block_size <= (q - offset) // block_size,
            }[layout]
            assert bool(mask[q, k]) == expected


@pytest.mark.parametrize("gqa", [None, 2])
def test_causal_ignores_future_tokens(gqa):
    model, ids = _model("causal", n_kv_heads=gqa), _ids(2, 12)
    later = ids.clone()
    later[:, 7:] = (later[:, 7:] + 1) % MASK_ID
    before, after = model(ids), model(later)
    assert all(not _changed(before, after, i) for i in range(7))
    assert all(_changed(before, after, i) for i in range(7, 12))


def test_block_causal_sees_own_block_not_later_blocks():
    model, ids = _model("block_causal"), _ids(2, 12)  # blocks [0,4) [4,8) [8,12)
    edited = ids.clone()
    edited[:, 6] = (edited[:, 6] + 1) % MASK_ID  # a token in the middle of block 1
    before, after = model(ids), model(edited)
    assert all(not _changed(before, after, i) for i in range(4))
    assert all(_changed(before, after, i) for i in range(4, 12))  # incl. 4, 5: earlier in the same block


def test_block_offset_aligns_blocks_and_matches_explicit_mask():
    model, ids = _model("block_causal"), _ids(2, 12)
    edited = ids.clone()
    edited[:, 5] = (edited[:, 5] + 1) % MASK_ID  # with offset 2, blocks are [2,6) [6,10) ...
    before, after = model(ids, block_offset=2), model(edited, block_offset=2)
    assert not _changed(before, after, 1) and _changed(before, after, 2)
    positions = torch.arange(12).expand(2, 12)
    mask = layout_mask("block_causal", positions, positions, block_size=4, block_offset=torch.tensor([2, 2]))
    torch.testing.assert_close(model(ids, attention_mask=mask[:, None]), before)


def test_bidirectional_depends_on_everything():
    model, ids = _model("bidirectional"), _ids(2, 10)
    edited = ids.clone()
    edited[:, -1] = (edited[:, -1] + 1) % MASK_ID
    before, after = model(ids), model(edited)
    assert all(_changed(before, after, i) for i in range(10))


def test_rotary_positions_order_tokens_and_are_relative():
    model, ids = _model("bidirectional"), _ids(2, 10)
    logits = model(ids)
    # without positions a bidirectional model would be permutation-equivariant
    assert not torch.allclose(model(ids.flip(1)), logits.flip(1), atol=1e-5)
    shifted = model(ids, position_ids=torch.arange(10).expand(2, 10) + 7)
    torch.testing.assert_close(shifted, logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("layout", list(LAYOUT_KWARGS))
def test_left_padding_matches_unpadded_rows(layout):
    model = _model(layout)
    long_row, short_row = _ids(1, 10, seed=2), _ids(1, 7, seed=3)
    pad = torch.zeros(1, 3, dtype=torch.long)
    ids = torch.cat((long_row, torch.cat((pad, short_row), dim=1)))
    attention_mask = torch.ones(2, 10, dtype=torch.long)
    attention_mask[1, :3] = 0
    logits = model(ids, attention_mask=attention_mask)
    torch.testing.assert_close(logits[:1], model(long_row), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits[1:, 3:], model(short_row), atol=1e-5, rtol=1e-5)


def test_causal_incremental_cache_matches_full_forward():
    model, ids = _model("causal", n_kv_heads=2), _ids(2, 12)
    full = model(ids)
    cache = model.new_cache()
    steps = [model(ids[:, :5], cache=cache, use_cache=True)]
    steps += [model(ids[:, i : i + 1], cache=cache, use_cache=True) for i in range(5, 12)]
    assert cache.length == 12
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-4, rtol=1e-4)


def test_causal_cache_with_left_padding():
    model = _model("causal")
    padded = torch.cat((torch.zeros(1, 2, dtype=torch.long), _ids(1, 7, seed=5)), dim=1)
    ids = torch.cat((_ids(1, 9, seed=4), padded))
    attention_mask = torch.ones(2, 9, dtype=torch.long)
    attention_mask[1, :2] = 0
    full = model(ids, attention_mask=attention_mask)
    cache = model.new_cache()
    model(ids[:, :6], attention_mask=attention_mask[:, :6], cache=cache, use_cache=True)
    rest = model(ids[:, 6:], cache=cache)
    torch.testing.assert_close(rest, full[:, 6:], atol=1e-4, rtol=1e-4)
    assert cache.length == 6  # read-only without use_cache


def test_block_causal_prefix_cache_serves_expanded_copies():
    model, width = _model("block_causal"), 3
    prefix, blocks = _ids(2, 8, seed=6), _ids(2 * width, 4, seed=7)  # 2 whole blocks, 3 variants of block 2
    cache = model.new_cache()
    model(prefix, cache=cache, use_cache=True)
    copies = model(blocks, cache=cache.expand(width))
    full = model(torch.cat((prefix.repeat_interleave(width, dim=0), blocks), dim=1))
    torch.testing.assert_close(copies, full[:, 8:], atol=1e-4, rtol=1e-4)


def test_expand_single_row_is_a_view():
    model = _model("block_causal")
    cache = model.new_cache()
    model(_ids(1, 8), cache=cache, use_cache=True)
    wide = cache.expand(5)
    assert wide.batch_size == 5 and wide.keys[0].data_ptr() == cache.keys[0].data_ptr()
    assert wide.keys[0].stride(0) == 0


def test_cache_rollback_after_rejected_drafts():
    model, ids = _model("causal"), _ids(2, 10)
    cache = model.new_cache()
    model(ids[:, :6], cache=cache, use_cache=True)
    model(_ids(2, 3, seed=9), cache=cache, use_cache=True)  # drafts, all rejected
    cache.crop(6)
    rest = model(ids[:, 6:], cache=cache, use_cache=True)
    torch.testing.assert_close(rest, model(ids)[:, 6:], atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="crop length"):
        cache.crop(11)


def test_ragged_rollback_per_row():
    model, ids = _model("causal"), _ids(2, 10)
    cache = model.new_cache()
    model(ids[:, :8], cache=cache, use_cache=True)
    cache.crop(torch.tensor([8, 5]))  # row 1 rejected its last 3 tokens
    logits = model(torch.stack((ids[0, 8:10], ids[1, 5:7])), cache=cache)
    torch.testing.assert_close(logits[0], model(ids[:1])[0, 8:10], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[1], model(ids[1:, :7])[0, 5:7], atol=1e-4, rtol=1e-4)


def test_select_keeps_rows():
    model, ids = _model("causal"), _ids(3, 8)
    cache = model.new_cache()
    model(ids[:, :5], cache=cache, use_cache=True)
    rows = torch.tensor([2, 0])
    logits = model(ids[rows, 5:], cache=cache.select(rows))
    torch.testing.assert_close(logits, model(ids[rows])[:, 5:], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("attention_mask", "message"),
    [
        (torch.ones(2, 5), "match input_ids"),
        (torch.ones(2, 6, 6), "must be bool"),
        (torch.ones(2, 2, 6, 6, dtype=torch.bool), "\\[B, 1, Lq, Lk\\]"),
        (torch.ones(2, 6, 7, dtype=torch.bool), "cached \\+ new keys"),
    ],
)
def test_bad_attention_masks_are_explained(attention_mask, message):
    with pytest.raises(ValueError, match=message):
        _model()(_ids(2, 6), attention_mask=attention_mask)


def test_use_cache_without_cache_is_an_error():
    with pytest.raises(ValueError, match="new_cache"):
        _model()(_ids(1, 3), use_cache=True)
    assert KVCache().length == 0


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"layout": "encoder"}, "layout"),
        ({"dim": 30}, "n_heads"),
        ({"n_kv_heads": 3}, "n_kv_heads"),
        ({"dim": 12, "n_heads": 4}, "head_dim"),
        ({"vocab_size": 0}, "vocab_size"),
        ({"layout": "block_causal", "mask_token_id": 1}, "block_size"),
        ({"block_size": 4}, "block_size"),
        ({"layout": "bidirectional"}, "mask_token_id"),
        ({"mask_token_id": 1}, "mask_token_id"),
        ({"eos_token_id": VOCAB}, "eos_token_id"),
        ({"norm_eps": 0.0}, "norm_eps"),
        ({"tie_embeddings": "yes"}, "tie_embeddings"),
    ],
)
def test_config_validation_names_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        TransformerConfig(**{"vocab_size": VOCAB, "dim": 32, "n_heads": 4, **overrides})


def test_config_dict_round_trip_rejects_unknown_keys():
    config = TransformerConfig(vocab_size=VOCAB, layout="block_causal", block_size=8, mask_token_id=3)
    assert TransformerConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match="unknown TransformerConfig keys \\['n_layer'\\]"):
        TransformerConfig.from_dict({**config.to_dict(), "n_layer": 2})


@pytest.mark.parametrize("tie", [True, False])
def test_save_load_round_trip(tmp_path, tie):
    model, ids = _model("block_causal", tie_embeddings=tie), _ids(2, 8)
    model.save_pretrained(tmp_path)
    loaded = TransformerLM.from_pretrained(tmp_path)
    assert loaded.config == model.config and loaded.param_count() == model.param_count()
    assert (loaded.output.weight is loaded.tok_embeddings.weight) == tie
    torch.testing.assert_close(loaded(ids), model(ids), atol=0, rtol=0)
    half = TransformerLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert half.tok_embeddings.weight.dtype == torch.bfloat16


def test_param_count_counts_tied_weights_once():
    tied, untied = _model(tie_embeddings=True), _model(tie_embeddings=False)
    assert untied.param_count() - tied.param_count() == VOCAB * 32


@pytest.mark.parametrize("layout", list(LAYOUT_KWARGS))
def test_bf16_close_to_fp32(layout):
    model, ids = _model(layout, tie_embeddings=False), _ids(4, 32)
    with torch.no_grad():
        model.output.weight.mul_(20)  # logits spread like a trained model's (std ~ 3), not near-uniform
    reference = model(ids)
    half = copy.deepcopy(model).to(torch.bfloat16)
    assert half.rotary.cos.dtype == torch.float32
    logits = half(ids)
    finite = torch.isfinite(reference)
    assert logits.dtype == torch.float32
    assert (logits - reference)[finite].abs().max() < 0.05 * reference[finite].std()
    assert (logits.argmax(-1) == reference.argmax(-1)).float().mean() >= 0.9


def test_positions_beyond_max_seq_len_are_rejected():
    with pytest.raises(ValueError, match="max_seq_len"):
        _model()(_ids(1, 65, seed=2))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("layout", list(LAYOUT_KWARGS))
def test_cuda_matches_cpu_with_cache(layout):
    model, ids = _model(layout), _ids(2, 12)
    reference = model(ids)
    gpu = copy.deepcopy(model).cuda()
    cache = gpu.new_cache()
    gpu(ids[:, :8].cuda(), cache=cache, use_cache=True, block_offset=torch.tensor([0, 0]).cuda())
    rest = gpu(ids[:, 8:].cuda(), cache=cache)
    full = gpu(ids.cuda())
    torch.testing.assert_close(full.cpu(), reference, atol=1e-3, rtol=1e-3)
    if layout != "bidirectional":  # a cache is exact only for causal and whole-block prefixes
        torch.testing.assert_close(rest.cpu(), reference[:, 8:], atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("layout", ["causal", "block_causal", "bidirectional"])
def test_return_hidden_gives_the_features_the_logits_are_projected_from(layout):
    extra = {"block_size": 4} if layout == "block_causal" else {}
    if layout != "causal":
        extra["mask_token_id"] = 2
    config = TransformerConfig(vocab_size=40, dim=32, n_layers=2, n_heads=2, max_seq_len=32, layout=layout, **extra)
    model = TransformerLM(config).eval()
    ids = torch.randint(3, 40, (2, 9), generator=torch.Generator().manual_seed(0))
    logits, features = model(ids, return_hidden=True)
    assert features.shape == (2, 9, 32)
    torch.testing.assert_close(logits, model(ids))
    torch.testing.assert_close(model._project(features), logits)
    cache = model.new_cache()
    model.forward_cached(ids[:, :4], cache)
    cached_logits, cached_features = model.forward_cached(ids[:, 4:], cache, append=False, return_hidden=True)
    if layout != "bidirectional":  # the cache is exact there: the same features as the full call
        torch.testing.assert_close(cached_features, features[:, 4:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cached_logits, model._project(cached_features))
    assert model.capabilities.hidden_states


def test_keep_layers_drops_layers_and_round_trips(tmp_path):
    """keep_layers([0, 2]) of a 3-layer model computes what the model computes with its middle layer
    skipped, saves as a 2-layer model that loads back to the same logits, and refuses bad indices."""
    model = _model("block_causal", n_layers=3)
    ids = _ids(2, 12)
    skipped = copy.deepcopy(model)
    skipped.layers[1].forward = lambda x, *rest: (x, None, None)  # the residual stream passes layer 1 unchanged
    expected = skipped(ids, block_offset=torch.zeros(2, dtype=torch.long))
    kept = copy.deepcopy(model)
    kept.keep_layers([0, 2])
    assert kept.config.n_layers == 2 and len(kept.layers) == 2
    got = kept(ids, block_offset=torch.zeros(2, dtype=torch.long))
    assert torch.allclose(got, expected, atol=1e-5)
    kept.save_pretrained(tmp_path / "m")
    again = TransformerLM.from_pretrained(tmp_path / "m")
    assert torch.allclose(again(ids, block_offset=torch.zeros(2, dtype=torch.long)), got, atol=1e-6)
    for bad in ([], [1, 0], [0, 0], [3], [-1]):
        with pytest.raises(ValueError, match="layers to keep must be increasing indices in 0..2"):
            copy.deepcopy(model).keep_layers(bad)
