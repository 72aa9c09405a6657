"""Recipes ``eagle-head``, ``dflash-head``, ``repair-head``, ``distill-drafter``: train an ar_spec drafter
(a draft head, or a diffusion drafter's own weights) against the frozen AR target.

    python -m dllm.train --recipe eagle-head --config configs/eagle_head.toml --output runs/eagle-ce
    python -m dllm.train --recipe dflash-head --config configs/dflash_head.toml --output runs/dflash
    python -m dllm.train --recipe repair-head --config configs/repair_head.toml --set objective=tv
    python -m dllm.train --recipe distill-drafter --config configs/distill_drafter.toml --output runs/distill

The targets are free: the AR target's next-token distributions (no_grad) on the synthetic training stream
(``dllm.data.synthetic``, the data the target was trained on). Objectives (``draft_losses.py``):

- ``ce`` / ``tv`` (offline): teacher forcing on the sequences. The EAGLE head drafts ``unroll`` steps
  from every answer position at once (``eagle_train_logits``: EAGLE-3's training-time test, each step
  fed the sequence's token and the head's own previous output in place of the target's feature, so
  training sees the drift it meets when drafting); a DFlash head drafts the same ``unroll`` depths from
  every position in one pass (``dflash_train_logits``: depth t is slot t of the block whose context ends
  t positions earlier); the repair head rewrites a block of
  ``num_draft_tokens`` drafts from the diffusion drafter's features at ``starts`` random answer positions;
  ``distill-drafter`` (kind ``drafter``) trains the diffusion drafter itself on the same canvases (the ones
  ar_spec gives it: the sequence before the start, masks to the end of the last draft's block), its
  marginals at the k draft positions against the target's next-token laws there. Its rounds cost what
  the shipped drafter's cost (one call, no head steps).
  With ``data = "rollouts"`` (the default) the answers are the target's own continuations of each
  step's prompts (half greedy, half sampled at T=1; their forward tokens count in the budget): the
  sequences ar_spec meets, where at T=0 the accepted drafts ARE the target's greedy chain. ``data =
  "stream"`` trains on the data's answers.
- ``opd`` (on-policy, Draft-OPD): the head drafts ``num_draft_tokens`` tokens (sampled, T=1) from random
  answer positions, the target verifies them (one call), forward KL where accepted and reverse KL where
  rejected (positions after the first rejection are off-policy and dropped), then one replay rollout from
  the first rejected position (prefix + accepted drafts + the target's correction).

Compute is budgeted in target-model forward tokens (``budget_tokens``, the dominant cost): every
objective stops when its target and drafter calls have fed that many tokens, so objectives compare at
the same compute. Held-out acceptance: ar_spec (k = ``num_draft_tokens``) tokens per target call on the
first ``eval_prompts`` held-out problems, T=0 and T=1.
"""

from __future__ import annotations

import argparse
import json
import math
import time
import tomllib
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import torch

from dllm.data.synthetic import PRESETS, format_example, heldout_set
from dllm.data.tokenizer import load_tokenizer
from dllm.models.ar_heads import (
    FEATURE_KINDS,
    KINDS,
    HeadConfig,
    check_head,
    dflash_from_eagle,
    feature_draft,
    feature_train_logits,
    load_head,
    new_head,
    repair_unroll,
    save_head,
)
from dllm.models.transformer import TransformerLM
from dllm.numerics import forbid_token, left_pad
from dllm.training.batches import IGNORE, Example, build_batch, derive_seed, step_problems, tokenize_problems
from dllm.training.draft_losses import OBJECTIVES, draft_loss

WEIGHTS = Path(__file__).resolve().parent.parent / "weights"
RECIPE_KINDS = (*KINDS, "drafter")  # "drafter": the diffusion drafter's own weights, no head


