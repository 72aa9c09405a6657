"""SDAR's samplers. ``sampler="sdar"``, SDAR's official ``block_diffusion_generate``
(shared/remote_code/sdar/generate.py): token for token at T=0 on a tiny real checkpoint (the official function on
the real model, ours on the native load), batch 1 and a ragged batch (each row against its own official run: the
official function takes one prompt length), at the checkpoint's block of 4 and at the block lengths 2, 8 and 16 the
official function builds its attention mask from (ours too: a run's blocks are its block_length on SDAR), called with
the official option names. The exact samplers on the native model: the enumerated chain's law, in the checkpoint's
blocks and in a run's own.

At T=0 the official sampler divides by the temperature; the greedy limit used for it here is its own function
with the draw replaced by the argmax (and the mask token, which ours never proposes, forbidden). Everything else,
the block loop, the cache, the schedule and the remasking rules, runs as published.
"""

from __future__ import annotations

import importlib
import warnings

import pytest
import torch
from fixtures.hf.sdar_checkpoints import _PACKAGE, _modules, _patched, make_sdar_folder, reference_model

import dllm


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_sdar_folder(tmp_path_factory.mktemp("sdar"), seed=3)


@pytest.fixture(scope="module")
def official(folder):
    """(the real model, generate.py's block_diffusion_generate) with the greedy limit at temperature 0."""
    _modules()
    with _patched():
        module = importlib.import_module(f"{_PACKAGE}.generate")
    model = reference_model(folder)
    return model, module


def _official(official, ids, mask_id, gen, monkeypatch, **options):
    model, module = official
    real_sampler = module.sample_with_temperature_topk_topp

    def greedy(logits, temperature=1.0, top_k=0, top_p=1.0):
        if temperature:
            return real_sampler(logits, temperature, top_k, top_p)
        logits = logits.clone()
        logits[..., mask_id] = -torch.inf
        if top_k > 0:
            logits = module.top_k_logits(logits.reshape(-1, logits.shape[-1]), top_k).reshape(logits.shape)
        if top_p < 1.0:
            logits = module.top_p_logits(logits.reshape(-1, logits.shape[-1]), top_p).reshape(logits.shape)
        probs = torch.softmax(logits, dim=-1)
        token = probs.argmax(dim=-1)
        return token, probs.gather(-1, token[..., None]).squeeze(-1)

    monkeypatch.setattr(module, "sample_with_temperature_topk_topp", greedy)
    options = {"block_length": 4, **options}
    with _patched(), torch.no_grad():
        return module.block_diffusion_generate(model, {"input_ids": ids}, mask_id, gen_length=gen, temperature=0.0,
                                               **options)


CASES = [
    {"denoising_steps": 4, "remasking_strategy": "low_confidence_dynamic", "confidence_threshold": 0.85},
    {"denoising_steps": 4, "remasking_strategy": "low_confidence_dynamic", "confidence_threshold": 0.05},
    {"denoising_steps": 4, "remasking_strategy": "low_confidence_static"},
    {"denoising_steps": 2, "remasking_strategy": "sequential"},
    {"denoising_steps": 4, "remasking_strategy": "low_confidence_dynamic", "confidence_threshold": 0.3, "top_k": 5,
     "top_p": 0.9},
]


@pytest.mark.parametrize("options", CASES)
@pytest.mark.parametrize("prompt_length", [8, 6, 5])
def test_greedy_equals_the_official_function(folder, official, options, prompt_length, monkeypatch):
    """Prompts ending at a block's end and inside one; 12 new tokens, so the last block is filled out by the
    official function (its output runs to the block's end) and by ours (decoded, then cut)."""
    native = dllm.load(folder)
    mask_id = native.mask_token_id
    ids = torch.randint(0, 290, (1, prompt_length), generator=torch.Generator().manual_seed(prompt_length))
    expected = _official(official, ids, mask_id, 12, monkeypatch, **options)
    with torch.no_grad():
        ours = dllm.generate(native, ids, sampler="sdar", max_new_tokens=12, temperature=0.0, eos_token_id=None,
                             **options)
    assert ours.options["block_length"] == 4
    assert ours.sequences[0].tolist() == expected[0, : prompt_length + 12].tolist()


