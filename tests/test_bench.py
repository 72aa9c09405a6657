"""dllm bench: configuration parsing, the study end to end on tiny random models, and the cost model."""

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from dllm.defaults import auto_dtype
from dllm.eval.study import bench, cost_model
from dllm.models.transformer import TransformerConfig, TransformerLM

ROOT = Path(__file__).resolve().parents[1]
TINY_ROLES = ["--role", "ar=tiny", "--role", "diffusion=tiny-bidirectional", "--role", "diffusion=tiny+block4",
              "--role", "drafter=tiny"]
TINY_GRID = ["--cost-rows", "1,2", "--cost-tokens", "1,4", "--cost-contexts", "0,8", "--cost-layers", "1,2",
             "--cost-reps", "1", "--threads", "1"]
EXACT_DIFFUSION = ["sequential", "sequential no-cache", "fef w2", "fef w4", "fef w8", "fef w4 no-cache",
                   "fef w4 stale"]
EXACT_AR = ["ar greedy", "ar_spec drafter-ar k4", "ar_spec drafter-diffusion k4", "ar_spec ngram k4"]


def save_tiny_models(folder: Path) -> dict[str, str]:
    """A small trained tokenizer and random ar / drafter (causal) / diffusion (block-causal) models."""
    from dllm.data.tokenizer import train_tokenizer, training_corpus

    tokenizer = train_tokenizer(training_corpus(n_synthetic=200), vocab_size=300, out_path=folder / "tokenizer.json")
    layouts = {"ar": {"layout": "causal"}, "drafter": {"layout": "causal", "dim": 32},
               "diffusion": {"layout": "block_causal", "block_size": 4, "mask_token_id": tokenizer.mask_token_id}}
    paths = {}
    for name, layout in layouts.items():
        torch.manual_seed(0)
        config = TransformerConfig(**{"vocab_size": len(tokenizer), "dim": 64, "n_layers": 2, "n_heads": 2,
                                      "max_seq_len": 256, "eos_token_id": tokenizer.eos_token_id,
                                      "pad_token_id": tokenizer.pad_token_id, **layout})
        TransformerLM(config).save_pretrained(folder / name)
        shutil.copy(folder / "tokenizer.json", folder / name / "tokenizer.json")
        paths[name] = str(folder / name)
    return paths


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    return save_tiny_models(tmp_path_factory.mktemp("models"))


def model_flags(paths: dict[str, str]) -> list[str]:
    return [flag for name, path in paths.items() for flag in ("--model", f"{name}={path}")]


@pytest.fixture(scope="module")
def study(tiny_models, tmp_path_factory) -> tuple[Path, dict]:
    """The default study, every configuration, on 2 synthetic prompts and 8 new tokens."""
    out = tmp_path_factory.mktemp("study")
    argv = model_flags(tiny_models) + ["--num-prompts", "2", "--max-new-tokens", "8", "--batch-size", "2",
                                       "--repeats", "2", "--threads", "1", "--output", str(out)]
    assert bench.main(argv) == 0
    return out, json.loads((out / "results.json").read_text())


# --------------------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------------------


def test_parse_config_types_values_and_keeps_choice_none():
    config = bench.parse_config("name=fef w4 ; model=diffusion;sampler=fef;window=4;cache=none;temperature=0.5")
    assert (config.name, config.model, config.sampler, config.temperature) == ("fef w4", "diffusion", "fef", 0.5)
    assert config.options == {"window": 4, "cache": "none"}
    assert bench.parse_config("name=f;model=d;sampler=fast_dllm;threshold=none").options == {"threshold": None}


def test_parse_config_rejects_bad_configurations():
    with pytest.raises(ValueError, match="unknown option"):
        bench.parse_config("name=x;model=d;sampler=fef;windw=4")
    with pytest.raises(ValueError, match="sampler must be one of"):
        bench.parse_config("name=x;model=d;sampler=nope")
    with pytest.raises(ValueError, match="lacks"):
        bench.parse_config("model=d;sampler=ar")
    with pytest.raises(ValueError, match="tokens_per_step"):
        bench.parse_config("name=x;model=d;sampler=fef;tokens_per_step=2")


