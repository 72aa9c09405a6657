"""Native SDAR (dllm.models.native, family "sdar") against SDAR's real modelling code, on tiny hub-layout folders.

The folders (tests/fixtures/hf/sdar_checkpoints.py) hold the hub's config keys, the real .py files and weights
written by the real class's ``save_pretrained``; ``reference_model`` runs that code (test-only), called as the
official ``block_diffusion_generate`` calls it: a block-causal mask with blocks anchored at position 0. The package
never imports it. Tolerance: 1e-4 in float32 (the two compute the same sums in different orders).
"""

import json
import sys

import pytest
import torch
from fixtures.hf.remote_checkpoints import max_logit_diff, require_remote_code
from fixtures.hf.sdar_checkpoints import REMOTE_CODE, make_sdar_folder, reference_logits, reference_model

import dllm
from dllm.models.loading import detect_kind
from dllm.models.native import NativeLM, load_native, sdar_config
from dllm.models.transformer import TransformerConfig, TransformerLM
from dllm.protocols import Capabilities, capabilities

MASK = 299  # <|MASK|> in the folders' tokenizer, found by its name (the hub config names no mask id)
TOLERANCE = 1e-4
# head_dim 16 = hidden / heads with as many key-value heads as heads, tied embeddings, another theta and eps; and a
# config.json that carries its own block size (the training repository's does)
VARIANTS = [{"head_dim": 16, "num_key_value_heads": 4, "tie_word_embeddings": True, "rope_theta": 10000.0,
             "rms_norm_eps": 1e-5}, {"block_size": 8}]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_sdar_folder(tmp_path_factory.mktemp("sdar") / "ckpt")


@pytest.fixture(scope="module")
def reference(folder):
    return reference_model(folder)


def _max_diff(native, real, mask=MASK):
    return max_logit_diff(native, real, mask)


def _ids(shape, seed):
    return torch.randint(0, MASK, shape, generator=torch.Generator().manual_seed(seed))


def test_loads_as_native_block_causal_model_anchored_at_zero(folder):
    model = dllm.load(folder)
    assert type(model) is NativeLM and model.family == "sdar" and model.dtype == torch.float32
    config = model.config
    assert (config.layout, config.block_size, config.head_dim, config.n_kv_heads, config.qk_norm) == \
        ("block_causal", 4, 32, 2, True)
    assert not config.shift_logits and not config.tie_embeddings and config.rope_theta == 1e6
    caps = capabilities(model)
    assert (caps.block_size, caps.block_anchor, caps.cache, caps.cache_exact) == (4, "absolute", True, True)
    assert model.mask_token_id == MASK and model.stop_token_ids == (0, 2)  # <|endoftext|>, then <|im_end|>
    assert type(dllm.load(folder, kind="sdar")) is NativeLM


def test_full_forward_equals_the_real_code(folder, reference):
    """(a) A length that is not a multiple of the block: the last block is partial in both."""
    ids = _ids((2, 11), 1)
    assert _max_diff(dllm.load(folder)(ids), reference_logits(reference, ids, 4)) <= TOLERANCE


@pytest.mark.parametrize("overrides", VARIANTS)
def test_config_variants_equal_the_real_code(tmp_path, overrides):
    folder = make_sdar_folder(tmp_path / "variant", seed=3, **overrides)
    model, reference = dllm.load(folder), reference_model(folder)
    block = overrides.get("block_size", 4)
    assert model.config.block_size == block and model.config.head_dim == overrides.get("head_dim", 32)
    if overrides.get("tie_word_embeddings"):
        assert model.output.weight is model.tok_embeddings.weight
    ids = _ids((2, 13), 2)
    assert _max_diff(model(ids), reference_logits(reference, ids, block)) <= TOLERANCE


def test_block_cache_equals_the_real_full_forward(folder, reference):
    """(b) Whole blocks prefilled into the KV cache (two at once, then one by one as block_diffusion_generate
    stores each finished block), then the current block read against them."""
    model, ids = dllm.load(folder), _ids((2, 18), 4)
    real = reference_logits(reference, ids, 4)
    cache = model.new_cache()
    model.forward_cached(ids[:, :8], cache)
    for start in range(8, 18, 4):
        current = model.forward_cached(ids[:, start:start + 4], cache, append=False)
        assert _max_diff(current, real[:, start:start + 4]) <= TOLERANCE, start
        model.forward_cached(ids[:, start:start + 4], cache)
    assert cache.length == 18


