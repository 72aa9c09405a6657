"""Windows along the backbone's own decoding chain, the states fef visits, for training a fef draft head.

fef (left-to-right, block cache) visits the states of the backbone's own chain: block b with its first k
positions decoded, the window the rest of the block. At T=0 the verifier accepts draft j iff it is the
backbone's argmax at s_j given the chain before it, so the accepted prefix IS the greedy chain; at T=1
accepted drafts follow the target's law, so a sampled chain stands in for the prefixes the verifier sees.
One left-to-right rollout therefore gives every window's inputs and targets at once: the state after k
steps has the features and marginals at s_k..s_7, and its marginal at s_k is the verifier's target for
every window that reaches s_k with the chain before it (copy c of a window is a later state of the chain).

Rows are right padded with the mask token: positions after a row's current block are invisible to it
under block-causal attention, so one canvas serves prompts of different lengths.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from dllm.numerics import forbid_token, sample_from_logits


class Windows:
    """A draft head's training windows (``features``, ``base``, ``targets`` and ``count`` per window, plus what
    each layout adds); ``inputs`` and ``trained`` say how the head reads them and which slots it learns."""

    count: torch.Tensor  # [N] valid slots

    def __len__(self) -> int:
        return self.count.shape[0]

    def take(self, index: torch.Tensor):
        """The windows at ``index`` [n], features and logits as float32."""
        values = {f.name: getattr(self, f.name)[index] for f in fields(self)}
        return type(self)(**{name: v.float() if v.is_floating_point() else v for name, v in values.items()})


@dataclass
class ChainWindows(Windows):
    """Windows s_k..s_{B-1} of every state of a chain, padded to the block (``count`` valid slots)."""

    features: torch.Tensor  # [N, W, D] the state's features at the window
    base: torch.Tensor  # [N, W, V] the state's marginals there
    targets: torch.Tensor  # [N, W, V] the verifier's target at slot j: the chain's state at s_j, its marginal
    chain: torch.Tensor  # [N, W] the chain's tokens at the window (the accepted drafts)
    count: torch.Tensor  # [N] valid slots (B - k)

    def inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The head's arguments: (features, base, previous, offsets), the chain's tokens as the drafts."""
        from dllm.training.fef_head import previous_of

        previous, offsets = previous_of(self.chain, self._slots())
        return self.features, self.base, previous, offsets

    def trained(self) -> torch.Tensor:
        """Slots trained [N, W]: 1..count-1 (slot 0 is the state's own marginal: exact already)."""
        slots = self._slots()
        return (slots >= 1) & (slots < self.count[:, None])

    def _slots(self) -> torch.Tensor:
        return torch.arange(self.chain.shape[1])[None].expand_as(self.chain)

    @staticmethod
    def cat(parts: list[ChainWindows]) -> ChainWindows:
        """Concatenate along the window axis."""
        return ChainWindows(*(torch.cat([getattr(p, name) for p in parts]) for name in
                              ("features", "base", "targets", "chain", "count")))


