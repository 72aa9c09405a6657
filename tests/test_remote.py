"""The guarded remote-code path (dllm/models/remote.py, kind='remote'), tried on the real LLaDA / Dream code."""

import re
import subprocess
import sys

import pytest
import torch
import transformers
from fixtures.hf import builders
from fixtures.hf.remote_checkpoints import (
    _default_rope,
    _remote_classes,
    auto_registrations_restored,
    make_dream_folder,
    make_llada_folder,
    reference_model,
    reference_model_unloaded,
)
from safetensors.torch import load_file, save_file

from dllm import load
from dllm.models.hf import DreamAdapter, LLaDAAdapter
from dllm.models.remote import RemoteCodeError, check_rotary
from dllm.samplers.baselines.native import native
from dllm.stats import DecodeStats

IDS = torch.tensor([[2, 20, 21, 299, 299, 1]])
FIX = r"use the native kind \(kind='llada' or kind='dream': no hub code runs\) or install transformers<5"
TRANSFORMERS_5 = pytest.mark.skipif(int(transformers.__version__.split(".")[0]) < 5,
                                    reason="these are transformers-5 failures")


@pytest.fixture(autouse=True)
def _forget_registrations():
    """Loading the real code (dllm.load does, through transformers) registers "llada" globally: undo it."""
    with auto_registrations_restored():
        yield


@pytest.fixture(scope="module")
def llada(tmp_path_factory):
    return make_llada_folder(tmp_path_factory.mktemp("llada"))


@pytest.fixture(scope="module")
def dream(tmp_path_factory):
    return make_dream_folder(tmp_path_factory.mktemp("dream"))


@TRANSFORMERS_5
@pytest.mark.parametrize("options", [{"kind": "remote"}, {"trust_remote_code": True},
                                     {"kind": "llada", "trust_remote_code": True}])
def test_llada_remote_code_failure_is_one_clear_message(llada, options):
    with pytest.raises(RemoteCodeError, match=r"remote code \(llada\) fails under transformers 5\.\d+\.\d+: its "
                                              r"model class never calls post_init\(\).*all_tied_weights_keys.*" + FIX):
        load(llada, **options)


@TRANSFORMERS_5
def test_dream_remote_code_failures_are_one_clear_message(dream):
    with pytest.raises(RemoteCodeError, match=r"ROPE_INIT_FUNCTIONS\['default'\], which transformers 5 removed.*"
                                              + FIX):
        load(dream, kind="remote")
    with _default_rope():  # the common workaround gets one step further, to Dream's generation config
        with pytest.raises(RemoteCodeError, match=r"DreamGenerationConfig overrides GenerationConfig.validate\(\)"):
            load(dream, kind="remote")


@TRANSFORMERS_5
def test_dream_uninitialised_rotary_table_is_refused_not_returned(dream):
    """What transformers 5's from_pretrained makes of Dream (past its own override): silently wrong logits."""
    _, model_class, _ = _remote_classes(dream, "dream")
    with _default_rope():
        loaded = transformers.PreTrainedModel.from_pretrained.__func__(model_class, dream).eval()
    with torch.no_grad():
        diff = (loaded(IDS).logits - reference_model(dream)(IDS).logits).abs()
    # wrong, no error: the table is uninitialised memory, so the logits are off or, as often, NaN
    assert not torch.isfinite(diff).all() or diff.max() > 1e-3
    with pytest.raises(RemoteCodeError, match=r"rotary table model\.(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq "
                                              r"is not 1 / theta\^\(2i/d\).*silently wrong.*" + FIX):
        check_rotary(loaded, loaded.config, "dream-folder")


def test_correct_rotary_tables_pass_and_corrupted_ones_are_refused(llada, dream):
    llada_model, dream_model = reference_model(llada), reference_model(dream)
    assert check_rotary(llada_model, llada_model.config, "llada") == 2  # LLaDA's shared sin / cos cache
    layers = dream_model.config.num_hidden_layers
    assert check_rotary(dream_model, dream_model.config, "dream") == 1 + layers  # model's + each attention's
    dream_model.to(torch.bfloat16)  # a bf16 table is the formula rounded: accepted at bf16 precision
    assert dream_model.model.rotary_emb.inv_freq.dtype == torch.bfloat16
    check_rotary(dream_model, dream_model.config, "dream")
    dream_model.model.rotary_emb.inv_freq[-1] *= 1.02  # off by 2%: more than bf16 rounding
    with pytest.raises(RemoteCodeError, match=r"model\.rotary_emb\.inv_freq is not 1 / theta"):
        check_rotary(dream_model, dream_model.config, "dream")
    cache = next(v for v in vars(llada_model.model).values() if isinstance(v, dict) and "rope_pos_sin" in v)
    cache["rope_pos_cos"] = cache["rope_pos_cos"] * 1.001
    with pytest.raises(RemoteCodeError, match="rope_pos_cos is not 1 / theta"):
        check_rotary(llada_model, llada_model.config, "llada")