def test_random_reveal_states_equal_the_real_code(folder, reference):
    """(c) A prompt of 6 then an answer of 10 with random positions masked (any number, anywhere): the full
    forward, and each block read against the cached blocks before it, equal the real full forward."""
    model = dllm.load(folder)
    generator = torch.Generator().manual_seed(5)
    for _ in range(4):
        clean = _ids((3, 16), int(torch.randint(0, 1000, (1,), generator=generator)))
        hidden = (torch.rand(3, 16, generator=generator) < torch.rand(3, 1, generator=generator)) \
            & (torch.arange(16) >= 6)
        state = torch.where(hidden, MASK, clean)
        real = reference_logits(reference, state, 4)
        assert _max_diff(model(state), real) <= TOLERANCE
        cache = model.new_cache()
        for start in range(0, 16, 4):
            block = model.forward_cached(state[:, start:start + 4], cache, append=False)
            assert _max_diff(block, real[:, start:start + 4]) <= TOLERANCE
            model.forward_cached(state[:, start:start + 4], cache)


def test_prompt_is_block_causal_from_position_zero(folder, reference):
    """A prompt of 6 tokens (not a multiple of 4) and a masked answer: every position equals the real code, whose
    blocks start at 0 (positions 4..7 hold the prompt's tail and the answer's head in one block). Blocks anchored at
    the answer instead (block_offset = 6, what samplers pass to answer-anchored models) give other logits."""
    model = dllm.load(folder)
    ids = torch.cat([_ids((2, 6), 6), torch.full((2, 8), MASK)], dim=1)
    real = reference_logits(reference, ids, 4)
    assert _max_diff(model(ids), real) <= TOLERANCE
    assert _max_diff(model(ids, block_offset=torch.zeros(2, dtype=torch.long)), real) <= TOLERANCE
    assert _max_diff(model(ids, block_offset=6), real) > 1e-2


def test_sharded_checkpoint_loads_shard_by_shard(tmp_path, folder, reference):
    sharded = make_sdar_folder(tmp_path / "sharded", max_shard_size="20KB")  # same seed as ``folder``
    assert len(list(sharded.glob("model-*.safetensors"))) > 2 and (sharded / "model.safetensors.index.json").is_file()
    model = dllm.load(sharded, device_map={"": "cpu"})
    ids = _ids((2, 9), 7)
    torch.testing.assert_close(model(ids), dllm.load(folder)(ids), atol=0, rtol=0)
    assert _max_diff(model(ids), reference_logits(reference, ids, 4)) <= TOLERANCE


def test_transformers_5_config_is_read(tmp_path, folder):
    """A config.json as transformers 5's save_pretrained writes it (theta under rope_parameters too)."""
    config = json.loads((folder / "config.json").read_text())
    config.update(rope_parameters={"rope_theta": config["rope_theta"], "rope_type": "default"})
    config.pop("rope_scaling")
    other = tmp_path / "t5"
    other.mkdir()
    for file in folder.iterdir():
        (other / file.name).write_bytes(file.read_bytes())
    (other / "config.json").write_text(json.dumps(config))
    ids = _ids((1, 7), 8)
    torch.testing.assert_close(dllm.load(other)(ids), dllm.load(folder)(ids), atol=0, rtol=0)


def test_loading_never_runs_the_folders_python(tmp_path):
    """Every .py beside the weights (named by auto_map) is a trap, and no module of the real code is imported."""
    folder = make_sdar_folder(tmp_path / "trapped")
    marker = tmp_path / "ran"
    for file in folder.glob("*.py"):
        file.write_text(f"open({str(marker)!r}, 'w').write('x')\nraise RuntimeError('hub code ran')\n")
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    settings["auto_map"] = {"AutoTokenizer": ["configuration_sdar.Trap", None]}
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    assert "auto_map" in json.loads((folder / "config.json").read_text())
    before = set(sys.modules)
    model = dllm.load(folder)
    assert not marker.exists() and type(model) is NativeLM
    new = [sys.modules[name] for name in set(sys.modules) - before]
    files = [str(getattr(module, "__file__", "") or "") for module in new]
    assert not [f for f in files if str(folder) in f or str(REMOTE_CODE) in f]
    assert not [module.__name__ for module in new if "sdar" in module.__name__]


# ------------------------------------------------------------------ block size and mask token


