"""Issue 29, real sizes: logits only where they are read, the host out of the loop, bounded forwards.

- ``logits_at`` gives the full logits' numbers at the positions asked, for every layout of the project's
  transformer (plain, cached, shifted, with features), in the model's dtype;
- no sampler's round projects more positions than it reads (a spy on the output layer), so no [B, L, V] tensor;
- ``call_tokens`` splits a verification call without changing the answer (greedy token for token, the law by
  chi-square), across the block cache's folded commits too;
- a step of the shipped diffusion model's exact samplers reads the device at most 3 times (fef) or 2 times
  (sequential), counted as a GPU would (``dllm.syncs``), whatever the window.
"""

import pytest
import torch
from test_fef_head import tiny_block_causal

import dllm
from dllm.models.oracle import HMMOracle, InconsistentModel
from dllm.models.transformer import TransformerConfig, TransformerLM
from dllm.samplers import sequential_distribution
from dllm.syncs import count_syncs

from stat_tools import ALPHA, chi_square_pvalue


def _model(layout, shift=False, dtype=torch.float32, seed=0, block_size=4):
    torch.manual_seed(seed)
    extra = {"block_size": block_size} if layout == "block_causal" else {}
    config = TransformerConfig(vocab_size=11, dim=32, n_layers=2, n_heads=2, max_seq_len=64, layout=layout,
                               mask_token_id=None if layout == "causal" else 10, shift_logits=shift, **extra)
    return TransformerLM(config).to(dtype).eval()


