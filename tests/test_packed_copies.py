"""Packed verification copies (``forward``'s ``segments``, ``Capabilities.packs_copies``): the block cache's
session feeds a row's copies as one input sharing the pending finished block, instead of a row per copy that
reads the cache and repeats the block. The model's answer must be the separate rows' answer, the cache it
commits the same, and fef's output the same token for token with packing on or off."""

from __future__ import annotations

import pytest
import torch

import dllm
from dllm.models.transformer import MoEConfig, TransformerConfig, TransformerLM
from dllm.samplers.sessions import BlockCacheSession

BLOCK = 4


def _model(moe: bool = False, shift: bool = False) -> TransformerLM:
    torch.manual_seed(0)
    config = TransformerConfig(vocab_size=40, dim=32, n_layers=2, n_heads=4, max_seq_len=96, layout="block_causal",
                               block_size=BLOCK, mask_token_id=39, shift_logits=shift,
                               moe=MoEConfig(n_experts=8, experts_per_token=2, hidden=16, n_shared_experts=1,
                                             dense_layers=1) if moe else None)
    return TransformerLM(config).eval()


def _finite_close(a: torch.Tensor, b: torch.Tensor) -> None:
    """Equal up to float32 rounding, with the forbidden mask token's -inf in the same places."""
    assert torch.equal(torch.isfinite(a), torch.isfinite(b))
    assert (a - b)[torch.isfinite(a)].abs().max() < 1e-4


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_segments_equal_a_row_per_copy_and_commit_the_same_cache(moe):
    model = _model(moe)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 38, (2, 8), generator=gen)
    padding = torch.ones(2, 8, dtype=torch.long)
    padding[1, :3] = 0  # row 1: a left-padded prompt of 5 tokens, its blocks offset by 1
    offset = torch.tensor([0, 1])
    base = model.new_cache()
    model.forward_cached(prompt, base, append=True, attention_mask=padding, block_offset=offset)
    pending = torch.randint(0, 38, (2, BLOCK), generator=gen)  # a finished block, not yet cached
    copies = torch.randint(0, 38, (3, 2, 2 * BLOCK), generator=gen)  # 3 copies per row: active block + the next
    copies[:, :, 1:] = 39
    copies[1, :, 0] = 39

    separate, committed = [], None
    for row in range(2):
        for copy in range(3):
            cache = base.select(torch.tensor([row]))
            tokens = torch.cat([pending[row], copies[copy, row]])[None]
            keys = torch.cat([padding[row], torch.ones(len(tokens[0]), dtype=torch.long)])[None]
            separate.append(model.forward_cached(tokens, cache, append=False, attention_mask=keys,
                                                 block_offset=offset[row : row + 1])[0, BLOCK:])
    separate = torch.stack(separate).view(2, 3, 2 * BLOCK, -1)
    unpacked = base.select(torch.arange(2))  # the row-per-copy commit path, for the cache it leaves
    rows = torch.tensor([0, 0, 0, 1, 1, 1])
    model.forward_cached(torch.cat([pending[rows], copies.transpose(0, 1).reshape(6, -1)], dim=1), unpacked,
                         rows=rows, append=False, commit=BLOCK,
                         attention_mask=torch.cat([padding[rows], torch.ones(6, 3 * BLOCK, dtype=torch.long)], 1),
                         block_offset=offset[rows])
    committed = unpacked

    filler = torch.full((2, 3), 5)  # a short row's filler: segment -1, seen by nobody
    tokens = torch.cat([pending, copies[0], copies[1], copies[2], filler], dim=1)
    segments = torch.tensor([0] * BLOCK + [1] * 8 + [2] * 8 + [3] * 8 + [-1] * 3).expand(2, -1)
    packed_cache = base.select(torch.arange(2))
    out = model.forward_cached(tokens, packed_cache, rows=torch.arange(2), append=False, commit=BLOCK,
                               segments=segments, block_offset=offset,
                               attention_mask=torch.cat([padding, torch.ones(2, tokens.shape[1], dtype=torch.long)], 1))
    _finite_close(out[:, BLOCK : BLOCK + 24].reshape(2, 3, 2 * BLOCK, -1), separate)
    assert packed_cache.length == committed.length == 8 + BLOCK
    assert torch.equal(packed_cache.positions, committed.positions)
    assert torch.equal(packed_cache.valid, committed.valid)
    for packed_keys, keys in zip(packed_cache.keys, committed.keys, strict=True):
        assert (packed_keys - keys).abs().max() < 1e-5


