"""Native LLaDA and Dream (dllm.models.native) against their real modelling code, on tiny hub-layout folders.

The folders (tests/fixtures/hf/remote_checkpoints.py) hold the hub's config keys, the real .py files and weights
saved by the real classes; ``reference_model`` runs that code (test-only). The package never imports it.
"""

import json
import sys
from pathlib import Path

import pytest
import torch
from fixtures.hf.remote_checkpoints import make_dream_folder, make_llada_folder, reference_model
from safetensors.torch import load_file, save_file
from structured_checks import assert_structured_equals_copies

import dllm
from dllm.models.hf import DreamAdapter
from dllm.models.native import NativeLM, llada_config, load_native
from dllm.models.transformer import TransformerConfig, TransformerLM

MAKERS = {"llada": make_llada_folder, "dream": make_dream_folder}
PROMPTS = torch.tensor([[5, 9, 7, 11, 3], [1, 1, 8, 4, 6]])  # row 1 left-padded (pad id 1 in both folders)
MASK = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    made = {}

    def get(family):
        if family not in made:
            made[family] = MAKERS[family](tmp_path_factory.mktemp(family) / "ckpt")
        return made[family]

    return get


def _reference_logits(family, reference, ids, mask=None):
    """What the real code scores at each position: LLaDA's logits, Dream's shifted back (its generation code)."""
    with torch.no_grad():
        if family == "dream":
            return DreamAdapter(reference, None, mask_token_id=reference.config.mask_token_id)(ids, mask)
        return reference(input_ids=ids).logits.float()


def _assert_close(native, real, mask_id):
    keep = torch.ones(native.shape[-1], dtype=torch.bool)
    keep[mask_id] = False  # the native model sets the mask's logit to -inf
    assert torch.isinf(native[..., mask_id]).all()
    assert (native[..., keep] - real[..., keep]).abs().max() <= 1e-4


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_native_logits_equal_the_real_code(folders, family):
    model, reference = dllm.load(folders(family)), reference_model(folders(family))
    assert type(model) is NativeLM and model.family == family and model.dtype == torch.float32
    ids = torch.randint(0, 300, (3, 17), generator=torch.Generator().manual_seed(1))
    _assert_close(model(ids), _reference_logits(family, reference, ids), model.mask_token_id)


@pytest.mark.parametrize("family,overrides", [
    ("llada", {"weight_tying": True}), ("llada", {"include_qkv_bias": True, "n_kv_heads": 2}),
    ("llada", {"embedding_size": 384, "mlp_hidden_size": None, "mlp_ratio": 3}),
    # (a tied Dream cannot be built: its code's list-valued _tied_weights_keys breaks transformers 5's post_init)
    ("dream", {"num_key_value_heads": 4, "rope_theta": 10000.0, "rms_norm_eps": 1e-5}),
])
def test_config_variants_equal_the_real_code(tmp_path, family, overrides):
    """Weight tying, q/k/v biases, grouped-query attention, a padded embedding, other theta: same logits."""
    folder = MAKERS[family](tmp_path / "variant", **overrides)
    model, reference = dllm.load(folder), reference_model(folder)
    ids = torch.randint(0, 300, (2, 11), generator=torch.Generator().manual_seed(7))
    _assert_close(model(ids), _reference_logits(family, reference, ids), model.mask_token_id)
    if overrides.get("weight_tying"):
        assert model.output.weight is model.tok_embeddings.weight
    assert model.vocab_size == overrides.get("embedding_size", 320)


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_left_padding_gives_the_rows_own_logits(folders, family):
    """Real positions of a left-padded row score what the real code scores on the row alone (and, for Dream,
    what it scores on the padded batch with its own 4-D mask)."""
    model, reference = dllm.load(folders(family)), reference_model(folders(family))
    padded = model(PROMPTS, attention_mask=MASK)
    alone = _reference_logits(family, reference, PROMPTS[1:, 2:])
    first = 1 if family == "dream" else 0  # Dream's first real token reads the state before it: a pad, never used
    _assert_close(padded[1:, 2 + first:], alone[:, first:], model.mask_token_id)
    if family == "dream":
        batch = _reference_logits(family, reference, PROMPTS, MASK)
        _assert_close(padded[:, 3:], batch[:, 3:], model.mask_token_id)


