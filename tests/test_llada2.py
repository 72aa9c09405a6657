"""Native LLaDA2 (dllm.models.native, family "llada2") against LLaDA2's real modelling code, on tiny hub-layout folders.

The folders (tests/fixtures/hf/llada2_checkpoints.py) hold the hub's config keys (the real LLaDA2-mini config scaled
down: layer 0 dense, then 8 experts top-2 in 2 groups of which 1 is kept, one shared expert, partial rotary 0.5,
random router biases), the real .py files and weights written by the real class's ``save_pretrained``;
``reference_model`` runs that code (test-only), called as the official ``generate`` calls it: a block-causal mask with
blocks anchored at position 0. The package never imports it. Tolerance: 1e-4 in float32 (the two compute the same
sums in different orders; measured differences are near 1e-6). Each parity test is shown able to fail: the routing
changes the tests guard (no bias, no group limit, the bias in the weights, no renormalisation, full rotary, another
q/k/v layout, answer-anchored blocks) move the logits by far more than the tolerance.
"""

import dataclasses
import json
import sys

import pytest
import torch
from fixtures.hf.llada2_checkpoints import make_llada2_folder, reference_logits, reference_model
from fixtures.hf.remote_checkpoints import REMOTE_CODE, max_logit_diff, require_remote_code

import dllm
from dllm.models import transformer
from dllm.models.loading import detect_kind
from dllm.models.native import NativeLM, llada2_config
from dllm.models.transformer import MoEConfig, TransformerConfig, TransformerLM
from dllm.protocols import capabilities

MASK = 299  # <|mask|> in the folders' tokenizer (its mask token; the config names none)
BLOCK = 4  # the tests' block (dllm.load's block_size=; the hub config has none, the default is 32)
TOLERANCE = 1e-4
FAR = 1e-2  # what a wrong routing, rotary or layout must move the logits by, at least (100 x the tolerance)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_llada2_folder(tmp_path_factory.mktemp("llada2") / "ckpt")


@pytest.fixture(scope="module")
def reference(folder):
    return reference_model(folder)


@pytest.fixture(scope="module")
def model(folder):
    return dllm.load(folder, block_size=BLOCK)


def _max_diff(native, real, mask=MASK):
    return max_logit_diff(native, real, mask)


def _ids(shape, seed):
    return torch.randint(0, MASK, shape, generator=torch.Generator().manual_seed(seed))


def _moe_layers(model):
    return [layer.mlp for layer in model.layers if isinstance(layer.mlp, transformer._MoE)]


# ------------------------------------------------------------------ loading


def test_loads_as_native_block_causal_moe_model_anchored_at_zero(folder):
    model = dllm.load(folder)
    assert type(model) is NativeLM and model.family == "llada2" and model.dtype == torch.float32
    config = model.config
    assert (config.layout, config.block_size, config.head_dim, config.rotary_dim, config.n_kv_heads) == \
        ("block_causal", 32, 16, 8, 2)
    assert config.qk_norm and not config.shift_logits and not config.tie_embeddings and config.rope_theta == 600000
    assert config.moe == MoEConfig(n_experts=8, experts_per_token=2, hidden=24, n_shared_experts=1, n_groups=2,
                                   topk_groups=1, routed_scaling=2.5, norm_topk=True, dense_layers=1)
    assert [type(layer.mlp).__name__ for layer in model.layers] == ["_SwiGLU", "_MoE", "_MoE"]
    assert config.mlp_hidden == 96 and model.output.weight is not model.tok_embeddings.weight
    caps = capabilities(model)
    assert (caps.block_size, caps.block_anchor, caps.cache, caps.cache_exact) == (32, "absolute", True, True)
    assert model.mask_token_id == MASK and model.eos_token_id == 0 and model.stop_token_ids == (0,)
    assert all((mlp.expert_bias != 0).all() for mlp in _moe_layers(model))  # the fixture's random router biases
    assert type(dllm.load(folder, kind="llada2")) is NativeLM
    assert "experts=8 (top 2)" in repr(model)


def test_kind_is_detected_from_model_type_or_architecture():
    assert detect_kind({"model_type": "llada2_moe", "architectures": ["LLaDA2MoeModelLM"]}) == "llada2"
    assert detect_kind({"architectures": ["LLaDA2MoeModelLM"]}) == "llada2"
    assert detect_kind({"model_type": "llada21_moe"}) == "llada2"  # the 2.1 code's own model_type
    assert detect_kind({"model_type": "llada", "architectures": ["LLaDAModelLM"]}) == "llada"  # LLaDA 1 unchanged