def test_a_ragged_batch_equals_each_rows_official_run(folder, official, monkeypatch):
    native = dllm.load(folder)
    mask_id = native.mask_token_id
    lengths = [7, 4, 9]
    prompts = [torch.randint(0, 290, (n,), generator=torch.Generator().manual_seed(n)) for n in lengths]
    width = max(lengths)
    ids = torch.stack([torch.cat([torch.zeros(width - len(p), dtype=torch.long), p]) for p in prompts])
    mask = torch.stack([torch.cat([torch.zeros(width - len(p)), torch.ones(len(p))]).long() for p in prompts])
    options = CASES[0]
    with torch.no_grad():
        ours = dllm.generate(native, ids, attention_mask=mask, sampler="sdar", max_new_tokens=10, temperature=0.0,
                             eos_token_id=None, **options)
    for r, prompt in enumerate(prompts):
        expected = _official(official, prompt[None], mask_id, 10, monkeypatch, **options)
        assert ours.sequences[r, width:].tolist() == expected[0, len(prompt) : len(prompt) + 10].tolist(), r


def test_sdar_is_labelled_approximate_and_checks_its_options(folder):
    native = dllm.load(folder)
    ids = torch.tensor([[1, 2, 3]])
    out = dllm.generate(native, ids, sampler="sdar", max_new_tokens=4)
    assert not out.exact
    with pytest.raises(ValueError, match="remasking_strategy must be one of"):
        dllm.generate(native, ids, sampler="sdar", max_new_tokens=4, remasking_strategy="entropy_bounded")
    with pytest.raises(ValueError, match="confidence_threshold must lie in"):
        dllm.generate(native, ids, sampler="sdar", max_new_tokens=4, confidence_threshold=1.5)


# --- a run's own blocks and the official option names ------------------------------------------------------------

RUN_WARNING = r"block_length={} sets this run's attention blocks \({} positions\), not NativeLM's block_size=4"
# Cases where the official function's top-k never exceeds the masks left (it would rewrite a revealed or prompt token
# there, which ours does not: SdarStepper's docstring): one token a step, or the sequential strategy.
BLOCK_CASES = [
    lambda block: {"denoising_steps": block},
    lambda block: {"denoising_steps": block, "confidence_threshold": 0.05},
    lambda block: {"denoising_steps": block, "remasking_strategy": "low_confidence_static"},
    lambda block: {"denoising_steps": 2, "remasking_strategy": "sequential"},
]


@pytest.mark.parametrize("case", range(len(BLOCK_CASES)))
@pytest.mark.parametrize("block", [2, 8, 16])
def test_greedy_equals_the_official_function_in_a_runs_own_blocks(folder, official, block, case, monkeypatch):
    """block_length 2, 8 and 16 on the checkpoint of blocks of 4: the official function builds its mask from its
    block_length, and so does our run (said in one warning); prompts ending at a block's end and inside one; called
    with the official names mask_id and gen_length."""
    native = dllm.load(folder)
    mask_id = native.mask_token_id
    options = {"block_length": block, **BLOCK_CASES[case](block)}
    for prompt_length in (5, 8, 9):
        ids = torch.randint(0, 290, (1, prompt_length), generator=torch.Generator().manual_seed(prompt_length))
        expected = _official(official, ids, mask_id, 12, monkeypatch, **options)
        with torch.no_grad(), pytest.warns(UserWarning, match=RUN_WARNING.format(block, block)):
            ours = dllm.generate(native, ids, sampler="sdar", max_new_tokens=12, temperature=0.0, eos_token_id=None,
                                 mask_id=mask_id, gen_length=12, **options)
        assert ours.options["block_length"] == block
        assert ours.sequences[0].tolist() == expected[0, : prompt_length + 12].tolist(), prompt_length


