"""The eagle-head / dflash-head / repair-head / distill-drafter recipes (dllm/training/ar_heads.py) on tiny
random backbones (offline, fast)."""

import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import dllm
from dllm.data.synthetic import PRESETS
from dllm.data.tokenizer import load_tokenizer
from dllm.models.ar_heads import load_head, save_head
from dllm.models.transformer import TransformerConfig, TransformerLM
from dllm.training.ar_heads import (
    HeadRecipe,
    _Models,
    _rollout_examples,
    main,
    offline_loss,
    on_policy_loss,
    train_head,
)
from dllm.training.batches import build_batch, step_problems, tokenize_problems
from dllm.training.recipes import RECIPES

SHIPPED = Path(dllm.__file__).resolve().parent / "weights"


@pytest.fixture(scope="module")
def backbones(tmp_path_factory):
    """A tiny causal target and a tiny block-causal diffusion drafter on the shipped tokenizer."""
    root = tmp_path_factory.mktemp("backbones")
    torch.manual_seed(0)
    shapes = dict(vocab_size=495, dim=16, n_layers=1, n_heads=2, max_seq_len=256, eos_token_id=1, pad_token_id=0)
    folders = {}
    for name, extra in (("ar", {}), ("diffusion", dict(layout="block_causal", block_size=8, mask_token_id=2))):
        TransformerLM(TransformerConfig(**shapes, **extra)).save_pretrained(root / name)
        shutil.copyfile(SHIPPED / "ar" / "tokenizer.json", root / name / "tokenizer.json")
        folders[name] = str(root / name)
    return folders


def _batch(recipe):
    tokenizer = load_tokenizer(Path(recipe.target) / "tokenizer.json")
    examples = tokenize_problems(step_problems(0, 0, 4, 0, 1, PRESETS["default"]), tokenizer, "causal", None, 0)
    batch = build_batch("causal", examples, pad_id=0, mask_id=None, block_size=None, generator=torch.Generator())
    return batch, torch.tensor([len(e.prompt) for e in examples])


@pytest.mark.parametrize("kind", ["eagle", "dflash", "repair", "drafter"])
@pytest.mark.parametrize("objective", ["ce", "tv"])
def test_offline_objectives_fit_a_fixed_batch(backbones, kind, objective):
    recipe = HeadRecipe(kind=kind, objective=objective, target=backbones["ar"], drafter=backbones["diffusion"],
                        hidden=32, starts=2, num_draft_tokens=4, unroll=3)
    models = _Models(recipe)
    batch, prompt_lens = _batch(recipe)
    optimizer = torch.optim.AdamW(models.head.parameters(), lr=1e-2)
    losses = []
    for _ in range(25):
        loss = offline_loss(models, recipe, batch, prompt_lens, torch.Generator().manual_seed(0))
        assert torch.isfinite(loss)  # the repair target's mass on the mask id is renormalised away
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.8 * losses[0]
    assert all(p.grad is None or p.grad.abs().sum() == 0 for p in models.target.parameters())


@pytest.mark.parametrize("kind", ["eagle", "dflash", "repair", "drafter"])
def test_on_policy_loss_is_finite_and_reaches_the_head(backbones, kind):
    recipe = HeadRecipe(kind=kind, objective="opd", target=backbones["ar"], drafter=backbones["diffusion"],
                        hidden=32, starts=1, num_draft_tokens=4)
    models = _Models(recipe)
    batch, prompt_lens = _batch(recipe)
    loss = on_policy_loss(models, recipe, batch, prompt_lens, torch.Generator().manual_seed(0))
    loss.backward()
    assert torch.isfinite(loss)
    assert sum(float(p.grad.abs().sum()) for p in models.head.parameters() if p.grad is not None) > 0
    assert models.tokens > 0  # the rollouts' target calls are counted in the compute budget


