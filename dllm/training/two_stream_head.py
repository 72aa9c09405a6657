"""Recipe ``two-stream-head``: a draft head for fef on a two-stream model, trained on fef's own rounds.

On the two-stream layout (dllm/models/two_stream.py) fef drafts a window from query logits stored by
earlier calls; the first draft's query did not see the correction emitted just before the window, the
next ones not the drafts before them either, so acceptance falls along the window (0.95, 0.93, 0.76,
0.69 at window 4). A ``condition_first`` head (dllm/models/draft_head.py) reads, at slot j, the stored
query's features and logits at s_j and the token before s_j (the pending correction at slot 0, draft
d_{j-1} after), so each draft is conditioned on what its query missed.

The targets are free and exact: the verify call's copy-j query at s_j sees the prefix, the pending token
and d_<j, so its logits are p(x_{s_j} | everything before s_j), the conditional draft j is tested
against. Rolling fef itself with a recording head therefore gives, per round and slot, the head's very
inputs and the verifier's target for them (on-policy: the drafts before slot j are the rolling head's).

    python -m dllm.train --recipe two-stream-head --output runs/two_stream_head
    python -m dllm.training.two_stream_head --prompts 512 --window 6 --steps 1500 --output runs/two_stream_head

Each round's prompts are split evenly over the rollout orders (``--orders``: left to right, the default,
and/or by confidence in the model's blocks) and T=0 / T=1; ``--rounds 3`` rolls again with the head trained so
far and trains on everything rolled (states
closer to the trained head's own). Held out: problems 64-127 of the held-out set (``--heldout``), rolled the same ways
with the stored query logits, per-slot acceptance of head vs those logits (argmax agreement at T=0, sum
min(p, q) at T=1) and the expected accepted drafts per window. The head and ``train.json`` are saved after
every round. ``--init`` continues a saved head (its rounds rolled with it from the first), with ``--seed``
choosing fresh problems.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

import torch

from dllm.models.draft_head import DraftHead, DraftHeadConfig
from dllm.models.loading import SHIPPED
from dllm.training.fef_chain import Windows

ORDERS = ("left_to_right", "confidence")  # the orders rollouts may take (--orders)


@dataclass
class RoundWindows(Windows):
    """Windows of fef rounds on a two-stream model: the head's inputs and the verifier's targets."""

    features: torch.Tensor  # [N, W, D] stored query features at s_j
    base: torch.Tensor  # [N, W, V] stored query logits at s_j
    targets: torch.Tensor  # [N, W, V] copy j's logits at s_j (what draft j was tested against)
    previous: torch.Tensor  # [N, W] the token before s_j: the pending correction at slot 0, then d_{j-1}
    offsets: torch.Tensor  # [N, W] s_j minus that token's column
    count: torch.Tensor  # [N] slots tested

    def inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.features, self.base, self.previous, self.offsets

    def trained(self) -> torch.Tensor:
        """Every tested slot, slot 0 included (its query missed the pending correction) [N, W]."""
        return torch.arange(self.previous.shape[1])[None] < self.count[:, None]

    @staticmethod
    def cat(parts: list[RoundWindows]) -> RoundWindows:
        width = max(p.previous.shape[1] for p in parts)

        def pad(t: torch.Tensor) -> torch.Tensor:  # slots beyond a part's window are never trained
            extra = width - t.shape[1]
            return torch.cat([t, t.new_zeros((t.shape[0], extra, *t.shape[2:]))], dim=1) if extra else t

        fields = ("features", "base", "targets", "previous", "offsets")
        return RoundWindows(*(torch.cat([pad(getattr(p, name)) for p in parts]) for name in fields),
                            torch.cat([p.count for p in parts]))


class _RecordingHead(DraftHead):
    """A DraftHead that keeps the inputs of its latest window (``start``'s and every step's)."""

    last: dict | None = None

    def start(self, features, base_logits, compiled=False):
        steps = super().start(features, base_logits, compiled)
        record = self.last = {"features": features, "base": base_logits, "previous": [], "offsets": []}
        step = steps.next

        def next_step(previous, offset):
            record["previous"].append(previous.clone())
            record["offsets"].append(offset.clone())
            return step(previous, offset)

        steps.next = next_step
        return steps


@torch.no_grad()
def collect(model, prompts: list[list[int]], head: DraftHead, *, window: int, temperature: float,
            generator: torch.Generator, batch_size: int = 16, max_new_tokens: int = 64,
            dtype: torch.dtype = torch.float16, order: str = "left_to_right") -> RoundWindows:
    """Roll fef (``order``, ``window``, ``draft="head"`` with ``head``; confidence in the model's blocks, as
    it decodes by default) over ``prompts`` and record every round's head inputs and verify targets ->
    RoundWindows (features and logits stored as ``dtype``); a ValueError if no round drafted."""
    import dllm
    from dllm.numerics import forbid_token

    recorder = _RecordingHead(head.config)
    recorder.load_state_dict(head.state_dict())
    recorder.eval()
    parts: list[RoundWindows] = []
    mask_id = model.mask_token_id

    def record(event) -> None:
        if event.window is None or event.window.shape[1] == 0 or recorder.last is None:
            return
        last, recorder.last = recorder.last, None
        features, base = last["features"], last["base"]
        previous, offsets = torch.stack(last["previous"], dim=1), torch.stack(last["offsets"], dim=1)
        width = event.window.shape[1]
        if features.shape[1] != width:
            raise RuntimeError("two-stream head recording: the head's window is not the round's")
        parts.append(RoundWindows(features.to(dtype), forbid_token(base, mask_id).to(dtype),
                                  event.target_logits[:, :width].to(dtype), previous, offsets,
                                  event.num_drafts.clone()))

    pad = model.pad_token_id if model.pad_token_id is not None else 0
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        dllm.generate(model, ids, attention_mask=mask, sampler="fef", window=window, draft="head",
                      draft_head=recorder, max_new_tokens=max_new_tokens, order=order,
                      temperature=temperature, generator=generator, callback=record)
    if not parts:
        raise ValueError(f"no fef round drafted over {len(prompts)} prompt(s): every answer ended in its first call")
    return RoundWindows.cat(parts)


def acceptance(head: DraftHead, win: RoundWindows, greedy: bool) -> dict:
    """Per-slot acceptance of ``head`` and of the stored marginals on ``win``: argmax agreement with the
    target at T=0 (``greedy``), sum_v min(p, q) at T=1; and the expected accepted drafts per window."""
    from dllm.training.draft_losses import expected_acceptance

    valid = win.trained()
    out = {}
    with torch.no_grad():
        for name, logits in (("head", head(*win.inputs())), ("marginal", win.base)):
            if greedy:
                acc = (logits.argmax(-1) == win.targets.argmax(-1)).float() * valid
            else:
                acc = expected_acceptance(logits, win.targets) * valid
            out[name] = {"by_slot": [round(float(v), 4) for v in acc.sum(0) / valid.sum(0).clamp(min=1)],
                         "expected_accepted_per_window": round(float(torch.cumprod(acc, 1).sum(1).mean()), 4)}
    return out


def main(argv: list[str] | None = None) -> int:
    from dllm.data.synthetic import heldout_set, training_stream
    from dllm.data.tokenizer import load_tokenizer
    from dllm.models.two_stream import TwoStreamLM
    from dllm.training.batches import derive_seed, format_example
    from dllm.training.fef_chain import train_head

    parser = argparse.ArgumentParser(prog="python -m dllm.training.two_stream_head",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(SHIPPED / "two_stream"), help="a two-stream model folder")
    parser.add_argument("--prompts", type=int, default=512, help="training prompts per rollout round, split "
                        "evenly over the orders and T=0 / T=1 (at least one per share)")
    parser.add_argument("--orders", default="left_to_right", help="comma-separated rollout orders: "
                        "left_to_right (default; the shipped head), confidence, or both")
    parser.add_argument("--window", type=int, default=6, help="fef window of the rollouts (slots trained)")
    parser.add_argument("--rounds", type=int, default=1, help="rollout rounds; later ones roll the trained head")
    parser.add_argument("--objective", choices=("ce", "tv"), default="tv")
    parser.add_argument("--dim", type=int, default=128, help="head width")
    parser.add_argument("--layers", type=int, default=1, help="head layers (causal over the window's steps)")
    parser.add_argument("--init", help="a two-stream head folder to continue (its shape replaces --dim/--layers); "
                        "round 1 then rolls with it, on-policy from the start")
    parser.add_argument("--seed", type=int, default=0, help="training-stream and rollout seed (a continued head "
                        "takes another one, so its rounds see new problems)")
    parser.add_argument("--steps", type=int, default=1500, help="optimizer steps per round")
    parser.add_argument("--batch-size", type=int, default=256, help="windows per optimizer step")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--heldout", type=int, default=64, help="held-out problems (from the 65th) per kind")
    parser.add_argument("--output", required=True)
    args = parser.parse_args(argv)
    orders = tuple(args.orders.split(","))
    if not orders or any(order not in ORDERS for order in orders) or len(set(orders)) != len(orders):
        print(f"two-stream-head: --orders must be a comma-separated subset of {list(ORDERS)}, got {args.orders!r}",
              file=sys.stderr)
        return 2
    for name, low in (("prompts", 2 * len(orders)), ("window", 1), ("rounds", 1), ("steps", 1), ("batch_size", 1),
                      ("dim", 1), ("layers", 1), ("heldout", 1), ("seed", 0)):
        if getattr(args, name) < low:
            print(f"two-stream-head: --{name.replace('_', '-')} must be >= {low}, got {getattr(args, name)}",
                  file=sys.stderr)
            return 2
    if not args.lr > 0:
        print(f"two-stream-head: --lr must be > 0, got {args.lr}", file=sys.stderr)
        return 2
    torch.set_flush_denormal(True)
    model = TwoStreamLM.from_pretrained(args.model).requires_grad_(False)
    tokenizer = load_tokenizer(Path(args.model) / "tokenizer.json")

    def prompts(problems):
        # As bench and eval prompt: the question formatted alone, no special tokens.
        return tokenizer([format_example(p["question"]) for p in problems], add_special_tokens=False)["input_ids"]

    torch.manual_seed(args.seed)
    try:
        if args.init:
            head = DraftHead.from_pretrained(args.init)
            head.check_backbone(model.vocab_size, model.config.dim, name=args.init)
            if not head.config.condition_first:
                raise ValueError(f"{args.init} is a block-diffusion head (condition_first=False); a two-stream "
                                 "model needs condition_first=True")
        else:
            head = DraftHead(DraftHeadConfig(vocab_size=model.vocab_size, backbone_dim=model.config.dim,
                                             dim=args.dim, n_layers=args.layers, mask_token_id=model.mask_token_id,
                                             condition_first=True))
    except ValueError as error:
        print(f"two-stream-head: {'--init' if args.init else '--dim/--layers'}: {error}", file=sys.stderr)
        return 2
    gen, start = torch.Generator().manual_seed(derive_seed(args.seed, "two-stream-head")), time.time()
    untrained = DraftHead(head.config).eval()  # zero correction: the marginals
    kinds = [(order, t) for order in orders for t in (0, 1)]
    held = {(order, t): collect(model, prompts(heldout_set()[64 : 64 + args.heldout]), untrained, window=args.window,
                                temperature=float(t), generator=gen, order=order) for order, t in kinds}
    stream = training_stream(derive_seed(args.seed, "two-stream-head-data"))
    data: list[RoundWindows] = []
    report = {}
    for round_index in range(args.rounds):
        t0 = time.time()
        batch = list(islice(stream, args.prompts))
        roller = head.eval()
        share = len(batch) // len(kinds)  # contiguous shares: the first for kinds[0], ...
        data += [collect(model, prompts(batch[i * share : (i + 1) * share if i + 1 < len(kinds) else None]), roller,
                         window=args.window, temperature=float(t), generator=gen, order=order)
                 for i, (order, t) in enumerate(kinds)]
        windows = RoundWindows.cat(data)
        rolled = time.time() - t0
        head.train()
        t1 = time.time()
        # Seed 0 keeps the shipped head's batches (round r draws with seed r); others derive theirs.
        order_seed = derive_seed(args.seed, "steps", round_index) if args.seed else round_index + 1
        losses = train_head(head, windows, args.objective, args.steps, args.batch_size, args.lr,
                            torch.Generator().manual_seed(order_seed), model.mask_token_id,
                            log=lambda line: print(line, flush=True))
        head.eval()
        acc = {f"{order} T{t}": acceptance(head, held[order, t], greedy=t == 0) for order, t in kinds}
        report[f"round {round_index + 1}"] = {"train_windows": len(windows), "rollout_seconds": round(rolled, 1),
                                              "train_seconds": round(time.time() - t1, 1),
                                              "losses": losses[::10], "heldout": acc}
        print(f"round {round_index + 1}: {len(windows)} windows", json.dumps(acc), flush=True)
        # Saved after every round: an interrupted run keeps the rounds it finished.
        folder = Path(args.output)
        head.save_pretrained(folder)
        (folder / "train.json").write_text(json.dumps({
            "model": args.model, "init": args.init, "seed": args.seed, "objective": args.objective,
            "dim": head.config.dim, "layers": head.config.n_layers,
            "window": args.window, "orders": list(orders), "prompts_per_round": args.prompts,
            "rounds_done": round_index + 1, "rounds": args.rounds, "steps_per_round": args.steps,
            "batch_size": args.batch_size, "lr": args.lr,
            "heldout_problems": f"heldout_set()[64:{64 + args.heldout}], rolled with the stored query logits",
            "wall_seconds": round(time.time() - start, 1), **report}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
