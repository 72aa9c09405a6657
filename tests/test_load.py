"""Tests for dllm.models.loading.load: kind detection, explicit kinds, errors, and generation end to end.

Every checkpoint is a tiny random model written to a temporary folder (tests/fixtures/hf/builders.py).
"""

from pathlib import Path

import pytest
import torch
from fixtures.hf import builders

import dllm
from dllm.models.hf import CausalLMAdapter, DreamAdapter, LLaDAAdapter, MaskedLMAdapter
from dllm.models.loading import detect_kind, load
from dllm.models.transformer import TransformerLM

RECIPES = {  # name: (builder, kind, adapter class)
    "llama": (lambda p: builders.save_causal(p, "llama"), "causal", CausalLMAdapter),
    "qwen3": (lambda p: builders.save_causal(p, "qwen3"), "causal", CausalLMAdapter),
    "bert": (lambda p: builders.save_mlm(p, "bert"), "mlm", MaskedLMAdapter),
    "modernbert": (lambda p: builders.save_mlm(p, "modernbert"), "mlm", MaskedLMAdapter),
    "llada": (builders.save_llada, "llada", LLaDAAdapter),
    "dream": (builders.save_dream, "dream", DreamAdapter),
    "dllm": (builders.save_dllm, "dllm", TransformerLM),
    "dllm_causal": (lambda p: builders.save_dllm(p, layout="causal"), "dllm", TransformerLM),
}


REMOTE = {"llada", "dream"}  # the stand-ins are remote-code checkpoints: loaded with trust_remote_code=True


