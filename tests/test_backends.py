"""Every sampler on every relevant backend kind, batched with ragged (left-padded) prompts."""

import pytest
import torch
from fixtures.hf import builders

import dllm
from dllm.models.loading import load

DIFFUSION_RECIPES = {
    "llada": builders.save_llada,
    "dream": builders.save_dream,
    "diffusion_gemma": builders.save_diffusion_gemma,
    "bert": lambda p: builders.save_mlm(p, "bert"),
    "modernbert": lambda p: builders.save_mlm(p, "modernbert"),
    "dllm_bidirectional": builders.save_dllm,
    "dllm_block_causal": lambda p: builders.save_dllm(p, layout="block_causal"),
}
CAUSAL_RECIPES = {
    "llama": lambda p: builders.save_causal(p, "llama"),
    "qwen3": lambda p: builders.save_causal(p, "qwen3"),
    "dllm_causal": lambda p: builders.save_dllm(p, layout="causal"),
}
DIFFUSION_RUNS = [
    ("sequential", {"order": "confidence"}), ("fef", {"window": 2}), ("fef", {"draft": "stale", "window": 3}),
    ("llada", {"steps": 4}), ("llada", {"steps": 2, "cfg_scale": 0.5}), ("dream", {"alg": "entropy"}),
    ("fast_dllm", {"threshold": 0.3}), ("eb", {"gamma": 0.5}),
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    made = {}

    def get(name):
        if name not in made:
            recipe = {**DIFFUSION_RECIPES, **CAUSAL_RECIPES}[name]
            made[name] = recipe(tmp_path_factory.mktemp(name))
        return made[name]

    return get


def ragged(model) -> tuple[torch.Tensor, torch.Tensor]:
    """Two prompts of lengths 4 and 2, left padded with the pad id."""
    pad = model.pad_token_id if model.pad_token_id is not None else 0
    ids = torch.tensor([[5, 6, 7, 8], [pad, pad, 9, 10]])
    return ids, torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]])


@pytest.mark.parametrize("name", sorted(DIFFUSION_RECIPES))
def test_every_diffusion_sampler_with_ragged_prompts(folder, name):
    # the llada/dream stand-ins are remote code (native models: test_native_models.py)
    model = load(folder(name), **({"trust_remote_code": True} if name in ("llada", "dream") else {}))
    ids, mask = ragged(model)
    block = getattr(model, "block_size", None) or 2
    for sampler, options in DIFFUSION_RUNS:
        out = dllm.generate(model, ids, sampler=sampler, max_new_tokens=2 * block, block_length=block,
                            attention_mask=mask, temperature=1.0, generator=torch.Generator().manual_seed(0),
                            eos_token_id=None, **options)
        assert out.sequences.shape == (2, 4 + 2 * block), (sampler, options)
        assert not bool((out.sequences[:, 4:] == model.mask_token_id).any())
        # the padded row decodes as the row alone at temperature 0
    greedy = dict(sampler="fef", max_new_tokens=2 * block, block_length=block, temperature=0.0, eos_token_id=None)
    batch = dllm.generate(model, ids, attention_mask=mask, **greedy)
    alone = dllm.generate(model, ids[1:, 2:], **greedy)
    assert torch.equal(batch.sequences[1, 4:], alone.sequences[0, 2:])


@pytest.mark.parametrize("name", sorted(CAUSAL_RECIPES))
def test_every_causal_sampler_with_ragged_prompts(folder, name):
    model = load(folder(name))
    ids, mask = ragged(model)
    greedy = dict(max_new_tokens=6, temperature=0.0, attention_mask=mask, eos_token_id=None)
    reference = dllm.generate(model, ids, sampler="ar", **greedy).sequences
    for options in ({"drafter": "ngram"}, {"drafter": model, "num_draft_tokens": 3}, {"cache": "none"}):
        out = dllm.generate(model, ids, sampler="ar_spec", **greedy, **options)
        assert torch.equal(out.sequences, reference), options
    alone = dllm.generate(model, ids[1:, 2:], sampler="ar", max_new_tokens=6, temperature=0.0, eos_token_id=None)
    assert torch.equal(reference[1, 4:], alone.sequences[0, 2:])
    sampled = dllm.generate(model, ids, sampler="ar_spec", max_new_tokens=6, attention_mask=mask,
                            generator=torch.Generator().manual_seed(0), drafter=model)
    assert sampled.stats.accepted == sampled.stats.drafted  # a model drafting for itself is always accepted