# ------------------------------------------------------------------ parity with the real code


def test_full_forward_equals_the_real_code(model, reference):
    """(a) A length that is not a multiple of the block: the last block is partial in both."""
    ids = _ids((2, 11), 1)
    assert _max_diff(model(ids), reference_logits(reference, ids, BLOCK)) <= TOLERANCE


def test_default_block_of_32_equals_the_real_code(folder, reference):
    ids = _ids((1, 45), 2)
    assert _max_diff(dllm.load(folder)(ids), reference_logits(reference, ids, 32)) <= TOLERANCE


def test_block_cache_equals_the_real_full_forward(model, reference):
    """(b) Whole blocks prefilled into the KV cache (two at once, then one by one as generate's blocks finish),
    then the current block read against them."""
    ids = _ids((2, 18), 4)
    real = reference_logits(reference, ids, BLOCK)
    cache = model.new_cache()
    model.forward_cached(ids[:, :8], cache)
    for start in range(8, 18, BLOCK):
        current = model.forward_cached(ids[:, start:start + BLOCK], cache, append=False)
        assert _max_diff(current, real[:, start:start + BLOCK]) <= TOLERANCE, start
        model.forward_cached(ids[:, start:start + BLOCK], cache)
    assert cache.length == 18


def test_random_reveal_states_equal_the_real_code(model, reference):
    """(c) A prompt of 6 then an answer of 10 with random positions masked (any number, anywhere): the full
    forward, and each block read against the cached blocks before it, equal the real full forward."""
    generator = torch.Generator().manual_seed(5)
    for _ in range(4):
        clean = _ids((3, 16), int(torch.randint(0, 1000, (1,), generator=generator)))
        hidden = (torch.rand(3, 16, generator=generator) < torch.rand(3, 1, generator=generator)) \
            & (torch.arange(16) >= 6)
        state = torch.where(hidden, MASK, clean)
        real = reference_logits(reference, state, BLOCK)
        assert _max_diff(model(state), real) <= TOLERANCE
        cache = model.new_cache()
        for start in range(0, 16, BLOCK):
            block = model.forward_cached(state[:, start:start + BLOCK], cache, append=False)
            assert _max_diff(block, real[:, start:start + BLOCK]) <= TOLERANCE
            model.forward_cached(state[:, start:start + BLOCK], cache)


def test_prompt_is_block_causal_from_position_zero(model, reference):
    """(d) A prompt of 6 tokens (not a multiple of 4) and a masked answer: every position equals the real code, whose
    blocks start at 0 (positions 4..7 hold the prompt's tail and the answer's head in one block). Blocks anchored at
    the answer instead (block_offset = 6) give other logits."""
    ids = torch.cat([_ids((2, 6), 6), torch.full((2, 8), MASK)], dim=1)
    real = reference_logits(reference, ids, BLOCK)
    assert _max_diff(model(ids), real) <= TOLERANCE
    assert _max_diff(model(ids, block_offset=6), real) > FAR


def test_sharded_checkpoint_loads_shard_by_shard(tmp_path, folder, reference):
    sharded = make_llada2_folder(tmp_path / "sharded", max_shard_size="20KB")  # same seed as ``folder``
    assert len(list(sharded.glob("model-*.safetensors"))) > 2 and (sharded / "model.safetensors.index.json").is_file()
    model = dllm.load(sharded, block_size=BLOCK, device_map={"": "cpu"})
    ids = _ids((2, 9), 7)
    torch.testing.assert_close(model(ids), dllm.load(folder, block_size=BLOCK)(ids), atol=0, rtol=0)
    assert _max_diff(model(ids), reference_logits(reference, ids, BLOCK)) <= TOLERANCE


def test_llada21_code_equals_the_native_model(tmp_path):
    """LLaDA2.1's copy of the code (model_type llada21_moe): the same network, the same native model."""
    folder = make_llada2_folder(tmp_path / "v21", seed=4, llada21=True)
    model, reference = dllm.load(folder, block_size=BLOCK), reference_model(folder)
    assert model.family == "llada2" and type(reference).__module__.endswith("modeling_llada21_moe")
    ids = _ids((2, 13), 8)
    assert _max_diff(model(ids), reference_logits(reference, ids, BLOCK)) <= TOLERANCE


