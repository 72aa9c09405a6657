"""Policy-gradient steps on a diffusion LM with exact rollouts: ``python -m dllm.train --recipe grpo``.

Rollouts are drawn by an exact sampler (fef at temperature 1) with their log-probabilities (``generate(...,
logprobs=True)``): each token's probability under the policy that drew it, exactly, so a rollout's probability is
known, where d1 / diffu-GRPO and their successors have to approximate the policy's likelihood (a mean-field or ELBO
surrogate) because their samplers have none. The training forward re-scores the same tokens under the current
weights with the same chain (``dllm.score(..., grad=True)``: one call per block through the exact block cache);
at a step's first update the two are the same numbers, so the importance ratio is 1 up to float rounding
(recorded as ``ratio_error``), and after it the ratio is exact, not estimated.

The objective is GRPO's (Shao et al. 2024): per problem a group of rollouts, the reward 1 for a correct final answer
(``#### N``) and 0 otherwise, advantages normalised within the group, and the clipped surrogate
min(r A, clip(r, 1 - eps, 1 + eps) A) averaged over the answer's tokens (its stop token included), with r the
per-token ratio between the current policy and the rollout's. No KL term: the policy stays close through the
clip and few updates per batch.

Every ``eval_every`` steps the study reads, on held-out problems: the mean reward of one T = 1 sample each and the
greedy accuracy; the policy's entropy (nats per answer token at T = 1, the chain's conditionals along sequential's
samples); fef's acceptance with marginal drafts and with the shipped draft head, each with its acceptance-against-
entropy fit (``dllm.stats.EntropyAcceptance``: Bebop's slope); and the tokens/s of sequential, fef and fef with the
head on the same prompts in one run (their ratios are the speed-ups). docs/studies/rl-rollouts.md has a run.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

import dllm
from dllm.data.calc import final_answer
from dllm.data.synthetic import format_example, heldout_set, training_stream
from dllm.numerics import left_pad
from dllm.stats import EntropyAcceptance


@dataclass(frozen=True)
class GrpoConfig:
    model: str = "diffusion"  # a shipped model's name or a folder (a diffusion model with a tokenizer)
    steps: int = 40
    problems: int = 8  # problems per step
    group: int = 8  # rollouts per problem
    max_new_tokens: int = 48
    lr: float = 3e-5
    clip: float = 0.2  # the surrogate's epsilon
    updates: int = 1  # gradient steps per batch of rollouts (the first at ratio 1; more: the clip acts)
    window: int = 8  # fef's window for the rollouts and the study
    seed: int = 0
    eval_every: int = 10
    eval_problems: int = 64
    head: str | None = "fef_head"  # the draft head the study measures (a shipped name or folder; None: skip)
    output: str = "runs/grpo"


def rewards(tokenizer, answers: torch.Tensor, solutions: list[str]) -> torch.Tensor:
    """1.0 where a completion's final answer (``#### N``) is the solution's, else 0.0 -> [R]."""
    eos = tokenizer.eos_token_id
    out = []
    for ids, solution in zip(answers.tolist(), solutions):
        ids = ids[: ids.index(eos)] if eos in ids else ids
        text = tokenizer.decode(ids, skip_special_tokens=True).strip()
        out.append(float(final_answer(text) is not None and final_answer(text) == final_answer(solution)))
    return torch.tensor(out)


def _prompts(tokenizer, problems: list[dict], repeat: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each problem's prompt ``repeat`` times, left-padded -> (ids [R, P], attention mask [R, P])."""
    ids = tokenizer([format_example(p["question"]) for p in problems], add_special_tokens=False)["input_ids"]
    return left_pad([row for row in ids for _ in range(repeat)], tokenizer.pad_token_id or 0, "cpu")


def group_advantages(reward: torch.Tensor, group: int) -> torch.Tensor:
    """(r - mean of its group) / (std of its group + 1e-4): GRPO's advantages -> [R]; 0 for a group of equals."""
    grouped = reward.view(-1, group)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    return (centred / (grouped.std(dim=1, unbiased=False, keepdim=True) + 1e-4)).view(-1)


