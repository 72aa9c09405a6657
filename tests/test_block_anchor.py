"""Block-causal models whose blocks start at position 0 (``Capabilities.block_anchor == "absolute"``: SDAR,
LLaDA2): the canvas opens with the prompt's tail in the first block and runs on to a model block's end; exact
samplers keep the enumerated chain's law there, with and without the block cache, and a ragged batch decodes
each row as if alone. The same where a run chooses its attention blocks (``Capabilities.run_blocks``, as SDAR's and
LLaDA2's official decoders do): a block_length other than the checkpoint's block_size is the run's block layout,
whose chain the exact samplers sample."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest
import torch

import dllm
from dllm.models.oracle import HMMOracle, InconsistentModel, Wrapper
from dllm.models.transformer import TransformerConfig, TransformerLM
from dllm.protocols import Capabilities, capabilities, run_block_size
from dllm.samplers import sequential_distribution
from dllm.samplers.sessions import choose_session

from stat_tools import ALPHA, chi_square_pvalue, sharp

N_SAMPLES = 6000


class AnchoredLM(TransformerLM):
    """The project's block-causal transformer declared as trained with blocks from position 0."""

    @property
    def capabilities(self) -> Capabilities:
        return dataclasses.replace(super().capabilities, block_anchor="absolute")


@pytest.fixture(scope="module")
def model() -> AnchoredLM:
    torch.manual_seed(3)
    config = TransformerConfig(vocab_size=5, dim=32, n_layers=2, n_heads=2, max_seq_len=64, layout="block_causal",
                               block_size=2, mask_token_id=4)
    return sharp(AnchoredLM(config), 3.0)


@dataclass(frozen=True)
class BlockOracle(Wrapper):
    """A logits function that sees, at each position, its own block and the blocks before it (blocks of ``size``
    from ``block_offset``, in position ids): a block-causal model with exact, known conditionals. Its base is
    inconsistent (``InconsistentModel``: the logits depend on how many positions are masked), so which tokens a
    position sees, hence where the blocks start, changes the chain's law."""

    base: InconsistentModel
    size: int = 2
    anchor: str = "absolute"
    run_blocks: bool = False  # a run's block_size= replaces ``size`` (Capabilities.run_blocks)

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(block_size=self.size, block_anchor=self.anchor, run_blocks=self.run_blocks)

    def __call__(self, input_ids: torch.Tensor, block_offset=0, block_size=None, **unused) -> torch.Tensor:
        assert block_size is None or self.run_blocks, "block_size= for a model whose blocks are its own"
        size = self.size if block_size is None else block_size
        offset = torch.as_tensor(block_offset).reshape(-1, 1)  # [N or 1, 1]
        blocks = torch.div(torch.arange(input_ids.shape[1])[None, :] - offset, size, rounding_mode="floor")
        logits = torch.empty((*input_ids.shape, self.vocab_size), dtype=torch.float64)
        for b in blocks.unique().tolist():  # each block's rows from a call that hides every later block
            hidden = input_ids.masked_fill(blocks > b, self.mask_token_id)
            rows = (blocks == b).expand_as(input_ids)
            logits[rows] = self.base(hidden).double()[rows]
        return logits


@dataclass(frozen=True)
class PrefixBlockOracle(BlockOracle):
    """A BlockOracle whose positions in block b are answered from the prefix ending with block b: later positions
    do not exist for them (rather than being masked), as for a block-causal model's attention, so which masked
    positions share a block changes the logits (the base's bias reads the length and the masked count)."""

    def __call__(self, input_ids: torch.Tensor, block_offset=0, block_size=None, **unused) -> torch.Tensor:
        assert block_size is None or self.run_blocks, "block_size= for a model whose blocks are its own"
        size = self.size if block_size is None else block_size
        offset = torch.as_tensor(block_offset).reshape(-1)
        assert bool((offset == offset[0]).all()), "one block offset for every row"
        blocks = torch.div(torch.arange(input_ids.shape[1]) - offset[0], size, rounding_mode="floor")  # [L]
        logits = torch.empty((*input_ids.shape, self.vocab_size), dtype=torch.float64)
        for b in blocks.unique().tolist():
            end = int((blocks <= b).sum())
            logits[:, blocks == b] = self.base(input_ids[:, :end]).double()[:, blocks[:end] == b]
        return logits