def test_dream_logits_are_shifted(folders):
    """Dream's raw logits at i score token i + 1: native position p equals the real code's raw row p - 1."""
    model, reference = dllm.load(folders("dream")), reference_model(folders("dream"))
    ids = torch.randint(0, 300, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        raw = reference(input_ids=ids).logits.float()
    _assert_close(model(ids)[:, 1:], raw[:, :-1], model.mask_token_id)
    assert (model(ids)[:, 1:, :5] - raw[:, 1:, :5]).abs().max() > 1e-2  # unshifted would differ


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_special_ids_and_tokenizer(folders, family):
    model = dllm.load(folders(family))
    config = json.loads((folders(family) / "config.json").read_text())
    assert model.mask_token_id == config["mask_token_id"] == 299 and model.vocab_size == 320
    assert model.eos_token_id == config["eos_token_id"] and model.pad_token_id == config["pad_token_id"]
    end_of_turn = {"llada": "<|eot_id|>", "dream": "<|im_end|>"}[family]
    assert model.stop_token_ids == (model.eos_token_id, model.tokenizer.convert_tokens_to_ids(end_of_turn))
    assert model.accepts_attention_mask and model.cache_exact is False
    assert end_of_turn in dllm.apply_chat_template(model.tokenizer, "the cat")  # the folder's chat template
    assert model.tokenizer("the cat sat")["input_ids"] == [model.tokenizer.convert_tokens_to_ids(w)
                                                           for w in ("the", "cat", "sat")]


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_loading_never_runs_the_folders_python(tmp_path, folders, family):
    """Every .py of the folder (named by auto_map in config.json and tokenizer_config.json) is a trap."""
    folder = MAKERS[family](tmp_path / "trapped")
    marker = tmp_path / "ran"
    for file in folder.glob("*.py"):
        file.write_text(f"open({str(marker)!r}, 'w').write('x')\nraise RuntimeError('hub code ran')\n")
    trap = tmp_path / "trapped" / "tokenization_trap.py"
    trap.write_text(f"open({str(marker)!r}, 'w').write('x')\n")
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    settings["auto_map"] = {"AutoTokenizer": ["tokenization_trap.Trap", None]}
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    before = set(sys.modules)  # (making the folder imported its real code; loading must import nothing of it)
    model = dllm.load(folder)
    assert not marker.exists()
    assert not [name for name in set(sys.modules) - before
                if str(folder) in str(getattr(sys.modules[name], "__file__", "") or "")]
    ids = torch.randint(0, 300, (1, 6), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(model(ids), dllm.load(folders(family))(ids))  # same weights, same logits


def test_bf16_checkpoint_stays_bf16(tmp_path, folders):
    folder = make_llada_folder(tmp_path / "bf16")
    state = load_file(folder / "model.safetensors")
    save_file({k: v.to(torch.bfloat16) for k, v in state.items()}, folder / "model.safetensors")
    model = dllm.load(folder)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.rotary.cos.dtype == torch.float32  # rotary tables computed in float32, not loaded
    assert {p.dtype for p in dllm.load(folders("dream"), dtype=torch.bfloat16).parameters()} == {torch.bfloat16}
    ids = torch.randint(0, 300, (1, 8), generator=torch.Generator().manual_seed(4))
    logits = model(ids)
    assert logits.dtype == torch.float32
    full = dllm.load(folder, dtype=torch.float32)(ids)
    assert (logits - full).isfinite().any() and (logits.softmax(-1) - full.softmax(-1)).abs().max() < 0.05


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_sharded_bf16_checkpoint_loads_shard_by_shard(tmp_path, folders, family):
    """The hub's layout for big models: bf16 shards named by model.safetensors.index.json."""
    folder = MAKERS[family](tmp_path / "sharded")
    state = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    names = sorted(state)
    weight_map = {}
    for index, part in enumerate((names[::2], names[1::2])):
        shard = f"model-{index + 1:05d}-of-00002.safetensors"
        save_file({k: state[k].to(torch.bfloat16) for k in part}, folder / shard, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, shard))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    model = dllm.load(folder, device_map={"": "cpu"})
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    expected = dllm.load(folders(family), dtype=torch.bfloat16)
    ids = torch.randint(0, 300, (2, 7), generator=torch.Generator().manual_seed(6))
    torch.testing.assert_close(model(ids), expected(ids), atol=0, rtol=0)  # same bf16 weights, same logits


def test_unsupported_config_values_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"config.json scale_logits=True is not supported.*kind='remote'"):
        llada_config({"block_type": "llama", "layer_norm_type": "rms", "activation_type": "silu", "rope": True,
                      "scale_logits": True}, 5, 1, 1)
    folder = make_dream_folder(tmp_path / "slide", use_sliding_window=True, sliding_window=4)
    with pytest.raises(ValueError, match="use_sliding_window=True is not supported"):
        dllm.load(folder)
    with pytest.raises(TypeError, match="native dream loading takes the keywords"):
        load_native(folder, "dream", revision_typo="main")