@torch.no_grad()
def rollout_windows(backbone, prompts: list[list[int]], blocks: int, temperature: float,
                    generator: torch.Generator, dtype: torch.dtype = torch.float16) -> ChainWindows:
    """Decode ``blocks`` blocks after each prompt left to right (greedy at T=0, else sampled at
    ``temperature``), recording every state's window -> ChainWindows of len(prompts) * blocks * B rows.

    ``dtype`` stores features and logits compactly (a cache of thousands of windows); training reads float32."""
    block, mask_id = backbone.config.block_size, backbone.mask_token_id
    lengths = torch.tensor([len(p) for p in prompts])
    rows = torch.arange(len(prompts))
    canvas = torch.full((len(prompts), int(lengths.max()) + blocks * block), mask_id, dtype=torch.long)
    for r, prompt in enumerate(prompts):
        canvas[r, : len(prompt)] = torch.tensor(prompt)
    parts = []
    for b in range(blocks):
        starts = lengths + b * block
        span = starts[:, None] + torch.arange(block)[None]  # [R, B] the block's positions
        feats, logits, tokens = [], [], []
        for k in range(block):
            # Cut after the last row's block: later blocks are invisible to every row's current block.
            out, hidden = backbone(canvas[:, : int(starts.max()) + block], block_offset=lengths, return_hidden=True)
            feats.append(hidden[rows[:, None], span])  # [R, B, D] (slots < k unused)
            logits.append(forbid_token(out[rows[:, None], span], mask_id))  # [R, B, V]
            token = sample_from_logits(logits[-1][:, k].float(), temperature, generator)
            canvas[rows, span[:, k]] = token
            tokens.append(token)
        feats, logits, tokens = torch.stack(feats, 1), torch.stack(logits, 1), torch.stack(tokens, 1)
        parts.append(_windows(feats, logits, tokens, dtype))
    return ChainWindows.cat(parts)


def _windows(feats, logits, tokens, dtype) -> ChainWindows:
    """State k's window s_k..s_{B-1}, shifted to slot 0 and padded (feats [R, K, B, D], logits [R, K, B, V])."""
    rows, block = feats.shape[0], feats.shape[1]
    k = torch.arange(block)
    slot = (k[None, :] + k[:, None]).clamp(max=block - 1)  # [K, W] position of slot j in state k's window
    diag = logits[:, k, k]  # [R, B, V] the chain's marginal at s, with the chain before s
    features = feats[:, k[:, None], slot]  # [R, K, W, D]
    base = logits[:, k[:, None], slot]
    targets = diag[:, slot]
    chain = tokens[:, slot]
    count = (block - k).repeat(rows)
    flat = lambda t: t.reshape(rows * block, *t.shape[2:])  # noqa: E731
    return ChainWindows(flat(features).to(dtype), flat(base).to(dtype), flat(targets).to(dtype), flat(chain), count)


def chain_acceptance(head, win: ChainWindows, greedy: bool) -> dict:
    """Held-out acceptance of ``head`` vs the marginals on chain windows: at T=0 (``greedy``) the argmax
    matches the chain's token, at T=1 sum_v min(draft, target); per slot and the expected accepted drafts
    per window (sum over slots of the product of per-slot acceptance, slot 0 included)."""
    from dllm.training.draft_losses import expected_acceptance
    from dllm.training.fef_head import previous_of

    positions = torch.arange(win.chain.shape[1])[None].expand_as(win.chain)
    previous, offsets = previous_of(win.chain, positions)
    valid = positions < win.count[:, None]
    out = {}
    with torch.no_grad():
        for name, logits in (("head", head(win.features, win.base, previous, offsets)), ("marginal", win.base)):
            if greedy:
                acc = (logits.argmax(-1) == win.chain).float() * valid
            else:
                acc = expected_acceptance(logits, win.targets) * valid
            out[name] = {"by_slot": [round(float(v), 4) for v in acc.sum(0) / valid.sum(0).clamp(min=1)],
                         "expected_accepted_per_window": round(float(torch.cumprod(acc, 1).sum(1).mean()), 4)}
    return out


def train_head(head, windows, objective: str, steps: int, batch_size: int, lr: float,
               generator: torch.Generator, mask_id: int, warmup: int = 50, log=print) -> list[float]:
    """Fit ``head`` to cached windows (the backbone is not called: a step costs one head pass).

    ``windows``: ChainWindows, or anything with ``len``, ``take(index)`` and, on what it takes, ``inputs()``
    (the head's arguments), ``targets`` [n, W, V] and ``trained()`` [n, W] (dllm/training/two_stream_head.py)."""
    import math

    from dllm.training.draft_losses import draft_loss

    optimizer = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (
        1 + math.cos(math.pi * min(s, steps) / steps)))
    losses = []
    for step in range(steps):
        win = windows.take(torch.randint(len(windows), (batch_size,), generator=generator))
        logits = head(*win.inputs())
        valid = win.trained()
        # The mask token is -inf in both: drop its column (0 * -inf terms give a NaN gradient otherwise).
        keep = torch.arange(logits.shape[-1]) != mask_id
        loss = draft_loss(objective, logits[..., keep], win.targets[..., keep], valid=valid)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(float(loss.detach()))
        if step % 200 == 0 or step == steps - 1:
            log(f"step {step} {objective} loss {sum(losses[-200:]) / len(losses[-200:]):.4f}")
    return losses