# every layer routed, no group limit, one expert per token (its weight the raw score: no renormalisation), full
# rotary with as many key-value heads as heads, tied embeddings; no shared expert (num_shared_experts dropped: the
# class's default 0, whose 0-wide shared expert the checkpoint stores empty), no q/k norms, other theta and eps
VARIANTS = [
    {"first_k_dense_replace": 0, "n_group": 1, "topk_group": 1, "num_experts_per_tok": 1},
    {"partial_rotary_factor": 1.0, "num_key_value_heads": 4, "tie_word_embeddings": True, "topk_group": 2},
    {"num_shared_experts": None, "use_qk_norm": False, "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
     "num_experts_per_tok": 3, "n_group": 4, "topk_group": 2},
]


@pytest.mark.parametrize("overrides", VARIANTS)
def test_config_variants_equal_the_real_code(tmp_path, overrides):
    folder = make_llada2_folder(tmp_path / "variant", seed=3, **overrides)
    model, reference = dllm.load(folder, block_size=BLOCK), reference_model(folder)
    if overrides.get("tie_word_embeddings"):
        assert model.output.weight is model.tok_embeddings.weight
    ids = _ids((2, 13), 2)
    assert _max_diff(model(ids), reference_logits(reference, ids, BLOCK)) <= TOLERANCE


def test_checkpoint_without_router_bias_routes_on_scores(tmp_path, folder):
    """moe_router_enable_expert_bias false: no expert_bias tensors; the real code's buffer is then zero, ours too."""
    from safetensors.torch import load_file, save_file

    bare = tmp_path / "bare"
    bare.mkdir()
    for file in folder.iterdir():
        (bare / file.name).write_bytes(file.read_bytes())
    state = {k: v for k, v in load_file(bare / "model.safetensors").items() if not k.endswith("expert_bias")}
    save_file(state, bare / "model.safetensors", metadata={"format": "pt"})
    model = dllm.load(bare, block_size=BLOCK)
    assert all((mlp.expert_bias == 0).all() and mlp.expert_bias.dtype == torch.float32 for mlp in _moe_layers(model))
    reference = reference_model(folder)
    for layer in reference.model.layers[1:]:
        layer.mlp.gate.expert_bias.zero_()
    ids = _ids((2, 10), 9)
    assert _max_diff(model(ids), reference_logits(reference, ids, BLOCK)) <= TOLERANCE


# ------------------------------------------------------------------ the parity tests can fail


def _biased_weights(mlp, x):
    """DeepSeek-V3's rule broken: the bias in the weights too."""
    experts, _ = transformer._MoE.route(mlp, x)
    scores = torch.nn.functional.linear(x.float(), mlp.router.weight.float()).sigmoid() + mlp.expert_bias
    weights = scores.gather(1, experts)
    return experts, weights / weights.sum(-1, keepdim=True) * mlp.moe.routed_scaling


def _unnormalised(mlp, x):
    experts, _ = transformer._MoE.route(mlp, x)
    scores = torch.nn.functional.linear(x.float(), mlp.router.weight.float()).sigmoid()
    return experts, scores.gather(1, experts) * mlp.moe.routed_scaling


@pytest.mark.parametrize("change", ["no bias", "no group limit", "bias in the weights", "no renormalisation",
                                    "full rotary", "q/k/v interleaved per kv group"])
def test_each_guarded_detail_moves_the_logits_far(folder, reference, change):
    """What the parity tests guard, changed one at a time on the native model: each moves the logits by more than
    FAR (100 x the tolerance), so a parity test would fail on it."""
    model = dllm.load(folder, block_size=BLOCK)
    ids = _ids((3, 16), 10)
    real = reference_logits(reference, ids, BLOCK)
    assert _max_diff(model(ids), real) <= TOLERANCE
    with torch.no_grad():
        for mlp in _moe_layers(model):
            if change == "no bias":
                mlp.expert_bias.zero_()
            elif change == "no group limit":
                mlp.moe = dataclasses.replace(mlp.moe, topk_groups=mlp.moe.n_groups)
            elif change == "bias in the weights":
                mlp.route = lambda x, mlp=mlp: _biased_weights(mlp, x)
            elif change == "no renormalisation":
                mlp.route = lambda x, mlp=mlp: _unnormalised(mlp, x)
        if change == "full rotary":
            model.rotary = transformer._Rotary(model.config.head_dim, model.config.max_seq_len, model.config.rope_theta)
        if change == "q/k/v interleaved per kv group":  # the hub's rows read as [q0 q1 k0 v0 | q2 q3 k1 v1]
            for layer in model.layers:  # rows in head blocks of 16: q0 q1 q2 q3 k0 k1 v0 v1
                heads = layer.attn.wqkv.weight.view(8, 16, 64)
                layer.attn.wqkv.weight.copy_(heads[[0, 1, 4, 5, 2, 6, 3, 7]].reshape(128, 64))
    assert _max_diff(model(ids), real) > FAR