@pytest.fixture(scope="module")
def oracle() -> BlockOracle:
    hmm = HMMOracle.random(num_states=3, num_tokens=3, seed=1, stickiness=4.0, sharpness=3.0)
    return BlockOracle(InconsistentModel(hmm, scale=1.5, seed=2))


def _sample(model, prompt, gen, temperature=1.0, **options):
    with torch.no_grad():
        out = dllm.generate(model, prompt.expand(N_SAMPLES, -1), max_new_tokens=gen, temperature=temperature,
                            generator=torch.Generator().manual_seed(0), **options)
    return out


@pytest.mark.parametrize("prompt, gen", [([0, 1, 3], 3), ([0, 1, 3], 2), ([2, 1], 3)])
@pytest.mark.parametrize("sampler, options", [
    ("sequential", {}), ("sequential", {"cache": "none"}), ("fef", {"window": 2}),
    ("fef", {"window": 3, "cache": "none"}), ("fef", {"window": 2, "draft": "stale"}),
    ("sequential", {"order": "confidence"}), ("fef", {"window": 2, "order": "confidence"}),
])
def test_exact_samplers_keep_the_anchored_chains_law(model, prompt, gen, sampler, options):
    """A prompt of 3 or 2 tokens in blocks of 2: the first block holds the prompt's last token (or none), and an
    odd total runs one mask past max_new_tokens to the block's end, decoded as the chain decodes it."""
    prompt = torch.tensor(prompt)
    order = options.get("order", "left_to_right")
    expected = sequential_distribution(model, prompt, gen, block_length=2, temperature=1.0, order=order)
    out = _sample(model, prompt[None], gen, sampler=sampler, **options)
    assert out.sequences.shape == (N_SAMPLES, prompt.numel() + gen)
    assert out.exact
    p = chi_square_pvalue(out.sequences[:, prompt.numel():], expected)
    assert p > ALPHA, (sampler, options, p)


@pytest.mark.parametrize("prompt, gen", [([0, 1, 2], 3), ([2, 1], 3), ([0, 1, 2], 4)])
@pytest.mark.parametrize("sampler, options", [
    ("sequential", {}), ("fef", {"window": 2}), ("fef", {"window": 2, "draft": "stale"}),
    ("sequential", {"order": "confidence"}), ("fef", {"window": 2, "order": "confidence"}),
])
def test_exact_samplers_keep_the_law_of_an_anchored_oracle(oracle, prompt, gen, sampler, options):
    """The same on an oracle whose tokens depend strongly on each other: full-sequence calls, copies verifier."""
    prompt = torch.tensor(prompt)
    order = options.get("order", "left_to_right")
    expected = sequential_distribution(oracle, prompt, gen, block_length=2, temperature=1.0, order=order)
    out = _sample(oracle, prompt[None], gen, sampler=sampler, **options)
    assert out.exact
    assert chi_square_pvalue(out.sequences[:, prompt.numel():], expected) > ALPHA, (sampler, options)


@pytest.mark.parametrize("wrong", ["answer anchor", "llada"])
def test_the_test_rejects_what_is_not_the_anchored_chain(oracle, wrong):
    """A sampler that ignores the anchor (the same oracle declared anchored at the answer) and a parallel one
    (llada, both tokens of a block at once from the marginals) fail the same test."""
    prompt = torch.tensor([0, 1, 2])
    if wrong == "llada":
        expected = sequential_distribution(oracle, prompt, 4, block_length=2, temperature=1.0)
        out = _sample(oracle, prompt[None], 4, sampler="llada", steps=3)
    else:
        expected = sequential_distribution(oracle, prompt, 4, block_length=2, temperature=1.0)
        out = _sample(dataclasses.replace(oracle, anchor="answer"), prompt[None], 4, sampler="sequential")
    assert chi_square_pvalue(out.sequences[:, 3:], expected) < ALPHA


@pytest.mark.parametrize("options", [{"sampler": "fef", "window": 2}, {"sampler": "fef", "window": 3, "cache": "none"},
                                     {"sampler": "fef", "window": 2, "draft": "stale"},
                                     {"sampler": "sequential", "cache": "none"}])
