"""Recipe ``fef-head``: train a fef draft head (``dllm.models.draft_head``) on a frozen block-diffusion backbone.

    python -m dllm.train --recipe fef-head --config configs/fef_head.toml --objective ce --output runs/fef_head_ce
    python -m dllm.train --recipe fef-head --config configs/fef_head.toml --objective ce --objective tv \
        --objective opd --output runs/fef_heads   # one head per loss, same states: runs/fef_heads/<loss>

States come from the synthetic training stream: per problem one answer block b (blocks of the backbone's
size, aligned to the answer start) with the rest of block b masked, either a suffix (the states
left-to-right decoding visits; window = the masked positions in order) or a random subset (window = the
masked positions by the backbone's top-1 probability, the confidence order). Later blocks are invisible to
block b under block-causal attention, so each row is cut after block b and right padding is harmless.

The targets are free: copy c of the state reveals drafts d_<c, and the backbone's logits at s_c there are
the conditional the verifier tests draft c against (computed in no_grad, all copies in one batched call).
Objectives (``dllm/training/draft_losses.py``): ``ce`` and ``tv`` are offline, with the drafts d_<c the
training data's own tokens; ``opd`` is on-policy: drafts sampled from the head at T=1, targets on those
drafts, each slot marked accepted by the rejection rule; slots up to the first rejection are trained
(forward KL where accepted, reverse KL at the rejected one), later slots are never verified and are dropped.
Slot 0 is the state's own marginal in every copy, so it is neither trained nor evaluated.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import tomllib
from dataclasses import asdict, dataclass, fields
from itertools import islice
from pathlib import Path

import torch

from dllm.data.synthetic import PRESETS, heldout_set, training_stream
from dllm.data.tokenizer import load_tokenizer
from dllm.models.draft_head import DraftHead, DraftHeadConfig
from dllm.models.transformer import TransformerLM
from dllm.training.batches import derive_seed, tokenize_problems
from dllm.training.draft_losses import OBJECTIVES, draft_loss, expected_acceptance


@dataclass(frozen=True)
class FefHeadConfig:
    """One training run (``configs/fef_head.toml``, table ``[fef_head]``; ``--set key=value`` overrides)."""

    backbone: str = "dllm/weights/diffusion"
    objective: str = "ce"
    steps: int = 120
    batch_size: int = 16  # states per step (each costs one state call and up to block_size - 1 copies)
    lr: float = 2e-3
    weight_decay: float = 0.0
    warmup: int = 20
    dim: int = 128
    n_layers: int = 1
    n_heads: int = 4
    suffix_prob: float = 0.75  # share of left-to-right (masked suffix) states; the rest random masks
    seed: int = 0
    eval_problems: int = 64  # held-out problems for the acceptance table (one state per answer block)

    def __post_init__(self):
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {list(OBJECTIVES)}, got {self.objective!r}")
        for name in ("steps", "batch_size", "dim", "n_layers", "n_heads", "eval_problems"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not 0.0 <= self.suffix_prob <= 1.0:
            raise ValueError(f"suffix_prob must lie in [0, 1], got {self.suffix_prob}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")


@dataclass
class Windows:
    """A batch of states with their windows: everything the head and the losses need."""

    state: torch.Tensor  # [B, L] tokens (block b partly masked, cut after block b)
    offset: torch.Tensor  # [B] answer start (block_offset)
    positions: torch.Tensor  # [B, W] window positions (0 past count)
    count: torch.Tensor  # [B] valid window slots
    data: torch.Tensor  # [B, W] the data's tokens at the window
    base: torch.Tensor  # [B, W, V] the state's marginals at the window
    features: torch.Tensor  # [B, W, D] the state's features there


def make_states(examples, block: int, mask_id: int, suffix_prob: float, gen: torch.Generator):
    """One state per example: a random answer block, masked as a suffix or at random -> tokens, flags."""
    rows, masked, cut, suffix = [], [], [], []
    for ex in examples:
        tokens = list(ex.prompt) + list(ex.region)
        b = int(torch.randint(len(ex.region) // block, (1,), generator=gen))
        start = len(ex.prompt) + b * block
        is_suffix = bool(torch.rand((), generator=gen) < suffix_prob)
        k = int(torch.randint(block, (1,), generator=gen))  # revealed positions: 0..block-1
        if is_suffix:
            k = 0 if torch.rand((), generator=gen) < 0.5 else k  # window starts at a block start half the time
            hide = list(range(start + k, start + block))
        else:
            hide = [start + int(i) for i in torch.randperm(block, generator=gen)[: block - k]]
        rows.append(tokens[: start + block])
        masked.append(hide)
        cut.append(start + block)
        suffix.append(is_suffix)
    length = max(cut)
    state = torch.full((len(rows), length), mask_id, dtype=torch.long)  # right padding: later blocks, unseen
    data = state.clone()
    for r, (tokens, hide) in enumerate(zip(rows, masked)):
        data[r, : len(tokens)] = torch.tensor(tokens)
        state[r, : len(tokens)] = data[r, : len(tokens)]
        state[r, hide] = mask_id
    return state, data, masked, torch.tensor(suffix)


@torch.no_grad()
def build_windows(backbone, examples, block: int, suffix_prob: float, gen: torch.Generator) -> Windows:
    """States, their windows (suffix: in order; random: by the backbone's top-1 probability) and features."""
    mask_id = backbone.mask_token_id
    state, data, masked, suffix = make_states(examples, block, mask_id, suffix_prob, gen)
    offset = torch.tensor([len(ex.prompt) for ex in examples])
    logits, features = backbone(state, block_offset=offset, return_hidden=True)
    width = block
    positions = torch.zeros((len(examples), width), dtype=torch.long)
    count = torch.tensor([len(h) for h in masked])
    for r, hide in enumerate(masked):
        hide = sorted(hide)
        if not suffix[r]:  # confidence order: most confident first, ties leftmost (as samplers/order.py)
            probs = logits[r, hide].clone()
            probs[:, mask_id] = float("-inf")
            top = probs.softmax(-1).max(-1).values
            hide = [hide[i] for i in torch.sort(top, descending=True, stable=True).indices.tolist()]
        positions[r, : len(hide)] = torch.tensor(hide)
    rows = torch.arange(len(examples))[:, None]
    return Windows(state, offset, positions, count, data[rows, positions], logits[rows, positions],
                   features[rows, positions])


@torch.no_grad()
def copy_targets(backbone, win: Windows, drafts: torch.Tensor) -> torch.Tensor:
    """The verifier's targets: copy c (drafts d_<c revealed) at s_c, one batched call -> [B, W, V]."""
    width = win.positions.shape[1]
    c = torch.arange(width)
    wanted = (c[None] >= 1) & (c[None] < win.count[:, None])
    row_of, copy_of = wanted.nonzero(as_tuple=True)
    copies = win.state[row_of].clone()
    reveal = c[None] < copy_of[:, None]
    pos = win.positions[row_of]
    copies.scatter_(1, pos, torch.where(reveal, drafts[row_of], copies.gather(1, pos)))
    targets = win.base.clone()  # slot 0: the state itself
    if row_of.numel():
        out = backbone(copies, block_offset=win.offset[row_of])
        targets[row_of, copy_of] = out[torch.arange(row_of.numel()), pos[torch.arange(row_of.numel()), copy_of]]
    return targets


def previous_of(drafts: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Head inputs: slot j holds d_{j-1} and s_j - s_{j-1} -> ([B, W], [B, W])."""
    previous = torch.cat([drafts[:, :1], drafts[:, :-1]], dim=1)
    offsets = positions - torch.cat([positions[:, :1], positions[:, :-1]], dim=1)
    return previous, offsets


@torch.no_grad()
def head_rollout(head: DraftHead, win: Windows, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Drafts sampled from the head at T=1, slot by slot -> (drafts [B, W], their logits [B, W, V])."""
    drafts = torch.zeros_like(win.positions)
    logits = None
    for j in range(win.positions.shape[1]):
        previous, offsets = previous_of(drafts, win.positions)
        logits = head(win.features[:, : j + 1], win.base[:, : j + 1], previous[:, : j + 1], offsets[:, : j + 1])
        drafts[:, j] = torch.multinomial(logits[:, j].softmax(-1), 1, generator=gen)[:, 0]
    return drafts, logits


def valid_slots(win: Windows) -> torch.Tensor:
    """Slots 1..count-1 (slot 0 is the state's marginal, already exact) -> bool [B, W]."""
    c = torch.arange(win.positions.shape[1])
    return (c[None] >= 1) & (c[None] < win.count[:, None])


def objective_batch(head, backbone, objective: str, win: Windows, gen: torch.Generator, offline=None):
    """Drafts, targets and the loss's masks for one objective -> (drafts, targets, accepted, valid).

    ``offline``: targets on the data's drafts, computed once and shared by the offline objectives."""
    valid = valid_slots(win)
    if objective != "opd":
        return win.data, offline if offline is not None else copy_targets(backbone, win, win.data), None, valid
    drafts, draft_logits = head_rollout(head, win, gen)
    targets = copy_targets(backbone, win, drafts)
    draft_p = draft_logits.softmax(-1).gather(-1, drafts[..., None])[..., 0]
    target_p = targets.softmax(-1).gather(-1, drafts[..., None])[..., 0]
    accepted = torch.rand(draft_p.shape, generator=gen) * draft_p < target_p  # u < target / draft
    rejected = ~accepted & valid
    valid = valid & (torch.cumsum(rejected.long(), dim=1) - rejected.long() == 0)  # up to the first rejection
    return drafts, targets, accepted, valid


def train_step(head, backbone, optimizer, objective: str, win: Windows, gen: torch.Generator, offline=None) -> float:
    """One optimiser step of ``objective`` on a batch of windows -> loss."""
    drafts, targets, accepted, valid = objective_batch(head, backbone, objective, win, gen, offline)
    previous, offsets = previous_of(drafts, win.positions)
    logits = head(win.features, win.base, previous, offsets)
    # The mask token is -inf in both: drop its column, whose 0 * -inf terms give reverse KL a NaN gradient.
    keep = torch.arange(logits.shape[-1]) != backbone.mask_token_id
    loss = draft_loss(objective, logits[..., keep], targets[..., keep], accepted=accepted, valid=valid)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
    optimizer.step()
    return float(loss.detach())


@torch.no_grad()
def heldout_acceptance(head, backbone, examples, block: int) -> dict:
    """Per-slot acceptance at T=1 on held-out left-to-right states with the data as prefix, head vs
    marginals, and the expected tokens per round of a block-start window (prod of the slot chain)."""
    table = {"head": torch.zeros(block), "marginal": torch.zeros(block)}
    chain = {"head": torch.zeros(()), "marginal": torch.zeros(())}
    counts, windows = torch.zeros(block), 0
    for i in range(0, len(examples), 16):
        batch = examples[i : i + 16]
        # k = 0 left-to-right states: every window starts at its block's start.
        win = _block_start(backbone, batch, block)
        targets = copy_targets(backbone, win, win.data)
        previous, offsets = previous_of(win.data, win.positions)
        drafted = {"head": head(win.features, win.base, previous, offsets), "marginal": win.base}
        valid = torch.arange(block)[None] < win.count[:, None]
        counts += valid.sum(0)
        windows += len(valid)
        for name, logits in drafted.items():
            acc = expected_acceptance(logits, targets) * valid
            table[name] += acc.sum(0)
            chain[name] += torch.cumprod(acc, dim=1).sum()
    return {name: {"by_slot": [round(float(v), 4) for v in table[name] / counts.clamp(min=1)],
                   "expected_accepted_per_window": round(float(chain[name]) / windows, 4)} for name in table}


@torch.no_grad()
def _block_start(backbone, examples, block: int) -> Windows:
    """One block-start state per example and answer block (every block of the answer, in order)."""
    expanded = []
    for ex in examples:
        for b in range(len(ex.region) // block - 1):  # the last block is all EOS padding
            expanded.append((ex, b))
    mask_id = backbone.mask_token_id
    cut = [len(ex.prompt) + (b + 1) * block for ex, b in expanded]
    state = torch.full((len(expanded), max(cut)), mask_id, dtype=torch.long)
    data = state.clone()
    positions = torch.zeros((len(expanded), block), dtype=torch.long)
    for r, (ex, _) in enumerate(expanded):
        tokens = torch.tensor((list(ex.prompt) + list(ex.region))[: cut[r]])
        data[r, : cut[r]] = tokens
        state[r, : cut[r] - block] = tokens[:-block]
        positions[r] = torch.arange(cut[r] - block, cut[r])
    offset = torch.tensor([len(ex.prompt) for ex, _ in expanded])
    logits, features = backbone(state, block_offset=offset, return_hidden=True)
    rows = torch.arange(len(expanded))[:, None]
    return Windows(state, offset, positions, torch.full((len(expanded),), block), data[rows, positions],
                   logits[rows, positions], features[rows, positions])


def load_config(path: str | None, overrides: list[str], objective: str | None) -> FefHeadConfig:
    """The TOML table ``[fef_head]`` with ``--set key=value`` and ``--objective`` on top."""
    values = tomllib.loads(Path(path).read_text())["fef_head"] if path else {}
    names = {f.name: f.type for f in fields(FefHeadConfig)}
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or key not in names:
            raise ValueError(f"--set expects KEY=VALUE with KEY one of {sorted(names)}, got {item!r}")
        default = getattr(FefHeadConfig, key)
        values[key] = type(default)(text)
    if objective is not None:
        values["objective"] = objective
    unknown = sorted(set(values) - set(names))
    if unknown:
        raise ValueError(f"unknown [fef_head] keys {unknown}; allowed: {sorted(names)}")
    return FefHeadConfig(**values)


def train(config: FefHeadConfig, output: Path, objectives: tuple[str, ...] | None = None, log=print) -> dict:
    """Train one head per objective on the same states (same compute each; ``ce`` and ``tv`` also share
    their targets); writes each head folder with ``train.json`` (config, losses, held-out acceptance),
    into ``output`` for one objective, ``output/<objective>`` for several."""
    objectives = objectives or (config.objective,)
    torch.manual_seed(config.seed)
    backbone = TransformerLM.from_pretrained(config.backbone).eval().requires_grad_(False)
    tokenizer = load_tokenizer(Path(config.backbone) / "tokenizer.json")
    block = backbone.config.block_size
    if backbone.config.layout != "block_causal" or not block:
        raise ValueError(f"backbone {config.backbone!r} must be block-causal (layout {backbone.config.layout!r})")
    heads, optimizers, schedules = {}, {}, {}
    for objective in objectives:
        torch.manual_seed(config.seed)  # every head starts from the same weights
        heads[objective] = DraftHead(DraftHeadConfig(
            vocab_size=backbone.vocab_size, backbone_dim=backbone.config.dim, dim=config.dim,
            n_layers=config.n_layers, n_heads=config.n_heads, mask_token_id=backbone.mask_token_id))
        optimizers[objective] = torch.optim.AdamW(heads[objective].parameters(), lr=config.lr,
                                                  weight_decay=config.weight_decay)
        schedules[objective] = torch.optim.lr_scheduler.LambdaLR(optimizers[objective], lambda s: min(
            1.0, (s + 1) / config.warmup) * 0.5 * (1 + math.cos(math.pi * min(s, config.steps) / config.steps)))
    gen = torch.Generator().manual_seed(derive_seed(config.seed, "fef-head"))
    losses, start = {o: [] for o in objectives}, time.time()
    for step in range(config.steps):
        problems = list(islice(training_stream(derive_seed(config.seed, "data", step), PRESETS["default"]),
                               config.batch_size))
        examples = tokenize_problems(problems, tokenizer, "block_causal", block, 0)
        win = build_windows(backbone, examples, block, config.suffix_prob, gen)
        offline = copy_targets(backbone, win, win.data) if set(objectives) - {"opd"} else None
        for objective in objectives:
            losses[objective].append(train_step(heads[objective], backbone, optimizers[objective], objective, win,
                                                gen, offline))
            schedules[objective].step()
        if step % 10 == 0 or step == config.steps - 1:
            shown = " ".join(f"{o} {losses[o][-1]:.4f}" for o in objectives)
            log(f"step {step} loss {shown} ({time.time() - start:.0f}s)")
    seconds = time.time() - start
    held = tokenize_problems(heldout_set()[: config.eval_problems], tokenizer, "block_causal", block, 0)
    reports = {}
    for objective, head in heads.items():
        head.eval()
        acceptance = heldout_acceptance(head, backbone, held, block)
        folder = output if len(objectives) == 1 else output / objective
        head.save_pretrained(folder)
        reports[objective] = {"config": {**asdict(config), "objective": objective}, "objectives_trained_together":
                              list(objectives), "train_seconds": round(seconds, 1), "losses": losses[objective],
                              "heldout_acceptance_T1": acceptance}
        (folder / "train.json").write_text(json.dumps(reports[objective], indent=2) + "\n")
        log(f"{objective}: held-out acceptance (T=1, block-start windows): {json.dumps(acceptance)}")
    return reports


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="dllm train --recipe fef-head", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", help="TOML file with a [fef_head] table (configs/fef_head.toml)")
    parser.add_argument("--objective", choices=OBJECTIVES, action="append",
                        help="loss (overrides the config's); repeat to train one head per loss on the same states")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    parser.add_argument("--output", required=True, help="folder for the head (config.json, model.safetensors)")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config, args.set, args.objective[0] if args.objective else None)
    except (ValueError, OSError) as error:
        print(f"dllm train --recipe fef-head: {error}", file=sys.stderr)
        return 2
    objectives = tuple(dict.fromkeys(args.objective)) if args.objective else None
    train(config, Path(args.output), objectives, log=lambda line: print(line, flush=True))
    return 0

