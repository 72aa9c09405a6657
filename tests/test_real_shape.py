"""The real-shape study and the memory planner (eval/study/real_shape.py, eval/study/planner.py): the planner's peak
within 15% of the one measured in a subprocess, on a shape whose activations and held keys/values are hundreds of MiB;
the hub-layout folders load through the native loader; the logit positions the planner assumes are the ones the samplers
ask for; bad flags end in one line."""

import json

import pytest
import torch

import dllm
from dllm.cli import main
from dllm.eval.study import planner, real_shape
from dllm.eval.study.cost_model import ARCHS
from dllm.models.transformer import TransformerConfig, TransformerLM

# Narrow and wide: calls of 1536 tokens at batch 1 (sequential: one whole sequence; fef w8: 8 copies of 192) hold
# about 200 MiB of MLP transients and keys/values, 800 MiB at batch 4, against a few MiB of BLAS scratch. Measured
# at 2 of its 4 layers.
SHAPE = dict(dim=128, n_layers=4, n_heads=2, vocab_size=32000, mlp_hidden=8192, layout="bidirectional")


def _study(tmp_path, samplers: str, prompt: int, new: int) -> dict:
    args = real_shape.parser().parse_args(
        ["--layers", "2", "--dtype", "float32", "--batch-sizes", "1,4", "--samplers", samplers, "--prompt-length",
         str(prompt), "--max-new-tokens", str(new), "--device", "cpu", "--time-limit", "120", "--cache-dir",
         str(tmp_path / "cache"), "--output", str(tmp_path / "out"), "--sync-calls", "2"])
    real_shape.check_args(args)
    args.command = "test"
    return real_shape.study(args, progress=lambda *_: None, shape=SHAPE)


@pytest.mark.parametrize("samplers, options, prompt, new", [("sequential", {}, 1535, 1),
                                                              ("fef:window=8", {"window": 8}, 184, 8)])
def test_planned_peak_is_within_15_percent_of_the_measured_one(tmp_path, samplers, options, prompt, new):
    report = _study(tmp_path, samplers, prompt, new)
    assert [r["batch"] for r in report["rows"]] == [1, 4]
    for row in report["rows"]:
        assert row["status"] == "ok", row
        assert row["peak_above_weights_gib"] * 1024 > 150, row  # big enough for allocator noise not to matter
        assert 0.85 <= row["planned_over_measured"] <= 1.15, row
        assert row["calls"] >= 1 and row["s_per_round"] > 0 and 0 <= row["sampler_share"] < 1
        assert row["syncs_per_round"] >= 0  # dllm.syncs, in the untimed second decode
        projected = row["projected"]
        assert projected["n_layers"] == 4 and projected["s_per_round"] > row["s_per_round"]
        two, four = (planner.plan({**SHAPE, "n_layers": n}, "float32", row["batch"], prompt, new,
                                  samplers.split(":")[0], options) for n in (2, 4))
        measured = row["peak_above_weights_gib"] * 2**30  # + what grows from 2 to 4 layers: held keys/values
        assert projected["peak_bytes"] == pytest.approx(four.weights + measured + four.depth_bytes - two.depth_bytes)
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert saved["rows"] == report["rows"]
    assert samplers in (tmp_path / "out" / "results.md").read_text()


def test_planned_peak_with_the_exact_block_cache(tmp_path):
    # A block-causal model of this project's own layout: the cache, its per-copy select, the folded finished
    # block, and stale drafts' lookahead block and stored logits all enter the widest call.
    shape = {**SHAPE, "n_layers": 2, "layout": "block_causal", "block_size": 16}
    TransformerLM(TransformerConfig(**shape, max_seq_len=512, mask_token_id=31999)).save_pretrained(tmp_path)
    run = real_shape.Run(str(tmp_path), "fef", ["window=8", "draft=stale"], 4, 200, 32, 0.0, "cpu", "float32", 120,
                         sync_calls=0)
    measured = real_shape.run_child(run, 300)
    assert measured["status"] == "ok", measured
    plan = planner.plan(shape, "float32", 4, 200, 32, "fef", {"window": 8, "draft": "stale"})
    assert plan.setting["session"] == "block" and plan.cache > 0
    assert measured["peak_above_weights_bytes"] > 150 * 2**20
    assert 0.85 <= (plan.peak - plan.weights) / measured["peak_above_weights_bytes"] <= 1.15


def test_a_run_that_does_not_fit_is_reported_as_out_of_memory(tmp_path):
    folder = real_shape.ensure_folder(tmp_path, "test", SHAPE, 1, "float32", progress=lambda *_: None)
    run = real_shape.Run(str(folder), "fef", ["window=8"], 4, 184, 8, 0.0, "cpu", "float32", 60,
                         memory_limit_gib=0.02)
    assert real_shape.run_child(run, 300)["status"] == "out of memory"


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_hub_layout_folders_load_natively_in_shards(tmp_path, family):
    shape = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2 if family == "dream" else 4, vocab_size=320,
                 mlp_hidden=128, layout="bidirectional")
    real_shape.write_folder(tmp_path, family, shape, 2, "bfloat16", shard_bytes=40_000)
    assert len(list(tmp_path.glob("*.safetensors"))) > 1 and not (tmp_path / "tokenizer.json").exists()
    model = dllm.load(str(tmp_path))
    assert model.family == family and model.dtype == torch.bfloat16 and len(model.layers) == 2
    assert model.mask_token_id == 319  # the test vocabulary's last id (the real ids lie past 320)
    out = dllm.generate(model, torch.randint(0, 300, (2, 5)), sampler="fef", max_new_tokens=8, eos_token_id=None)
    assert out.stats.new_tokens == 16


