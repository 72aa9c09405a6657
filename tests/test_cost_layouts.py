"""Cost model: call shapes are replayed only onto targets whose attention layout runs the same computation."""

import json

import pytest
from test_bench import TINY_GRID, model_flags, save_tiny_models

from dllm.eval.study import bench, cost_model

CONFIGS = ["name=ar greedy;model=ar;sampler=ar",
           "name=ar_spec drafter-diffusion k2;model=ar;sampler=ar_spec;drafter=diffusion;num_draft_tokens=2",
           "name=sequential;model=diffusion;sampler=sequential",
           "name=sequential no-cache;model=diffusion;sampler=sequential;cache=none",
           "name=fef w2;model=diffusion;sampler=fef;window=2",
           "name=fast_dllm prefix;model=diffusion;sampler=fast_dllm;threshold=0.9;cache=prefix"]
BLOCK_CACHED = {"sequential", "fef w2"}


def test_fits_names_the_target_a_block_cached_shape_needs():
    llada, block8 = cost_model.arch_config("llada-8b"), cost_model.arch_config("llada-8b+block8")
    assert block8 == {**llada, "layout": "block_causal", "block_size": 8}
    why = cost_model.fits("block_causal:8", "llada-8b", llada)
    assert "llada-8b is bidirectional" in why and "llada-8b+block8" in why
    assert cost_model.fits("block_causal:8", "llada-8b+block8", block8) is None
    assert "llada-8b+block8" in cost_model.fits("block_causal:8", "llada-8b+block4",
                                                cost_model.arch_config("llada-8b+block4"))
    dream = cost_model.arch_config("dream-7b")
    assert "dream-7b is bidirectional" in cost_model.fits("block_causal:8", "dream-7b", dream)
    for shape in (llada, block8):  # whole-sequence calls run on either diffusion layout
        assert cost_model.fits("diffusion", "x", shape) is None
    assert "causal target" in cost_model.fits("causal", "llada-8b", llada)
    assert "diffusion calls" in cost_model.fits("diffusion", "qwen3-8b", cost_model.arch_config("qwen3-8b"))
    with pytest.raises(ValueError, match="block size"):
        cost_model.arch_config("llada-8b+blockx")


# The hub's config.json keys of GSAI-ML/LLaDA-8B-Base (OLMo-style) and Dream-org/Dream-v0-Base-7B (Qwen2-style).
HUB_CONFIGS = {
    "llada-8b": {"model_type": "llada", "d_model": 4096, "n_layers": 32, "n_heads": 32, "n_kv_heads": 32,
                 "mlp_hidden_size": 12288, "embedding_size": 126464, "vocab_size": 126464, "block_type": "llama",
                 "layer_norm_type": "rms", "activation_type": "silu", "rope": True},
    "dream-7b": {"model_type": "Dream", "hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28,
                 "num_key_value_heads": 4, "intermediate_size": 18944, "vocab_size": 152064},
}


def test_hub_configs_of_llada_and_dream_read_as_their_bidirectional_presets(tmp_path):
    for preset, config in HUB_CONFIGS.items():
        folder = tmp_path / preset
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config))
        shape = cost_model.arch_config(str(folder))
        assert shape["layout"] == "bidirectional", (preset, shape)
        assert {k: shape[k] for k in cost_model.ARCHS[preset]} == cost_model.ARCHS[preset]
        assert cost_model.fits("block_causal:8", str(folder), shape) is not None