def test_default_study_covers_every_family():
    configs = [bench.parse_config(text) for text in bench.DEFAULT_STUDY]
    samplers = {c.sampler for c in configs}
    assert {"ar", "ar_spec", "llada", "fast_dllm", "eb", "sequential", "fef"} <= samplers
    drafters = {c.options.get("drafter") for c in configs if c.sampler == "ar_spec"}
    assert drafters == {"ngram", "drafter", "diffusion"}
    fef = [c.options for c in configs if c.sampler == "fef"]
    assert {o.get("window") for o in fef} >= {2, 4, 8}
    assert {o.get("cache") for o in fef} >= {None, "none"} and {o.get("draft") for o in fef} >= {None, "stale"}
    assert any(o.get("verifier") == "structured" for o in fef)


def test_config_file_and_shipped_example(tmp_path):
    study, models, runs = bench.read_config_file(ROOT / "configs" / "bench_fef.toml")
    assert study["baseline"] in [r.name for r in runs] and models == {}
    file = tmp_path / "s.toml"
    file.write_text('[study]\nrepeats = 2\n[models]\nar = "x"\n[[run]]\nname = "a"\nmodel = "ar"\nsampler = "ar"\n')
    expected = ({"repeats": 2}, {"ar": "x"}, [bench.parse_config("name=a;model=ar;sampler=ar")])
    assert bench.read_config_file(file) == expected
    file.write_text("[study]\nrepeat = 2\n")
    with pytest.raises(ValueError, match="unknown \\[study\\] keys"):
        bench.read_config_file(file)


def test_batches_sort_by_length_and_left_pad():
    batches = bench.make_batches([[5, 6, 7], [8], [9, 9]], batch_size=2, pad_id=0, device="cpu")
    assert [b.index for b in batches] == [[1, 2], [0]]
    assert batches[0].input_ids.tolist() == [[0, 8], [9, 9]]
    assert batches[0].attention_mask.tolist() == [[0, 1], [1, 1]]
    assert batches[1].attention_mask is None


def test_repeats_interleave_configurations_round_robin(monkeypatch):
    calls = []
    monkeypatch.setattr(bench, "run_pass", lambda run, batches, settings, log=None, on_batch=None, clock=None:
                        calls.append((run.config.name, log is not None, clock is not None)) or (1.0, []))
    runs = [bench.Prepared(bench.parse_config(f"name={n};model=m;sampler=ar"), None, {}, 0.0) for n in "abc"]
    profiles, times = bench.time_study(runs, [], bench.Settings(repeats=3, warmup=2), progress=lambda _: None)
    recorded, rest = calls[:6], [name for name, _, _ in calls[6:]]
    # each configuration's recorded pass, then its clocked pass (model time; never timed)
    assert recorded == [(n, log, not log) for n in "abc" for log in (True, False)]
    assert profiles["a"][1].clocked == (1.0, {False: 0.0, True: 0.0})
    assert rest == list("abc") + list("abc") + list("bca") + list("cab")  # warm-up, then rotating repeats
    assert times == {n: [1.0] * 3 for n in "abc"}


def test_speedups_are_median_paired_ratios():
    runs = [{"name": "base", "new_tokens": 10, "times_s": [1.0, 2.0, 4.0]},
            {"name": "fast", "new_tokens": 20, "times_s": [1.0, 1.0, 1.0]}]
    bench.add_speedups(runs, "base")
    assert runs[0]["speedup"] == 1.0
    assert (runs[1]["speedup"], runs[1]["speedup_min"], runs[1]["speedup_max"]) == (4.0, 2.0, 8.0)


# --------------------------------------------------------------------------------------------------------
# The study end to end
# --------------------------------------------------------------------------------------------------------

