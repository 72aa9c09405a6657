"""The shipped SDAR-layout model (dllm/weights/sdar) and what made it: the absolute-anchor training objective
(blocks from position 0, as SDAR) and the hub SDAR export (dllm/training/sdar.py)."""

import json
import warnings

import pytest
import torch
from fixtures.hf.remote_checkpoints import max_logit_diff
from fixtures.hf.sdar_checkpoints import hub_model, reference_logits, reference_model

import dllm
from dllm.data.synthetic import format_example, heldout_set
from dllm.models.loading import SHIPPED, is_shipped
from dllm.models.native import NativeLM
from dllm.models.transformer import TransformerConfig, TransformerLM
from dllm.protocols import capabilities
from dllm.training import config_from_dict
from dllm.training.batches import IGNORE, Example, build_batch, region_length
from dllm.training.sdar import export_sdar

V, PAD, EOS, MASK = 40, 0, 1, 2
FOLDER = SHIPPED / "sdar"
shipped = pytest.mark.skipif(not (FOLDER / "model.safetensors").is_file(), reason="dllm/weights/sdar not present")


def _block_model(block_size=4, qk_norm=False) -> TransformerLM:
    torch.manual_seed(0)
    return TransformerLM(TransformerConfig(vocab_size=V, dim=32, n_layers=2, n_heads=2, max_seq_len=128,
                                           layout="block_causal", block_size=block_size, mask_token_id=MASK,
                                           eos_token_id=EOS, pad_token_id=PAD, qk_norm=qk_norm)).eval()


def _absolute_examples(lengths, block_size=4) -> list[Example]:
    g = torch.Generator().manual_seed(0)
    out = []
    for prompt_len, answer_len in lengths:
        prompt = torch.randint(4, V, (prompt_len,), generator=g).tolist()
        answer = torch.randint(4, V, (answer_len,), generator=g).tolist()
        region = region_length("block_causal", answer_len + 1, block_size, 80, prompt_len, "absolute")
        out.append(Example(tuple(prompt), tuple(answer) + (EOS,) * (region - answer_len), answer_len + 1))
    return out


# --- the training objective, blocks anchored at position 0 ----------------------------------------------

def test_absolute_regions_end_at_block_boundaries():
    for p in range(1, 12):
        for n in range(1, 9):
            r = region_length("block_causal", n, 4, 80, p, "absolute")
            assert (p + r) % 4 == 0 and r >= n + 4 and r - 4 < n + 4  # whole blocks + one all-EOS block