@pytest.fixture(scope="module")
def layouts_study(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("layouts")
    flags = model_flags(save_tiny_models(folder / "models")) + [
        "--num-prompts", "2", "--max-new-tokens", "8", "--batch-size", "2", "--repeats", "1", "--threads", "1",
        "--output", str(folder / "study")] + [x for c in CONFIGS for x in ("--config", c)]
    assert bench.main(flags) == 0
    return json.loads((folder / "study" / "results.json").read_text())


def test_study_records_what_its_call_shapes_need(layouts_study):
    needs = {r["name"]: r["needs"] for r in layouts_study["runs"]}
    assert needs["ar greedy"] == {"target": "causal", "draft": None}
    assert needs["ar_spec drafter-diffusion k2"] == {"target": "causal", "draft": "block_causal:4"}
    for name in BLOCK_CACHED:
        assert needs[name] == {"target": "block_causal:4", "draft": None}, name
    assert needs["sequential no-cache"]["target"] == needs["fast_dllm prefix"]["target"] == "diffusion"


@pytest.mark.parametrize("recorded", [True, False], ids=["needs recorded", "older results"])
def test_projection_never_replays_block_cached_shapes_on_a_bidirectional_target(layouts_study, tmp_path,
                                                                                 recorded):
    results = json.loads(json.dumps(layouts_study))
    if not recorded:
        for run in results["runs"]:
            del run["needs"]
    (tmp_path / "results.json").write_text(json.dumps(results))
    argv = ["--cost-model", "--results", str(tmp_path / "results.json"), "--role", "ar=tiny", "--role",
            "diffusion=tiny-bidirectional", "--role", "diffusion=tiny+block4", *TINY_GRID, "--output", str(tmp_path)]
    assert bench.main(argv) == 0
    report = json.loads((tmp_path / "cost_model.json").read_text())
    rows = {(r["name"], r["target_arch"]): r for r in report["projection"]["runs"]}
    for name in BLOCK_CACHED:
        off = rows[(name, "tiny-bidirectional")]
        assert not off["valid"] and off["projected_s_per_token"] is None and "+block4" in off["why"]
        assert rows[(name, "tiny+block4")]["valid"] and rows[(name, "tiny+block4")]["projected_s_per_token"] > 0
    for name in ("sequential no-cache", "fast_dllm prefix"):
        assert rows[(name, "tiny-bidirectional")]["valid"] and rows[(name, "tiny+block4")]["valid"]
    assert rows[("ar greedy", "tiny")]["projected_speedup"] == 1.0
    if recorded:  # the block drafter runs on the block-causal one of the diffusion role's targets
        assert rows[("ar_spec drafter-diffusion k2", "tiny")]["drafter_arch"] == "tiny+block4"
    text = (tmp_path / "cost_model.md").read_text()
    assert "| configuration | tiny | tiny-bidirectional | tiny+block4 |" in text
    assert "| sequential | - | no | yes |" in text and "| sequential no-cache | - | yes | yes |" in text
    assert "- sequential on tiny-bidirectional: its calls cover one block" in text


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_a_hub_folder_gets_the_shape_and_layout_dllm_load_gives_it(tmp_path, family):
    """The cost model's architecture of a hub-layout folder is the one dllm.load builds from it: LLaDA's MLP
    width from mlp_ratio when mlp_hidden_size is null, Dream bidirectional whatever the model_type's case."""
    from fixtures.hf.remote_checkpoints import require_remote_code

    from dllm.models.native import dream_config, llada_config

    config = json.loads((require_remote_code(family) / "config.tiny.json").read_text())
    config.update({"mlp_hidden_size": None, "mlp_ratio": 3} if family == "llada" else {"model_type": "dream"})
    (tmp_path / "config.json").write_text(json.dumps(config))
    native = (llada_config if family == "llada" else dream_config)(config, 5, 1, 1)
    got = cost_model.arch_config(str(tmp_path))
    assert got["mlp_hidden"] == native.mlp_hidden and got["layout"] == native.layout


def test_bench_without_matplotlib_says_so_in_one_line(tmp_path, monkeypatch, capsys):
    from dllm.eval.study.bench_report import write_plots

    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)  # import matplotlib now raises
    assert write_plots([], tmp_path) == []
    from dllm.extras import install_command

    assert capsys.readouterr().err == ("dllm bench: no plots: plotting needs matplotlib, which is not installed: "
                                       f"{install_command('bench')}\n")