def test_greedy_runs_match_block_cached_sequential_token_for_token(model, options):
    """At T=0 every exact sampler, with or without the block cache, gives block-cached sequential's tokens (the
    cache holds whole prompt blocks and finished blocks only: a wrong cache changes logits, hence argmaxes)."""
    prompts = torch.tensor([[0, 1, 3, 2, 1], [2, 1, 0, 0, 3]])
    assert choose_session("auto", model, 2) == "block"
    with torch.no_grad():
        for length in (5, 4, 3):
            ids = prompts[:, :length]
            reference = dllm.generate(model, ids, sampler="sequential", max_new_tokens=7, temperature=0.0)
            out = dllm.generate(model, ids, max_new_tokens=7, temperature=0.0, **options)
            assert out.sequences.tolist() == reference.sequences.tolist(), (length, options)


@pytest.mark.parametrize("sampler, options", [("sequential", {}), ("fef", {"window": 2}),
                                              ("fef", {"window": 2, "cache": "none"})])
def test_a_ragged_batch_decodes_each_row_as_alone(model, sampler, options):
    """Prompts of 3, 2 and 4 tokens (two ending mid-block, one at a block's end) left-padded in one batch, one
    generator per row: every row's tokens equal its own run's, at T=1, and the events name batch rows."""
    prompts = [[0, 1, 3], [2, 1], [1, 1, 0, 2]]
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    seen = set()

    def record(event):
        seen.update(event.rows.tolist())

    with torch.no_grad():
        batch = dllm.generate(model, ids, attention_mask=mask, max_new_tokens=3, temperature=1.0, sampler=sampler,
                              generator=[torch.Generator().manual_seed(10 + r) for r in range(3)], callback=record,
                              **options)
        for r, p in enumerate(prompts):
            alone = dllm.generate(model, torch.tensor([p]), max_new_tokens=3, temperature=1.0, sampler=sampler,
                                  generator=[torch.Generator().manual_seed(10 + r)], **options)
            assert batch.sequences[r, width:].tolist() == alone.sequences[0, len(p):].tolist(), (r, sampler)
    assert seen == {0, 1, 2}


# --- a run's own blocks (Capabilities.run_blocks: SDAR's and LLaDA2's official decoders choose them) ---------------

RUN_WARNING = r"block_length=\d+ sets this run's attention blocks"


class RunBlocksLM(AnchoredLM):
    """The anchored transformer whose attention blocks are a run's choice (its block_size, 2, only the default)."""

    @property
    def capabilities(self) -> Capabilities:
        return dataclasses.replace(super().capabilities, run_blocks=True)


@pytest.fixture(scope="module")
def run_model(model) -> RunBlocksLM:
    made = RunBlocksLM(model.config)
    made.load_state_dict(model.state_dict())
    return made.eval()


@pytest.fixture(scope="module")
def run_oracle(oracle) -> PrefixBlockOracle:
    """The oracle's base answering from block prefixes, blocks of 4 as the checkpoint's, a run's choice."""
    return PrefixBlockOracle(oracle.base, size=4, run_blocks=True)