def remote(name: str) -> dict:
    return {"trust_remote_code": True} if name in REMOTE else {}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Build each checkpoint once per module, on first use."""
    made = {}

    def get(name):
        if name not in made:
            made[name] = RECIPES[name][0](tmp_path_factory.mktemp(name))
        return made[name]

    return get


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_auto_and_explicit_kind_load_the_same_adapter(folders, name):
    _, kind, adapter_class = RECIPES[name]
    auto, explicit = load(folders(name), **remote(name)), load(str(folders(name)), kind=kind, **remote(name))
    for model in (auto, explicit):
        assert type(model) is adapter_class and model.tokenizer is not None
        assert model.vocab_size >= len(model.tokenizer)
    ids = torch.randint(3, 20, (1, 5))
    torch.testing.assert_close(auto(ids), explicit(ids))


DIFFUSION = ["llada", "dream", "bert", "modernbert", "dllm"]


@pytest.mark.parametrize("name", DIFFUSION)
@pytest.mark.parametrize("sampler, options", [("fef", {"window": 2}), ("llada", {"steps": 2})])
def test_generate_with_diffusion_kinds(folders, name, sampler, options):
    model = load(folders(name), **remote(name))
    text = "Tom has 3" if name == "dllm" else "the cat sat"  # words each tokenizer knows
    prompt = torch.tensor(model.tokenizer(text)["input_ids"])[None]
    out = dllm.generate(model, prompt, sampler=sampler, max_new_tokens=4, temperature=1.0,
                        generator=torch.Generator().manual_seed(0), **options)
    assert out.sequences.shape == (1, prompt.shape[1] + 4)
    assert torch.equal(out.sequences[:, :prompt.shape[1]], prompt)
    assert not (out.sequences == model.mask_token_id).any()


@pytest.mark.parametrize("name", ["llama", "qwen3", "dllm_causal"])
@pytest.mark.parametrize("sampler, options", [("ar", {}), ("ar_spec", {"drafter": "ngram", "num_draft_tokens": 2})])
def test_generate_with_causal_kinds(folders, name, sampler, options):
    model = load(folders(name))
    prompt = torch.tensor([[3, 4, 5, 3, 4]])
    out = dllm.generate(model, prompt, sampler=sampler, max_new_tokens=4, temperature=1.0,
                        generator=torch.Generator().manual_seed(0), **options)
    assert out.sequences.shape == (1, 9) and torch.equal(out.sequences[:, :5], prompt)


def test_ar_spec_matches_ar_at_temperature_zero(folders):
    model = load(folders("qwen3"))
    prompt = torch.tensor([[3, 4, 5, 3, 4, 5]])
    runs = [dllm.generate(model, prompt, sampler=s, max_new_tokens=6, temperature=0, **o).sequences
            for s, o in (("ar", {}), ("ar_spec", {"drafter": "ngram"}))]
    assert torch.equal(*runs)


def test_dtype_and_mask_override(folders):
    model = load(folders("llama"), dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16 and model(torch.tensor([[3, 4]])).dtype == torch.float32
    assert load(folders("bert"), dtype="float32").dtype == torch.float32
    assert load(folders("bert"), mask_token_id=5).mask_token_id == 5
    assert load(folders("dllm"), dtype=torch.bfloat16).output.weight.dtype == torch.bfloat16


# ------------------------------------------------------------------ kind detection


@pytest.mark.parametrize("config, kind", [
    ({"model_type": "llada", "architectures": ["LLaDAModelLM"],  # LLaDA's auto_map also names a causal head
      "auto_map": {"AutoModelForCausalLM": "modeling_llada.LLaDAModelLM"}}, "llada"),
    ({"model_type": "Dream", "architectures": ["DreamModel"]}, "dream"),
    ({"model_type": "bert", "architectures": ["BertForMaskedLM"]}, "mlm"),
    ({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, "causal"),
    ({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}, "causal"),
    ({"model_type": "gpt2"}, "causal"),  # no architectures: transformers' head mappings decide
    ({"model_type": "modernbert"}, "mlm"),
    ({"model_type": "bert"}, None),  # bert has both a masked and a causal head: ambiguous
    ({"model_type": "vit", "architectures": ["ViTModel"]}, None),
    ({"vocab_size": 8, "layout": "causal"}, "dllm"),
])
def test_detect_kind(config, kind):
    assert detect_kind(config) == kind


# ------------------------------------------------------------------ errors


def test_wrong_kind_is_refused(folders):
    with pytest.raises(ValueError, match="kind='mlm' does not match .* 'causal' checkpoint"):
        load(folders("llama"), kind="mlm")
    with pytest.raises(ValueError, match="kind='dream' does not match .* 'llada' checkpoint"):
        load(folders("llada"), kind="dream")


def test_unknown_kind_is_refused(folders):
    kinds = r"\['auto', 'llada', 'dream', 'sdar', 'llada2', 'diffusion_gemma', 'mlm', 'causal', 'dllm', 'remote'\]"
    with pytest.raises(ValueError, match=f"kind must be one of {kinds}"):
        load(folders("llama"), kind="gpt")


def test_missing_mask_token_is_refused(tmp_path):
    folder = builders.save_llada(tmp_path / "no_mask", mask_in_config=False)
    with pytest.raises(ValueError, match="needs a mask token.*pass mask_token_id="):
        load(folder, trust_remote_code=True)
    assert load(folder, mask_token_id=builders.VOCAB - 1, trust_remote_code=True).mask_token_id == builders.VOCAB - 1


def test_undetectable_config_needs_an_explicit_kind(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "vit"}')
    with pytest.raises(ValueError, match="kind='auto' cannot tell"):
        load(tmp_path)


def test_bad_paths_and_arguments(tmp_path, folders):
    with pytest.raises(FileNotFoundError, match="not a folder"):
        load(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load(tmp_path)
    with pytest.raises(TypeError, match="dtype must be"):
        load(folders("llama"), dtype="fast")
    with pytest.raises(TypeError, match="mask_token_id= is for diffusion kinds"):
        load(folders("llama"), mask_token_id=3)
    with pytest.raises(TypeError, match="kind='dllm' takes only"):
        load(folders("dllm"), revision="main")


def test_folder_without_tokenizer_loads_with_none(tmp_path, folders):
    folder = builders.save_causal(tmp_path / "bare", "llama")
    for file in folder.glob("tokenizer*"):
        file.unlink()
    model = load(folder)
    assert model.tokenizer is None and model.eos_token_id == 1  # from config.json
    assert load(folder, tokenizer=folders("llama")).tokenizer is not None


def test_bare_names_of_shipped_models_load_from_the_package():
    """``dllm.load("diffusion")`` is the shipped folder (no hub lookup); a name with a slash stays a hub id."""
    from dllm.models.loading import SHIPPED, _local_folder
    from dllm.models.two_stream import TwoStreamLM

    assert _local_folder("diffusion") == SHIPPED / "diffusion"
    assert _local_folder("someone/diffusion") is None
    assert isinstance(dllm.load("two_stream"), TwoStreamLM)


def test_unreachable_hub_fails_after_one_request(monkeypatch, tmp_path):
    """A hub id neither cached nor reachable fails at the first refused connection (no retries with backoff,
    about 25 s of warnings); a cached config or HF_HUB_OFFLINE makes no request at all."""
    import huggingface_hub
    from huggingface_hub import constants
    from transformers import PretrainedConfig

    from dllm.models import loading

    requests = []

    def refused(url, **kw):
        requests.append(url)
        raise ConnectionError("[Errno 111] Connection refused")

    def no_second_try(*args, **kw):
        raise AssertionError("the config was fetched after the hub was found unreachable")

    monkeypatch.setattr(huggingface_hub, "get_hf_file_metadata", refused)
    monkeypatch.setattr(PretrainedConfig, "get_config_dict", no_second_try)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    with pytest.raises(loading.HubUnreachableError, match=r"name_or_path 'someone/nonexistent-model': not in the "
                       r"local hub cache, and the hub \(.+\) could not be reached \(\[Errno 111\] Connection refused"):
        load("someone/nonexistent-model", cache_dir=str(tmp_path))
    assert len(requests) == 1 and requests[0].endswith("someone/nonexistent-model/resolve/main/config.json")
    loading.check_hub_reachable("someone/nonexistent-model", {"local_files_only": True})
    snapshot = tmp_path / "models--someone--cached" / "snapshots" / "abc"  # the hub cache's layout
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (tmp_path / "models--someone--cached" / "refs").mkdir()
    (tmp_path / "models--someone--cached" / "refs" / "main").write_text("abc")
    loading.check_hub_reachable("someone/cached", {"cache_dir": str(tmp_path)})
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    loading.check_hub_reachable("someone/nonexistent-model", {})
    assert len(requests) == 1  # none of the three asked the hub


def test_shipped_heads_and_models_by_bare_name_from_any_directory(tmp_path, monkeypatch):
    """draft_head= and bench's model aliases take a shipped name from a directory with no dllm/weights; a
    folder of that name in the working directory still wins."""
    from dllm.eval.study.bench import ModelStore
    from dllm.models.ar_heads import head_config, load_head
    from dllm.models.draft_head import DraftHead, load_draft_head
    from dllm.models.loading import SHIPPED, shipped_or_path

    monkeypatch.chdir(tmp_path)
    if not (SHIPPED / "fef_head" / "model.safetensors").exists():
        pytest.skip("shipped weights not present")
    assert shipped_or_path("fef_head") == SHIPPED / "fef_head"
    assert isinstance(load_draft_head("two_stream_head"), DraftHead)
    assert head_config("ar_eagle").kind == "eagle" and load_head("ar_repair").config.kind == "repair"
    assert ModelStore({}, torch.device("cpu"), torch.float32).path("drafter") == SHIPPED / "drafter"
    assert ModelStore({"mine": "ar"}, torch.device("cpu"), torch.float32).path("mine") == SHIPPED / "ar"
    (tmp_path / "drafter").mkdir()
    assert shipped_or_path("drafter") == Path("drafter")  # the working directory's folder
    assert shipped_or_path("someone/fef_head") == Path("someone/fef_head")  # only bare names
    with pytest.raises(ValueError, match="is a shipped draft head .*pass it as draft_head='fef_head'"):
        load("fef_head")
