"""Policy-gradient steps with exact rollouts (dllm/training/grpo.py): the rollout's log-probabilities are the
training forward's re-score, the update moves the policy toward rewarded rollouts, and the recipe's study writes
what it measured as it goes."""

import json

import pytest
import torch

import dllm
from dllm.data.synthetic import heldout_set
from dllm.training import grpo


def test_group_advantages_and_rewards():
    advantage = grpo.group_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0]), 3)
    assert advantage[:3].sum().abs() < 1e-6 and advantage[0] > 0 > advantage[1]
    assert torch.all(advantage[3:][1:] < 0) and advantage[3] > 0
    assert torch.equal(grpo.group_advantages(torch.ones(4), 2), torch.zeros(4))  # a group of equals learns nothing
    model = dllm.load("diffusion")
    tokenizer = model.tokenizer
    eos = tokenizer.eos_token_id
    good = tokenizer(" Tom has 3*4=<<3*4=12>>12 apples.\n#### 12")["input_ids"] + [eos]
    bad = tokenizer(" Tom has 7 apples.\n#### 7")["input_ids"] + [eos]
    width = max(len(good), len(bad))
    answers = torch.tensor([ids + [eos] * (width - len(ids)) for ids in (good, bad)])
    assert grpo.rewards(tokenizer, answers, ["3*4=<<3*4=12>>12\n#### 12"] * 2).tolist() == [1.0, 0.0]


def test_a_step_rescores_its_rollouts_exactly_and_moves_toward_the_reward():
    torch.manual_seed(0)
    config = grpo.GrpoConfig(problems=2, group=4, max_new_tokens=16, lr=3e-4, head=None)
    model = dllm.load(config.model, dtype=torch.float32).eval()
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=0.0)
    problems = heldout_set()[:2]
    record = grpo.train_step(model, optimizer, config, problems, torch.Generator().manual_seed(0))
    assert record["ratio_error"] < 1e-4  # rollout logprobs == the training forward's re-score, before the update
    assert record["rescore_calls"] <= 16 // model.block_size + 1  # one call per block (+ the prompt's fill)
    # The surrogate's step moves the policy toward the rollouts with a positive advantage: rewards set by hand
    # (half of each group), so the direction is tested whatever this seed's answers are.
    prompts, mask = grpo._prompts(model.tokenizer, problems, config.group)
    with torch.no_grad():
        out = dllm.generate(model, prompts, attention_mask=mask, max_new_tokens=16, temperature=1.0,
                            generator=torch.Generator().manual_seed(1), logprobs=True, window=config.window)
    answers = out.sequences[:, prompts.shape[1]:]
    advantage = grpo.group_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0] * 2), config.group)
    tokens = torch.ones_like(out.logprobs)
    scored = dllm.score(model, prompts, answers, attention_mask=mask, grad=True)
    loss, ratio = grpo.surrogate_loss(scored.logprobs, out.logprobs, advantage, tokens, config.clip)
    assert float((ratio.detach() - 1).abs().max()) < 1e-4
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    after = dllm.score(model, prompts, answers, attention_mask=mask).total
    gained = after - out.logprobs.double().sum(1)
    assert float(gained[advantage > 0].mean()) > float(gained[advantage < 0].mean())


def test_the_recipe_writes_its_study_as_it_goes(tmp_path):
    config = grpo.GrpoConfig(steps=1, problems=2, group=2, max_new_tokens=16, eval_every=1, eval_problems=4,
                             head="fef_head", output=str(tmp_path / "run"))
    summary = grpo.run(config, log=lambda line: None)
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [line["kind"] for line in lines] == ["study", "train", "study"] == [h["kind"] for h in summary["history"]]
    study = lines[0]
    for name in ("sequential", "fef", "fef_head"):
        assert study[name]["tokens_per_s"] > 0 and study[name]["speedup"] > 0
    assert 0 <= study["fef"]["acceptance"] <= 1 and "slope" in study["fef_head"]["acceptance_vs_entropy"]
    assert study["entropy"] >= 0 and 0 <= study["greedy_accuracy"] <= 1
    assert lines[1]["ratio_error"] < 1e-4
    with pytest.raises(SystemExit, match="--group must be >= 2"):
        grpo.main(["--group", "1", "--output", str(tmp_path / "x")])