def test_the_routing_choices_differ_with_and_without_bias_and_group_limit(model):
    """The fixture exercises the bias and the group limit: on these inputs they change which experts are chosen."""
    mlp = _moe_layers(model)[0]
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(11))  # RMS-normed states have unit scale
    chosen = mlp.route(x)[0].sort(dim=-1).values
    saved_bias, saved_moe = mlp.expert_bias.clone(), mlp.moe
    with torch.no_grad():
        mlp.expert_bias.zero_()
        without_bias = mlp.route(x)[0].sort(dim=-1).values
        mlp.expert_bias.copy_(saved_bias)
        mlp.moe = dataclasses.replace(mlp.moe, topk_groups=2)
        without_limit = mlp.route(x)[0].sort(dim=-1).values
        mlp.moe = saved_moe
    assert (chosen != without_bias).any(dim=-1).float().mean() > 0.2
    assert (chosen != without_limit).any(dim=-1).float().mean() > 0.2
    groups = chosen // 4  # 2 groups of 4 experts: one group per token
    assert (groups[:, 0] == groups[:, 1]).all()


# ------------------------------------------------------------------ block size, mask and EOS ids


def test_mask_and_eos_ids_from_config_json(tmp_path):
    folder = make_llada2_folder(tmp_path / "named", tokenizer=False, mask_token_id=5, eos_token_id=6)
    model = dllm.load(folder)
    assert (model.mask_token_id, model.eos_token_id, model.stop_token_ids) == (5, 6, (6,))


def test_block_size_from_config_json_and_override(tmp_path, folder):
    named = make_llada2_folder(tmp_path / "blocks", block_size=8)
    assert dllm.load(named).config.block_size == 8 and dllm.load(named, block_size=16).config.block_size == 16
    assert capabilities(dllm.load(folder, block_size=64)).block_size == 64


def test_default_ids_are_llada2s(tmp_path):
    """Nothing names a mask or EOS token: 156895 and 156892 (the official generate's) where the vocabulary holds
    them; else the mask is a clear error and the EOS unknown; generation_config.json's EOS is read."""
    big = make_llada2_folder(tmp_path / "big", tokenizer=False, vocab_size=157184, hidden_size=16,
                             num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                             first_k_dense_replace=1, max_position_embeddings=64)
    (big / "generation_config.json").unlink()
    model = dllm.load(big)
    assert (model.mask_token_id, model.eos_token_id, model.stop_token_ids) == (156895, 156892, (156892,))
    (big / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 8]}))
    assert dllm.load(big).eos_token_id == 7
    small = make_llada2_folder(tmp_path / "small", tokenizer=False)
    with pytest.raises(ValueError, match=r"names no mask token.*156895 is outside its vocab_size=320.*mask_token_id="):
        dllm.load(small)
    model = dllm.load(small, mask_token_id=7)
    assert model.mask_token_id == 7 and model.eos_token_id is None


def test_loading_never_runs_the_folders_python(tmp_path):
    """Every .py beside the weights (named by auto_map) is a trap, and no module of the real code is imported."""
    folder = make_llada2_folder(tmp_path / "trapped")
    marker = tmp_path / "ran"
    for file in folder.glob("*.py"):
        file.write_text(f"open({str(marker)!r}, 'w').write('x')\nraise RuntimeError('hub code ran')\n")
    assert "auto_map" in json.loads((folder / "config.json").read_text())
    before = set(sys.modules)
    model = dllm.load(folder)
    assert not marker.exists() and type(model) is NativeLM
    new = [sys.modules[name] for name in set(sys.modules) - before]
    files = [str(getattr(module, "__file__", "") or "") for module in new]
    assert not [f for f in files if str(folder) in f or str(REMOTE_CODE) in f]
    assert not [module.__name__ for module in new if "llada2" in module.__name__.lower()]