def test_unknown_hub_tensor_is_refused(tmp_path):
    folder = make_llada_folder(tmp_path / "extra")
    state = load_file(folder / "model.safetensors")
    state["model.transformer.blocks.0.q_norm.weight"] = torch.ones(64)
    save_file(state, folder / "model.safetensors")
    with pytest.raises((KeyError, ValueError), match="q_norm"):
        dllm.load(folder)


# ------------------------------------------------------------------ samplers on the native models

RUNS = [("sequential", {}), ("fef", {"window": 3}), ("fef", {"window": 4, "draft": "stale"}),
        ("fef", {"window": 4, "draft_candidates": 3}), ("llada", {"steps": 4}), ("dream", {"steps": 4}),
        ("fast_dllm", {"threshold": 0.5}), ("eb", {})]


@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("sampler,options", RUNS)
def test_every_sampler_padded_row_equals_row_alone(folders, family, sampler, options):
    model = dllm.load(folders(family))
    common = dict(sampler=sampler, max_new_tokens=8, temperature=0.0, block_length=4, eos_token_id=None, **options)
    batch = dllm.generate(model, PROMPTS, attention_mask=MASK, **common)
    alone = dllm.generate(model, PROMPTS[1:, 2:], **common)
    assert torch.equal(batch.sequences[1, 5:], alone.sequences[0, 3:])
    assert not (batch.sequences == model.mask_token_id).any()


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_fef_at_temperature_zero_is_sequential(folders, family):
    model = dllm.load(folders(family))
    common = dict(max_new_tokens=12, temperature=0.0, block_length=4, attention_mask=MASK, eos_token_id=None)
    sequential = dllm.generate(model, PROMPTS, sampler="sequential", **common)
    for options in ({"window": 2}, {"window": 4}, {"window": 4, "draft_candidates": 3},
                    {"window": 4, "draft": "stale", "draft_candidates": 2}):  # with draft trees (the copies')
        fef = dllm.generate(model, PROMPTS, sampler="fef", **options, **common)
        assert torch.equal(fef.sequences, sequential.sequences) and fef.exact, options
        assert fef.stats.siblings_taken > 0 or "draft_candidates" not in options  # the trees took siblings


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_fast_paths_run_and_are_labelled_approximate(folders, family):
    model = dllm.load(folders(family))
    common = dict(max_new_tokens=8, block_length=4, attention_mask=MASK, eos_token_id=None,
                  generator=torch.Generator().manual_seed(0))
    for sampler, options in (("fast_dllm", {"cache": "prefix"}), ("fast_dllm", {"cache": "dual"}),
                             ("fef", {"cache": "prefix"}), ("fef", {"verifier": "structured"})):
        out = dllm.generate(model, PROMPTS, sampler=sampler, **common, **options)
        assert out.exact is False and not (out.sequences == model.mask_token_id).any(), (sampler, options)


# ------------------------------------------------------------------ Dream's shift with caches and the verifier


def _shifted(layout, n_layers=2, seed=0):
    torch.manual_seed(seed)
    config = TransformerConfig(vocab_size=30, dim=32, n_layers=n_layers, n_heads=2, layout=layout, mask_token_id=2,
                               block_size=4 if layout == "block_causal" else None, max_seq_len=64,
                               shift_logits=True, qkv_bias=True)
    model = TransformerLM(config).eval()
    with torch.no_grad():
        for layer in model.layers:
            layer.attn.wqkv.bias.normal_(0, 0.5)  # nonzero biases, so a dropped bias would show
    return model


