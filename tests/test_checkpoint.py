"""load_checkpoint: sharded safetensors into a meta-built module, by a weight-name table (dllm/models/checkpoint.py)."""

import json
import re

import pytest
import torch
from accelerate import init_empty_weights
from fixtures.hf.remote_checkpoints import (
    make_dream_folder,
    make_llada_folder,
    reference_model,
    reference_model_unloaded,
)
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors.torch import load_file, save_file
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from dllm.models.checkpoint import Target, load_checkpoint

V, D, F, LAYERS = 40, 16, 24, 2


class Rotary(nn.Module):
    """A computed, non-persistent table, as a rotary embedding keeps."""

    def __init__(self):
        super().__init__()
        self.register_buffer("inv_freq", torch.empty(D // 2, device="meta"), persistent=False)

    def init_buffers(self, device):
        self.inv_freq = 1.0 / 10000 ** (torch.arange(0, D, 2, device=device).float() / D)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.Parameter(torch.ones(D))
        self.wqkv = nn.Linear(D, 3 * D, bias=False)  # fused q, k, v
        self.w13 = nn.Linear(D, 2 * F, bias=False)  # fused gate, up
        self.w2 = nn.Linear(F, D, bias=False)
        self.rotary = Rotary()

    def forward(self, x):
        h = x * self.norm
        q, k, v = self.wqkv(h).chunk(3, dim=-1)
        gate, up = self.w13(h).chunk(2, dim=-1)
        return x + q * k + v + self.w2(nn.functional.silu(gate) * up) + self.rotary.inv_freq.sum()


class Tiny(nn.Module):
    _no_split_modules = ["Block"]

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.out = nn.Linear(D, V, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


def rename(hub: str) -> Target | None:
    """The hub's Llama-style names onto Tiny's fused ones."""
    table = {"model.embed_tokens.weight": Target("embed.weight"), "lm_head.weight": Target("out.weight")}
    if hub in table:
        return table[hub]
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", hub)
    if m is None:
        raise KeyError(hub)
    i, rest = m.groups()
    parts = {"input_layernorm.weight": ("norm", 0), "self_attn.q_proj.weight": ("wqkv.weight", 0),
             "self_attn.k_proj.weight": ("wqkv.weight", D), "self_attn.v_proj.weight": ("wqkv.weight", 2 * D),
             "mlp.gate_proj.weight": ("w13.weight", 0), "mlp.up_proj.weight": ("w13.weight", F),
             "mlp.down_proj.weight": ("w2.weight", 0)}
    if rest == "self_attn.rotary_emb.inv_freq":
        return None  # computed by Rotary.init_buffers, never loaded
    if rest not in parts:
        raise KeyError(hub)
    name, offset = parts[rest]
    return Target(f"layers.{i}.{name}", offset)


def hub_state(dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    state = {"model.embed_tokens.weight": torch.randn(V, D, generator=g),
             "lm_head.weight": torch.randn(V, D, generator=g)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        state |= {p + "input_layernorm.weight": torch.randn(D, generator=g),
                  p + "self_attn.rotary_emb.inv_freq": torch.randn(D // 2, generator=g)}
        for name in ("q_proj", "k_proj", "v_proj"):
            state[p + f"self_attn.{name}.weight"] = torch.randn(D, D, generator=g)
        for name, shape in (("gate_proj", (F, D)), ("up_proj", (F, D)), ("down_proj", (D, F))):
            state[p + f"mlp.{name}.weight"] = torch.randn(*shape, generator=g)
    return {k: v.to(dtype) for k, v in state.items()}


def save_sharded(folder, state, max_shard_size=2000):
    """Shards plus model.safetensors.index.json, split the way huggingface_hub splits real checkpoints."""
    folder.mkdir(parents=True, exist_ok=True)
    split = split_torch_state_dict_into_shards(state, max_shard_size=max_shard_size)
    for file, names in split.filename_to_tensors.items():
        save_file({n: state[n].contiguous() for n in names}, folder / file, metadata={"format": "pt"})
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


def empty_tiny(tied=False):
    with init_empty_weights():
        model = Tiny()
    if tied:  # after the context: inside it, accelerate re-wraps each registered parameter, which unties it
        model.out.weight = model.embed.weight
    return model


def assert_matches_hub(model, state, dtype):
    got = model.state_dict()
    for i in range(LAYERS):
        p, q = f"model.layers.{i}.", f"layers.{i}."
        qkv = torch.cat([state[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])
        gate_up = torch.cat([state[p + "mlp.gate_proj.weight"], state[p + "mlp.up_proj.weight"]])
        assert torch.equal(got[q + "wqkv.weight"], qkv.to(dtype))
        assert torch.equal(got[q + "w13.weight"], gate_up.to(dtype))
        assert torch.equal(got[q + "w2.weight"], state[p + "mlp.down_proj.weight"].to(dtype))
    assert torch.equal(got["embed.weight"], state["model.embed_tokens.weight"].to(dtype))


class Float32Watch(TorchDispatchMode):
    """Records every real (non-meta) float32 tensor any torch op produces."""

    def __init__(self):
        super().__init__()
        self.float32 = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else [out]:
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and not t.is_meta and t.numel() > D // 2:
                self.float32.append((str(func), tuple(t.shape)))
        return out


def test_bf16_shards_load_as_bf16_without_a_float32_copy(tmp_path):
    state = hub_state(torch.bfloat16)
    folder = save_sharded(tmp_path / "ckpt", state)
    assert len(set(json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"].values())) >= 3
    model = empty_tiny()
    with Float32Watch() as watch:
        load_checkpoint(model, folder, rename)
    # the only float32 tensors allowed are the rotary tables init_buffers computes (D/2 elements, not counted)
    assert watch.float32 == []
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert_matches_hub(model, state, torch.bfloat16)
    expected = 1.0 / 10000 ** (torch.arange(0, D, 2).float() / D)
    assert all(torch.equal(layer.rotary.inv_freq, expected) for layer in model.layers)  # computed, not loaded
    assert model(torch.tensor([[1, 2, 3]])).dtype == torch.bfloat16


def test_dtype_converts_each_tensor(tmp_path):
    state = hub_state(torch.bfloat16)
    model = load_checkpoint(empty_tiny(), save_sharded(tmp_path / "ckpt", state), rename, dtype=torch.float32)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert_matches_hub(model, state, torch.float32)


def test_single_file_and_tied_output_layer(tmp_path):
    state = hub_state(torch.float32)
    del state["lm_head.weight"]  # a tied checkpoint stores the embedding once
    folder = save_sharded(tmp_path / "ckpt", state, max_shard_size=10**9)
    assert (folder / "model.safetensors").is_file() and not (folder / "model.safetensors.index.json").exists()
    model = load_checkpoint(empty_tiny(tied=True), folder, rename)
    assert model.out.weight is model.embed.weight
    assert torch.equal(model.out.weight, state["model.embed_tokens.weight"])


@pytest.mark.parametrize("drop, message", [
    ("lm_head.weight", r"lacks tensors for 1 parameter\(s\) of Tiny: 'out.weight'"),
    ("model.layers.1.self_attn.k_proj.weight", r"'layers.1.wqkv.weight' has rows 16..32 unfilled"),
    ("model.layers.0.self_attn.v_proj.weight", r"'layers.0.wqkv.weight' is filled up to row 32 of 48"),
])
def test_missing_tensors_are_refused_by_name(tmp_path, drop, message):
    state = hub_state()
    del state[drop]
    model = empty_tiny()
    with pytest.raises(ValueError, match=message):
        load_checkpoint(model, save_sharded(tmp_path / "ckpt", state), rename)
    assert all(p.is_meta for p in model.parameters())  # refused before any weight was read


def test_unknown_and_misfit_tensors_are_refused(tmp_path):
    state = hub_state()
    state["model.layers.0.self_attn.o_proj.weight"] = torch.zeros(D, D, dtype=torch.bfloat16)
    state["model.vision.patch.weight"] = torch.zeros(2, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"2 tensor\(s\) this Tiny does not know .*'model.layers.0.self_attn"
                                         r".o_proj.weight', 'model.vision.patch.weight'"):
        load_checkpoint(empty_tiny(), save_sharded(tmp_path / "unknown", state), rename)
    state = hub_state()
    state["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(D, D + 1, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"'model.layers.0.self_attn.k_proj.weight' of shape \[16, 17\] does not "
                                         r"fit 'layers.0.wqkv.weight' of shape \[48, 16\] at offset 16"):
        load_checkpoint(empty_tiny(), save_sharded(tmp_path / "misfit", state), rename)
    with pytest.raises(ValueError, match="'nowhere.weight', which Tiny does not have"):
        load_checkpoint(empty_tiny(), save_sharded(tmp_path / "ok", hub_state()),
                        lambda n: Target("nowhere.weight") if n == "lm_head.weight" else rename(n))


def test_a_dtype_safetensors_has_but_torch_loading_does_not_read_is_refused_by_name(tmp_path):
    """An unsigned 32-bit tensor (safetensors "U32") is named with its dtype, not a bare KeyError('U32')."""
    state = hub_state()
    name = "model.layers.0.input_layernorm.weight"
    state[name] = state[name].float().view(torch.uint32)
    with pytest.raises(ValueError, match=rf"'{name}' in \S+ has safetensors dtype U32, which is not read "
                                         r"\(allowed: \["):
        load_checkpoint(empty_tiny(), save_sharded(tmp_path / "u32", state), rename)


def test_bad_arguments_and_folders(tmp_path):
    folder = save_sharded(tmp_path / "ckpt", hub_state())
    with pytest.raises(ValueError, match="pass device= or device_map=, not both"):
        load_checkpoint(empty_tiny(), folder, rename, device="cpu", device_map="auto")
    with pytest.raises(TypeError, match="device_map must be None, 'auto' or a dict"):
        load_checkpoint(empty_tiny(), folder, rename, device_map="everywhere")
    with pytest.raises(TypeError, match="dtype must be None or a floating torch.dtype"):
        load_checkpoint(empty_tiny(), folder, rename, dtype=torch.int8)
    with pytest.raises(ValueError, match="disk offload is not supported"):
        load_checkpoint(empty_tiny(), folder, rename, device_map={"": "cpu", "out": "disk"})
    with pytest.raises(ValueError, match="device_map places no prefix of 'out.weight'"):
        load_checkpoint(empty_tiny(), folder, rename, device_map={"embed": "cpu", "layers": "cpu"})
    with pytest.raises(FileNotFoundError, match="has neither model.safetensors nor model.safetensors.index.json"):
        load_checkpoint(empty_tiny(), tmp_path, rename)
    shard = sorted(folder.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=f"names shards that are not there: \\['{shard.name}'"):
        load_checkpoint(empty_tiny(), folder, rename)


@pytest.mark.parametrize("device_map", ["auto", {"embed": "cpu", "layers.0": "cpu", "layers.1": "cpu",
                                                 "out": "cpu"}])
def test_device_map_goes_through_accelerate(tmp_path, device_map):
    state = hub_state(torch.float32)
    model = load_checkpoint(empty_tiny(), save_sharded(tmp_path / "ckpt", state), rename, device_map=device_map)
    assert getattr(model, "hf_device_map", None) is not None  # set by accelerate's dispatch_model
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert_matches_hub(model, state, torch.float32)
    eager = Tiny()
    eager.load_state_dict(model.state_dict(), strict=True)
    for layer in eager.layers:
        layer.rotary.init_buffers("cpu")
    ids = torch.tensor([[1, 5, 7, 9]])
    assert torch.equal(model(ids), eager(ids))


@pytest.mark.parametrize("make", [make_llada_folder, make_dream_folder])
def test_fills_the_real_modelling_code_as_load_state_dict_does(tmp_path, make):
    """The real LLaDA / Dream classes, built on meta and filled by name: logits equal the reference's."""
    folder = make(tmp_path / "real")
    state = load_file(folder / "model.safetensors")
    save_sharded(tmp_path / "sharded", {k: v.to(torch.bfloat16) for k, v in state.items()}, max_shard_size=40_000)
    with init_empty_weights():
        model = reference_model_unloaded(folder)
    load_checkpoint(model, tmp_path / "sharded", lambda name: Target(name))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    reference = reference_model(folder)  # the same bf16-rounded weights, buffers as its constructor made them
    reference.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in state.items()})
    ids = torch.tensor([[2, 20, 21, 299, 299, 1]])
    torch.testing.assert_close(model.float().eval()(ids).logits, reference(ids).logits, rtol=0, atol=0)


def test_a_buffer_neither_loaded_nor_computed_is_refused(tmp_path):
    model = empty_tiny()
    model.layers[0].rotary = nn.Module()  # a table without init_buffers, which the checkpoint does not hold
    model.layers[0].rotary.register_buffer("inv_freq", torch.empty(D // 2, device="meta"), persistent=False)
    with pytest.raises(ValueError, match=r"still on the meta device .*: \['layers.0.rotary.inv_freq'\]"):
        load_checkpoint(model, save_sharded(tmp_path / "ckpt", hub_state()), rename)