RUN_FIELDS = ("name", "model", "sampler", "options", "tokens_per_s", "s_per_token", "s_per_sample", "nfe",
              "nfe_draft", "forward_tokens_per_token", "tokens_per_call", "tokens_per_row_call",
              "mean_acceptance_length", "acceptance_per_position", "accuracy", "speedup", "speedup_min",
              "speedup_max", "tokens_per_s_min", "tokens_per_s_max", "relative_spread", "times_s", "call_shapes")


def test_study_writes_every_field(study):
    out, results = study
    assert {"platform", "processor"} <= set(results["machine"])
    auto = str(auto_dtype(results["machine"]["device"])).removeprefix("torch.")  # the default dtype "auto"
    assert results["dtype"] == auto and results["torch_version"] == torch.__version__
    assert results["threads"] == 1 and results["baseline"] == "ar greedy" and results["prompts"]["scored"]
    assert [r["name"] for r in results["runs"]] == [bench.parse_config(t).name for t in bench.DEFAULT_STUDY]
    for run in results["runs"]:
        assert set(RUN_FIELDS) <= set(run), set(RUN_FIELDS) - set(run)
        assert len(run["times_s"]) == 2 and run["tokens_per_s"] > 0 and run["nfe"] > 0
        assert run["accuracy"] is not None and run["num_scored"] == 2
    by_name = {r["name"]: r for r in results["runs"]}
    assert by_name["ar greedy"]["speedup"] == 1.0
    assert by_name["ar_spec drafter-ar k4"]["nfe_draft"] > 0 and by_name["ar_spec ngram k4"]["nfe_draft"] == 0
    assert by_name["fef w4"]["acceptance_per_position"] and by_name["fef w4"]["options"]["block_length"] == 4
    assert by_name["llada 2/step"]["options"]["steps"] == 4
    assert "| fef w4 |" in (out / "results.md").read_text()
    for run in results["runs"]:  # the clocked pass splits each configuration's wall time
        shares = run["model_share"]
        assert 0 < shares["target"] < 1 and 0 < run["non_model_share"] < 1, run["name"]
        assert abs(shares["target"] + shares["draft"] + run["non_model_share"] - 1) < 1e-9
        assert (shares["draft"] > 0) == (run["nfe_draft"] > 0), run["name"]


def test_recorded_call_shapes_match_the_counters(study):
    for run in study[1]["runs"]:
        calls = {"target": 0, "draft": 0}
        for call in run["call_shapes"]:
            calls[call["role"]] += call["count"]
        assert (calls["target"], calls["draft"]) == (run["nfe"], run["nfe_draft"]), run["name"]


def test_configurations_see_the_same_prompts(study):
    """At T=0 exact samplers reproduce their reference token for token, which only holds on the same prompts."""
    by_name = {r["name"]: r for r in study[1]["runs"]}
    for group in (EXACT_DIFFUSION, EXACT_AR):
        assert len({tuple(by_name[name]["examples"]) for name in group}) == 1, group


def test_plots_are_written(study):
    out, results = study
    assert results["plots"] == ["pareto.png", "tokens_per_call.png", "acceptance.png", "acceptance_entropy.png",
                                "speed.png"]
    for name in results["plots"]:
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_random_and_jsonl_prompts(tiny_models, tmp_path, capsys):
    flags = model_flags(tiny_models) + ["--max-new-tokens", "4", "--batch-size", "2", "--repeats", "1",
                                        "--threads", "1", "--config", "name=ar;model=ar;sampler=ar",
                                        "--config", "name=fef;model=diffusion;sampler=fef;window=2"]
    assert bench.main(flags + ["--prompts", "random", "--num-prompts", "3", "--output", str(tmp_path / "r")]) == 0
    results = json.loads((tmp_path / "r" / "results.json").read_text())
    assert not results["prompts"]["scored"] and all(r["accuracy"] is None for r in results["runs"])
    # no --baseline and no 'ar greedy': the first configuration is the baseline, and the run says so
    assert results["baseline"] == "ar"
    assert "dllm bench: speedups are relative to 'ar', the first configuration" in capsys.readouterr().err
    file = tmp_path / "p.jsonl"
    file.write_text('{"prompt": "Question: 1+1?\\nAnswer:"}\n{"prompt": "Hi"}\n')
    assert bench.main(flags + ["--prompts", str(file), "--output", str(tmp_path / "j")]) == 0
    results = json.loads((tmp_path / "j" / "results.json").read_text())
    assert results["prompts"]["count"] == 2 and results["runs"][0]["accuracy"] is None