def test_remote_code_is_refused(folder):
    with pytest.raises(ValueError, match="trust_remote_code=True: LLaDA2 checkpoints load natively only"):
        dllm.load(folder, trust_remote_code=True)
    with pytest.raises(ValueError, match="kind='remote' loads LLaDA or Dream hub code"):
        dllm.load(folder, kind="remote")
    with pytest.raises(ValueError, match="kind='sdar' does not match"):
        dllm.load(folder, kind="sdar")


def test_generate_runs_on_the_native_model(model):
    """The samplers see a block-causal model anchored at 0 (a smoke test: their laws are tested elsewhere)."""
    out = dllm.generate(model, _ids((1, 6), 12), sampler="sequential", max_new_tokens=6, block_length=BLOCK,
                        temperature=0.0)
    assert out.sequences.shape[0] == 1


# ------------------------------------------------------------------ hub config -> TransformerConfig


def _hub(**changes):
    """The real LLaDA2-mini config.json (from the fixtures) with ``changes``."""
    config = json.loads((require_remote_code("llada2") / "dfactory_llada2_mini_config.json").read_text())
    config.update(model_type="llada2_moe", **changes)
    return config


def test_config_maps_the_hub_keys():
    config = llada2_config(_hub(), 156895, 156892, 156892)
    assert (config.dim, config.n_layers, config.n_heads, config.n_kv_heads, config.head_dim, config.rotary_dim) == \
        (2048, 20, 16, 4, 128, 64)
    assert (config.mlp_hidden, config.block_size, config.max_seq_len, config.rope_theta, config.norm_eps) == \
        (5120, 32, 16384, 600000.0, 1e-6)
    assert config.moe == MoEConfig(n_experts=256, experts_per_token=8, hidden=512, n_shared_experts=1, n_groups=8,
                                   topk_groups=4, routed_scaling=2.5, norm_topk=True, dense_layers=1)
    assert config.qk_norm and not config.tie_embeddings and config.vocab_size == 157184
    assert llada2_config(_hub(num_key_value_heads=0, head_dim=None), 1, 2, 2).n_kv_heads == 16  # 2.1's rule
    assert llada2_config(_hub(head_dim=None), 1, 2, 2).head_dim == 128  # hidden / heads
    assert llada2_config(_hub(num_experts=None), 1, 2, 2).moe is None
    assert llada2_config(_hub(rope_scaling={"rope_type": "default"}), 1, 2, 2, block_size=16).block_size == 16
    assert llada2_config(_hub(norm_topk_prob=False), 1, 2, 2).moe.norm_topk  # the real code does not read it


@pytest.mark.parametrize("changes,message", [
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, r"rope_scaling=.*linear.*not supported"),
    ({"rope_parameters": {"rope_theta": 6e5, "rope_type": "yarn"}}, r"rope_type='yarn' is not supported"),
    ({"use_bias": None}, r"use_bias=True is not supported"),  # None: the key dropped (the class's default)
    ({"use_bias": True}, r"use_bias=True is not supported"),
    ({"use_qkv_bias": True}, r"use_qkv_bias=True is not supported"),
    ({"score_function": "softmax"}, r"score_function='softmax' is not supported"),
    ({"hidden_act": "gelu"}, r"hidden_act='gelu' is not supported"),
    ({"use_sliding_window": True}, r"use_sliding_window=True is not supported"),
    ({"partial_rotary_factor": 0}, r"partial_rotary_factor=0 must give an even number"),
    ({"partial_rotary_factor": "half"}, r"partial_rotary_factor='half' must give"),
    ({"partial_rotary_factor": 1.5}, r"partial_rotary_factor=1.5 must give"),
    ({"head_dim": 10}, r"partial_rotary_factor=0.5 must give an even number of rotated channels .* got 5"),
    ({"n_group": 3}, r"n_group -> n_groups.*moe.n_groups \(3\) must divide moe.n_experts \(256\)"),
    ({"topk_group": 9}, r"moe.topk_groups \(9\) must be <= moe.n_groups \(8\)"),
    ({"moe_intermediate_size": None}, r"moe_intermediate_size -> hidden.*moe.hidden must be a positive int"),
    ({"intermediate_size": None}, r"intermediate_size is null but the dense layers"),
    ({"block_size": 0}, r"config.json block_size must be a positive int, got 0"),
])
def test_unsupported_config_values_are_refused(changes, message):
    hub = _hub(**changes)
    if changes.get("use_bias", False) is None:
        hub.pop("use_bias")  # absent: the config class's default, True
    with pytest.raises(ValueError, match=message):
        llada2_config(hub, 156895, 156892, 156892)