def test_shifted_cache_reads_the_cached_state_before_the_first_new_token():
    """Block-causal attention makes a prefix cache exact, so cached shifted logits must equal uncached ones:
    the first new position reads the last cached token's state (kept in the cache)."""
    model = _shifted("block_causal")
    x = torch.randint(3, 30, (2, 12), generator=torch.Generator().manual_seed(5))
    mask = torch.tensor([[1] * 12, [0, 0] + [1] * 10])
    offset = torch.tensor([0, 2])
    with torch.no_grad():
        full = model(x, attention_mask=mask, block_offset=offset)
        cache = model.new_cache()
        model.forward_cached(x[:, :8], cache, attention_mask=mask[:, :8], block_offset=offset)
        rest = model.forward_cached(x[:, 8:], cache, attention_mask=mask, block_offset=offset)
        dual = cache.drop(4, 8)  # Fast-dLLM's dual cache: prefix and suffix cached, the block recomputed
        middle = model.forward_cached(x[:, 4:8], dual, rows=torch.arange(2), append=False, attention_mask=mask,
                                      block_offset=offset, position_ids=(mask.cumsum(1) - 1).clamp(min=0)[:, 4:8])
    keep = torch.isfinite(full)
    assert torch.allclose(rest[keep[:, 8:]], full[:, 8:][keep[:, 8:]], atol=1e-5)
    assert torch.allclose(middle[keep[:, 4:8]], full[:, 4:8][keep[:, 4:8]], atol=1e-5)