def main(argv: list[str] | None = None) -> int:
    """``python -m dllm.training.fef_chain --output DIR``: roll chains, train one head per objective, report."""
    import argparse
    import json
    import sys
    import time
    from itertools import islice
    from pathlib import Path

    from dllm.data.synthetic import heldout_set, training_stream
    from dllm.data.tokenizer import load_tokenizer
    from dllm.models.draft_head import DraftHead, DraftHeadConfig
    from dllm.models.transformer import TransformerLM
    from dllm.training.batches import derive_seed, tokenize_problems

    parser = argparse.ArgumentParser(prog="python -m dllm.training.fef_chain", description=__doc__.split("\n\n")[0])
    parser.add_argument("--backbone", default=str(Path(__file__).resolve().parents[1] / "weights" / "diffusion"))
    parser.add_argument("--batches", type=int, default=4, help="rollout batches of 64 prompts, T=0 and T=1 alternating")
    parser.add_argument("--objective", action="append", choices=("ce", "tv"), help="repeatable; default ce and tv")
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--output", required=True)
    args = parser.parse_args(argv)
    if args.batches < 1 or args.steps < 1 or not args.lr > 0:
        print("python -m dllm.training.fef_chain: --batches and --steps must be >= 1 and --lr > 0", file=sys.stderr)
        return 2
    backbone = TransformerLM.from_pretrained(args.backbone).eval().requires_grad_(False)
    tokenizer = load_tokenizer(Path(args.backbone) / "tokenizer.json")
    block, blocks = backbone.config.block_size, 8  # 64 new tokens, as the speed study decodes

    def prompts(problems):
        return [list(e.prompt) for e in tokenize_problems(problems, tokenizer, "block_causal", block, 0)]

    gen, start = torch.Generator().manual_seed(derive_seed(0, "fef-chain")), time.time()
    held = {t: rollout_windows(backbone, prompts(heldout_set()[64:96]), blocks, float(t), gen) for t in (0, 1)}
    stream = training_stream(derive_seed(0, "chain-data"))
    train = ChainWindows.cat([rollout_windows(backbone, prompts(list(islice(stream, 64))), blocks, float(i % 2), gen)
                              for i in range(args.batches)])
    rolled = time.time() - start
    for objective in args.objective or ["ce", "tv"]:
        torch.manual_seed(0)
        head = DraftHead(DraftHeadConfig(vocab_size=backbone.vocab_size, backbone_dim=backbone.config.dim,
                                         mask_token_id=backbone.mask_token_id))
        t = time.time()
        losses = train_head(head, train, objective, args.steps, 256, args.lr, torch.Generator().manual_seed(1),
                            backbone.mask_token_id, log=lambda line: print(line, flush=True))
        head.eval()
        acc = {f"T{t}": chain_acceptance(head, held[t].take(torch.arange(2048)), greedy=t == 0) for t in (0, 1)}
        folder = Path(args.output) / objective
        head.save_pretrained(folder)
        (folder / "train.json").write_text(json.dumps({
            "objective": objective, "steps": args.steps, "batch_size": 256, "lr": args.lr, "rollout_batches":
            args.batches, "train_windows": len(train), "rollout_seconds": round(rolled, 1),
            "train_seconds": round(time.time() - t, 1), "losses": losses[::10],
            "heldout_chain_acceptance": acc}, indent=1) + "\n")
        print(objective, json.dumps(acc), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