def test_unknown_hub_tensor_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = make_llada2_folder(tmp_path / "extra")
    state = load_file(folder / "model.safetensors")
    state["model.layers.1.mlp.experts.8.up_proj.weight"] = torch.zeros(24, 64)  # a ninth expert of eight
    save_file(state, folder / "model.safetensors")
    with pytest.raises(ValueError, match=r"experts\.8\.up_proj"):
        dllm.load(folder)


# ------------------------------------------------------------------ the new TransformerConfig fields


MOE = {"n_experts": 8, "experts_per_token": 2, "hidden": 16}


@pytest.mark.parametrize("changes,message", [
    ({"rotary_dim": 7}, r"rotary_dim must be even and <= head_dim \(8\), got 7"),
    ({"rotary_dim": 10}, r"rotary_dim must be even and <= head_dim \(8\), got 10"),
    ({"rotary_dim": 0}, r"rotary_dim must be a positive int, got 0"),
    ({"moe": 3}, r"moe must be None, a MoEConfig or its dict, got 3"),
    ({"moe": {**MOE, "experts": 4}}, r"unknown MoEConfig keys \['experts'\]"),
    ({"moe": {**MOE, "dense_layers": 3}}, r"moe.dense_layers \(3\) must be <= n_layers \(2\)"),
    ({"moe": {**MOE, "dense_layers": -1}}, r"moe.dense_layers must be an int >= 0, got -1"),
    ({"moe": {**MOE, "n_groups": 8}}, r"moe.n_groups \(8\) leaves fewer than 2 experts per group"),
    ({"moe": {**MOE, "n_groups": 4, "topk_groups": 5}}, r"moe.topk_groups \(5\) must be <= moe.n_groups \(4\)"),
    ({"moe": {**MOE, "n_groups": 4, "experts_per_token": 3}},
     r"moe.experts_per_token \(3\) must be <= the experts of the moe.topk_groups best groups \(2\)"),
    ({"moe": {**MOE, "routed_scaling": 0}}, r"moe.routed_scaling must be a positive number, got 0"),
    ({"moe": {**MOE, "norm_topk": 1}}, r"moe.norm_topk must be a bool, got 1"),
    ({"moe": {**MOE, "score": "softmax"}}, r"moe.score must be one of \('sigmoid',\), got 'softmax'"),
    ({"moe": {**MOE, "hidden": 0}}, r"moe.hidden must be a positive int, got 0"),
    ({"moe": {**MOE, "n_shared_experts": True}}, r"moe.n_shared_experts must be an int >= 0, got True"),
])
def test_new_config_fields_are_checked(changes, message):
    with pytest.raises(ValueError, match=message):
        TransformerConfig(**{"vocab_size": 20, "dim": 32, "n_heads": 4, "n_layers": 2, **changes})


def _own_moe_model(**moe) -> TransformerLM:
    torch.manual_seed(0)
    config = TransformerConfig(vocab_size=30, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, rotary_dim=4,
                               layout="block_causal", block_size=4, mask_token_id=29, max_seq_len=64,
                               moe=MoEConfig(**{**MOE, "n_shared_experts": 1, "n_groups": 2, "routed_scaling": 2.0,
                                                "dense_layers": 1, **moe}))
    model = TransformerLM(config).eval()
    with torch.no_grad():
        for mlp in _moe_layers(model):
            mlp.expert_bias.normal_(0, 0.1)
    return model