def test_bad_study_fails_before_timing(tiny_models, tmp_path):
    flags = model_flags(tiny_models) + ["--output", str(tmp_path)]
    with pytest.raises(ValueError, match="block_length"):
        bench.main(flags + ["--config", "name=x;model=diffusion;sampler=fef;block_length=3"])
    with pytest.raises(FileNotFoundError, match="--model"):
        bench.main(["--model", f"ar={tmp_path / 'missing'}", "--config", "name=a;model=ar;sampler=ar"])
    assert not (tmp_path / "results.json").exists()


# --------------------------------------------------------------------------------------------------------
# Cost model
# --------------------------------------------------------------------------------------------------------


def test_depth_fit_separates_fixed_and_per_layer_cost():
    assert cost_model._fit((1, 2), [3.0, 5.0], 10) == (21.0, False)  # fixed 1 + 2 per layer
    assert cost_model._fit((1, 2), [5.0, 3.0], 10) == (4.0, True)  # noise: slope clamped at 0
    assert cost_model._fit((4,), [2.0], 8) == (4.0, False)


def test_latency_interpolates_inside_and_extrapolates_outside():
    grid = cost_model.Grid(rows=(1, 2), tokens=(1, 4), contexts=(0, 8), layers=(1,), reps=1)
    seconds = {(r, t, c): r * t + c / 8 for r in grid.rows for t in grid.tokens for c in grid.contexts}
    table = cost_model.LatencyTable("toy", {"n_layers": 1}, grid, seconds, {1: seconds})
    assert table.latency(2, 4, 8) == (9.0, False)
    assert table.latency(1, 2, 4) == pytest.approx((2.5, False))
    assert table.latency(4, 4, 0) == (16.0, True)  # twice the largest measured rows: twice the time
    assert table.latency(1, 1, 16) == (3.0, True)  # context beyond the grid: the last segment's slope


def test_cost_model_measures_a_tiny_architecture(tmp_path):
    assert bench.main(["--cost-model", "--arch", "tiny", *TINY_GRID, "--output", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "cost_model.json").read_text())
    points = report["archs"]["tiny"]["points"]
    assert len(points) == 8 and all(p["seconds"] > 0 and set(p["measured"]) == {"1", "2"} for p in points)
    assert any("layers" in a for a in report["assumptions"]) and report["projection"] is None
    assert (tmp_path / "latency.png").stat().st_size > 5000


def test_cost_model_projects_a_study(study, tmp_path):
    out, results = study
    argv = ["--cost-model", "--results", str(out / "results.json"), *TINY_ROLES, *TINY_GRID, "--output", str(tmp_path)]
    assert bench.main(argv) == 0
    projection = json.loads((tmp_path / "cost_model.json").read_text())["projection"]
    rows = {r["name"]: r for r in projection["runs"]}
    assert set(rows) == {r["name"] for r in results["runs"]} and rows["ar greedy"]["projected_speedup"] == 1.0
    valid = [r for r in projection["runs"] if r["valid"]]
    assert all(r["projected_s_per_token"] > 0 and 0 <= r["extrapolated_fraction"] <= 1 for r in valid)
    assert rows["ar_spec drafter-ar k4"]["drafter_arch"] == "tiny"
    with pytest.raises(ValueError, match="--role"):
        cost_model.project(results, {}, {})