def test_a_calls_block_size_replaces_the_checkpoints(model, run_model):
    """``block_size=`` on a call gives the logits of the same weights built with that block size: plain, cached
    and one-pass verify calls; a run's block size is block_length on such a model, the checkpoint's elsewhere."""
    four = AnchoredLM(dataclasses.replace(model.config, block_size=4))
    four.load_state_dict(model.state_dict())
    x = torch.randint(0, 4, (2, 11), generator=torch.Generator().manual_seed(0))
    zero = torch.zeros(2, dtype=torch.long)
    with torch.no_grad():
        torch.testing.assert_close(run_model(x, block_offset=zero, block_size=4), four(x, block_offset=zero),
                                   rtol=0, atol=0)
        assert not torch.equal(run_model(x, block_offset=zero), four(x, block_offset=zero))
        ours, theirs = run_model.new_cache(), four.new_cache()
        run_model.forward_cached(x[:, :8], ours, block_offset=zero, block_size=4)
        four.forward_cached(x[:, :8], theirs, block_offset=zero)
        torch.testing.assert_close(run_model.forward_cached(x[:, 8:], ours, block_offset=zero, block_size=4),
                                   four.forward_cached(x[:, 8:], theirs, block_offset=zero), rtol=0, atol=0)
        args = (x, torch.tensor([[8, 9], [9, 10]]), torch.tensor([[1, 2], [3, 0]]), torch.tensor([2, 1]),
                torch.tensor([10, -1]))
        for mine, other in zip(run_model.structured_verify(*args, block_offset=zero, block_size=4),
                               four.structured_verify(*args, block_offset=zero), strict=True):
            torch.testing.assert_close(mine, other, rtol=0, atol=0)
    with pytest.raises(ValueError, match="block_size= is for a block_causal model"):
        TransformerLM(TransformerConfig(vocab_size=5, dim=16, n_layers=1, n_heads=2, max_seq_len=16,
                                        layout="bidirectional", mask_token_id=4))(x, block_size=4)
    assert (run_block_size(run_model, 3), run_block_size(model, 1), run_block_size(model, None)) == (3, 2, 2)
    assert capabilities(run_model).run_blocks and not capabilities(model).run_blocks


def test_a_run_block_other_than_the_checkpoints_is_said_in_one_warning(run_model):
    import warnings

    with pytest.warns(UserWarning, match=RUN_WARNING + r" \(4 positions\), not RunBlocksLM's block_size=2"):
        out = _sample(run_model, torch.tensor([[0, 1, 3]]), 4, sampler="sequential", block_length=4)
    assert out.options["block_length"] == 4 and choose_session("auto", run_model, 4) == "block"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _sample(run_model, torch.tensor([[0, 1, 3]]), 4, sampler="sequential")  # the checkpoint's blocks: silent


@pytest.mark.parametrize("block, prompt, gen", [(4, [0, 1, 3], 3), (3, [0, 1, 3, 2], 3), (4, [2, 1], 3),
                                                (6, [0, 1, 3], 3)])
@pytest.mark.parametrize("sampler, options", [
    ("sequential", {}), ("sequential", {"cache": "none"}), ("fef", {"window": 2}),
    ("fef", {"window": 3, "cache": "none"}), ("fef", {"window": 2, "draft": "stale"}),
    ("sequential", {"order": "confidence"}), ("fef", {"window": 2, "order": "confidence"}),
])
def test_exact_samplers_keep_the_law_of_a_runs_own_blocks(run_model, block, prompt, gen, sampler, options):
    """Blocks of 4, 3 and 1 on a checkpoint of blocks of 2: the attention blocks are the run's (with the exact
    block cache: the copies packed, the finished block committed), the canvas opens with the prompt's tail and
    runs to a run block's end."""
    prompt = torch.tensor(prompt)
    order = options.get("order", "left_to_right")
    expected = sequential_distribution(run_model, prompt, gen, block_length=block, temperature=1.0, order=order)
    with pytest.warns(UserWarning, match=RUN_WARNING):
        out = _sample(run_model, prompt[None], gen, sampler=sampler, block_length=block, **options)
    assert out.exact
    p = chi_square_pvalue(out.sequences[:, prompt.numel():], expected)
    assert p > ALPHA, (block, sampler, options, p)


@pytest.mark.parametrize("prompt, gen", [([0, 1, 2], 5), ([2, 1], 4)])
@pytest.mark.parametrize("sampler, options", [("sequential", {}), ("fef", {"window": 2}),
                                              ("fef", {"window": 2, "draft": "stale"}),
                                              ("sequential", {"order": "confidence"}),
                                              ("fef", {"window": 2, "order": "confidence"})])
def test_exact_samplers_keep_the_law_of_an_oracles_run_blocks(run_oracle, prompt, gen, sampler, options):
    """Blocks of 2 on an oracle whose checkpoint blocks are 4 (full-sequence calls, copies verifier)."""
    prompt = torch.tensor(prompt)
    order = options.get("order", "left_to_right")
    expected = sequential_distribution(run_oracle, prompt, gen, block_length=2, temperature=1.0, order=order)
    with pytest.warns(UserWarning, match=RUN_WARNING):
        out = _sample(run_oracle, prompt[None], gen, sampler=sampler, block_length=2, **options)
    assert out.exact
    assert chi_square_pvalue(out.sequences[:, prompt.numel():], expected) > ALPHA, (sampler, options)


