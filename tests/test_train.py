"""Tests for dllm.training: config validation, objectives' inputs, exact resume, multi-process, shipped weights."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dllm.data.synthetic import PRESETS, heldout_set
from dllm.data.tokenizer import load_tokenizer, train_tokenizer, training_corpus
from dllm.models.transformer import TransformerConfig, TransformerLM
from dllm.training import build_model, config_from_dict, heldout_loss, load_config, train
from dllm.training.batches import (
    IGNORE,
    Example,
    build_batch,
    mask_groups,
    micro_batches,
    step_problems,
    tokenize_problems,
)

ROOT = Path(__file__).resolve().parents[1]
WEIGHTS = ROOT / "dllm" / "weights"
V, PAD, EOS, MASK = 40, 0, 1, 2


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory) -> str:
    """A small tokenizer trained on a few hundred problems (BPE on the full corpus takes seconds)."""
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_tokenizer(training_corpus(300, seed=0), 512, path)
    return str(path)


def _config(tokenizer_path: str, layout: str = "causal", **train) -> dict:
    model = {"layout": layout, "dim": 32, "n_layers": 2, "n_heads": 2, "max_seq_len": 256}
    if layout == "block_causal":
        model["block_size"] = 8
    return {"model": model, "data": {"tokenizer": tokenizer_path},
            "train": {"steps": 4, "batch_size": 8, "micro_batch_size": 4, "lr": 3e-3, "warmup_steps": 1,
                      "log_every": 1, "eval_every": 0, "eval_problems": 8, "checkpoint_every": 2,
                      "precision": "fp32", **train}}


def _losses(summary: dict) -> list[float]:
    return [h["loss"] for h in summary["history"] if "loss" in h]


# --- config -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, layout", [("ar", "causal"), ("drafter", "causal"), ("diffusion", "block_causal"),
                                          ("tiny", "causal")])
def test_training_configs_load(name, layout):
    assert load_config(ROOT / "configs" / f"{name}.toml").layout == layout


@pytest.mark.parametrize("values, message", [
    ({"train": {"stepz": 3}}, "unknown [train] keys ['stepz']; allowed keys: ['seed', 'steps'"),
    ({"trian": {}}, "unknown config tables ['trian']; allowed tables: ['data', 'model', 'train']"),
    ({"data": {"preset": "impossible"}}, "data.preset must be one of ['default', 'easy', 'hard', 'medium']"),
    ({"train": {"precision": "fp16"}}, "train.precision must be one of ['bf16', 'fp32'], got 'fp16'"),
    ({"train": {"steps": 0}}, "train.steps must be >= 1, got 0"),
    ({"train": {"lr": "fast"}}, "train.lr must be a finite number, got 'fast'"),
    ({"train": {"beta2": 1.0}}, "train.beta2 must lie in [0.0, 1.0), got 1.0"),
    ({"model": {"layout": "sideways"}}, "layout must be one of ('causal', 'bidirectional', 'block_causal')"),
    ({"model": {"colour": 3}}, "unknown [model] keys ['colour']; allowed keys: ['dim', 'n_layers'"),
    ({"model": {"vocab_size": 9}}, "model keys ['vocab_size'] come from the tokenizer"),
    ({"model": {"layout": "block_causal"}}, "block_size must be a positive int, got None"),
])
def test_config_errors_name_the_key(values, message):
    with pytest.raises(ValueError) as info:
        config_from_dict(values)
    assert message in str(info.value)


def test_load_config_overrides(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[model]\nlayout = "causal"\n[train]\nsteps = 7\n')
    config = load_config(path, {"train": {"batch_size": 4, "micro_batch_size": 2}})
    assert (config.train.steps, config.train.batch_size, config.train.micro_batch_size) == (7, 4, 2)


# --- data and objectives ------------------------------------------------------------------------------

def test_step_shards_are_disjoint_and_cover_the_batch():
    preset = PRESETS["default"]
    whole = step_problems(5, 3, 8, 0, 1, preset)
    shards = [step_problems(5, 3, 8, rank, 2, preset) for rank in range(2)]
    assert sorted(map(json.dumps, shards[0] + shards[1])) == sorted(map(json.dumps, whole))
    assert not {p["question"] for p in shards[0]} & {p["question"] for p in shards[1]}
    assert step_problems(5, 4, 8, 0, 1, preset) != whole  # each step draws new problems
    held_out = {p["question"] for p in heldout_set()}
    assert not held_out & {p["question"] for p in whole}


def test_regions_per_layout(tokenizer_path):
    tokenizer = load_tokenizer(tokenizer_path)
    problems = step_problems(0, 0, 4, 0, 1, PRESETS["default"])
    for layout, block, check in [
        ("causal", None, lambda e: len(e.region) == e.answer_tokens),
        ("bidirectional", None, lambda e: len(e.region) == 80),
        ("block_causal", 8, lambda e: len(e.region) % 8 == 0 and 8 <= len(e.region) - e.answer_tokens < 16),
    ]:
        for example, problem in zip(tokenize_problems(problems, tokenizer, layout, block, 80), problems):
            assert check(example), layout
            assert set(example.region[example.answer_tokens - 1:]) == {tokenizer.eos_token_id}
            text = tokenizer.decode(list(example.prompt) + list(example.region[:example.answer_tokens - 1]))
            assert text == f"Question: {problem['question']}\nAnswer: {problem['answer']}"


def test_mask_groups_masks_k_of_n_with_weight_n_over_k():
    regions = torch.ones(64, 16, dtype=torch.bool)
    regions[:, 12:] = False  # a padding block: never masked
    masked, weights = mask_groups(regions, 4, torch.Generator().manual_seed(0))
    per_block = masked.view(64, 4, 4).sum(-1)
    assert (per_block[:, :3] >= 1).all() and (per_block[:, 3] == 0).all()
    expected = torch.where(masked.view(64, 4, 4), 4.0 / per_block.clamp(min=1)[..., None].float(), 0.0)
    assert torch.equal(weights, expected.view(64, 16))
    # k is uniform on {1..4}, so the mean weighted count per block is n = 4 (the ELBO's normaliser)
    assert abs(float(weights[:, :12].sum()) / (64 * 3) - 4.0) < 1e-4
    assert set(per_block[:, :3].unique().tolist()) == {1, 2, 3, 4}


def test_suffix_masks_are_block_suffixes():
    regions = torch.ones(32, 16, dtype=torch.bool)
    masked, weights = mask_groups(regions, 8, torch.Generator().manual_seed(0), suffix_prob=1.0)
    blocks = masked.view(32, 2, 8).int()
    assert (blocks.diff(dim=-1) >= 0).all() and (blocks[..., -1] == 1).all()  # 0...0 1...1 in each block
    assert torch.equal(weights.view(32, 2, 8).amax(-1), 8.0 / blocks.sum(-1).float())


def _block_model(block_size=4) -> TransformerLM:
    torch.manual_seed(0)
    return TransformerLM(TransformerConfig(vocab_size=V, dim=32, n_layers=2, n_heads=2, max_seq_len=128,
                                           layout="block_causal", block_size=block_size, mask_token_id=MASK,
                                           eos_token_id=EOS, pad_token_id=PAD)).eval()


def _examples(lengths, block_size=4) -> list[Example]:
    g = torch.Generator().manual_seed(0)
    out = []
    for prompt_len, answer_len in lengths:
        prompt = torch.randint(4, V, (prompt_len,), generator=g).tolist()
        answer = torch.randint(4, V, (answer_len,), generator=g).tolist()
        region = -(-(answer_len + 1) // block_size) * block_size + block_size
        out.append(Example(tuple(prompt), tuple(answer) + (EOS,) * (region - answer_len), answer_len + 1))
    return out


def test_two_stream_forward_equals_inference_forward():
    """Noisy block b's training logits == the plain call on [prompt, clean blocks < b, noisy block b]."""
    model, keep = _block_model(), torch.arange(V) != MASK
    examples = _examples([(5, 6), (9, 3), (3, 10)])
    batch = build_batch("block_causal", examples, pad_id=PAD, mask_id=MASK, block_size=4,
                        generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids)
        checked = 0
        for i, example in enumerate(examples):
            prompt, region = list(example.prompt), list(example.region)
            noisy = batch.input_ids[i, :len(region)].tolist()
            assert batch.targets[i, :len(region)].tolist() == [t if n == MASK else IGNORE
                                                              for t, n in zip(region, noisy)]
            for b in range(len(region) // 4):
                context = prompt + region[:4 * b] + noisy[4 * b:4 * b + 4]
                reference = model(torch.tensor([context]), block_offset=len(prompt))[0, -4:]
                torch.testing.assert_close(logits[i, 4 * b:4 * b + 4, keep], reference[:, keep],
                                           rtol=1e-5, atol=1e-5)
                checked += 1
        # the check can fail: aligning blocks to position 0 instead of the answer changes the logits
        wrong = model(torch.tensor([context]))[0, -4:]
        assert not torch.allclose(wrong[:, keep], reference[:, keep], atol=1e-4)
    assert checked == sum(len(e.region) // 4 for e in examples)


def test_masked_batch_keeps_prompt_clean(tokenizer_path):
    tokenizer = load_tokenizer(tokenizer_path)
    examples = tokenize_problems(step_problems(0, 0, 4, 0, 1, PRESETS["default"]), tokenizer,
                                 "bidirectional", None, 80)
    batch = build_batch("bidirectional", examples, pad_id=PAD, mask_id=MASK, block_size=None,
                        generator=torch.Generator().manual_seed(0))
    for i, example in enumerate(examples):
        p = len(example.prompt)
        assert batch.input_ids[i, :p].tolist() == list(example.prompt)
        assert (batch.targets[i, :p] == IGNORE).all()
        masked = batch.input_ids[i, p:p + 80] == MASK
        assert masked.any() and torch.equal(batch.targets[i, p:p + 80] != IGNORE, masked)
    assert batch.count == 4 * 80


def test_micro_batches_sort_by_length():
    examples = _examples([(9, 3), (3, 2), (12, 20), (4, 4)])
    chunks = micro_batches(examples, 2)
    lengths = [len(e.prompt) + len(e.region) for chunk in chunks for e in chunk]
    assert lengths == sorted(lengths) and [len(c) for c in chunks] == [2, 2]


# --- training -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["causal", "bidirectional", "block_causal"])
def test_tiny_run_lowers_heldout_loss(tmp_path, tokenizer_path, layout):
    config = config_from_dict(_config(tokenizer_path, layout, steps=6, lr=1e-2))
    tokenizer = load_tokenizer(tokenizer_path)
    before = heldout_loss(build_model(config, tokenizer), config, tokenizer)
    summary = train(config, tmp_path / "run", progress=False)
    after = summary["final_eval"]["eval_loss"]
    assert after < before[0] / before[1] - 0.2
    model = TransformerLM.from_pretrained(tmp_path / "run" / "model")
    assert model.config.layout == layout and (tmp_path / "run" / "model" / "tokenizer.json").exists()


def test_exact_resume_after_kill(tmp_path, tokenizer_path):
    config = config_from_dict(_config(tokenizer_path, "block_causal", precision="bf16"))
    straight = train(config, tmp_path / "straight", progress=False)
    killed = train(config, tmp_path / "resumed", stop_at_step=2, progress=False)
    assert killed["steps"] == 2 and not (tmp_path / "resumed" / "model").exists()
    resumed = train(config, tmp_path / "resumed", resume=True, progress=False)
    assert _losses(resumed) == _losses(straight) and len(_losses(straight)) == 4
    a = load_file(tmp_path / "straight" / "model" / "model.safetensors")
    b = load_file(tmp_path / "resumed" / "model" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    fresh = train(config, tmp_path / "fresh", stop_at_step=2, progress=False)  # same seed, same start
    assert _losses(fresh) == _losses(straight)[:2]


def test_resume_refuses_another_model(tmp_path, tokenizer_path):
    train(config_from_dict(_config(tokenizer_path, steps=2)), tmp_path / "run", progress=False)
    other = _config(tokenizer_path, steps=2)
    other["model"]["dim"] = 64
    with pytest.raises(ValueError, match=r"different \[model\] config"):
        train(config_from_dict(other), tmp_path / "run", resume=True, progress=False)


def test_init_from_another_layout(tmp_path, tokenizer_path):
    train(config_from_dict(_config(tokenizer_path, steps=2)), tmp_path / "ar", progress=False)
    values = _config(tokenizer_path, "block_causal", init_from=str(tmp_path / "ar" / "model"))
    tokenizer = load_tokenizer(tokenizer_path)
    model = build_model(config_from_dict(values), tokenizer)
    source = load_file(tmp_path / "ar" / "model" / "model.safetensors")
    assert model.config.layout == "block_causal"
    assert all(torch.equal(model.state_dict()[k], v) for k, v in source.items())
    values["model"]["dim"] = 64
    with pytest.raises(ValueError, match="does not fit"):
        build_model(config_from_dict(values), tokenizer)


@pytest.mark.slow
def test_two_processes_match_one(tmp_path, tokenizer_path):
    """``accelerate launch`` with 2 CPU processes: disjoint shards, the same updates as one process."""
    pytest.importorskip("accelerate")
    config = _config(tokenizer_path, steps=3)
    path = tmp_path / "run.toml"
    path.write_text(_toml(config))
    single = train(config_from_dict(config), tmp_path / "one", progress=False)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_cpu_threads_per_process", "1", "-m", "dllm.train", "--config", str(path),
               "--output", str(tmp_path / "two"), "--no-progress"]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    two = json.loads((tmp_path / "two" / "metrics.json").read_text())
    assert two["processes"] == 2
    torch.testing.assert_close(torch.tensor(_losses(two)), torch.tensor(_losses(single)), rtol=1e-5, atol=0)
    a = load_file(tmp_path / "one" / "model" / "model.safetensors")
    b = load_file(tmp_path / "two" / "model" / "model.safetensors")
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-5)


def _toml(values: dict) -> str:
    def show(v):
        return json.dumps(v) if isinstance(v, str) else str(v).lower() if isinstance(v, bool) else repr(v)
    return "".join(f"[{table}]\n" + "".join(f"{k} = {show(v)}\n" for k, v in entries.items())
                   for table, entries in values.items())


def test_cli_set_override_and_eval(tmp_path, tokenizer_path, capsys):
    from dllm.train import main

    path = tmp_path / "run.toml"
    path.write_text(_toml(_config(tokenizer_path, "block_causal")))
    assert main(["--config", str(path), "--output", str(tmp_path / "run"), "--set", "train.steps=2",
                 "--no-progress"]) == 0
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["steps"] == 2
    capsys.readouterr()
    assert main(["--eval", str(tmp_path / "run" / "model"), "--limit", "2", "--max-new-tokens", "16"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["sampler"] == "sequential" and report["n"] == 2 and report["options"]["block_length"] == 8


# --- shipped weights ----------------------------------------------------------------------------------

# Shipped models carry their tokenizer; the draft heads beside them (fef_head, ar_eagle, ...) do not and have
# their own tests (tests/test_fef_head.py, tests/test_ar_heads.py).
SHIPPED = sorted(p.name for p in WEIGHTS.iterdir() if (p / "tokenizer.json").exists()) if WEIGHTS.exists() else []


@pytest.mark.skipif(not SHIPPED, reason="no shipped weights in dllm/weights")
@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_weights_load_and_generate(name):
    import dllm
    from dllm.protocols import capabilities
    from dllm.training.evaluate import AnswerAligned, default_sampler

    folder = WEIGHTS / name
    hub = "model_type" in json.loads((folder / "config.json").read_text())  # a hub-layout folder (sdar)
    model = dllm.load(folder) if hub else TransformerLM.from_pretrained(folder)
    tokenizer = load_tokenizer(folder / "tokenizer.json")
    assert model.vocab_size == len(tokenizer) and (folder / "README.md").exists()
    prompt = tokenizer(f"Question: {heldout_set()[0]['question']}\nAnswer:")["input_ids"]
    sampler, options = default_sampler(model)
    aligned = model.config.layout == "block_causal" and capabilities(model).block_anchor == "answer"
    target = AnswerAligned(model, len(prompt)) if aligned else model  # an absolute anchor: generate's own
    out = dllm.generate(target, torch.tensor([prompt]), sampler=sampler, max_new_tokens=8, temperature=0,
                        generator=torch.Generator().manual_seed(0), **options)
    text = tokenizer.decode(out.sequences[0, len(prompt):])
    assert out.sequences.shape == (1, len(prompt) + 8) and text.startswith(" ")


@pytest.mark.parametrize("layout, sampler, options", [
    ("causal", "ar", {}),
    ("block_causal", "sequential", {"block_length": 4}),
    ("block_causal", "fef", {"block_length": 4, "window": 3}),
])
def test_chunked_decoding_equals_one_call_up_to_eos(layout, sampler, options):
    """Stopping at EOS chunk by chunk changes nothing before the EOS (greedy)."""
    import dllm
    from dllm.training.evaluate import AnswerAligned, generate_until_eos

    torch.manual_seed(3)
    extra = {"mask_token_id": MASK, "block_size": 4} if layout == "block_causal" else {}
    model = TransformerLM(TransformerConfig(vocab_size=V, dim=32, n_layers=2, n_heads=2, max_seq_len=128,
                                            layout=layout, eos_token_id=EOS, **extra)).eval()
    prompt = torch.randint(4, V, (6, 5), generator=torch.Generator().manual_seed(0))
    target = AnswerAligned(model, 5) if layout == "block_causal" else model
    whole = dllm.generate(target, prompt, sampler=sampler, max_new_tokens=24, temperature=0, **options)
    eos = int(whole.sequences[:, 5:13].flatten().mode().values)  # an early token stands in for EOS
    totals = {"nfe": 0, "new_tokens": 0, "wall_time_s": 0.0}
    chunked = generate_until_eos(model, prompt, sampler, 24, eos, totals, temperature=0,
                                 generator=torch.Generator(), **options)
    stopped = 0
    for row, ids in zip(whole.sequences[:, 5:].tolist(), chunked):
        cut = row.index(eos) + 1 if eos in row else len(row)
        assert ids[:cut] == row[:cut] and (eos in ids or len(ids) == 24)
        stopped += len(ids) < 24
    assert stopped and totals["new_tokens"] < 6 * 24


def test_an_unknown_recipe_is_refused_naming_the_parameter(capsys):
    from dllm.train import main

    assert main(["--recipe", "no-such-recipe"]) == 2
    assert "--recipe must be one of" in capsys.readouterr().err