@pytest.mark.slow
def test_gpu_study_script_runs_small_on_cpu(tiny_models, tmp_path):
    env = {**os.environ, "SMALL": "1", "MODEL_AR": tiny_models["ar"], "MODEL_DIFFUSION": tiny_models["diffusion"],
           "MODEL_DRAFTER": tiny_models["drafter"], "NUM_PROMPTS": "2", "MAX_NEW_TOKENS": "4", "BATCH_SIZE": "2",
           "REPEATS": "1", "THREADS": "1", "COST_ROLES": "ar=tiny,diffusion=tiny-bidirectional,diffusion=tiny+block4,"
           "drafter=tiny", "COST_ROWS": "1,2",
           "COST_TOKENS": "1,4", "COST_CONTEXTS": "0,8", "COST_REPS": "1", "SELF_ROWS": "1,2", "SELF_TOKENS": "1,4",
           "SELF_CONTEXTS": "0,8", "HEAD_ARCH": "tiny-bidirectional",
           "REAL_SHAPE": "0"}  # a real shape is gigabytes even at 2 layers: tests/test_real_shape.py covers the tool
    done = subprocess.run(["bash", str(ROOT / "eval" / "gpu_study.sh"), str(tmp_path)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    for name in ("results.json", "results.md", "pareto.png", "cost_model.json", "projection.png",
                 "selfcheck/cost_model.json", "head_cost/head_cost.json", "trees/results.json"):
        assert (tmp_path / name).stat().st_size > 0, name
    assert "| sequential | - | no | yes |" in (tmp_path / "cost_model.md").read_text()  # block-cached


def test_interrupted_repeats_keep_what_every_configuration_finished(monkeypatch):
    """An interrupt in repeat 2 reports repeat 1 for everyone; one before any full repeat propagates."""
    passes = []

    def run_pass(run, batches, settings, log=None, on_batch=None, clock=None):
        passes.append(run.config.name)
        if len(passes) == 6 + 3 + 2:  # recorded and clocked x3, repeat 1 x3, then the second pass of repeat 2
            raise KeyboardInterrupt
        return 1.0, []

    monkeypatch.setattr(bench, "run_pass", run_pass)
    runs = [bench.Prepared(bench.parse_config(f"name={n};model=m;sampler=ar"), None, {}, 0.0) for n in "abc"]
    _, times = bench.time_study(runs, [], bench.Settings(repeats=3, warmup=1), progress=lambda _: None)
    assert times == {n: [1.0] for n in "abc"}
    passes.clear()
    monkeypatch.setattr(bench, "run_pass", lambda *a, **k: passes.append(1) or (
        (_ for _ in ()).throw(KeyboardInterrupt) if len(passes) == 7 else (1.0, [])))
    with pytest.raises(KeyboardInterrupt):
        bench.time_study(runs, [], bench.Settings(repeats=3, warmup=1), progress=lambda _: None)


def test_round_parts_split_a_round_into_its_mechanisms():
    """python -m dllm.eval.study.round_parts: each layout's parts are clocked, the model calls taken out of them,
    and the parts add up to the run's wall time."""
    import dllm
    from dllm.eval.study.round_parts import profile

    oracle = dllm.HMMOracle.random(num_states=3, num_tokens=4, seed=0)
    prompts = [[0, 1, 2], [1, 2, 3], [2, 2, 0]]
    for model, sampler, options in ((oracle, "fef", {"window": 3}),
                                    (oracle.as_causal(), "ar_spec", {"num_draft_tokens": 3})):
        drafter = oracle.perturbed(0.5) if sampler == "ar_spec" else None
        found = profile(model, prompts, sampler, 2, 6, drafter, **options)
        parts = found["parts"]
        assert found["rounds"] > 0 and parts["verify rule"] > 0 and parts["target model"] > 0
        assert abs(sum(parts.values()) - found["total_s"]) < 1e-6 * max(1.0, found["total_s"]) + 1e-9
        assert (parts["drafter model"] > 0) == (drafter is not None)