def test_a_ragged_batch_in_a_runs_own_blocks_equals_each_rows_official_run(folder, official, monkeypatch):
    native = dllm.load(folder)
    mask_id = native.mask_token_id
    lengths = [7, 4, 9]
    prompts = [torch.randint(0, 290, (n,), generator=torch.Generator().manual_seed(n)) for n in lengths]
    width = max(lengths)
    ids = torch.stack([torch.cat([torch.zeros(width - len(p), dtype=torch.long), p]) for p in prompts])
    mask = torch.stack([torch.cat([torch.zeros(width - len(p)), torch.ones(len(p))]).long() for p in prompts])
    options = {"block_length": 8, "denoising_steps": 8, "confidence_threshold": 0.3}
    with torch.no_grad(), pytest.warns(UserWarning, match=RUN_WARNING.format(8, 8)):
        ours = dllm.generate(native, ids, attention_mask=mask, sampler="sdar", max_new_tokens=10, temperature=0.0,
                             eos_token_id=None, **options)
    for r, prompt in enumerate(prompts):
        expected = _official(official, prompt[None], mask_id, 10, monkeypatch, **options)
        assert ours.sequences[r, width:].tolist() == expected[0, len(prompt) : len(prompt) + 10].tolist(), r


def test_stopping_criteria_idx_stops_where_the_official_function_does(folder, official, monkeypatch):
    """The official name of the stop ids: rows stop at a token of ``stopping_criteria_idx`` (the run's stop ids, as
    ``eos_token_id`` names them), the answers equal up to it; the official function goes on to its block's end."""
    native = dllm.load(folder)
    mask_id = native.mask_token_id
    options = {"block_length": 8, "denoising_steps": 8}
    stopped = 0
    for prompt_length in (5, 9):
        ids = torch.randint(0, 290, (1, prompt_length), generator=torch.Generator().manual_seed(prompt_length))
        with pytest.warns(UserWarning, match=RUN_WARNING.format(8, 8)):
            free = dllm.generate(native, ids, sampler="sdar", max_new_tokens=16, temperature=0.0, eos_token_id=None,
                                 **options).sequences[0, prompt_length:].tolist()
        for stop in sorted(set(free[1:6])):
            expected = _official(official, ids, mask_id, 16, monkeypatch, stopping_criteria_idx=[stop],
                                 **options)[0, prompt_length:].tolist()
            expected = expected[: expected.index(stop) + 1]
            with torch.no_grad(), pytest.warns(UserWarning, match=RUN_WARNING.format(8, 8)):
                ours = dllm.generate(native, ids, sampler="sdar", max_new_tokens=16, temperature=0.0,
                                     eos_token_id=stop, stopping_criteria_idx=[stop], **options)
            answer = ours.sequences[0, prompt_length:].tolist()
            assert answer[: len(expected)] == expected and set(answer[len(expected):]) <= {stop}, stop
            stopped += len(expected) < 16
    assert stopped