@dataclass(frozen=True)
class HeadRecipe:
    """One head-training run (a TOML file's top-level keys)."""

    kind: str = "eagle"  # eagle | dflash | repair | drafter (the diffusion drafter's own weights)
    objective: str = "ce"  # OBJECTIVES
    target: str = str(WEIGHTS / "ar")
    drafter: str = str(WEIGHTS / "diffusion")  # the repair head's diffusion drafter
    hidden: int = 512
    batch_size: int = 32
    lr: float = 2e-3
    weight_decay: float = 0.0
    budget_tokens: int = 2_000_000  # target + drafter forward tokens
    unroll: int = 4  # EAGLE teacher-forced steps
    starts: int = 4  # random answer positions per problem (repair, opd)
    num_draft_tokens: int = 8
    seed: int = 0
    eval_prompts: int = 16
    eval_new_tokens: int = 64
    init: str = ""  # a head folder to start from (Draft-OPD starts from an offline-trained head); dflash: or eagle
    data: str = "rollouts"  # offline sequences: "rollouts" (the target's own answers) or "stream" (the data's)
    context: int = 64  # EAGLE: target features the head attends to before its drafts
    n_heads: int = 4  # EAGLE, DFlash: attention heads
    layers: int = 1  # DFlash: transformer layers
    greedy_share: float = 0.5  # data="rollouts": the share of each step's answers decoded greedily (the rest T=1)
    drafter_layers: tuple[int, ...] = ()  # distill-drafter: keep only these of the drafter's layers (a cheaper one)

    def __post_init__(self) -> None:
        if self.kind not in RECIPE_KINDS:
            raise ValueError(f"kind must be one of {RECIPE_KINDS}, got {self.kind!r}")
        if self.kind == "drafter" and self.init:
            raise ValueError(f"init names a head to start from; distill-drafter starts from drafter= "
                             f"({self.drafter!r}), got init={self.init!r}")
        if self.drafter_layers and self.kind != "drafter":
            raise ValueError(f"drafter_layers is distill-drafter's (kind='drafter'), got kind={self.kind!r}")
        layers = list(self.drafter_layers)
        if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in layers) or layers != sorted(set(layers)):
            raise ValueError(f"drafter_layers must be increasing layer indices >= 0, got {self.drafter_layers!r}")
        if not 0 <= self.greedy_share <= 1:
            raise ValueError(f"greedy_share must be in [0, 1] (the share of rollouts decoded greedily), "
                             f"got {self.greedy_share!r}")
        if self.kind != "dflash" and self.layers != 1:
            raise ValueError(f"layers must be 1 for a {self.kind} head (layers is a dflash head's), got {self.layers}")
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, got {self.objective!r}")
        if self.data not in ("rollouts", "stream"):
            raise ValueError(f"data must be 'rollouts' or 'stream', got {self.data!r}")
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "int" and (not isinstance(value, int) or value < (0 if f.name == "seed" else 1)):
                raise ValueError(f"{f.name} must be a positive int, got {value!r}")
            if f.type == "float" and (not isinstance(value, int | float) or value < 0):
                raise ValueError(f"{f.name} must be a non-negative number, got {value!r}")