@pytest.mark.parametrize("order", ["left_to_right", "confidence"])
@pytest.mark.parametrize("wrong", ["checkpoint blocks", "llada"])
def test_the_test_rejects_what_is_not_the_runs_chain(run_oracle, wrong, order):
    """Sequential nesting its blocks of 2 in the checkpoint's attention blocks of 4 (what dllm did before a run chose
    its blocks: the same canvas, other attention) and a parallel sampler both fail the test of the run's layout."""
    prompt = torch.tensor([0, 1, 2])
    expected = sequential_distribution(run_oracle, prompt, 5, block_length=2, temperature=1.0, order=order)
    if wrong == "llada":
        with pytest.warns(UserWarning, match=RUN_WARNING):
            out = _sample(run_oracle, prompt[None], 5, sampler="llada", steps=3, block_length=2)
    else:
        fixed = dataclasses.replace(run_oracle, run_blocks=False)
        out = _sample(fixed, prompt[None], 5, sampler="sequential", block_length=2, order=order)
    assert chi_square_pvalue(out.sequences[:, 3:], expected) < ALPHA


@pytest.mark.parametrize("options", [{"sampler": "fef", "window": 2}, {"sampler": "fef", "window": 3, "cache": "none"},
                                     {"sampler": "fef", "window": 3, "draft": "stale"},
                                     {"sampler": "fef", "window": 2, "order": "confidence"},
                                     {"sampler": "sequential", "cache": "none"}])
@pytest.mark.parametrize("block", [4, 3])
def test_greedy_runs_in_a_runs_own_blocks_match_sequential(run_model, options, block):
    """At T=0 every exact sampler gives block-cached sequential's tokens in the run's blocks (of the same order), with
    ragged prompts decoded each as alone (they end at different places in a run block)."""
    order = options.get("order", "left_to_right")
    prompts = torch.tensor([[0, 1, 3, 2, 1], [2, 1, 0, 0, 3]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    with torch.no_grad(), pytest.warns(UserWarning, match=RUN_WARNING):
        for length in (5, 4):
            ids = prompts[:, :length]
            reference = dllm.generate(run_model, ids, sampler="sequential", max_new_tokens=7, temperature=0.0,
                                      block_length=block, order=order)
            out = dllm.generate(run_model, ids, max_new_tokens=7, temperature=0.0, block_length=block, **options)
            assert out.sequences.tolist() == reference.sequences.tolist(), (length, options)
        ragged = dllm.generate(run_model, prompts, attention_mask=mask, max_new_tokens=7, temperature=0.0,
                               block_length=block, **options)
        alone = dllm.generate(run_model, prompts[1:, 2:], max_new_tokens=7, temperature=0.0, block_length=block,
                              **options)
    assert ragged.sequences[1, 5:].tolist() == alone.sequences[0, 3:].tolist()


@pytest.mark.parametrize("sampler, options", [("sequential", {}), ("fef", {"window": 2}),
                                              ("fef", {"window": 2, "cache": "none"})])
def test_a_ragged_batch_in_a_runs_own_blocks_decodes_each_row_as_alone(run_model, sampler, options):
    """At T=1 with one generator per row, blocks of 3 on a checkpoint of 2."""
    prompts = [[0, 1, 3], [2, 1], [1, 1, 0, 2]]
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    common = dict(max_new_tokens=4, temperature=1.0, sampler=sampler, block_length=3, **options)
    with torch.no_grad(), pytest.warns(UserWarning, match=RUN_WARNING):
        batch = dllm.generate(run_model, ids, attention_mask=mask,
                              generator=[torch.Generator().manual_seed(10 + r) for r in range(3)], **common)
        for r, p in enumerate(prompts):
            alone = dllm.generate(run_model, torch.tensor([p]), generator=[torch.Generator().manual_seed(10 + r)],
                                  **common)
            assert batch.sequences[r, width:].tolist() == alone.sequences[0, len(p):].tolist(), (r, sampler)