@pytest.mark.parametrize("layout", ["bidirectional", "block_causal"])
def test_shifted_structured_verifier_equals_copies_for_one_layer(layout):
    """One layer: query j (standing at s_j - 1 with copy j's token there) sees exactly copy j's context."""
    model = _shifted(layout, n_layers=1)
    x = torch.tensor([[5, 6, 7, 8, 2, 2, 2, 2, 2, 2, 2, 2], [9, 9, 9, 9, 11, 2, 2, 2, 2, 2, 2, 2]])
    positions, drafts = torch.tensor([[4, 5, 6], [5, 7, 6]]), torch.tensor([[10, 11, 12], [13, 14, 15]])
    count, bonus, offset = torch.tensor([3, 2]), torch.tensor([7, 8]), torch.tensor([4, 4])
    assert_structured_equals_copies(model, x, positions, drafts, count, bonus, offset)


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_cli_generate_on_a_hub_layout_folder(folders, family, capsys):
    from dllm.cli import main

    assert main(["generate", "the cat sat", "--model", str(folders(family)), "--max-new-tokens", "4",
                 "--option", "block_length=2", "--temperature", "0", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["sampler"] == "fef" and out["exact"] is True and out["stats"]["nfe"] >= 1


def test_hub_ids_download_no_python(monkeypatch, folders):
    """A hub id is fetched by snapshot_download with patterns that leave every .py behind (offline: faked)."""
    import fnmatch

    import huggingface_hub

    calls = []

    def fake_snapshot_download(repo_id, allow_patterns, ignore_patterns, **kw):
        calls.append((repo_id, allow_patterns, ignore_patterns, kw))
        return str(folders("llada"))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    model = load_native("GSAI-ML/LLaDA-8B-Instruct", "llada", revision="main")
    assert type(model) is NativeLM
    assert calls[0][0] == "GSAI-ML/LLaDA-8B-Instruct" and calls[0][3] == {"revision": "main"}
    _, allow, ignore, _ = calls[0]
    fetched = [f for f in ("config.json", "model-00001-of-00006.safetensors", "model.safetensors.index.json",
                           "tokenizer.json", "tokenizer_config.json", "modeling_llada.py", "configuration_llada.py")
               if any(fnmatch.fnmatch(f, p) for p in allow) and not any(fnmatch.fnmatch(f, p) for p in ignore)]
    assert fetched == ["config.json", "model-00001-of-00006.safetensors", "model.safetensors.index.json",
                       "tokenizer.json", "tokenizer_config.json"]


def test_dream_bpe_files_without_tokenizer_json(tmp_path):
    """Dream's hub tokenizer is its tokenization_dream.py over vocab.json + merges.txt; transformers' Qwen2
    tokenizer reads those files to the same ids as that code (run here, test-only), which never runs in load."""
    import importlib.util

    from fixtures.hf.remote_checkpoints import require_remote_code
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    folder = make_dream_folder(tmp_path / "bpe")
    (folder / "tokenizer.json").unlink()
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=280, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(["the cat sat on the mat", "a dog ran to the big red mat", "Hello world, 1 2 3!"] * 9,
                            trainer)
    bpe.model.save(str(folder))
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]  # ids 280..283
    added = {str(280 + i): {"content": t, "special": True, "normalized": False, "lstrip": False, "rstrip": False,
                            "single_word": False} for i, t in enumerate(specials)}
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "DreamTokenizer", "auto_map": {"AutoTokenizer": ["tokenization_dream.DreamTokenizer", None]},
        "added_tokens_decoder": added, "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
        "mask_token": "<|mask|>", "bos_token": None, "unk_token": None, "errors": "replace"}))
    config = json.loads((folder / "config.json").read_text())
    config.update(mask_token_id=283, eos_token_id=280, pad_token_id=280, bos_token_id=280)
    (folder / "config.json").write_text(json.dumps(config))
    spec = importlib.util.spec_from_file_location("_dream_tokenizer_reference", require_remote_code("dream") /
                                                  "tokenization_dream.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    reference = module.DreamTokenizer.from_pretrained(str(folder))
    marker = tmp_path / "ran"
    (folder / "tokenization_dream.py").write_text(f"open({str(marker)!r}, 'w').write('x')\n")
    model = dllm.load(folder)
    assert not marker.exists()
    assert (model.mask_token_id, model.eos_token_id, model.stop_token_ids) == (283, 280, (280, 282))
    for text in ("the cat sat", " Hello world, 1 2 3!<|im_end|>", "<|im_start|>user dog<|im_end|>\n<|mask|>",
                 "  two  spaces\n\nnew", "naïve café"):
        assert model.tokenizer(text)["input_ids"] == reference(text)["input_ids"], text


def test_native_sampler_points_to_the_remote_code(folders):
    """sampler='native' is Dream's own diffusion_generate, i.e. its hub code: the native model says where it is."""
    with pytest.raises(TypeError, match=r"NativeLM has none .*trust_remote_code=True"):
        dllm.generate(dllm.load(folders("dream")), PROMPTS[:1], sampler="native", max_new_tokens=4)


def test_transformers_5_rope_parameters_are_read_or_refused(tmp_path, folders):
    """Configs saved by transformers 5 keep RoPE theta (and any scaling) only in ``rope_parameters``: the
    theta must be read there (not defaulted to 10000: silently wrong logits), a scaled rotary refused."""
    folder = make_dream_folder(tmp_path / "t5")
    config = json.loads((folder / "config.json").read_text())
    theta = config.pop("rope_theta")
    config.pop("rope_scaling")
    config["rope_parameters"] = {"rope_theta": theta, "rope_type": "default"}
    (folder / "config.json").write_text(json.dumps(config))
    ids = torch.randint(0, 300, (1, 9), generator=torch.Generator().manual_seed(8))
    model = dllm.load(folder)
    assert model.config.rope_theta == theta
    torch.testing.assert_close(model(ids), dllm.load(folders("dream"))(ids), atol=0, rtol=0)
    for parameters, message in [({"rope_theta": theta, "rope_type": "linear", "factor": 2.0}, "rope_type='linear'"),
                                ({"rope_theta": 10000.0, "rope_type": "default"}, "differ")]:
        config["rope_parameters"] = parameters
        config["rope_theta"] = theta
        (folder / "config.json").write_text(json.dumps(config))
        with pytest.raises(ValueError, match=message):
            dllm.load(folder)


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_prefix_conditioned_recipe_fine_tunes_a_hub_checkpoint(tmp_path, folders, family):
    """The FeF fine-tuning path, run: ``--native`` reads a hub-layout checkpoint (the real config keys and
    weights), the recipe trains on prompt-response pairs and saves a two-stream folder whose exact
    samplers then run (greedy fef == greedy sequential)."""
    from dllm.models.two_stream import TwoStreamLM
    from dllm.train import main

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": f"what is {i} + 1", "response": f"{i + 1}"}) + "\n"
                             for i in range(8)))
    settings = ["train.steps=2", "train.batch_size=4", "train.micro_batch_size=2", "train.log_every=1",
                "train.eval_every=2", "train.eval_problems=2", "train.warmup_steps=1", f'prefix.pairs="{pairs}"']
    config = Path(__file__).resolve().parents[1] / "configs" / "prefix_conditioned.toml"
    args = ["--recipe", "prefix-conditioned", "--config", str(config), "--init",
            str(folders(family)), "--native", family, "--output", str(tmp_path / "run")]
    assert main(args + [a for s in settings for a in ("--set", s)]) == 0
    model = dllm.load(tmp_path / "run" / "model")
    assert isinstance(model, TwoStreamLM) and model.capabilities.one_pass_exact
    before = load_native(folders(family), family)
    assert not torch.equal(model.base.layers[0].attn.wqkv.weight, before.layers[0].attn.wqkv.weight)
    with torch.no_grad():
        runs = [dllm.generate(model, PROMPTS[:1], sampler=s, max_new_tokens=8, temperature=0, **o)
                for s, o in (("sequential", {}), ("fef", {"window": 3}))]
    assert torch.equal(runs[0].sequences, runs[1].sequences)