class _Models:
    """The frozen target (and drafter), the head, and the forward-token count of their calls."""

    def __init__(self, recipe: HeadRecipe):
        self.target = TransformerLM.from_pretrained(recipe.target, dtype=torch.float32).requires_grad_(False)
        self.drafter = None
        backbone = self.target
        if recipe.kind in ("repair", "drafter"):
            self.drafter = TransformerLM.from_pretrained(recipe.drafter, dtype=torch.float32).requires_grad_(False)
            if self.drafter.config.layout != "block_causal":
                raise ValueError(f"{recipe.kind} training needs a block-causal drafter; {recipe.drafter} is "
                                 f"{self.drafter.config.layout}")
            backbone = self.drafter
        self.backbone = backbone
        self.tokens = 0
        if recipe.kind == "drafter":  # the drafter's own weights are what trains
            if recipe.drafter_layers:
                self.drafter.keep_layers(recipe.drafter_layers)
            self.head = self.drafter.requires_grad_(True).train()
            return
        self.head = new_head(HeadConfig(recipe.kind, backbone.config.dim, backbone.vocab_size, recipe.hidden,
                                        n_heads=recipe.n_heads, context=recipe.context, layers=recipe.layers))
        if recipe.init:
            # A DFlash head may start from an EAGLE head (its layer becomes the first: dflash_from_eagle).
            kinds = ("dflash", "eagle") if recipe.kind == "dflash" else recipe.kind
            try:
                config = check_head(recipe.init, kinds, backbone)
            except ValueError as error:
                raise ValueError(f"init={recipe.init!r}: {error}") from None
            self.head = load_head(recipe.init)
            if config.kind != recipe.kind:
                self.head = dflash_from_eagle(self.head, recipe.layers)
            self.head.train()

    def call(self, model, input_ids, grad: bool = False, **kwargs):
        """(logits, features) of ``model``, its fed tokens counted in the budget; ``grad``: with gradient."""
        self.tokens += int(kwargs["attention_mask"].sum()) if "attention_mask" in kwargs else input_ids.numel()
        with torch.set_grad_enabled(grad):
            return model(input_ids, return_hidden=True, **kwargs)