def test_own_moe_model_cache_save_load_and_layer_dropping(tmp_path):
    """The MoE and partial rotary on the project's own model: cached blocks equal the full forward, save / load keeps
    both fields (and the router biases), and dropping layers keeps the dense ones first."""
    model = _own_moe_model()
    ids = _ids((2, 10), 13) % 29
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache()
        model.forward_cached(ids[:, :8], cache)
        rest = model.forward_cached(ids[:, 8:], cache, append=False)
    assert (rest[..., :29] - full[:, 8:, :29]).abs().max() <= 1e-5
    model.save_pretrained(tmp_path / "saved")
    assert json.loads((tmp_path / "saved" / "config.json").read_text())["moe"]["n_groups"] == 2
    again = TransformerLM.from_pretrained(tmp_path / "saved")
    assert again.config == model.config and again.config.rotary_dim == 4
    with torch.no_grad():
        torch.testing.assert_close(again(ids), full, atol=0, rtol=0)
    model.keep_layers([0, 2])
    assert model.config.moe.dense_layers == 1 and model.config.n_layers == 2
    model.keep_layers([1])
    assert model.config.moe.dense_layers == 0 and type(model.layers[0].mlp).__name__ == "_MoE"


def test_default_config_and_rotary_are_unchanged():
    """The new fields are off by default: full rotary over head_dim, no experts; a model saved before they existed
    (no such keys in config.json) reads as before."""
    config = TransformerConfig(vocab_size=20, dim=32, n_heads=4)
    assert config.rotary_dim == 8 and config.moe is None
    assert TransformerConfig(vocab_size=20, dim=32, n_heads=4, rotary_dim=6).rotary_dim == 6
    legacy = {k: v for k, v in config.to_dict().items() if k not in ("rotary_dim", "moe")}
    assert TransformerConfig.from_dict(legacy) == config


@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_per_expert_matmuls_equal_the_grouped_matmul(monkeypatch, tokens):
    """The fallback (one matmul per expert that got tokens) and F.grouped_mm give the same MoE output, also when
    experts get no token (1 or 3 tokens x 2 experts of 8)."""
    mlp = _moe_layers(_own_moe_model())[0]
    x = torch.randn(1, tokens, 32, generator=torch.Generator().manual_seed(tokens))
    if getattr(torch.nn.functional, "grouped_mm", None) is not None:  # torch >= 2.9: the grouped path runs first
        assert transformer._grouped_mm_ok(x[0], mlp.experts_w13.view(8, 32, 32))
    with torch.no_grad():
        grouped = mlp(x)
        monkeypatch.setattr(transformer, "_grouped_mm_ok", lambda *args: False)
        looped = mlp(x)
    torch.testing.assert_close(looped, grouped, atol=1e-6, rtol=1e-5)
    assert grouped.shape == x.shape


@pytest.mark.parametrize("hidden", [16, 6])
def test_moe_output_equals_a_per_token_reference(hidden):
    """Token by token, the written-out rule: sigmoid scores, bias for the choice, group limit, renormalised unbiased
    weights times the scaling, SwiGLU experts, plus the shared expert. Experts 6 wide: rows of 24 bytes, which
    F.grouped_mm refuses, so the second projection takes the per-expert path."""
    mlp = _moe_layers(_own_moe_model(hidden=hidden))[0]
    moe = mlp.moe
    assert transformer._grouped_mm_ok(torch.ones(2, hidden), mlp.experts_w2.view(8, 32, hidden)) == (hidden == 16) \
        or getattr(torch.nn.functional, "grouped_mm", None) is None
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(3))
    w13 = mlp.experts_w13.view(moe.n_experts, 2 * moe.hidden, 32)
    w2 = mlp.experts_w2.view(moe.n_experts, 32, moe.hidden)
    expected = []
    with torch.no_grad():
        for token in x.reshape(-1, 32):
            scores = (mlp.router.weight @ token).sigmoid()
            biased = scores + mlp.expert_bias
            groups = biased.view(moe.n_groups, -1)
            best_group = groups.topk(2, dim=-1).values.sum(-1).argmax()  # topk_groups = 1
            allowed = torch.full_like(biased, float("-inf")).view(moe.n_groups, -1)
            allowed[best_group] = groups[best_group]
            chosen = allowed.flatten().topk(moe.experts_per_token).indices
            weights = scores[chosen] / scores[chosen].sum() * moe.routed_scaling
            out = sum(w * (w2[e] @ (torch.nn.functional.silu(w13[e, :hidden] @ token) * (w13[e, hidden:] @ token)))
                      for e, w in zip(chosen.tolist(), weights))
            expected.append(out + mlp.shared(token[None, None])[0, 0])
        torch.testing.assert_close(mlp(x), torch.stack(expected).view_as(x), atol=1e-5, rtol=1e-5)
