"""Benchmark: fef with the exact block cache vs fef with full-sequence copies vs sequential.

Prints wall-clock seconds per generated token and forward tokens per generated token for each setting,
measured in one run on the same prompts (ratios are what to read: absolute times drift on shared
machines). Also reports how far the approximate Fast-dLLM caches (prefix, dual) drift from the exact
output on a bidirectional model (fraction of answer tokens that differ at temperature 0).

    python -m dllm.eval.study.bench_cache --new-tokens 256 --block-length 32
    python -m dllm.eval.study.bench_cache --model dllm/weights/diffusion   # a trained block-causal model
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import dllm
from dllm.models.transformer import TransformerConfig, TransformerLM


def _random_model(layout: str, block_length: int, max_len: int) -> TransformerLM:
    torch.manual_seed(0)
    config = TransformerConfig(
        vocab_size=2048,
        dim=256,
        n_layers=4,
        n_heads=4,
        max_seq_len=max_len,
        layout=layout,
        block_size=block_length if layout == "block_causal" else None,
        mask_token_id=2,
    )
    return TransformerLM(config).eval()


def _load(path: str | None, layout: str, block_length: int, max_len: int, dtype: torch.dtype):
    model = TransformerLM.from_pretrained(path) if path else _random_model(layout, block_length, max_len)
    return model.to(dtype)


def _prompts(args, model) -> torch.Tensor:
    """Held-out synthetic questions (their last --prompt-length tokens) for a trained model, else random ids."""
    if not args.model:
        return torch.randint(3, model.vocab_size, (args.batch_size, args.prompt_length),
                             generator=torch.Generator().manual_seed(1))
    from dllm.data.synthetic import format_example, heldout_set
    from dllm.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(f"{args.model}/tokenizer.json")
    rows = [tokenizer(format_example(p["question"]))["input_ids"] for p in heldout_set()[: args.batch_size]]
    return torch.tensor([row[-args.prompt_length :] for row in rows])


def _time(model, prompts, repeats: int, **kw) -> dict:
    """Median over ``repeats`` timed runs (after one warm-up run) of one generate call."""
    times, out = [], None
    for i in range(repeats + 1):
        start = time.perf_counter()
        with torch.inference_mode():
            out = dllm.generate(model, prompts, generator=torch.Generator().manual_seed(0), eos_token_id=None, **kw)
        if i:
            times.append(time.perf_counter() - start)
    s = out.stats
    seconds = statistics.median(times)
    return {
        "s_per_token": seconds / s.new_tokens,
        "forward_tokens_per_token": s.forward_tokens / s.new_tokens,
        "tokens_per_call": s.tokens_per_row_call,
        "nfe": s.nfe,
        "seconds": seconds,
        "spread": (max(times) - min(times)) / seconds if len(times) > 1 else 0.0,
        "sequences": out.sequences,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="folder of a block-causal TransformerLM (default: random weights)")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--block-length", type=int, default=32)
    parser.add_argument("--prompt-length", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--window", type=int, default=4)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--output", help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    max_len = args.prompt_length + args.new_tokens + 8
    model = _load(args.model, "block_causal", args.block_length, max_len, dtype)
    prompts = _prompts(args, model)
    common = dict(max_new_tokens=args.new_tokens, temperature=args.temperature, block_length=args.block_length)
    runs = {
        "sequential": _time(model, prompts, args.repeats, sampler="sequential", cache="none", **common),
        "sequential+block_cache": _time(model, prompts, args.repeats, sampler="sequential", cache="block", **common),
        "fef (copies)": _time(model, prompts, args.repeats, sampler="fef", window=args.window, cache="none", **common),
        "fef+block_cache": _time(
            model, prompts, args.repeats, sampler="fef", window=args.window, cache="block", **common
        ),
        "fef+block_cache (stale drafts)": _time(
            model, prompts, args.repeats, sampler="fef", window=args.window, cache="block", draft="stale", **common
        ),
    }
    base = runs["sequential"]["s_per_token"]
    print(f"{'setting':34s} {'s/token':>9s} {'fwd tok/token':>13s} {'tok/call':>8s} {'speedup vs seq':>14s}")
    for name, r in runs.items():
        print(
            f"{name:34s} {r['s_per_token']:9.4f} {r['forward_tokens_per_token']:13.1f} "
            f"{r['tokens_per_call']:8.2f} {base / r['s_per_token']:13.2f}x"
        )
    ratio = runs["fef (copies)"]["s_per_token"] / runs["fef+block_cache"]["s_per_token"]
    print(f"block-cached fef is {ratio:.2f}x faster than fef with full copies")
    drift = _cache_drift(args, max_len, dtype)
    print(
        "approximate caches on a bidirectional model (fraction of answer tokens differing from no cache, T=0): "
        + ", ".join(f"{k} {v:.3f}" for k, v in drift.items())
    )
    result = {
        "runs": {k: {m: v for m, v in r.items() if m != "sequences"} for k, r in runs.items()},
        "block_cache_speedup_over_copies": ratio,
        "approximate_cache_drift": drift,
        "args": vars(args),
    }
    if args.output:
        with open(args.output, "w") as f:
            json.dump(result, f, indent=2)
    return result


def _cache_drift(args, max_len: int, dtype) -> dict:
    """Token disagreement of prefix/dual caches with the uncached output, fef at T=0, bidirectional model."""
    model = _load(None, "bidirectional", args.block_length, max_len, dtype)
    prompts = torch.randint(3, model.vocab_size, (2, args.prompt_length), generator=torch.Generator().manual_seed(2))
    common = dict(
        sampler="fef",
        max_new_tokens=min(args.new_tokens, 64),
        temperature=0.0,
        block_length=min(args.block_length, 64),
        eos_token_id=None,
    )
    with torch.inference_mode():
        exact = dllm.generate(model, prompts, cache="none", **common).sequences
        return {
            cache: float((dllm.generate(model, prompts, cache=cache, **common).sequences != exact).float().mean())
            for cache in ("prefix", "dual")
        }


if __name__ == "__main__":
    main()