def test_weights_are_the_published_parameter_counts():
    assert planner.weights_bytes(ARCHS["llada-8b"], 2) / 2 == pytest.approx(8.02e9, rel=0.005)  # LLaDA-8B
    dream = {**ARCHS["dream-7b"], "qkv_bias": True}
    assert planner.weights_bytes(dream, 2) / 2 == pytest.approx(7.62e9, rel=0.005)  # Qwen2.5-7B's body


@pytest.mark.parametrize("block", [None, 32])
def test_what_grows_with_depth_grows_in_proportion(block):
    """The exact block cache grows with depth; whole-sequence calls hold nothing per layer (a call that appends to
    no cache keeps no layer's keys and values)."""
    shape = {**ARCHS["llada-8b"], **({"layout": "block_causal", "block_size": block} if block else {})}

    def plan(layers):
        options = {"window": 8, **({"block_length": block} if block else {})}
        return planner.plan({**shape, "n_layers": layers}, "bfloat16", 8, 30, 1024, "fef", options)

    two, full = plan(2), plan(32)
    assert full.depth_bytes == 16 * two.depth_bytes and (full.depth_bytes > 0) == (block is not None)
    assert full.peak - full.weights - full.depth_bytes == two.peak - two.weights - two.depth_bytes


@pytest.mark.parametrize("sampler, options", [
    ("sequential", {}), ("sequential", {"order": "confidence"}), ("fef", {"window": 4}),
    ("fef", {"window": 4, "draft": "stale"}), ("fef", {"window": 3, "order": "confidence", "draft": "stale"})])
def test_logit_positions_are_what_the_samplers_ask_for(sampler, options):
    shape = dict(dim=32, n_layers=1, n_heads=2, vocab_size=64, mlp_hidden=64, layout="bidirectional")
    model = TransformerLM(TransformerConfig(**shape, max_seq_len=64, mask_token_id=63)).eval()
    asked = []
    forward = model.forward

    def spy(*args, logits_at=None, **kwargs):
        asked.append(None if logits_at is None else logits_at.shape[1])
        return forward(*args, logits_at=logits_at, **kwargs)

    model.forward = spy
    dllm.generate(model, torch.randint(0, 60, (2, 6)), sampler=sampler, max_new_tokens=16, eos_token_id=None,
                  generator=torch.Generator().manual_seed(0), **options)
    assert set(asked) == {planner.plan(shape, "float32", 2, 6, 16, sampler, options).setting["logit_positions"]}


def _one_line(argv, capsys) -> str:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and len(captured.err.splitlines()) == 1, captured.err
    return captured.err.strip()


def test_bad_flags_are_one_line_naming_the_flag(capsys, tmp_path):
    arch = _one_line(["study", "real-shape", "--arch", "qwen3-8b"], capsys)
    assert arch.startswith("dllm study: --arch") and "llada-8b" in arch and "dream-7b" in arch
    assert "--batch-sizes must be >= 1" in _one_line(["study", "real-shape", "--batch-sizes", "1,0"], capsys)
    assert "--samplers: 'ar' is not a diffusion sampler" in _one_line(["study", "real-shape", "--samplers", "ar"],
                                                                      capsys)
    option = _one_line(["study", "real-shape", "--samplers", "fef:windw=8", "--cache-dir", str(tmp_path)], capsys)
    assert option.startswith("dllm study: --samplers") and "windw" in option
    assert not any(tmp_path.iterdir())  # refused before any checkpoint was written
    assert _one_line(["plan", "--batch-size", "0"], capsys) == "dllm plan: --batch-size must be >= 1, got 0"
    assert "--sampler must be one of sequential, fef" in _one_line(["plan", "--sampler", "llada"], capsys)
    assert _one_line(["plan", "--model", "nope"], capsys).startswith("dllm plan: --model nope:")
    assert "--option names unknown option(s) ['windw'] for sampler 'fef'" in _one_line(["plan", "--option", "windw=8"],
                                                                                       capsys)


def test_plan_prints_each_part_and_json(capsys):
    assert main(["plan", "--model", "llada-8b", "--batch-size", "8", "--max-new-tokens", "1024", "--sampler", "fef",
                 "--option", "window=8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["peak_bytes"] == sum(out["terms_bytes"].values())
    assert out["setting"]["logit_positions"] == 9 and out["setting"]["session"] == "none"
    assert main(["plan", "--model", "llada-8b"]) == 0
    text = capsys.readouterr().out
    assert all(part in text for part in ("weights", "KV cache", "activations", "logits", "peak"))
