"""Block-causal models whose blocks start at position 0 (``Capabilities.block_anchor == "absolute"``: SDAR,
LLaDA2): the canvas opens with the prompt's tail in the first block and runs on to a model block's end; exact
samplers keep the enumerated chain's law there, with and without the block cache, and a ragged batch decodes
each row as if alone."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest
import torch

import dllm
from dllm.models.oracle import HMMOracle, InconsistentModel, Wrapper
from dllm.models.transformer import TransformerConfig, TransformerLM
from dllm.protocols import Capabilities
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

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(block_size=self.size, block_anchor=self.anchor)

    def __call__(self, input_ids: torch.Tensor, block_offset=0, **unused) -> torch.Tensor:
        offset = torch.as_tensor(block_offset).reshape(-1, 1)  # [N or 1, 1]
        blocks = torch.div(torch.arange(input_ids.shape[1])[None, :] - offset, self.size, rounding_mode="floor")
        logits = torch.empty((*input_ids.shape, self.vocab_size), dtype=torch.float64)
        for b in blocks.unique().tolist():  # each block's rows from a call that hides every later block
            hidden = input_ids.masked_fill(blocks > b, self.mask_token_id)
            rows = (blocks == b).expand_as(input_ids)
            logits[rows] = self.base(hidden).double()[rows]
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
