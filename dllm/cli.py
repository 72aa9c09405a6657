"""The ``dllm`` command line: ``generate`` now; ``eval``, ``bench`` and ``train`` as they land."""

from __future__ import annotations

import argparse
import json
import sys

import torch

from dllm.api import generate
from dllm.models.oracle import HMMOracle
from dllm.samplers import SAMPLERS

DEMO_ALPHABET = "abcdefgh"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dllm", description="Exact speculative decoding for diffusion LMs.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub.add_parser("generate", help="generate text (a built-in oracle demo until models ship)"))
    for name, text in [("eval", "evaluate on GSM8K, MATH, HumanEval, MBPP"), ("bench", "speed study"),
                       ("train", "train the small default models")]:
        sub.add_parser(name, help=f"{text} (not available in this version)")
    args = parser.parse_args(argv)
    if args.command == "generate":
        return _generate(args)
    print(f"dllm {args.command}: not available in this version yet", file=sys.stderr)
    return 2


def _add_generate(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", nargs="?", default="abca", help=f"demo prompt over the letters {DEMO_ALPHABET!r}")
    p.add_argument("--sampler", default="fef", choices=sorted(SAMPLERS))
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-samples", type=int, default=1)
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="sampler option, e.g. --option window=4 --option order=confidence")
    p.add_argument("--show-steps", action="store_true", help="print the canvas after every round")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def _parse_option(text: str) -> tuple[str, object]:
    if "=" not in text:
        raise SystemExit(f"--option expects KEY=VALUE, got {text!r}")
    key, value = text.split("=", 1)
    for cast in (int, float):
        try:
            return key, cast(value)
        except ValueError:
            pass
    return key, {"none": None, "true": True, "false": False}.get(value.lower(), value)


def _generate(args: argparse.Namespace) -> int:
    """Demo on the HMM oracle: a model whose exact distribution is known, standing in for a real LM."""
    oracle = HMMOracle.random(num_states=4, num_tokens=len(DEMO_ALPHABET), seed=0, stickiness=3.0, sharpness=2.0)
    unknown = set(args.prompt) - set(DEMO_ALPHABET)
    if unknown or not args.prompt:
        raise SystemExit(f"the demo prompt must be non-empty letters from {DEMO_ALPHABET!r}; got {sorted(unknown)}")
    ids = torch.tensor([[DEMO_ALPHABET.index(c) for c in args.prompt]]).expand(args.num_samples, -1)
    model = oracle.as_causal() if args.sampler.startswith("ar") else oracle
    options = dict(_parse_option(o) for o in args.option)
    if args.show_steps and not args.json:
        options["callback"] = lambda event: print("  step:", " | ".join(_render(r, oracle) for r in event["x"]))
    out = generate(model, ids, sampler=args.sampler, max_new_tokens=args.max_new_tokens,
                   temperature=args.temperature, generator=torch.Generator().manual_seed(args.seed), **options)
    texts = [_render(row, oracle) for row in out.sequences]
    if args.json:
        print(json.dumps({"model": "hmm-oracle-demo", "sampler": args.sampler, "options": out.options,
                          "texts": texts, "stats": out.stats.to_dict(), "exact": out.exact}))
        return 0
    print(f"model: HMM oracle demo (exact conditionals), sampler: {args.sampler} {out.options}")
    for text in texts:
        print(f"  {args.prompt} | {text[len(args.prompt):]}")
    s = out.stats
    print(f"new tokens {s.new_tokens}, model calls {s.nfe}, tokens/call {s.tokens_per_call:.2f}, "
          f"mean acceptance length {s.mean_acceptance_length:.2f}, {s.wall_time_s * 1e3:.1f} ms"
          f" ({'exact' if out.exact else 'approximate'} sampler)")
    return 0


def _render(row: torch.Tensor, oracle: HMMOracle) -> str:
    return "".join("_" if t == oracle.mask_token_id else DEMO_ALPHABET[t] for t in row.tolist())


if __name__ == "__main__":
    sys.exit(main())
