"""LLaDA2's samplers. ``sampler="llada2"``: the official ``generate`` of LLaDA2.0 (threshold decoding) and LLaDA2.1
(token editing), token for token at T=0 on tiny real checkpoints (the official method on the real model, ours on the
native load), batch 1 and a ragged batch (each row against its own official run: the official method takes one
prompt); on a checkpoint whose config names no block size (32, the official default) at the block lengths 4, 8, 16
and 64 the official method builds its attention mask from (ours too: a run's blocks are its block_length on LLaDA2),
called with the official option names, rows stopping where it stops them. The exact samplers on the native model
(mixture of experts, routing included): the enumerated chain's law, in the checkpoint's blocks and in a run's own.

Two test-only adjustments of the official method, both where it cannot run as published here: its block mask is
cast to bfloat16 (a float32 model then fails inside attention), so the real model reads it in float32; and its draw
may return the mask token, which ours never proposes, so the mask token is forbidden there too.
"""

from __future__ import annotations

import warnings

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
    options = {"block_length": 4, "eos_id": native.eos_token_id, **options}
    with torch.no_grad():
        out = real.generate(ids, temperature=0.0, gen_length=gen, mask_id=native.mask_token_id, **options)
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


# --- a run's own blocks and the official option names ------------------------------------------------------------

RUN_WARNING = r"block_length={} sets this run's attention blocks \({} positions\), not NativeLM's block_size=32"


@pytest.fixture(scope="module", params=[False, True], ids=["2.0", "2.1"])
def wide(request, tmp_path_factory):
    """A checkpoint whose config.json names no block size, as the hub's: blocks of 32, the official default."""
    folder = make_llada2_folder(tmp_path_factory.mktemp("llada2_wide"), seed=5, llada21=request.param)
    native = dllm.load(folder)
    assert native.config.block_size == 32
    return request.param, native, _runnable(reference_model(folder), native.mask_token_id)


WIDE_CASES = [{"steps": 4, "threshold": 0.5}, {"steps": 8, "threshold": 0.9, "top_k": 0},
              {"steps": 4, "threshold": 0.3, "editing_threshold": 0.2, "max_post_steps": 3, "num_to_transfer": 2}]


@pytest.mark.parametrize("case", range(len(WIDE_CASES)))
@pytest.mark.parametrize("block", [4, 8, 16, 64])
def test_greedy_equals_the_official_method_in_a_runs_own_blocks(wide, block, case):
    """block_length 4, 8, 16 and 64 on a checkpoint of blocks of 32: the official method builds its mask from its
    block_length, and so does our run (said in one warning); called with the official names eos_id, mask_id,
    gen_length, eos_early_stop; prompts ending at a block's end and inside one."""
    llada21, native, _ = wide
    options = dict(WIDE_CASES[case])
    if not llada21 and "editing_threshold" in options:
        pytest.skip("token editing is LLaDA2.1's")
    if llada21 and "editing_threshold" not in options:  # 2.1's generate always edits (its defaults)
        options.update(editing_threshold=0.9, max_post_steps=16, num_to_transfer=1)
    for prompt_length in (5, 8, 9):
        ids = torch.randint(0, 290, (1, prompt_length), generator=torch.Generator().manual_seed(prompt_length))
        expected = _official(wide, ids, 12, block_length=block, eos_early_stop=True, **options)
        with torch.no_grad(), pytest.warns(UserWarning, match=RUN_WARNING.format(block, block)):
            ours = dllm.generate(native, ids, sampler="llada2", max_new_tokens=12, temperature=0.0, block_length=block,
                                 eos_id=native.eos_token_id, mask_id=native.mask_token_id, gen_length=12,
                                 eos_early_stop=True, **options)
        assert ours.options["block_length"] == block
        assert ours.sequences[0, prompt_length : prompt_length + len(expected)].tolist() == expected, prompt_length


def test_a_ragged_batch_in_a_runs_own_blocks_equals_each_rows_official_run(wide):
    llada21, native, _ = wide
    lengths = [7, 4, 9]
    prompts = [torch.randint(0, 290, (n,), generator=torch.Generator().manual_seed(n)) for n in lengths]
    width = max(lengths)
    ids = torch.stack([torch.cat([torch.zeros(width - len(p), dtype=torch.long), p]) for p in prompts])
    mask = torch.stack([torch.cat([torch.zeros(width - len(p)), torch.ones(len(p))]).long() for p in prompts])
    options = {"steps": 4, "threshold": 0.3, "block_length": 8, **({"editing_threshold": 0.9} if llada21 else {})}
    with torch.no_grad(), pytest.warns(UserWarning, match=RUN_WARNING.format(8, 8)):
        ours = dllm.generate(native, ids, attention_mask=mask, sampler="llada2", max_new_tokens=10, temperature=0.0,
                             **options)
    for r, prompt in enumerate(prompts):
        expected = _official(wide, prompt[None], 10, **options)
        assert ours.sequences[r, width : width + len(expected)].tolist() == expected, r


