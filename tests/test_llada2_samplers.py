"""LLaDA2's samplers. ``sampler="llada2"``: the official ``generate`` of LLaDA2.0 (threshold decoding) and LLaDA2.1
(token editing), token for token at T=0 on tiny real checkpoints (the official method on the real model, ours on the
native load), batch 1 and a ragged batch (each row against its own official run: the official method takes one
prompt). The exact samplers on the native model (mixture of experts, routing included): the enumerated chain's law.

Two test-only adjustments of the official method, both where it cannot run as published here: its block mask is
cast to bfloat16 (a float32 model then fails inside attention), so the real model reads it in float32; and its draw
may return the mask token, which ours never proposes, so the mask token is forbidden there too.
"""

from __future__ import annotations

import pytest
import torch
from fixtures.hf.llada2_checkpoints import make_llada2_folder, reference_model

import dllm


def _runnable(model, mask_id: int):
    """The real model with its generate's two adjustments (module docstring)."""
    forward, draw = model.forward, model._sample_with_temperature_topk_topp

    def float_mask_forward(*args, attention_mask=None, **kwargs):
        return forward(*args, attention_mask=None if attention_mask is None else attention_mask.float(), **kwargs)

    def no_mask_draw(logits, *args, **kwargs):
        logits = logits.clone()
        logits[..., mask_id] = -torch.inf
        return draw(logits, *args, **kwargs)

    model.forward, model._sample_with_temperature_topk_topp = float_mask_forward, no_mask_draw
    return model


@pytest.fixture(scope="module", params=[False, True], ids=["2.0", "2.1"])
def checkpoint(request, tmp_path_factory):
    folder = make_llada2_folder(tmp_path_factory.mktemp("llada2"), seed=5, llada21=request.param, block_size=4)
    native = dllm.load(folder)
    return request.param, native, _runnable(reference_model(folder), native.mask_token_id)


def _official(checkpoint, ids, gen, **options):
    llada21, native, real = checkpoint
    if not llada21:
        options = {k: v for k, v in options.items() if k not in ("editing_threshold", "max_post_steps",
                                                                  "num_to_transfer")}
    with torch.no_grad():
        out = real.generate(ids, temperature=0.0, block_length=4, gen_length=gen, eos_id=native.eos_token_id,
                            mask_id=native.mask_token_id, **options)
    return out[0].tolist()


CASES = [{"steps": 4, "threshold": 0.95}, {"steps": 2, "threshold": 0.1}, {"steps": 4, "threshold": 0.0},
         {"steps": 4, "threshold": 0.5, "editing_threshold": 0.2, "max_post_steps": 3, "num_to_transfer": 2}]


@pytest.mark.parametrize("options", CASES)
@pytest.mark.parametrize("prompt_length", [8, 6, 5])
def test_greedy_equals_the_official_method(checkpoint, options, prompt_length):
    llada21, native, _ = checkpoint
    if not llada21 and "editing_threshold" in options:
        pytest.skip("token editing is LLaDA2.1's")
    ids = torch.randint(0, 290, (1, prompt_length), generator=torch.Generator().manual_seed(prompt_length))
    expected = _official(checkpoint, ids, 12, **options)
    ours_options = dict(options)
    if llada21 and "editing_threshold" not in ours_options:  # 2.1's generate always edits (its defaults)
        ours_options.update(editing_threshold=0.9, max_post_steps=16, num_to_transfer=1)
    with torch.no_grad():
        ours = dllm.generate(native, ids, sampler="llada2", max_new_tokens=12, temperature=0.0, **ours_options)
    assert ours.options["block_length"] == 4
    assert ours.sequences[0, prompt_length : prompt_length + len(expected)].tolist() == expected


def test_a_ragged_batch_equals_each_rows_official_run(checkpoint):
    llada21, native, _ = checkpoint
    lengths = [7, 4, 9]
    prompts = [torch.randint(0, 290, (n,), generator=torch.Generator().manual_seed(n)) for n in lengths]
    width = max(lengths)
    ids = torch.stack([torch.cat([torch.zeros(width - len(p), dtype=torch.long), p]) for p in prompts])
    mask = torch.stack([torch.cat([torch.zeros(width - len(p)), torch.ones(len(p))]).long() for p in prompts])
    options = {"steps": 4, "threshold": 0.3}
    extra = {"editing_threshold": 0.9} if llada21 else {}
    with torch.no_grad():
        ours = dllm.generate(native, ids, attention_mask=mask, sampler="llada2", max_new_tokens=10, temperature=0.0,
                             **options, **extra)
    for r, prompt in enumerate(prompts):
        expected = _official(checkpoint, prompt[None], 10, **options, **extra)
        assert ours.sequences[r, width : width + len(expected)].tolist() == expected, r


def test_llada2_is_labelled_approximate_and_checks_its_options(checkpoint):
    _, native, _ = checkpoint
    ids = torch.tensor([[1, 2, 3]])
    assert not dllm.generate(native, ids, sampler="llada2", max_new_tokens=4).exact
    with pytest.raises(ValueError, match="threshold must lie in"):
        dllm.generate(native, ids, sampler="llada2", max_new_tokens=4, threshold=2.0)
    out = dllm.generate(native, ids, sampler="llada2", max_new_tokens=8, minimal_topk=4)
    assert out.options["steps"] == 2  # as the official method: at most max_new_tokens // minimal_topk


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A native LLaDA2 of 5 tokens plus the mask (id 5), experts and routing as the tiny config's."""
    folder = make_llada2_folder(tmp_path_factory.mktemp("llada2_small"), seed=6, tokenizer=False, vocab_size=6,
                                mask_token_id=5, eos_token_id=4, pad_token_id=4, block_size=4)
    model = dllm.load(folder)
    with torch.no_grad():
        model.output.weight.mul_(4.0)  # laws far from uniform, so that a wrong law shows
    return model


@pytest.mark.parametrize("sampler, options", [("sequential", {}), ("fef", {"window": 2}),
                                              ("fef", {"window": 3, "draft": "stale"}), ("fef", {"cache": "none"})])
def test_exact_samplers_sample_the_native_models_chain(small, sampler, options):
    from stat_tools import check_native_chain

    # the decoder revealing the block at once samples another law
    check_native_chain(small, torch.tensor([0, 3, 1, 4, 2, 0]), 3, 4, sampler, options,
                       {"sampler": "llada2", "steps": 1, "threshold": 0.0})