def test_segments_refuse_what_they_cannot_pack():
    tokens, segments = torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="shifted logits"):
        _model(shift=True).forward(tokens, segments=segments)
    with pytest.raises(ValueError, match="no tree_mask or position_ids"):
        _model().forward(tokens, segments=segments, position_ids=torch.arange(4)[None])
    assert not _model(shift=True).capabilities.packs_copies and _model().capabilities.packs_copies


@pytest.mark.parametrize("options", [{"draft": "marginal"}, {"draft": "stale"}, {"draft_candidates": 2},
                                     {"draft": "stale", "order": "confidence"}],
                         ids=["marginal", "stale", "tree", "stale-confidence"])
def test_fef_is_the_same_with_copies_packed_or_not(monkeypatch, options):
    """A ragged batch (prompts of 3, 6 and 9 tokens, left-padded) with a stop id: the same tokens, steps and
    accepted drafts at T=0. One row alone, stale drafts: fewer forward tokens packed (the finished block rides
    with the copies and is fed once, not once per copy; marginal drafts commit it in their state call, so the
    count is the same and packing saves the cache read per copy). In a batch, rows with fewer copies carry
    filler, counted as computed."""
    model = _model()
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 38, (3, 9), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, :6], mask[1, :3] = 0, 0
    kwargs = dict(sampler="fef", max_new_tokens=16, block_length=BLOCK, window=4, attention_mask=mask,
                  eos_token_id=7, **options)
    packed = dllm.generate(model, ids, **kwargs)
    monkeypatch.setattr(BlockCacheSession, "_pack", None)  # fail loudly if the unpacked run still packed
    monkeypatch.setattr(BlockCacheSession, "__init__", _unpacked_init)
    unpacked = dllm.generate(model, ids, **kwargs)
    assert torch.equal(packed.sequences, unpacked.sequences)
    assert packed.stats.nfe == unpacked.stats.nfe
    assert packed.stats.accepted == unpacked.stats.accepted
    alone = dllm.generate(model, ids[2:], **{**kwargs, "attention_mask": None})
    monkeypatch.undo()
    tokens = dllm.generate(model, ids[2:], **{**kwargs, "attention_mask": None}).stats.forward_tokens
    assert tokens < alone.stats.forward_tokens if options.get("draft") == "stale" else \
        tokens <= alone.stats.forward_tokens


_ORIGINAL_INIT = BlockCacheSession.__init__


def _unpacked_init(self, *args, **kwargs):
    _ORIGINAL_INIT(self, *args, **kwargs)
    self.packs = False


def test_packing_keeps_fef_at_temperature_one_on_the_same_draws():
    """At T=1 with one seed, the draws are the same whether copies are packed or not (the logits agree to
    float32 rounding, and every random number is drawn in the same order)."""
    model = _model()
    ids = torch.randint(0, 38, (2, 5), generator=torch.Generator().manual_seed(3))
    kwargs = dict(sampler="fef", max_new_tokens=12, block_length=BLOCK, window=3, temperature=1.0)
    first = dllm.generate(model, ids, generator=torch.Generator().manual_seed(4), **kwargs)
    session = BlockCacheSession.__init__
    try:
        BlockCacheSession.__init__ = _unpacked_init
        second = dllm.generate(model, ids, generator=torch.Generator().manual_seed(4), **kwargs)
    finally:
        BlockCacheSession.__init__ = session
    assert torch.equal(first.sequences, second.sequences)


def test_the_shipped_sdar_model_decodes_the_same_packed(monkeypatch):
    """SDAR's native model (blocks from position 0, the prompt's tail in the first block), stale drafts: packed
    and unpacked runs give the same tokens."""
    model = dllm.load("sdar")
    assert model.capabilities.packs_copies
    tokenizer = model.tokenizer
    prompts = ["Question: Tom has 3 bags with 4 apples each. How many apples does Tom have?\nAnswer:",
               "Question: 7 + 5 = ?\nAnswer:"]
    tokenizer.padding_side = "left"
    batch = tokenizer(prompts, padding=True, return_tensors="pt")
    kwargs = dict(sampler="fef", draft="stale", max_new_tokens=24, attention_mask=batch["attention_mask"])
    packed = dllm.generate(model, batch["input_ids"], **kwargs)
    monkeypatch.setattr(BlockCacheSession, "__init__", _unpacked_init)
    unpacked = dllm.generate(model, batch["input_ids"], **kwargs)
    assert torch.equal(packed.sequences, unpacked.sequences)
    assert packed.stats.forward_tokens < unpacked.stats.forward_tokens