def surrogate_loss(logprobs: torch.Tensor, old: torch.Tensor, advantage: torch.Tensor, tokens: torch.Tensor,
                   clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO's clipped surrogate, negated and averaged over the answers' tokens -> (loss, the ratio [R, N]) from the
    current policy's log-probabilities [R, N] (differentiable), the rollout's ``old`` [R, N], advantages [R] and the
    tokens that count [R, N] (0/1)."""
    ratio = torch.exp(logprobs - old)  # 1 where nothing changed (past a stop: 0 - 0)
    clipped = torch.clamp(ratio, 1 - clip, 1 + clip)
    surrogate = torch.minimum(ratio * advantage[:, None], clipped * advantage[:, None])
    return -(surrogate * tokens).sum() / tokens.sum(), ratio


def train_step(model, optimizer, config: GrpoConfig, problems: list[dict], generator: torch.Generator) -> dict:
    """One batch of rollouts and its ``updates`` gradient steps -> the step's record."""
    tokenizer = model.tokenizer
    prompts, mask = _prompts(tokenizer, problems, config.group)
    started = time.perf_counter()
    with torch.no_grad():
        out = dllm.generate(model, prompts, attention_mask=mask, sampler="fef", window=config.window,
                            max_new_tokens=config.max_new_tokens, temperature=1.0, generator=generator,
                            logprobs=True)
    rollout_s = time.perf_counter() - started
    answers, old = out.sequences[:, prompts.shape[1]:], out.logprobs
    reward = rewards(tokenizer, answers, [p["answer"] for p in problems for _ in range(config.group)])
    advantage = group_advantages(reward, config.group)
    lengths = dllm.stops.answer_lengths(answers, dllm.stops.resolve(model, "model"))
    tokens = (torch.arange(answers.shape[1])[None, :] < lengths[:, None]).float()  # the answer, its stop included
    record = {"reward": float(reward.mean()), "rollout_s": rollout_s, "tokens": int(tokens.sum()),
              "nfe": out.stats.nfe, "acceptance": out.stats.acceptance_rate}
    started = time.perf_counter()
    for update in range(config.updates):
        scored = dllm.score(model, prompts, answers, attention_mask=mask, temperature=1.0, grad=True)
        loss, ratio = surrogate_loss(scored.logprobs, old, advantage, tokens, config.clip)
        if update == 0:  # the rollout's own numbers, re-scored under the same weights
            record["ratio_error"] = float(((ratio.detach() - 1).abs() * tokens).max())
            record["rescore_calls"] = scored.stats.nfe
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        record[f"loss_{update}"] = float(loss.detach())
    record["update_s"] = time.perf_counter() - started
    return record


def study(model, config: GrpoConfig, head) -> dict:
    """The held-out measurements of the module docstring, at the policy's current weights."""
    problems = heldout_set()[: config.eval_problems]
    tokenizer = model.tokenizer
    prompts, mask = _prompts(tokenizer, problems, 1)
    solutions = [p["answer"] for p in problems]
    new = config.max_new_tokens
    common = {"attention_mask": mask, "max_new_tokens": new}
    result = {}
    with torch.no_grad():
        greedy = dllm.generate(model, prompts, sampler="sequential", temperature=0.0, **common)
        result["greedy_accuracy"] = float(rewards(tokenizer, greedy.sequences[:, prompts.shape[1]:], solutions).mean())
        runs = {"sequential": {"sampler": "sequential"}, "fef": {"sampler": "fef", "window": config.window}}
        if head is not None:
            runs["fef_head"] = {"sampler": "fef", "window": config.window, "draft": "head", "draft_head": head}
        for name, options in runs.items():
            fit = EntropyAcceptance()
            extra = {} if name == "sequential" else {"callback": fit}
            top = {"top_logprobs": model.vocab_size} if name == "sequential" else {}
            out = dllm.generate(model, prompts, temperature=1.0, generator=torch.Generator().manual_seed(config.seed),
                                logprobs=True, **top, **common, **options, **extra)
            entry = {"tokens_per_s": out.stats.tokens_per_second, "nfe": out.stats.nfe,
                     "reward": float(rewards(tokenizer, out.sequences[:, prompts.shape[1]:], solutions).mean())}
            if name == "sequential":  # the policy's entropy along its own samples, from the full conditionals
                lengths = dllm.stops.answer_lengths(out.sequences[:, prompts.shape[1]:],
                                                    dllm.stops.resolve(model, "model"))
                answer = torch.arange(new)[None, :] < lengths[:, None]
                probs = out.top_logprobs.exp()
                entropy = -(probs * out.top_logprobs.clamp(min=-1e4)).sum(-1)  # [E, N] nats
                entry["entropy"] = float(entropy[answer].mean())
            else:
                entry["acceptance"] = out.stats.acceptance_rate
                entry["mean_acceptance_length"] = out.stats.mean_acceptance_length
                entry["acceptance_vs_entropy"] = {k: v for k, v in fit.fit().items() if k != "bins"}
            result[name] = entry
    base = result["sequential"]["tokens_per_s"]
    for name in runs:
        result[name]["speedup"] = result[name]["tokens_per_s"] / base
    result["reward"] = result["fef"]["reward"]
    result["entropy"] = result["sequential"]["entropy"]
    return result


def run(config: GrpoConfig, log=print) -> dict:
    """Train, measuring before, every ``eval_every`` steps and at the end; writes metrics.jsonl and summary.json to
    ``config.output`` (each line as soon as it is known, so an interrupted run keeps what it measured)."""
    torch.manual_seed(config.seed)
    model = dllm.load(config.model, dtype=torch.float32).eval()  # eval mode: no dropout, rollouts == re-scores
    head = None
    if config.head is not None:
        from dllm.models.draft_head import load_draft_head

        head = load_draft_head(config.head)  # a shipped head by its name, or a folder
    output = Path(config.output)
    output.mkdir(parents=True, exist_ok=True)
    metrics = output / "metrics.jsonl"
    metrics.write_text("")
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=0.0)
    stream = training_stream(config.seed + 1)
    generator = torch.Generator().manual_seed(config.seed)
    history = []

    def keep(entry: dict) -> None:
        history.append(entry)
        with metrics.open("a") as file:
            file.write(json.dumps(entry) + "\n")

    for step in range(config.steps + 1):
        if step % config.eval_every == 0 or step == config.steps:
            measured = {"step": step, "kind": "study", **study(model, config, head)}
            keep(measured)
            log(f"step {step:3d} study: reward {measured['reward']:.3f}, greedy {measured['greedy_accuracy']:.3f}, "
                f"entropy {measured['entropy']:.3f} nats, fef acceptance {measured['fef']['acceptance']:.3f} "
                f"(speed-up {measured['fef']['speedup']:.2f}x)")
        if step == config.steps:
            break
        problems = [next(stream) for _ in range(config.problems)]
        entry = {"step": step, "kind": "train", **train_step(model, optimizer, config, problems, generator)}
        keep(entry)
        log(f"step {step:3d}: reward {entry['reward']:.3f}, ratio error {entry['ratio_error']:.1e}, "
            f"loss {entry['loss_0']:+.4f}, rollout {entry['rollout_s']:.1f}s, update {entry['update_s']:.1f}s")
    summary = {"config": asdict(config), "history": history}
    (output / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    _plot(history, output)
    return summary


def _plot(history: list[dict], output: Path) -> None:
    """rl.png: reward and entropy over steps, and fef's acceptance against the policy's entropy."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        from dllm.extras import missing

        print(f"no rl.png: {missing('matplotlib', 'bench', 'the plot')}")
        return
    studies = [h for h in history if h["kind"] == "study"]
    train = [h for h in history if h["kind"] == "train"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot([h["step"] for h in train], [h["reward"] for h in train], alpha=0.4, label="rollout reward (train)")
    left.plot([h["step"] for h in studies], [h["reward"] for h in studies], marker="o", label="held-out reward, T=1")
    left.plot([h["step"] for h in studies], [h["greedy_accuracy"] for h in studies], marker="s",
              label="held-out greedy accuracy")
    left.set_xlabel("step")
    left.set_ylabel("reward / accuracy")
    left.grid(alpha=0.3)
    left.legend(fontsize=8)
    for name, marker in (("fef", "o"), ("fef_head", "^")):
        points = [(h["entropy"], h[name]["acceptance"]) for h in studies if name in h]
        if points:
            right.plot(*zip(*points), marker=marker, label=f"{name} acceptance")
    right.set_xlabel("policy entropy (nats per answer token, T=1)")
    right.set_ylabel("acceptance rate")
    right.grid(alpha=0.3)
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(output / "rl.png", dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dllm train --recipe grpo", description=__doc__.split("\n\n")[0])
    for name, value in asdict(GrpoConfig()).items():
        kind = type(value) if value is not None else str
        parser.add_argument(f"--{name.replace('_', '-')}", type=kind, default=value, help=f"(default {value})")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    args = vars(parser.parse_args(argv))
    threads = args.pop("threads")
    if threads:
        torch.set_num_threads(threads)
    config = GrpoConfig(**{key: (None if value == "none" else value) for key, value in args.items()})
    for name in ("steps", "problems", "group", "max_new_tokens", "updates", "window", "eval_every", "eval_problems"):
        if getattr(config, name) < 1:
            raise SystemExit(f"dllm train --recipe grpo: --{name.replace('_', '-')} must be >= 1")
    if config.group < 2:
        raise SystemExit("dllm train --recipe grpo: --group must be >= 2 (advantages are relative to the group)")
    if not 0 < config.lr < math.inf or not 0 < config.clip < 1:
        raise SystemExit("dllm train --recipe grpo: --lr must be > 0 and --clip in (0, 1)")
    run(config)
    return 0