def test_block_size_and_mask_token_overrides(folder, reference):
    """dllm.load's block_size= and mask_token_id= win over the defaults (the logits then follow blocks of 8)."""
    model = dllm.load(folder, block_size=8, mask_token_id=298)
    assert (model.config.block_size, model.mask_token_id, capabilities(model).block_size) == (8, 298, 8)
    ids = _ids((1, 13), 9)
    keep = torch.ones(320, dtype=torch.bool)
    keep[298] = False
    real = reference_logits(reference, ids, 8)
    assert (model(ids)[..., keep] - real[..., keep]).abs().max() <= TOLERANCE
    assert (model(ids)[..., keep] - reference_logits(reference, ids, 4)[..., keep]).abs().max() > 1e-2


def test_mask_token_from_config_json(tmp_path):
    folder = make_sdar_folder(tmp_path / "named", mask_token_id=5)
    assert dllm.load(folder).mask_token_id == 5


def test_mask_token_default_is_sdar_4b_chats(tmp_path):
    """Nothing names a mask token: 151669 (SDAR-4B-Chat's) where the vocabulary holds it, else a clear error."""
    big = make_sdar_folder(tmp_path / "big", tokenizer=False, vocab_size=151936, hidden_size=16, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=8, intermediate_size=32)
    assert dllm.load(big).mask_token_id == 151669
    small = make_sdar_folder(tmp_path / "small", tokenizer=False)
    with pytest.raises(ValueError, match=r"names no mask token.*151669 is outside its vocab_size=320.*mask_token_id="):
        dllm.load(small)
    assert dllm.load(small, mask_token_id=7).mask_token_id == 7


def test_kind_is_detected_from_model_type_or_architecture():
    assert detect_kind({"model_type": "sdar", "architectures": ["SDARForCausalLM"]}) == "sdar"
    assert detect_kind({"architectures": ["SDARForCausalLM"]}) == "sdar"  # not "causal": it is block diffusion
    assert detect_kind({"model_type": "sdar"}) == "sdar"  # TraDo's config


# ------------------------------------------------------------------ bad inputs: one message naming the parameter


def _hub(**changes):
    """SDAR-4B-Chat's config.json (from the fixtures) with ``changes``."""
    config = json.loads((require_remote_code("sdar") / "config.json").read_text())
    config.update(changes)
    return config


@pytest.mark.parametrize("changes,message", [
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, r"rope_scaling=.*linear.*not supported"),
    ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, r"rope_scaling=.*yarn.*not supported"),
    ({"rope_parameters": {"rope_theta": 1e6, "rope_type": "dynamic"}}, r"rope_type='dynamic' is not supported"),
    ({"attention_bias": True}, r"attention_bias=True is not supported"),
    ({"hidden_act": "gelu"}, r"hidden_act='gelu' is not supported"),
    ({"use_sliding_window": True}, r"use_sliding_window=True is not supported"),
    ({"block_size": 0}, r"config.json block_size must be a positive int, got 0"),
    ({"block_size": "4"}, r"config.json block_size must be a positive int, got '4'"),
])
def test_unsupported_config_values_are_refused(changes, message):
    with pytest.raises(ValueError, match=message):
        sdar_config(_hub(**changes), 151669, 151643, 151643)


def test_config_maps_the_hub_keys():
    config = sdar_config(_hub(), 151669, 151643, 151643)
    assert (config.dim, config.n_layers, config.n_heads, config.n_kv_heads, config.head_dim, config.mlp_hidden) == \
        (2560, 36, 32, 8, 128, 9728)
    assert (config.block_size, config.max_seq_len, config.rope_theta, config.norm_eps) == (4, 32768, 1e6, 1e-6)
    assert sdar_config(_hub(rope_scaling={"rope_type": "default"}), 5, 1, 1, block_size=16).block_size == 16
    assert sdar_config(_hub(head_dim=None), 5, 1, 1).head_dim == 80  # null: hidden / heads, Qwen3's rule