@pytest.mark.parametrize("layout, shift", [("bidirectional", False), ("bidirectional", True),
                                           ("block_causal", False), ("causal", False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logits_at_equal_the_full_logits(layout, shift, dtype):
    model = _model(layout, shift, dtype)
    ids = torch.randint(0, 10, (3, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # a left-padded row
    at = torch.tensor([[0, 8, 3], [2, 2, 7], [5, 6, 4]])
    full, features = model(ids, attention_mask=mask, return_hidden=True)
    picked, picked_features = model(ids, attention_mask=mask, return_hidden=True, logits_at=at)
    assert full.dtype == torch.float32 and picked.dtype == dtype and picked.shape == (3, 3, 11)
    index = at[..., None]
    assert torch.equal(picked.float(), full.gather(1, index.expand(-1, -1, 11)))
    assert torch.equal(picked_features, features.gather(1, index.expand(-1, -1, features.shape[-1])))
    cache = model.new_cache()
    model.forward_cached(ids[:, :4], cache, attention_mask=mask[:, :4])
    tail = model.forward_cached(ids[:, 4:], cache, rows=torch.tensor([0, 1, 2]), append=False, attention_mask=mask,
                                logits_at=torch.tensor([[0], [4], [2]]))
    whole = model.forward_cached(ids[:, 4:], cache, rows=torch.tensor([0, 1, 2]), append=False, attention_mask=mask)
    assert torch.equal(tail.float()[:, 0], whole[torch.arange(3), torch.tensor([0, 4, 2])])


@pytest.fixture
def projected(monkeypatch):
    """Positions per input of every output-layer call (the spy on ``TransformerLM._project``)."""
    seen, real = [], TransformerLM._project

    def spy(self, features, *args, **kwargs):
        seen.append(features.shape[1])
        return real(self, features, *args, **kwargs)

    monkeypatch.setattr(TransformerLM, "_project", spy)
    return seen


@pytest.mark.parametrize("sampler, options, most", [
    ("sequential", {}, 1),
    ("sequential", {"order": "confidence"}, 8),  # the active block: the choice reads every candidate
    ("fef", {"window": 4}, 5),  # the window and the bonus
    ("fef", {"window": 4, "draft": "stale"}, 10),  # and what the next round drafts from
    ("fef", {"window": 4, "order": "confidence"}, 8),
    ("fef", {"window": 4, "draft_candidates": 2}, 5),
    ("llada", {"steps": 8}, 8),
    ("dream", {"steps": 8}, 8),
    ("fast_dllm", {}, 8),
])
@pytest.mark.parametrize("cache", ["none", "block"])
def test_rounds_project_only_what_they_read(projected, monkeypatch, sampler, options, most, cache):
    """On a block-causal model over 6 + 16 positions in blocks of 8, no call projects more positions per input
    than the round reads (a [B, L, V] tensor would show as 22 or 8 + 8), with fef's copies one input each (packed,
    under the block cache, a row's copies share an input and project only their asked positions: the same tokens)."""
    from dllm.samplers.sessions import BlockCacheSession

    model = _model("block_causal", seed=2, block_size=8)
    if cache == "block" and sampler in ("llada", "dream"):
        pytest.skip("llada and dream run without the block cache")
    prompt = torch.randint(0, 10, (2, 6), generator=torch.Generator().manual_seed(3))

    def run():
        projected.clear()
        out = dllm.generate(model, prompt, sampler=sampler, max_new_tokens=16, temperature=1.0, cache=cache,
                            block_length=8, generator=torch.Generator().manual_seed(0), **options)
        assert out.sequences.shape == (2, 22) and projected
        return out, list(projected)

    packed, _ = run()
    real_init = BlockCacheSession.__init__

    def unpacked_init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        self.packs = False

    monkeypatch.setattr(BlockCacheSession, "__init__", unpacked_init)
    unpacked, positions = run()
    assert max(positions) <= most, positions
    assert torch.equal(packed.sequences, unpacked.sequences)


@pytest.mark.parametrize("cache", ["none", "block"])
@pytest.mark.parametrize("draft", ["marginal", "stale"])
def test_split_verification_calls_change_nothing(cache, draft):
    """``call_tokens`` runs the copies call in parts (after folding a finished block in on its own, with the
    block cache): greedy output equals the unsplit run token for token, over several blocks and a ragged batch."""
    model = tiny_block_causal(block_size=4)
    prompt = torch.tensor([[1, 3, 0, 4, 1], [0, 0, 3, 4, 1]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    runs = [dllm.generate(model, prompt, attention_mask=mask, sampler="fef", max_new_tokens=12, temperature=0.0,
                          window=4, block_length=4, cache=cache, draft=draft, **extra)
            for extra in ({}, {"call_tokens": 5}, {"call_tokens": 1})]
    assert torch.equal(runs[0].sequences, runs[1].sequences) and torch.equal(runs[0].sequences, runs[2].sequences)
    assert runs[0].stats.nfe <= runs[1].stats.nfe  # a fill before a split call is a call of its own


def test_split_verification_calls_keep_the_law():
    oracle = HMMOracle.random(num_states=3, num_tokens=3, seed=0, stickiness=2.0, sharpness=2.0)
    model = InconsistentModel(oracle, scale=1.0, seed=3)
    prompt = torch.tensor([0, 2])
    out = dllm.generate(model, prompt.expand(12000, -1), sampler="fef", max_new_tokens=4, window=3, temperature=1.0,
                        call_tokens=6 * 2000, generator=torch.Generator().manual_seed(5))
    assert chi_square_pvalue(out.sequences[:, 2:], sequential_distribution(model, prompt, 4)) > ALPHA


def test_call_tokens_is_checked():
    with pytest.raises((TypeError, ValueError), match="call_tokens"):
        dllm.generate(tiny_block_causal(), torch.tensor([[1, 3]]), sampler="fef", max_new_tokens=4, call_tokens=0)


@pytest.fixture(scope="module")
def shipped():
    return dllm.load("diffusion")


@pytest.mark.parametrize("sampler, options, most", [
    ("sequential", {}, 2),
    ("fef", {"window": 2}, 3),
    ("fef", {"window": 4}, 3),
    ("fef", {"window": 8}, 3),
    ("fef", {"window": 8, "draft": "stale"}, 3),
    ("fef", {"window": 8, "draft": "head"}, 3),
])
@pytest.mark.parametrize("batch, temperature", [(1, 0.0), (3, 1.0)])
def test_a_step_reads_the_device_at_most_three_times(shipped, sampler, options, most, temperature, batch):
    """Synchronisations between consecutive steps (the callback's own reads paused), counted as on a GPU: the
    loop's one read of the pending rows, the verify rule's draw of noise for the rows that draw (T > 0), and a
    block's end."""
    ids = torch.tensor([shipped.tokenizer.encode("Tom has 3 apples and buys 5 more. How many?")] * batch)
    marks = []
    with count_syncs(as_gpu=True) as syncs:
        def mark(event):
            with syncs.paused():
                marks.append(syncs.count)

        dllm.generate(shipped, ids, sampler=sampler, max_new_tokens=32, temperature=temperature, callback=mark,
                      generator=torch.Generator().manual_seed(0), **options)
    steps = [after - before for before, after in zip(marks, marks[1:])]
    assert len(steps) > 3 and max(steps) <= most, steps