def test_the_official_names_of_generates_parameters_are_checked(folder):
    """mask_id, gen_length and stopping_criteria_idx must agree with the model's mask token, max_new_tokens and the
    run's stop ids (a ValueError naming both sides); eb_threshold (read only by the refused entropy_bounded strategy)
    changes nothing."""
    native = dllm.load(folder)
    ids = torch.tensor([[1, 2, 3]])
    common = dict(sampler="sdar", max_new_tokens=8, temperature=0.0, eos_token_id=None)
    mask = native.mask_token_id
    with pytest.raises(ValueError, match=rf"mask_id=7 .* differs from this model's mask_token_id={mask}: load it with "
                                         r"dllm.load\(\.\.\., mask_token_id=7\)"):
        dllm.generate(native, ids, mask_id=7, **common)
    with pytest.raises(ValueError, match=r"gen_length=16 .* differs from max_new_tokens=8: pass max_new_tokens=16"):
        dllm.generate(native, ids, gen_length=16, **common)
    with pytest.raises(ValueError, match=r"stopping_criteria_idx=\[5\] .* contradicts this run's stop ids None .*"
                                         r"pass eos_token_id=5"):
        dllm.generate(native, ids, stopping_criteria_idx=[5], **common)
    with pytest.raises(TypeError, match="stopping_criteria_idx must be an int"):
        dllm.generate(native, ids, stopping_criteria_idx=["5"], **common)
    plain = dllm.generate(native, ids, **common)
    named = dllm.generate(native, ids, eb_threshold=0.35, mask_id=native.mask_token_id, gen_length=8,
                          stopping_criteria_idx=[], **common)
    assert torch.equal(plain.sequences, named.sequences) and named.options["eb_threshold"] == 0.35
    from dllm.samplers.registry import parse_options

    parsed = parse_options("sdar", ["stopping_criteria_idx=1,2", "mask_id=3", "eb_threshold=none"])
    assert parsed == {"stopping_criteria_idx": [1, 2], "mask_id": 3, "eb_threshold": None}
    assert parse_options("sdar", ["stopping_criteria_idx=[7]"]) == {"stopping_criteria_idx": [7]}
    with pytest.raises(ValueError, match="stopping_criteria_idx expects ints separated by commas"):
        parse_options("sdar", ["stopping_criteria_idx=eos"])


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A native SDAR of 5 tokens plus the mask (id 5): small enough to enumerate the chain's law."""
    folder = make_sdar_folder(tmp_path_factory.mktemp("sdar_small"), seed=4, tokenizer=False, vocab_size=6,
                              mask_token_id=5, eos_token_id=4, bos_token_id=4, pad_token_id=4)
    model = dllm.load(folder)
    with torch.no_grad():
        model.output.weight.mul_(4.0)  # laws far from uniform, so that a wrong law shows
    return model


@pytest.mark.parametrize("sampler, options", [("sequential", {}), ("fef", {"window": 2}),
                                              ("fef", {"window": 3, "draft": "stale"}), ("fef", {"cache": "none"}),
                                              ("fef", {"draft_candidates": 2, "window": 2}),
                                              ("sequential", {"order": "confidence"})])
@pytest.mark.parametrize("block, prompt", [(4, [0, 3, 1, 4, 2, 0]), (2, [0, 3, 1, 4, 2, 0]), (8, [0, 3, 1, 4, 2])])
def test_exact_samplers_sample_the_native_models_chain(small, sampler, options, block, prompt):
    """On the native SDAR itself (q/k norm, head_dim != hidden / heads, blocks from position 0), in its own blocks of 4
    and in a run's blocks of 2 and 8 (the attention blocks follow block_length): a 6-token prompt puts two prompt
    tokens in the first block of 4, 3 new tokens end one short of it (decoded, then cut); blocks of 8 hold a 5-token
    prompt and the 3 new tokens."""
    from stat_tools import check_native_chain

    # the decoder revealing the block at once samples another law
    order = options.get("order", "left_to_right")
    wrong = {"sampler": "sdar", "denoising_steps": 1}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", RUN_WARNING.format(block, block), UserWarning)
        check_native_chain(small, torch.tensor(prompt), 3, block, sampler, options, wrong, order=order)


def test_the_eval_preset_runs_the_official_decoder_and_is_recorded(folder, tmp_path):
    """``dllm eval synthetic --preset sdar``: SDAR's published decoding on the native model, the preset's name and
    values in run.json; an explicit flag wins over the preset."""
    import json

    from dllm.eval.runner import main

    out = tmp_path / "run"
    assert main(["synthetic", "--preset", "sdar", "--model", str(folder), "--no-chat", "--limit", "2",
                 "--max-new-tokens", "8", "--option", "denoising_steps=2", "--output", str(out), "--no-progress",
                 "--dtype", "float32"]) == 0
    identity = json.loads((out / "run.json").read_text())["identity"]
    assert identity["preset"] == "sdar" and identity["sampler"] == "sdar" and identity["temperature"] == 0.0
    assert identity["sampler_options"]["confidence_threshold"] == 0.9  # the preset's
    assert identity["sampler_options"]["denoising_steps"] == 2  # the flag's