@pytest.mark.parametrize("kind", ["eagle", "dflash"])
def test_recipe_trains_a_head_that_ar_spec_loads(backbones, tmp_path, kind):
    recipe = HeadRecipe(kind=kind, target=backbones["ar"], hidden=32, budget_tokens=500, eval_prompts=1,
                        eval_new_tokens=6, num_draft_tokens=3)
    summary = train_head(recipe, tmp_path, log=lambda _: None)
    assert summary["forward_tokens"] >= 500 and summary["heldout"]["T0"]["new_tokens"] > 0
    target = TransformerLM.from_pretrained(backbones["ar"])
    prompt = torch.tensor([[5, 6, 7]])
    spec = dllm.generate(target, prompt, sampler="ar_spec", max_new_tokens=6, temperature=0.0, drafter="head",
                         draft_head=str(tmp_path / "head"), num_draft_tokens=3)
    plain = dllm.generate(target, prompt, sampler="ar", max_new_tokens=6, temperature=0.0)
    assert torch.equal(spec.sequences, plain.sequences)
    assert load_head(tmp_path / "head").config.kind == kind


def test_distill_drafter_trains_a_drafter_that_ar_spec_loads(backbones, tmp_path):
    """kind="drafter" trains the diffusion drafter's own weights (the folder it came from is untouched) and
    saves a model folder; ar_spec with it is the target's greedy chain, token for token."""
    recipe = HeadRecipe(kind="drafter", objective="tv", target=backbones["ar"], drafter=backbones["diffusion"],
                        budget_tokens=800, starts=2, eval_prompts=1, eval_new_tokens=6, num_draft_tokens=4, lr=1e-2)
    summary = train_head(recipe, tmp_path, log=lambda _: None)
    assert summary["forward_tokens"] >= 800 and summary["heldout"]["T0"]["new_tokens"] > 0
    before = TransformerLM.from_pretrained(backbones["diffusion"])
    after = dllm.load(tmp_path / "drafter")
    assert after.config == before.config and (tmp_path / "drafter" / "tokenizer.json").is_file()
    assert any(not torch.equal(a, b) for a, b in zip(after.parameters(), before.parameters()))
    target = TransformerLM.from_pretrained(backbones["ar"])
    prompt = torch.tensor([[5, 6, 7, 8]])
    spec = dllm.generate(target, prompt, sampler="ar_spec", max_new_tokens=10, temperature=0.0, drafter=after,
                         num_draft_tokens=4)
    plain = dllm.generate(target, prompt, sampler="ar", max_new_tokens=10, temperature=0.0)
    assert torch.equal(spec.sequences, plain.sequences) and spec.stats.drafted > 0


def test_distill_drafter_refuses_a_head_init_and_a_bad_greedy_share(backbones, tmp_path):
    with pytest.raises(ValueError, match="distill-drafter starts from drafter="):
        HeadRecipe(kind="drafter", init=str(tmp_path / "h"))
    with pytest.raises(ValueError, match=r"greedy_share must be in \[0, 1\]"):
        HeadRecipe(kind="drafter", greedy_share=1.5)
    with pytest.raises(ValueError, match="needs a block-causal drafter"):
        _Models(HeadRecipe(kind="drafter", target=backbones["ar"], drafter=backbones["ar"]))
    with pytest.raises(ValueError, match="drafter_layers is distill-drafter's"):
        HeadRecipe(kind="eagle", drafter_layers=(0,))
    with pytest.raises(ValueError, match="drafter_layers must be increasing layer indices"):
        HeadRecipe(kind="drafter", drafter_layers=(1, 0))
    with pytest.raises(ValueError, match=r"layers to keep must be increasing indices in 0\.\.0"):
        _Models(HeadRecipe(kind="drafter", target=backbones["ar"], drafter=backbones["diffusion"], drafter_layers=(1,)))
    kept = _Models(HeadRecipe(kind="drafter", target=backbones["ar"], drafter=backbones["diffusion"],
                              drafter_layers=(0,)))
    assert kept.head is kept.drafter and kept.drafter.config.n_layers == 1


def test_recipes_are_registered_and_refuse_bad_keys(tmp_path, capsys):
    assert RECIPES["eagle-head"].startswith("dllm.training.ar_heads") and "repair-head" in RECIPES
    assert RECIPES["dflash-head"] == "dllm.training.ar_heads:dflash_main"
    assert RECIPES["distill-drafter"] == "dllm.training.ar_heads:drafter_main"
    with pytest.raises(SystemExit):
        main(["--output", str(tmp_path), "--set", "objective='kl'"])
    assert "objective must be one of" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--output", str(tmp_path), "--set", "window=3"])
    assert "unknown keys ['window']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--output", str(tmp_path), "--set", "data='web'"])
    assert "data must be 'rollouts' or 'stream'" in capsys.readouterr().err