def test_two_stream_forward_equals_inference_forward_absolute_anchor():
    """Noisy block b's training logits == the inference call (block_offset 0) on [prompt and clean tokens before
    block b, noisy block b], where block 0 of the noisy stream is the prompt's last (partial) block."""
    model, keep = _block_model(qk_norm=True), torch.arange(V) != MASK
    examples = _absolute_examples([(5, 6), (9, 3), (3, 10), (8, 4), (6, 1)])
    batch = build_batch("block_causal", examples, pad_id=PAD, mask_id=MASK, block_size=4,
                        generator=torch.Generator().manual_seed(1), suffix_prob=0.5, anchor="absolute")
    assert batch.block_offset.tolist() == [0] * len(examples)
    with torch.no_grad():
        logits = model(batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids)
        checked = 0
        for i, example in enumerate(examples):
            prompt, region = list(example.prompt), list(example.region)
            lead = len(prompt) % 4
            start = len(prompt) - lead  # the noisy stream starts at the block holding the answer's first token
            span = lead + len(region)
            assert (start + span) % 4 == 0
            noisy = batch.input_ids[i, :span].tolist()
            assert batch.position_ids[i, :span].tolist() == list(range(start, start + span))
            assert noisy[:lead] == prompt[start:]  # the prompt's tail rides clean in the first noisy block
            assert batch.targets[i, :lead].tolist() == [IGNORE] * lead
            assert batch.targets[i, lead:span].tolist() == [t if n == MASK else IGNORE
                                                            for t, n in zip(region, noisy[lead:])]
            assert (batch.targets[i, span:] == IGNORE).all()  # the clean stream is never a target
            clean = prompt + region
            for b in range(span // 4):
                context = clean[:start + 4 * b] + noisy[4 * b:4 * b + 4]
                reference = model(torch.tensor([context]), block_offset=0)[0, -4:]
                torch.testing.assert_close(logits[i, 4 * b:4 * b + 4, keep], reference[:, keep],
                                           rtol=1e-5, atol=1e-5)
                checked += 1
            # the check can fail: anchoring blocks at the answer instead changes the logits (when lead > 0)
            if lead:
                wrong = model(torch.tensor([context]), block_offset=len(prompt))[0, -4:]
                assert not torch.allclose(wrong[:, keep], reference[:, keep], atol=1e-4)
    assert checked == sum((len(e.prompt) % 4 + len(e.region)) // 4 for e in examples)


def test_absolute_anchor_never_masks_the_prompt_and_weights_blocks_by_their_answer_tokens():
    examples = _absolute_examples([(5, 6), (7, 2), (2, 9)])
    batch = build_batch("block_causal", examples, pad_id=PAD, mask_id=MASK, block_size=4,
                        generator=torch.Generator().manual_seed(3), anchor="absolute")
    for i, e in enumerate(examples):
        lead, r = len(e.prompt) % 4, len(e.region)
        masked = batch.input_ids[i, :lead + r] == MASK
        assert not masked[:lead].any() and masked[lead:].any()
        weights = batch.weights[i, :lead + r].view(-1, 4)
        real = torch.ones(lead + r, dtype=torch.bool)
        real[:lead] = False
        for w, m, n in zip(weights, masked.view(-1, 4), real.view(-1, 4).sum(-1)):
            assert m.sum() >= 1  # every block masks at least one answer position
            torch.testing.assert_close(w[m], torch.full((int(m.sum()),), float(n) / float(m.sum())))
    assert batch.count == sum(len(e.region) for e in examples)


def test_sdar_training_config_loads():
    from dllm.training import load_config

    config = load_config(SHIPPED.parents[1] / "configs" / "sdar.toml")
    assert config.layout == "block_causal" and config.train.block_anchor == "absolute"
    assert config.model["block_size"] == 4 and config.model["qk_norm"] is True


def test_block_anchor_config_is_checked():
    base = {"model": {"layout": "block_causal", "block_size": 4, "dim": 32, "n_layers": 1, "n_heads": 2}}
    assert config_from_dict({**base, "train": {"block_anchor": "absolute"}}).train.block_anchor == "absolute"
    with pytest.raises(ValueError, match="train.block_anchor"):
        config_from_dict({**base, "train": {"block_anchor": "zero"}})
    with pytest.raises(ValueError, match="block_causal"):
        config_from_dict({"model": {"layout": "causal"}, "train": {"block_anchor": "absolute"}})


# --- the hub SDAR export ----------------------------------------------------------------------------------

def test_export_loads_as_native_sdar_with_the_same_logits(tmp_path):
    model = _block_model(qk_norm=True)
    with torch.no_grad():
        for layer in model.layers:  # gains away from 1, so a swapped q/k norm would show
            layer.attn.q_norm.weight.uniform_(0.5, 2.0)
            layer.attn.k_norm.weight.uniform_(0.5, 2.0)
    model.save_pretrained(tmp_path / "ours")
    (tmp_path / "ours" / "tokenizer.json").write_bytes((SHIPPED / "diffusion" / "tokenizer.json").read_bytes())
    export_sdar(tmp_path / "ours", tmp_path / "hub")
    config = json.loads((tmp_path / "hub" / "config.json").read_text())
    assert config["model_type"] == "sdar" and config["block_size"] == 4 and config["mask_token_id"] == MASK
    native = dllm.load(tmp_path / "hub")
    assert isinstance(native, NativeLM) and native.family == "sdar" and native.config.qk_norm
    assert capabilities(native).block_anchor == "absolute" and capabilities(native).block_size == 4
    x = torch.randint(3, V, (2, 19))
    keep = torch.arange(V) != MASK
    with torch.no_grad():
        torch.testing.assert_close(native(x, block_offset=torch.zeros(2, dtype=torch.long))[..., keep],
                                   model(x, block_offset=0)[..., keep], rtol=0, atol=0)
    generation = json.loads((tmp_path / "hub" / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 3, "eos_token_id": EOS, "pad_token_id": PAD}
    assert max_logit_diff(native(x[:1], block_offset=torch.zeros(1, dtype=torch.long)),
                          reference_logits(hub_model(tmp_path / "hub"), x[:1], 4), MASK) < 1e-4


# --- the shipped model --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sdar_model():
    return dllm.load("sdar")


def _prompts(tokenizer, indices) -> list[torch.Tensor]:
    problems = heldout_set()
    return [torch.tensor([tokenizer(format_example(problems[i]["question"]), add_special_tokens=False)["input_ids"]])
            for i in indices]


@shipped
def test_shipped_sdar_loads_by_name_as_native_sdar(sdar_model):
    assert is_shipped("sdar")
    config = json.loads((FOLDER / "config.json").read_text())
    assert config["model_type"] == "sdar" and config["block_size"] == 4 and config["mask_token_id"] == 2
    assert isinstance(sdar_model, NativeLM) and sdar_model.family == "sdar"
    assert sdar_model.config.layout == "block_causal" and sdar_model.config.block_size == 4
    assert sdar_model.config.qk_norm
    assert capabilities(sdar_model).block_anchor == "absolute"
    tokenizer = sdar_model.tokenizer
    assert tokenizer.mask_token_id == sdar_model.mask_token_id == 2 and tokenizer.eos_token_id == 1
    assert sdar_model.stop_token_ids == (1,)


@shipped
def test_shipped_sdar_equals_the_real_sdar_code(sdar_model):
    """The shipped folder run by SDAR's own modelling code (as block_diffusion_generate calls it) gives the
    native model's logits."""
    reference = reference_model(FOLDER)
    ids = _prompts(sdar_model.tokenizer, [0])[0]
    ids = torch.cat([ids, torch.full((1, 6), 2)], dim=1)
    with torch.no_grad():
        ours = sdar_model(ids, block_offset=torch.zeros(1, dtype=torch.long))
    assert max_logit_diff(ours, reference_logits(reference, ids, 4), 2) < 1e-4


@shipped
@pytest.mark.parametrize("block", [4, 8, 2])
def test_shipped_folder_runs_in_sdars_own_code_as_its_config_makes_it(sdar_model, block):
    """The shipped folder is a hub SDAR folder: SDAR's own modelling code builds from its config.json as is (every key
    that code reads is there; nothing patched in) and gives the native load's logits, in the checkpoint's blocks of 4
    and in a run's own (the official decoder's mask of its block_length; ours by the run's block_size=)."""
    ids = torch.cat([_prompts(sdar_model.tokenizer, [1])[0], torch.full((1, 7), 2)], dim=1)
    reference = hub_model(FOLDER)
    with torch.no_grad():
        ours = sdar_model(ids, block_offset=torch.zeros(1, dtype=torch.long), block_size=block)
    assert max_logit_diff(ours, reference_logits(reference, ids, block), 2) < 1e-4


@shipped
def test_a_folder_without_sdars_config_keys_fails_in_its_code(tmp_path):
    """What the test above guards against: the folder as it was shipped before (configuration_sdar.py's keys only)
    cannot run a forward in SDAR's code."""
    config = json.loads((FOLDER / "config.json").read_text())
    for key in ("fuse_cross_entropy", "ep_size", "micro_forward", "use_deepep", "skip_checkpoint", "debug", "auto_map"):
        config.pop(key)
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").symlink_to(FOLDER / "model.safetensors")
    with pytest.raises(AttributeError, match="fuse_cross_entropy"):
        reference_logits(hub_model(tmp_path), torch.tensor([[5, 6, 7, 2]]), 4)


@shipped
@pytest.mark.parametrize("block", [4, 8])
@pytest.mark.parametrize("index", [0, 1, 2])
def test_shipped_sdar_fef_at_zero_temperature_is_greedy_sequential(sdar_model, index, block):
    """In the checkpoint's blocks of 4 and in a run's blocks of 8."""
    prompt = _prompts(sdar_model.tokenizer, [index])[0]
    outputs = {}
    for sampler, options in (("sequential", {"order": "left_to_right"}), ("fef", {"window": 4})):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "block_length=8 sets this run's attention blocks", UserWarning)
            out = dllm.generate(sdar_model, prompt, sampler=sampler, max_new_tokens=16, temperature=0.0,
                                block_length=block, **options)
        outputs[sampler] = out.sequences
    assert torch.equal(outputs["fef"], outputs["sequential"])
    answer = sdar_model.tokenizer.decode(outputs["fef"][0, prompt.shape[1]:])
    assert answer.strip()  # decodes to text


@shipped
def test_shipped_sdar_runs_the_sdar_sampler(sdar_model):
    prompt = _prompts(sdar_model.tokenizer, [0])[0]
    out = dllm.generate(sdar_model, prompt, sampler="sdar", max_new_tokens=8, temperature=0.0, block_length=4)
    assert out.sequences.shape == (1, prompt.shape[1] + 8)
    assert (out.sequences[0, prompt.shape[1]:] != 2).all()


@pytest.mark.parametrize("sampler, options", [("sequential", {"order": "left_to_right"}),
                                              ("sequential", {"order": "confidence"}), ("fef", {"window": 3})])
def test_chunked_decoding_of_an_absolute_anchor_model_equals_one_call(tmp_path, sampler, options):
    """The evaluator's chunks run to model-block ends from position 0 (the first one to the end of the prompt's
    last block), so stopping at EOS changes nothing before the EOS, whatever the order inside a block."""
    from dllm.training.evaluate import generate_until_eos

    model = _block_model(qk_norm=True)
    model.save_pretrained(tmp_path / "ours")
    (tmp_path / "ours" / "tokenizer.json").write_bytes((SHIPPED / "diffusion" / "tokenizer.json").read_bytes())
    native = dllm.load(export_sdar(tmp_path / "ours", tmp_path / "hub"))
    prompt = torch.randint(4, V, (6, 5), generator=torch.Generator().manual_seed(0))  # 5 = one block and 1 token
    whole = dllm.generate(native, prompt, sampler=sampler, max_new_tokens=23, temperature=0, block_length=4,
                          **options)
    eos = int(whole.sequences[:, 5:13].flatten().mode().values)  # an early token stands in for EOS
    totals = {"nfe": 0, "new_tokens": 0, "wall_time_s": 0.0}
    chunked = generate_until_eos(native, prompt, sampler, 23, eos, totals, temperature=0,
                                 generator=torch.Generator(), block_length=4, **options)
    stopped = 0
    for row, ids in zip(whole.sequences[:, 5:].tolist(), chunked):
        cut = row.index(eos) + 1 if eos in row else len(row)
        assert ids[:cut] == row[:cut] and (eos in ids or len(ids) == 23)
        stopped += len(ids) < 23
    assert stopped