def test_remote_kind_loads_compatible_code_through_the_adapters(tmp_path):
    """Remote code that works under the installed transformers (the stand-ins) loads through kind='remote'."""
    model = load(builders.save_llada(tmp_path / "llada"), kind="remote")
    assert isinstance(model, LLaDAAdapter)
    assert isinstance(load(builders.save_dream(tmp_path / "dream"), trust_remote_code=True), DreamAdapter)
    x = torch.full((1, 4), model.mask_token_id)
    assert model(x).shape == (1, 4, model.vocab_size)


def test_tensors_the_checkpoint_lacks_are_refused_not_left_random(tmp_path):
    folder = builders.save_llada(tmp_path / "llada")
    state = load_file(folder / "model.safetensors")
    dropped = sorted(k for k in state if k.endswith("weight"))[0]
    del state[dropped]
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(RemoteCodeError, match=rf"holds no tensor for 1 of the model's \('{re.escape(dropped)}'\); "
                                              r"from_pretrained left them random"):
        load(folder, kind="remote")


def test_remote_kind_is_for_llada_and_dream_only(tmp_path):
    with pytest.raises(ValueError, match=r"kind='remote' loads LLaDA or Dream hub code, but .* is neither "
                                         r"\(model_type='llama'"):
        load(builders.save_causal(tmp_path / "llama"), kind="remote")


@TRANSFORMERS_5
def test_dream_native_sampler_failures_are_one_clear_message(tmp_path, monkeypatch):
    """Dream's diffusion_generate under transformers 5, unpatched (a folder reference_model never touched):
    first its old validate() signature, and past that (patched here) the missing eps."""
    folder = make_dream_folder(tmp_path / "dream")
    with _default_rope():
        model = reference_model_unloaded(folder).eval()
    adapter = DreamAdapter(model)
    run = dict(temperature=0.0, generator=torch.Generator(), stats=DecodeStats())
    with pytest.raises(RemoteCodeError, match=r"sampling from DreamModel with its remote code \(dream\) fails under "
                                              r"transformers .*validate\(\) with transformers 4's signature.*" + FIX):
        native(adapter, IDS[:, :3], 2, **run)
    generation_config_class = _remote_classes(folder, "dream")[2].DreamGenerationConfig
    monkeypatch.setattr(generation_config_class, "validate", lambda self, *args, **kwargs: None)
    with pytest.raises(RemoteCodeError, match=r"from_model_config compares each field .*no 'eps'.*" + FIX):
        native(adapter, IDS[:, :3], 2, **run)


@TRANSFORMERS_5
def test_cli_says_it_in_one_line(llada):
    run = subprocess.run([sys.executable, "-m", "dllm.cli", "generate", "the cat", "--model", str(llada),
                          "--kind", "remote", "--sampler", "llada"], capture_output=True, text=True, timeout=300)
    assert run.returncode != 0 and "Traceback" not in run.stderr
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("dllm generate: loading ") and "post_init()" in last and "transformers<5" in last


def test_a_hub_id_is_checked_against_its_cached_snapshot_too(tmp_path, monkeypatch):
    """kind='remote' on a hub id: the tensors its snapshot lacks are refused as for a local folder (offline:
    the config read, the download and the snapshot lookup are faked onto a local folder)."""
    import json

    import huggingface_hub

    import dllm.models.loading as loading

    folder = builders.save_llada(tmp_path / "llada")
    state = load_file(folder / "model.safetensors")
    dropped = sorted(k for k in state if k.endswith("weight"))[0]
    del state[dropped]
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    real_load_hf = loading._load_hf
    config = json.loads((folder / "config.json").read_text())
    monkeypatch.setattr(loading, "_config_dict", lambda name, local, kw: config)
    monkeypatch.setattr(loading, "_load_hf", lambda name, kind, local, *args: real_load_hf(str(folder), kind, folder,
                                                                                          *args))
    looked_up = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download",
                        lambda name, **kw: looked_up.append((name, kw)) or str(folder))
    with pytest.raises(RemoteCodeError, match=rf"org/llada: its checkpoint holds no tensor for 1 of the model's "
                                              rf"\('{re.escape(dropped)}'\)"):
        load("org/llada", kind="remote", revision="main")
    assert looked_up[0][0] == "org/llada" and looked_up[0][1]["local_files_only"] is True
    assert looked_up[0][1]["revision"] == "main"