@pytest.mark.parametrize("early", [False, True])
def test_rows_stop_where_the_official_method_stops_them(wide, early):
    """eos_id (the run's one stop id, as eos_token_id names it), with and without eos_early_stop: the answers equal the
    official method's up to their first eos_id. 2.1 may still edit a block's tokens once a stop is revealed in it, so
    its rows stop only at the block's end (one token a step and edits on every change here, so edits happen)."""
    llada21, native, _ = wide
    options = {"steps": 8, "threshold": 0.99, "block_length": 8, **({"editing_threshold": 0.0} if llada21 else {})}
    stopped = 0
    for prompt_length in (20, 38, 39):
        ids = torch.randint(0, 290, (1, prompt_length), generator=torch.Generator().manual_seed(100 + prompt_length))
        with pytest.warns(UserWarning, match=RUN_WARNING.format(8, 8)):
            free = dllm.generate(native, ids, sampler="llada2", max_new_tokens=16, temperature=0.0,
                                 eos_token_id=None, **options).sequences[0, prompt_length:].tolist()
        for stop in sorted(set(free)):
            expected = _official(wide, ids, 16, eos_id=stop, eos_early_stop=early, **options)
            with torch.no_grad(), pytest.warns(UserWarning, match=RUN_WARNING.format(8, 8)):
                ours = dllm.generate(native, ids, sampler="llada2", max_new_tokens=16, temperature=0.0,
                                     eos_token_id=stop, eos_id=stop, eos_early_stop=early, **options)
            assert ours.sequences[0, prompt_length : prompt_length + len(expected)].tolist() == expected, stop
            stopped += len(expected) < 16
    assert stopped


def test_the_official_names_of_generates_parameters_are_checked(checkpoint):
    """eos_id, mask_id and gen_length must agree with the run's stop ids, the model's mask token and max_new_tokens (a
    ValueError naming both sides); top_k=0 is the official "no filter", as None."""
    _, native, _ = checkpoint
    ids = torch.tensor([[1, 2, 3]])
    common = dict(sampler="llada2", max_new_tokens=8, temperature=0.0)
    eos, mask = native.eos_token_id, native.mask_token_id
    with pytest.raises(ValueError, match=rf"eos_id=5 .* contradicts this run's stop ids \[{eos}\] \(generate's "
                                         r"eos_token_id, by default the model's\): pass eos_token_id=5"):
        dllm.generate(native, ids, eos_id=5, **common)
    with pytest.raises(ValueError, match=rf"eos_id={eos} .* contradicts this run's stop ids None"):
        dllm.generate(native, ids, eos_id=eos, eos_token_id=None, **common)
    with pytest.raises(ValueError, match=rf"mask_id=7 .* differs from this model's mask_token_id={mask}"):
        dllm.generate(native, ids, mask_id=7, **common)
    with pytest.raises(ValueError, match=r"gen_length=16 .* differs from max_new_tokens=8: pass max_new_tokens=16"):
        dllm.generate(native, ids, gen_length=16, **common)
    with pytest.raises(TypeError, match="eos_early_stop must be True or False"):
        dllm.generate(native, ids, eos_early_stop=1, **common)
    plain = dllm.generate(native, ids, **common)
    named = dllm.generate(native, ids, eos_id=eos, mask_id=mask, gen_length=8, eos_early_stop=True, top_k=0, **common)
    assert torch.equal(plain.sequences, named.sequences) and named.options["eos_id"] == eos
    sampled = [dllm.generate(native, ids, sampler="llada2", max_new_tokens=8, temperature=1.0, top_k=k,
                             generator=torch.Generator().manual_seed(0)).sequences for k in (0, None)]
    assert torch.equal(*sampled)


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
                                              ("fef", {"window": 3, "draft": "stale"}), ("fef", {"cache": "none"}),
                                              ("fef", {"window": 2, "order": "confidence"})])
@pytest.mark.parametrize("block, prompt", [(4, [0, 3, 1, 4, 2, 0]), (2, [0, 3, 1, 4, 2, 0]), (8, [0, 3, 1, 4, 2])])
def test_exact_samplers_sample_the_native_models_chain(small, sampler, options, block, prompt):
    """In the checkpoint's blocks of 4 and in a run's blocks of 2 and 8 (the attention blocks follow block_length)."""
    from stat_tools import check_native_chain

    # the decoder revealing the block at once samples another law
    wrong = {"sampler": "llada2", "steps": 1, "threshold": 0.0}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", r"block_length=\d+ sets this run's attention blocks", UserWarning)
        check_native_chain(small, torch.tensor(prompt), 3, block, sampler, options, wrong,
                           order=options.get("order", "left_to_right"))