@pytest.mark.parametrize("share, greedy_rows", [(0.5, 2), (0.75, 3)])
def test_rollout_data_is_the_targets_own_answers(backbones, share, greedy_rows):
    """data='rollouts': the first ``greedy_share`` of a step's prompts get the target's greedy answer (up to
    its EOS), the rest a T=1 sample; the prompts are kept and the generation's tokens count in the budget."""
    recipe = HeadRecipe(kind="eagle", target=backbones["ar"], hidden=32, eval_new_tokens=12, greedy_share=share)
    models = _Models(recipe)
    tokenizer = load_tokenizer(Path(recipe.target) / "tokenizer.json")
    examples = tokenize_problems(step_problems(0, 0, 4, 0, 1, PRESETS["default"]), tokenizer, "causal", None, 0)
    rolled = _rollout_examples(models, recipe, examples, seed=3)
    assert [e.prompt for e in rolled] == [e.prompt for e in examples]
    eos = models.target.eos_token_id
    for e in rolled[:greedy_rows]:
        greedy = dllm.generate(models.target, torch.tensor([e.prompt]), sampler="ar", max_new_tokens=12,
                               temperature=0.0, eos_token_id=eos).sequences[0, len(e.prompt):].tolist()
        assert list(e.region) == (greedy[: greedy.index(eos) + 1] if eos in greedy else greedy)
        assert e.answer_tokens == len(e.region)
    assert models.tokens == sum(len(e.prompt) + len(e.region) for e in rolled)


def test_init_starts_from_a_saved_head_of_the_same_kind(backbones, tmp_path):
    recipe = HeadRecipe(kind="eagle", target=backbones["ar"], hidden=32)
    first = _Models(recipe)
    save_head(first.head, tmp_path / "h")
    again = _Models(replace(recipe, init=str(tmp_path / "h")))
    for a, b in zip(first.head.parameters(), again.head.parameters()):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="init=.*is a 'eagle' head"):
        _Models(replace(recipe, kind="repair", drafter=backbones["diffusion"], init=str(tmp_path / "h")))


def test_a_dflash_head_warm_starts_from_an_eagle_head(backbones, tmp_path):
    """init= an EAGLE head for the dflash recipe: slot 0 (the context's last pair) then drafts exactly what
    the EAGLE head's first step drafts."""
    from dllm.models.ar_heads import eagle_draft, feature_draft

    recipe = HeadRecipe(kind="eagle", target=backbones["ar"], hidden=32, context=8)
    eagle = _Models(recipe)
    save_head(eagle.head, tmp_path / "e")
    dflash = _Models(replace(recipe, kind="dflash", init=str(tmp_path / "e"))).head.eval()
    assert dflash.config.kind == "dflash"
    target = eagle.target
    ids = torch.randint(4, 60, (2, 9))
    _, features = target(ids[:, :8], return_hidden=True)
    valid = torch.ones((2, 8), dtype=torch.bool)
    with torch.no_grad():
        first = eagle_draft(eagle.head.eval(), target, features, ids[:, 1:], valid, 1, lambda x: x.argmax(-1))[0]
        block = feature_draft(dflash, target, features, ids[:, 1:], valid, 4, lambda x: x.argmax(-1))[0]
    torch.testing.assert_close(block[:, 0], first[:, 0], rtol=1e-4, atol=1e-5)
    save_head(dflash, tmp_path / "d")
    with pytest.raises(ValueError, match="init=.*is a 'dflash' head"):  # no way back to an EAGLE head
        _Models(replace(recipe, init=str(tmp_path / "d")))


@pytest.mark.parametrize("name, kind", [("eagle_head", "eagle"), ("dflash_head", "dflash"),
                                        ("repair_head", "repair"), ("distill_drafter", "drafter")])
def test_shipped_recipe_configs_are_valid_recipes(name, kind):
    import tomllib

    values = tomllib.loads((Path(__file__).resolve().parents[1] / "configs" / f"{name}.toml").read_text())
    recipe = replace(HeadRecipe(), **values, kind=kind)  # unknown keys or bad values raise
    assert recipe.budget_tokens > 0 and recipe.objective in ("ce", "tv", "opd")