def _answer_starts(targets: torch.Tensor, count: int, width: int, generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` random positions p per row [B] with targets at p - 1 .. p + width - 2 inside the answer
    (the first draft position p) -> (row index [R], p [R])."""
    rows, starts = [], []
    for b in range(targets.shape[0]):
        answer = (targets[b] != IGNORE).nonzero().squeeze(-1)  # positions whose next token is scored
        first, last = int(answer[0]) + 1, int(answer[-1]) + 1 - width + 1
        last = max(first, last)
        picks = torch.randint(first, last + 1, (count,), generator=generator)
        rows += [b] * count
        starts += picks.tolist()
    return torch.tensor(rows), torch.tensor(starts)


def _window(t: torch.Tensor, rows, starts, width: int) -> torch.Tensor:
    """t[rows, starts + j] for j < width (clamped to t's length) -> [R, width, ...]."""
    at = (starts[:, None] + torch.arange(width)).clamp(max=t.shape[1] - 1)
    return t[rows[:, None], at]


def _drafter_outputs(models: _Models, input_ids, prompt_lens, rows, starts, width: int, grad: bool = False):
    """The diffusion drafter's (logits, features) at draft positions starts..starts+width-1 -> [R, width, V],
    [R, width, D], on the canvases ar_spec gives it: the data before ``starts``, masks up to the end of the
    last draft's block, blocks anchored at the answer start. ``grad``: with gradient (the drafter trains)."""
    block = models.drafter.config.block_size
    offset = prompt_lens[rows]
    ends = offset + torch.div(starts + width - 1 - offset, block, rounding_mode="floor").add(1).mul(block)
    size = int(ends.max())
    data = torch.nn.functional.pad(input_ids[rows], (0, max(0, size - input_ids.shape[1])))[:, :size]
    known = torch.arange(size)[None, :] < starts[:, None]
    canvas = torch.where(known, data, models.drafter.mask_token_id)
    mask = (torch.arange(size)[None, :] < ends[:, None]).long()
    logits, features = models.call(models.drafter, canvas, grad, attention_mask=mask, block_offset=offset)
    at = torch.arange(len(rows))
    logits = forbid_token(_window(logits, at, starts, width), models.drafter.mask_token_id)  # as ar_spec drafts
    return logits[..., : models.target.vocab_size], _window(features, at, starts, width)


def offline_loss(models: _Models, recipe: HeadRecipe, batch, prompt_lens, generator) -> torch.Tensor:
    """``ce`` / ``tv``: teacher-forced loss on the data (module docstring)."""
    logits, features = models.call(models.target, batch.input_ids, attention_mask=batch.attention_mask)
    ids, scored = batch.input_ids, batch.targets != IGNORE
    if recipe.kind in FEATURE_KINDS:
        depth, length = recipe.unroll, ids.shape[1]
        tokens = torch.cat([ids[:, 1:], ids[:, -1:]], dim=1)  # token i + 1 at position i
        real = batch.attention_mask.bool()
        head_logits = feature_train_logits(models.head, models.target, features, tokens, real, depth)
        # [t, b, i] drafts token i + 2 (the target's logits at i + 1) from a context ending at c = i - t;
        # ar_spec's contexts end at length - 2 >= prompt - 1, the first answer-scoring position.
        i = torch.arange(length)
        later = torch.cat([scored[:, 1:], scored[:, :1] & False], dim=1)  # token i + 2 is an answer token
        first = prompt_lens - 1
        valid = torch.stack([later & ((i - t)[None, :] >= first[:, None]) for t in range(depth)])
        target = torch.cat([logits[:, 1:], logits[:, -1:]], dim=1).expand(depth, *logits.shape)
        return draft_loss(recipe.objective, head_logits, target, valid=valid)
    k = recipe.num_draft_tokens
    rows, starts = _answer_starts(batch.targets, recipe.starts, k, generator)
    if recipe.kind == "drafter":
        head_logits = _drafter_outputs(models, ids, prompt_lens, rows, starts, k, grad=True)[0]
    else:
        feats = _drafter_outputs(models, ids, prompt_lens, rows, starts, k)[1]
        previous = _window(ids, rows, starts - 1, k)  # the confirmed token, then the data's drafts
        head_logits = repair_unroll(models.head, models.drafter, feats, previous)[..., : models.target.vocab_size]
    target = _reachable(models, _window(logits, rows, starts - 1, k))
    return draft_loss(recipe.objective, _reachable(models, head_logits), target,
                      valid=_window(scored, rows, starts - 1, k))


def _reachable(models: _Models, logits: torch.Tensor) -> torch.Tensor:
    """Logits [..., V] without a diffusion drafter's mask column: the drafter never drafts it, so the
    target's (tiny) mass there would make forward KL infinite, and -inf in both laws makes the reverse KL's
    gradient NaN; dropping the column renormalises both over the tokens a draft can be."""
    if models.drafter is None or models.drafter.mask_token_id >= logits.shape[-1]:
        return logits
    mask_id = models.drafter.mask_token_id
    return torch.cat([logits[..., :mask_id], logits[..., mask_id + 1 :]], dim=-1)


def _rollout(models: _Models, recipe: HeadRecipe, prefixes: list[list[int]], prompt_lens, generator):
    """Draft ``num_draft_tokens`` tokens (T=1) after each prefix and verify them with the target ->
    (head logits [R, k, V] with gradient, drafts [R, k], target logits [R, k, V])."""
    k, vocab = recipe.num_draft_tokens, models.target.vocab_size
    lengths = torch.tensor([len(p) for p in prefixes])
    width = int(lengths.max()) + k
    seq = torch.zeros((len(prefixes), width), dtype=torch.long)
    for r, p in enumerate(prefixes):
        seq[r, : len(p)] = torch.tensor(p)
    rows = torch.arange(len(prefixes))
    last = seq[rows, lengths - 1]
    drafts, steps = torch.zeros((len(rows), k), dtype=torch.long), []
    if recipe.kind in FEATURE_KINDS:
        upto = width - k - 1  # inputs up to the longest prefix's position length - 2
        valid = (torch.arange(upto)[None, :] < lengths[:, None] - 1).long()
        _, features = models.call(models.target, seq[:, :upto], attention_mask=valid)
        c = models.head.config.context
        at = lengths[:, None] - 1 - c + torch.arange(c)  # the context: positions length - 1 - c .. length - 2
        real = at >= 0
        step_logits, drafts = feature_draft(models.head, models.target, features[rows[:, None], at.clamp(min=0)],
                                          seq[rows[:, None], (at + 1).clamp(min=0)], real, k,
                                          lambda step: _draw(step.detach(), generator))
        steps = list(step_logits.unbind(1))
    elif recipe.kind == "drafter":  # independent drafts from the marginals, as DiffusionDrafter samples them
        logits = _drafter_outputs(models, seq, prompt_lens, rows, lengths, k, grad=True)[0]
        drafts = _draw(logits.detach().reshape(-1, vocab), generator).reshape(len(rows), k)
        steps = list(logits.unbind(1))
    else:
        feats = _drafter_outputs(models, seq, prompt_lens, rows, lengths, k)[1]
        embed = models.drafter.tok_embeddings
        state, token = torch.zeros_like(feats[:, 0]), last
        for j in range(k):
            repaired, state = models.head(feats[:, j], embed(token), state)
            step_logits = models.drafter._project(repaired)[:, :vocab]
            token = drafts[:, j] = _draw(step_logits.detach(), generator)
            steps.append(step_logits)
    at = lengths[:, None] + torch.arange(k)
    seq[rows[:, None], at] = drafts
    mask = (torch.arange(width)[None, :] < (lengths + k)[:, None]).long()
    target_logits, _ = models.call(models.target, seq, attention_mask=mask)
    return torch.stack(steps, dim=1), drafts, target_logits[rows[:, None], at - 1]


def _draw(logits: torch.Tensor, generator) -> torch.Tensor:
    return torch.multinomial(torch.softmax(logits.float(), dim=-1), 1, generator=generator).squeeze(-1)


def _verify(head_logits, drafts, target_logits, generator):
    """Target acceptance of each draft at T=1 -> (accepted-by-then [R, k] bool, first rejection [R],
    the correction at it [R] (a residual draw; a target draw after k acceptances))."""
    p = torch.softmax(head_logits.detach().float(), -1)
    q = torch.softmax(target_logits.float(), -1)
    pick = lambda t: t.gather(-1, drafts[..., None]).squeeze(-1)  # noqa: E731
    ok = torch.rand(drafts.shape, generator=generator) * pick(p) < pick(q)
    run = ok.long().cumprod(dim=1).bool()
    first = run.sum(dim=1)  # k when all accepted
    rows = torch.arange(len(drafts))
    at = first.clamp(max=drafts.shape[1] - 1)
    residual = (q[rows, at] - p[rows, at]).clamp(min=0)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, q[rows, at])
    correction = torch.multinomial(residual, 1, generator=generator).squeeze(-1)
    return run, first, correction


def on_policy_loss(models: _Models, recipe: HeadRecipe, batch, prompt_lens, generator) -> torch.Tensor:
    """``opd``: a rollout from random answer positions, then one replay from each first rejection."""
    k = recipe.num_draft_tokens
    rows, starts = _answer_starts(batch.targets, recipe.starts, k, generator)
    prefixes = [batch.input_ids[r, :s].tolist() for r, s in zip(rows.tolist(), starts.tolist())]
    plens = prompt_lens[rows]
    losses = []
    for _ in range(2):  # the rollout, then the replay
        head_logits, drafts, target_logits = _rollout(models, recipe, prefixes, plens, generator)
        run, first, correction = _verify(head_logits, drafts, target_logits, generator)
        upto = torch.arange(k)[None, :] <= first[:, None]  # accepted ones and the first rejected one
        losses.append(draft_loss("opd", _reachable(models, head_logits), _reachable(models, target_logits),
                                 accepted=run, valid=upto))
        prefixes = [p + drafts[r, : int(first[r])].tolist() + [int(correction[r])]
                    for r, p in enumerate(prefixes)]
    return sum(losses) / len(losses)


def _rollout_examples(models: _Models, recipe: HeadRecipe, examples: list[Example], seed: int) -> list[Example]:
    """The examples with the target's own answers to their prompts (``eval_new_tokens`` at most, up to and
    including its EOS): the first ``greedy_share`` of the rows greedy, the rest sampled at T=1. Batched ``ar`` with the
    KV cache (``dllm.generate``); its forward tokens (prompt + answer per row) count in the budget."""
    import dllm  # the front door, imported here so the training modules stay on the ground floor

    eos = models.target.eos_token_id
    out = []
    half = math.ceil(len(examples) * recipe.greedy_share)
    for part, temperature in ((examples[:half], 0.0), (examples[half:], 1.0)):
        if not part:
            continue
        ids, mask = left_pad([e.prompt for e in part], 0, None)
        width = ids.shape[1]
        result = dllm.generate(models.target, ids, sampler="ar", max_new_tokens=recipe.eval_new_tokens,
                               temperature=temperature, attention_mask=mask, eos_token_id=eos,
                               generator=torch.Generator().manual_seed(seed + int(temperature)))
        for e, row in zip(part, result.sequences[:, width:].tolist()):
            answer = row[: row.index(eos) + 1] if eos in row else row
            models.tokens += len(e.prompt) + len(answer)
            out.append(Example(e.prompt, tuple(answer), len(answer)))
    return out


def heldout_acceptance(models: _Models, recipe: HeadRecipe, temperature: float) -> dict[str, float]:
    """ar_spec with the head on the first ``eval_prompts`` held-out problems, batch 1 -> tokens per target call."""
    import dllm  # the front door, imported here so the training modules stay on the ground floor

    tokenizer = load_tokenizer(Path(recipe.target) / "tokenizer.json")
    if recipe.kind == "drafter":  # the drafter under training drafts alone
        options = {"drafter": models.drafter.eval()}
    else:
        options = {"drafter": "head" if recipe.kind in FEATURE_KINDS else models.drafter,
                   "draft_head": models.head.eval()}
    totals = {"new_tokens": 0, "nfe": 0, "rounds": 0}
    for i, problem in enumerate(heldout_set()[: recipe.eval_prompts]):
        prompt = torch.tensor([tokenizer(format_example(problem["question"]), add_special_tokens=False)["input_ids"]])
        out = dllm.generate(models.target, prompt, sampler="ar_spec", max_new_tokens=recipe.eval_new_tokens,
                            temperature=temperature, generator=torch.Generator().manual_seed(i),
                            num_draft_tokens=recipe.num_draft_tokens,
                            eos_token_id=models.target.eos_token_id, **options)
        for key in totals:
            totals[key] += getattr(out.stats, key)
    models.head.train()
    return {"tokens_per_target_call": totals["new_tokens"] / max(1, totals["nfe"]), **totals}


def train_head(recipe: HeadRecipe, output: Path, log=print) -> dict:
    """Train until ``budget_tokens`` target/drafter forward tokens are spent; save the head (``head/``; a
    distilled drafter: ``drafter/``, a model folder) and the metrics."""
    torch.manual_seed(recipe.seed)
    torch.set_flush_denormal(True)  # denormals in CPU kernels are several times slower
    models = _Models(recipe)
    tokenizer = load_tokenizer(Path(recipe.target) / "tokenizer.json")
    optimizer = torch.optim.AdamW(models.head.parameters(), lr=recipe.lr, weight_decay=recipe.weight_decay)
    loss_fn = on_policy_loss if recipe.objective == "opd" else offline_loss
    history, step, tick = [], 0, time.perf_counter()
    models.head.train()
    while models.tokens < recipe.budget_tokens:
        problems = step_problems(recipe.seed, step, recipe.batch_size, 0, 1, PRESETS["default"])
        examples = tokenize_problems(problems, tokenizer, "causal", None, 0)
        if recipe.data == "rollouts" and recipe.objective != "opd":
            examples = _rollout_examples(models, recipe, examples, derive_seed(recipe.seed, "rollouts", step))
        batch = build_batch("causal", examples, pad_id=tokenizer.pad_token_id, mask_id=None, block_size=None,
                            generator=torch.Generator())
        prompt_lens = torch.tensor([len(e.prompt) for e in examples])
        generator = torch.Generator().manual_seed(derive_seed(recipe.seed, "head", step))
        # Cosine decay over the budget (by tokens spent, so every objective sees the same schedule).
        for group in optimizer.param_groups:
            group["lr"] = recipe.lr * 0.5 * (1 + math.cos(math.pi * models.tokens / recipe.budget_tokens))
        loss = loss_fn(models, recipe, batch, prompt_lens, generator)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(models.head.parameters(), 1.0)
        optimizer.step()
        step += 1
        if step % 20 == 0:
            history.append({"step": step, "loss": float(loss.detach()), "tokens": models.tokens,
                            "wall_s": round(time.perf_counter() - tick, 1)})
            log(json.dumps(history[-1]))
    wall = time.perf_counter() - tick
    models.head.eval()
    evals = {f"T{t:g}": heldout_acceptance(models, recipe, t) for t in (0.0, 1.0)}
    summary = {"recipe": asdict(recipe), "steps": step, "forward_tokens": models.tokens, "train_wall_s": wall,
               "heldout": evals, "history": history}
    log(json.dumps({"steps": step, "train_wall_s": round(wall, 1), "heldout": evals}))
    if recipe.kind == "drafter":  # a model folder ar_spec (drafter=) and dllm.load take as it is
        models.drafter.save_pretrained(output / "drafter")
        from dllm.data.tokenizer import export_tokenizer

        export_tokenizer(Path(recipe.drafter), output / "drafter")
    else:
        save_head(models.head, output / "head")
    (output / "metrics.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="dllm train --recipe eagle-head|dflash-head|repair-head|distill-drafter",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", help="TOML file of HeadRecipe keys")
    parser.add_argument("--output", required=True, help="run folder: head/ (distill-drafter: drafter/), metrics.json")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a key (TOML syntax), e.g. --set objective='tv'")
    parser.add_argument("--kind", choices=RECIPE_KINDS, help="set by the recipe name")
    parser.add_argument("--eval-untrained", action="store_true",
                        help="only measure a fresh head's held-out acceptance (a repair head: the plain marginals)")
    args = parser.parse_args(argv)
    values = tomllib.loads(Path(args.config).read_text()) if args.config else {}
    for item in args.set:
        key, sep, text = item.partition("=")
        if not sep:
            parser.error(f"--set expects KEY=VALUE, got {item!r}")
        try:
            values[key.strip()] = tomllib.loads(f"v = {text}")["v"]
        except tomllib.TOMLDecodeError:
            values[key.strip()] = text  # a bare word: a string
    if args.kind:
        values["kind"] = args.kind
    known = {f.name for f in fields(HeadRecipe)}
    unknown = sorted(set(values) - known)
    if unknown:
        parser.error(f"unknown keys {unknown}; known: {sorted(known)}")
    try:
        recipe = replace(HeadRecipe(), **values)
    except ValueError as error:
        parser.error(str(error))
    if args.eval_untrained:
        models = _Models(recipe)
        models.head.eval()
        print(json.dumps({f"T{t:g}": heldout_acceptance(models, recipe, t) for t in (0.0, 1.0)}))
        return 0
    train_head(recipe, Path(args.output))
    return 0


def eagle_main(argv: list[str]) -> int:
    """``--recipe eagle-head``."""
    return main([*argv, "--kind", "eagle"])


def dflash_main(argv: list[str]) -> int:
    """``--recipe dflash-head``."""
    return main([*argv, "--kind", "dflash"])


def repair_main(argv: list[str]) -> int:
    """``--recipe repair-head``."""
    return main([*argv, "--kind", "repair"])


def drafter_main(argv: list[str]) -> int:
    """``--recipe distill-drafter``."""
    return main([*argv, "--kind", "drafter"])
