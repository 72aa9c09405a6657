"""Cost of fef's draft-head steps against one backbone call at a target's shape (random weights, no download).

    python -m dllm.eval.study.head_cost --arch llada-8b --output runs/head_cost                 # on a GPU
    python -m dllm.eval.study.head_cost --arch tiny-bidirectional --layers 1,2 --output /tmp/hc   # a CPU smoke run

fef with ``draft="head"`` adds W cached head steps to every round (``dllm/models/draft_head.py``), and they pay
only where they cost little against the round's backbone call. Measured here, at ``--rows`` rows:

- the backbone's state call, built as the cost model builds a target (``eval/study/cost_model.py: build``, random
  weights at a few depths, fitted to the target's full depth): without a cache, one forward over the
  ``--context`` tokens before the block and the ``--block`` tokens of it (LLaDA's bidirectional layout); with
  the block cache, the block alone against ``--context`` cached tokens (the block-diffusion shape);
- the head's W steps (``samplers/fef/sources.py: head_drafts``: its start, then per slot one cached step and
  one draw, at T=0 and T=1), an untrained head of ``--head-dim`` x ``--head-layers`` reading the backbone's
  features and logits (its output layer is the vocabulary's width, as the shipped heads').

Written to ``--output``: ``head_cost.json`` and ``head_cost.md`` (the ratios of the head's steps to each call).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import torch

from dllm.cli import UserError, check_device
from dllm.defaults import auto_dtype
from dllm.models.draft_head import DraftHead, DraftHeadConfig
from dllm.samplers.fef.sources import head_drafts

from .cost_model import ARCHS, _fit, _prefilled_cache, _time, arch_config, build, building

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dllm.eval.study.head_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="llada-8b", help=f"a preset ({', '.join(ARCHS)}) or a model folder")
    p.add_argument("--layers", help="depths measured, comma-separated (default 2,4 on CUDA, 1,2 elsewhere)")
    p.add_argument("--rows", type=int, default=1, help="batch rows (default 1)")
    p.add_argument("--context", type=int, default=256, help="tokens before the block (default 256)")
    p.add_argument("--block", type=int, default=32, help="tokens of the block (default 32)")
    p.add_argument("--window", type=int, default=8, help="head steps per round, fef's window (default 8)")
    p.add_argument("--head-dim", type=int, default=128, help="the head's width (default 128, the shipped heads')")
    p.add_argument("--head-layers", type=int, default=1, help="the head's layers (default 1)")
    p.add_argument("--reps", type=int, default=5, help="timed repeats per measurement, median kept (default 5)")
    p.add_argument("--device", default="auto", help="auto (CUDA when present), or a torch device: cpu, cuda, cuda:1")
    p.add_argument("--dtype", default="auto", choices=("auto", *DTYPES), help="auto: dllm.defaults.auto_dtype")
    p.add_argument("--output", required=True, help="folder for head_cost.json and head_cost.md")
    return p.parse_args(argv)


def check(args: argparse.Namespace) -> tuple[dict, tuple[int, ...], torch.device, torch.dtype]:
    """The architecture's shape, depths, device and dtype; a ValueError naming the flag otherwise."""
    for name in ("rows", "block", "window", "head_dim", "head_layers", "reps"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.context < 0:
        raise ValueError(f"--context must be >= 0, got {args.context}")
    try:
        check_device(args.device)
    except UserError as error:
        raise ValueError(str(error)) from None
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    try:
        shape = arch_config(args.arch)
    except ValueError as error:
        raise ValueError(f"--arch: {error}") from None
    text = args.layers or ("2,4" if device.type == "cuda" else "1,2")
    try:
        depths = tuple(sorted({int(d) for d in text.split(",")}))
    except ValueError:
        raise ValueError(f"--layers must be comma-separated ints, got {text!r}") from None
    if not depths or depths[0] < 1 or depths[-1] > shape["n_layers"]:
        raise ValueError(f"--layers must lie in 1..{shape['n_layers']} (the architecture's depth), got {text!r}")
    if args.head_dim % 4:
        raise ValueError(f"--head-dim must be a multiple of 4 (the head's 4 attention heads), got {args.head_dim}")
    dtype = auto_dtype(device) if args.dtype == "auto" else DTYPES[args.dtype]
    return shape, depths, device, dtype


@torch.inference_mode()
def measure(args: argparse.Namespace, shape: dict, depths: tuple[int, ...], device, dtype, log=print) -> dict:
    """Seconds of the state call (no cache, block cache) at full depth and of the head's W steps."""
    vocab, rows = shape["vocab_size"], args.rows
    calls: dict[str, dict[int, float]] = {"no_cache": {}, "block_cache": {}}
    for depth in depths:
        model = build(shape, depth, args.context + args.block, device, dtype)
        tokens = vocab - 1  # leave the mask id out of the inputs
        whole = torch.randint(tokens, (rows, args.context + args.block), device=device)
        calls["no_cache"][depth] = _time(functools.partial(model, whole), args.reps, device)
        block = torch.randint(tokens, (rows, args.block), device=device)
        cache = _prefilled_cache(model, rows, args.context, tokens, device) if args.context else model.new_cache()
        calls["block_cache"][depth] = _time(functools.partial(model.forward_cached, block, cache, append=False),
                                            args.reps, device)
        log(f"  depth {depth}: no cache {calls['no_cache'][depth] * 1e3:.2f} ms, "
            f"block cache {calls['block_cache'][depth] * 1e3:.2f} ms")
        del model, cache
    full = {kind: _fit(depths, [seconds[d] for d in depths], shape["n_layers"])[0] for kind, seconds in calls.items()}

    torch.manual_seed(0)
    config = DraftHeadConfig(vocab_size=vocab, backbone_dim=shape["dim"], dim=args.head_dim, n_layers=args.head_layers,
                             max_window=max(16, args.window), mask_token_id=vocab - 1)
    with building(device, dtype):
        head = DraftHead(config).eval()
    features = torch.randn(rows, args.window, shape["dim"], device=device, dtype=dtype)
    base = torch.randn(rows, args.window, vocab, device=device, dtype=dtype)
    first = torch.zeros(rows, dtype=torch.long, device=device)
    offsets = torch.ones(rows, args.window, dtype=torch.long, device=device)
    generator = torch.Generator(device=device).manual_seed(0)
    steps = {f"T{t}": _time(functools.partial(head_drafts, head, features, base, first, offsets, float(t), generator,
                                              vocab - 1), args.reps, device) for t in (0, 1)}
    params = sum(p.numel() for p in head.parameters())
    return {"backbone_seconds": {kind: {str(d): s for d, s in seconds.items()} for kind, seconds in calls.items()},
            "backbone_full_depth_seconds": full, "head_seconds": steps, "head_parameters": params,
            "ratio": {f"{t} / {kind}": steps[t] / full[kind] for t in steps for kind in full}}


def markdown(report: dict) -> str:
    r, s = report, report["settings"]
    full, head = r["backbone_full_depth_seconds"], r["head_seconds"]
    lines = [f"# Draft-head steps against the backbone call: {s['arch']} ({s['device']}, {s['dtype']})", "",
             f"{s['rows']} row(s), {s['context']} tokens before a block of {s['block']}, {s['window']} head steps "
             f"(head {s['head_dim']} x {s['head_layers']} layer(s), {r['head_parameters']:,} parameters); backbone "
             f"measured at depths {s['layers']} and fitted to {r['shape']['n_layers']}.", "",
             "| state call | backbone (ms) | head steps T=0 (ms) | ratio | head steps T=1 (ms) | ratio |",
             "| --- | --- | --- | --- | --- | --- |"]
    for kind, label in (("no_cache", "whole sequence, no cache"), ("block_cache", "block against cached context")):
        lines.append(f"| {label} | {full[kind] * 1e3:.2f} | {head['T0'] * 1e3:.2f} | {head['T0'] / full[kind]:.3f} "
                     f"| {head['T1'] * 1e3:.2f} | {head['T1'] / full[kind]:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        shape, depths, device, dtype = check(args)
    except ValueError as error:
        print(f"head-cost: {error}", file=sys.stderr)
        return 2
    settings = {"arch": args.arch, "device": str(device), "dtype": str(dtype).removeprefix("torch."),
                "rows": args.rows, "context": args.context, "block": args.block, "window": args.window,
                "head_dim": args.head_dim, "head_layers": args.head_layers, "layers": list(depths), "reps": args.reps}
    print(f"head-cost: {args.arch} on {device} in {settings['dtype']}", flush=True)
    start = time.time()
    report = {"settings": settings, "shape": shape, **measure(args, shape, depths, device, dtype)}
    report["wall_seconds"] = round(time.time() - start, 1)
    folder = Path(args.output)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "head_cost.json").write_text(json.dumps(report, indent=1) + "\n")
    (folder / "head_cost.md").write_text(markdown(report))
    print(markdown(report), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
