"""The hub-layout fixtures of the real LLaDA / Dream code are what they claim to be (tests/fixtures/hf)."""

import json

import pytest
import torch
from fixtures.hf.remote_checkpoints import make_dream_folder, make_llada_folder, reference_model
from safetensors.torch import load_file
from transformers import PreTrainedTokenizerFast

MAKERS = {"llada": make_llada_folder, "dream": make_dream_folder}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("remote")
    return {family: make(root / family) for family, make in MAKERS.items()}


@pytest.mark.parametrize("family", MAKERS)
def test_folder_has_hub_layout_and_matching_tokenizer(folders, family):
    folder = folders[family]
    config = json.loads((folder / "config.json").read_text())
    for module in {entry.split(".")[0] for entry in config["auto_map"].values()}:
        assert (folder / f"{module}.py").is_file()  # the real code sits beside the weights, as on the hub
    tokenizer = PreTrainedTokenizerFast.from_pretrained(folder)  # tokenizer.json: no hub code needed
    assert tokenizer.convert_tokens_to_ids({"llada": "<|mdm_mask|>", "dream": "<|mask|>"}[family]) \
        == config["mask_token_id"] == 299
    assert tokenizer.eos_token_id == config["eos_token_id"] and len(tokenizer) < config["vocab_size"]
    assert (tokenizer.mask_token_id == config["mask_token_id"]) == (family == "dream")  # LLaDA's names none


@pytest.mark.parametrize("family", MAKERS)
def test_reference_model_holds_the_saved_weights_and_the_rotary_formula(folders, family):
    model = reference_model(folders[family])
    saved = load_file(folders[family] / "model.safetensors")
    state = model.state_dict()
    assert set(saved) == set(state) and all(torch.equal(saved[k], state[k]) for k in saved)
    assert not model.training and all(p.dtype == torch.float32 for p in model.parameters())
    if family == "dream":  # the test-only "default" rope: 1 / theta^(2i/d), never left uninitialised
        head = model.config.hidden_size // model.config.num_attention_heads
        expected = 1.0 / model.config.rope_theta ** (torch.arange(0, head, 2).float() / head)
        torch.testing.assert_close(model.model.rotary_emb.inv_freq, expected, rtol=0, atol=0)
        assert model.generation_config.eps is not None  # diffusion_generate reads it
        torch.manual_seed(0)
        out = model.diffusion_generate(torch.tensor([[2, 20, 21]]), max_new_tokens=4, steps=4,
                                       return_dict_in_generate=True)
        assert out.sequences.shape == (1, 7) and (out.sequences[:, :3] == torch.tensor([[2, 20, 21]])).all()
    logits = model(torch.tensor([[2, 20, 21, 299, 299, 1]])).logits
    assert logits.shape == (1, 6, 320) and logits.isfinite().all() and logits.std() > 0.1


def test_seed_and_overrides_change_the_checkpoint(tmp_path):
    first = load_file(make_llada_folder(tmp_path / "a", seed=0) / "model.safetensors")
    again = load_file(make_llada_folder(tmp_path / "b", seed=0) / "model.safetensors")
    other = load_file(make_llada_folder(tmp_path / "c", seed=1, n_layers=1) / "model.safetensors")
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert len(other) < len(first) and not torch.equal(first["model.transformer.wte.weight"],
                                                       other["model.transformer.wte.weight"])