def test_bad_load_options_are_refused(tmp_path, folder):
    config = json.loads((folder / "config.json").read_text())
    with pytest.raises(ValueError, match="block_size must be >= 1, got 0"):
        dllm.load(folder, block_size=0)
    with pytest.raises(TypeError, match="block_size must be an int, got str"):
        dllm.load(folder, block_size="4")
    with pytest.raises(TypeError, match=r"block_size= is for the block-causal families \['sdar', 'llada2'\]"):
        load_native(folder, "dream", block_size=4)
    with pytest.raises(ValueError, match="mask_token_id must be None or an int in"):
        dllm.load(folder, mask_token_id=320)
    with pytest.raises(ValueError, match="trust_remote_code=True: SDAR checkpoints load natively only"):
        dllm.load(folder, trust_remote_code=True)
    with pytest.raises(ValueError, match="kind='causal' does not match"):
        dllm.load(folder, kind="causal")
    bad = tmp_path / "bad"
    bad.mkdir()
    for file in folder.iterdir():
        (bad / file.name).write_bytes(file.read_bytes())
    (bad / "config.json").write_text(json.dumps({**config, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}))
    with pytest.raises(ValueError, match=r"native sdar: config.json rope_scaling=.*no other loader for sdar"):
        dllm.load(bad)


def test_unknown_hub_tensor_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = make_sdar_folder(tmp_path / "extra")
    state = load_file(folder / "model.safetensors")
    state["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(128)
    save_file(state, folder / "model.safetensors")
    with pytest.raises(ValueError, match="q_proj.bias"):
        dllm.load(folder)


# ------------------------------------------------------------------ the new TransformerConfig fields


@pytest.mark.parametrize("changes,error,message", [
    ({"head_dim": 7}, ValueError, "head_dim must be even for rotary, got 7"),
    ({"head_dim": 0}, ValueError, "head_dim must be a positive int, got 0"),
    ({"head_dim": 8.0}, ValueError, "head_dim must be a positive int, got 8.0"),
    ({"qk_norm": 1}, ValueError, "qk_norm must be a bool, got 1"),
    ({"dim": 30, "n_heads": 4}, ValueError, r"dim \(30\) must be divisible by n_heads \(4\) when head_dim is None"),
])
def test_new_config_fields_are_checked(changes, error, message):
    with pytest.raises(error, match=message):
        TransformerConfig(**{"vocab_size": 20, "dim": 32, "n_heads": 4, **changes})


class _Absolute:
    """A bare logits function declaring blocks by attribute (the record is derived from them)."""

    vocab_size, mask_token_id, block_size, block_anchor = 8, 7, 4, "absolute"

    def __call__(self, input_ids):
        return torch.zeros(*input_ids.shape, 8)


def test_capabilities_block_anchor_is_checked():
    assert Capabilities().block_anchor == "answer" and capabilities(lambda ids: ids).block_anchor == "answer"
    assert (capabilities(_Absolute()).block_size, capabilities(_Absolute()).block_anchor) == (4, "absolute")
    with pytest.raises(ValueError, match=r"block_anchor must be one of \('answer', 'absolute'\), got 'start'"):
        Capabilities(block_anchor="start")


def test_own_model_with_head_dim_and_qk_norm(tmp_path):
    """head_dim apart from dim / n_heads and per-head q/k norms on the project's own model: cached blocks equal
    the full forward, the norms change the logits, and save / load keeps both fields."""
    torch.manual_seed(0)
    config = TransformerConfig(vocab_size=30, dim=32, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=24, qk_norm=True,
                               layout="block_causal", block_size=4, mask_token_id=29, max_seq_len=64)
    model = TransformerLM(config).eval()
    with torch.no_grad():
        for layer in model.layers:
            layer.attn.q_norm.weight.normal_(1.0, 0.3)
            layer.attn.k_norm.weight.normal_(1.0, 0.3)
        ids = _ids((2, 10), 10) % 29
        full = model(ids)
        cache = model.new_cache()
        model.forward_cached(ids[:, :8], cache)
        rest = model.forward_cached(ids[:, 8:], cache, append=False)
        assert (rest[..., :29] - full[:, 8:, :29]).abs().max() <= 1e-5
        plain = TransformerLM(TransformerConfig(**{**config.to_dict(), "qk_norm": False})).eval()
        plain.load_state_dict({k: v for k, v in model.state_dict().items()
                               if ".attn.q_norm." not in k and ".attn.k_norm." not in k})
        assert (plain(ids)[..., :29] - full[..., :29]).abs().max() > 1e-2
    model.save_pretrained(tmp_path / "saved")
    again = TransformerLM.from_pretrained(tmp_path / "saved")
    assert again.config == config and again.config.head_dim == 24 and again.config.qk_norm
    torch.testing.assert_close(again(ids), full, atol=0, rtol=0)
