"""The ``dllm`` command line: ``generate``, ``eval``, ``bench`` and ``train``."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

WEIGHTS = Path(__file__).resolve().parent / "weights"  # the shipped default models
DEFAULTS = {"diffusion": WEIGHTS / "diffusion", "ar": WEIGHTS / "ar", "drafter": WEIGHTS / "drafter"}
DEMO_ALPHABET = "abcdefgh"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    commands = {"eval": "dllm.eval.runner", "bench": "dllm.eval.bench", "train": "dllm.train"}
    if argv and argv[0] in commands:  # these own their argument parsing
        import importlib

        return importlib.import_module(commands[argv[0]]).main(argv[1:])
    parser = argparse.ArgumentParser(prog="dllm", description="Exact speculative decoding for diffusion LMs.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub.add_parser("generate", help="generate text (default: the shipped diffusion model with fef)"))
    for name, text in [("eval", "evaluate on GSM8K, MATH, HumanEval, MBPP, synthetic"),
                       ("bench", "AR vs diffusion speed study"), ("train", "train the small default models")]:
        sub.add_parser(name, help=text)
    args = parser.parse_args(argv)
    try:
        return _generate(args)
    except (ValueError, TypeError) as error:  # the library's bad-input errors name the parameter: say just that
        if os.environ.get("DLLM_DEBUG"):
            raise
        raise SystemExit(f"dllm generate: {error}") from None


def _add_generate(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", nargs="?", default="Tom has 3 bags with 4 apples each. How many apples does Tom have?")
    p.add_argument("--model", help="a folder or hub id for dllm.load (default: the shipped model for the sampler)")
    p.add_argument("--kind", default="auto",
                   help="dllm.load kind: auto, llada, dream, diffusion_gemma, mlm, causal, dllm, remote")
    p.add_argument("--sampler", default="fef")
    p.add_argument("--drafter", help="ar_spec drafter: 'ngram' or a model folder (default with the shipped AR "
                   "model: the shipped diffusion model, 8 drafts per round; the shipped causal drafter is "
                   "dllm/weights/drafter)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="sampler option, e.g. --option window=4 --option order=confidence "
                        "(fef here defaults to window=8, draft=stale)")
    p.add_argument("--raw", action="store_true",
                   help="use the prompt as is (the shipped models otherwise get 'Question: ...\\nAnswer:')")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: the checkpoint's)")
    p.add_argument("--show-steps", action="store_true", help="print the canvas after every round")
    p.add_argument("--trace", metavar="FILE", help="write the denoising trajectory as .html or .png")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--demo", action="store_true", help="run on the built-in HMM oracle (no model files needed)")


def parse_option(text: str) -> tuple[str, object]:
    """KEY=VALUE with the value read as int, float, bool, None or str."""
    from dllm.eval.runner import parse_value

    key, sep, value = text.partition("=")
    if not sep or not key:
        raise SystemExit(f"--option expects KEY=VALUE, got {text!r}")
    return key, parse_value(value)


def _generate(args: argparse.Namespace) -> int:
    import torch

    from dllm.samplers import SAMPLERS

    if args.sampler not in SAMPLERS:
        raise SystemExit(f"--sampler must be one of {sorted(SAMPLERS)}, got {args.sampler!r}")
    causal = SAMPLERS[args.sampler].model_kind == "causal"
    path = args.model or str(DEFAULTS["ar" if causal else "diffusion"])
    if args.demo or (args.model is None and not Path(path).exists()):
        return _demo(args)
    started = time.perf_counter()
    model = _load(path, args.kind, args.device, args.dtype)
    tokenizer = model.tokenizer
    options = dict(parse_option(o) for o in args.option)
    if args.sampler == "fef":  # the fastest exact setting measured on the shipped model (README)
        options = {"window": 8, "draft": "stale", **options}
    if args.sampler == "ar_spec" and "drafter" not in options:
        options["drafter"] = _drafter(args, model)
        if args.drafter is None and args.model is None and not isinstance(options["drafter"], str):
            options.setdefault("num_draft_tokens", 8)  # the shipped diffusion drafter: fastest measured (README)
    text = _format_prompt(args, tokenizer, default_model=args.model is None)
    from dllm.eval.runner import model_device

    ids = torch.tensor([tokenizer(text, add_special_tokens=not args.chat)["input_ids"]], device=model_device(model))
    if not args.json:
        print(f"model {path} ({type(model).__name__}), sampler {args.sampler}, loaded in "
              f"{time.perf_counter() - started:.1f}s", flush=True)
    events: list[dict] = []
    if args.show_steps or args.trace:
        options["callback"] = _recorder(events, tokenizer, model, args.show_steps and not args.json)
    with torch.inference_mode():
        out = _run(model, ids, args, options)
    answer = out.sequences[0, ids.shape[1]:]
    completion = tokenizer.decode(answer[: int(out.stats.new_tokens)], skip_special_tokens=True)
    if args.trace:
        from dllm.eval.trace import render_trace
        from dllm.stops import resolve as resolve_stops

        written = render_trace(events, tokenizer, args.trace, prompt_length=ids.shape[1],
                               mask_token_id=getattr(model, "mask_token_id", None),
                               stop_token_ids=resolve_stops(model))  # generate's stops: columns after go
        print(f"trace written to {written.resolve()}", file=sys.stderr)
    if args.json:
        print(json.dumps({"model": path, "sampler": args.sampler, "options": out.options, "prompt": text,
                          "completion": completion, "exact": out.exact, "stats": out.stats.to_dict()}))
        return 0
    print(text + completion)
    _print_stats(out)
    return 0


def _run(model, ids, args, options):
    import torch

    import dllm

    return dllm.generate(model, ids, sampler=args.sampler, max_new_tokens=args.max_new_tokens,
                         temperature=args.temperature, generator=torch.Generator(ids.device).manual_seed(args.seed),
                         **options)


def _load(path: str, kind: str, device, dtype):
    import torch

    import dllm

    if dtype is not None:
        if dtype not in ("float32", "bfloat16", "float16"):
            raise SystemExit(f"--dtype must be float32, bfloat16 or float16, got {dtype!r}")
        dtype = getattr(torch, dtype)
    model = dllm.load(path, kind=kind, device=device, dtype=dtype)
    if hasattr(model, "eval"):
        model.eval()
    return model


def _drafter(args, model):
    if args.drafter == "ngram":
        return "ngram"
    # With the shipped AR model the shipped diffusion model drafts: 8 tokens per call measured 2.1x ar.
    path = args.drafter or (str(DEFAULTS["diffusion"]) if args.model is None else None)
    if path is None or not Path(path).exists() and args.drafter is None:
        return "ngram"
    return _load(path, "auto", args.device, args.dtype)


def _format_prompt(args, tokenizer, default_model: bool) -> str:
    if args.chat:
        import dllm

        return dllm.apply_chat_template(tokenizer, args.prompt)
    if default_model and not args.raw:  # the shipped models were trained on this format
        from dllm.data.synthetic import format_example

        return format_example(args.prompt)
    return args.prompt


def _recorder(events: list[dict], tokenizer, model, show: bool):
    """A sampler callback that keeps every step's event and optionally prints the canvas."""
    mask_id = getattr(model, "mask_token_id", None)
    stops = set(getattr(model, "stop_token_ids", None) or [getattr(model, "eos_token_id", None)]) - {None}

    def record(event: dict) -> None:
        kept = {k: (v.detach().cpu().clone() if hasattr(v, "detach") else v) for k, v in event.items()}
        events.append(kept)
        if show:
            row = kept["x"][0].tolist()
            print(f"  step {len(events):3d} | " + render_canvas(row, tokenizer, mask_id, _emitted(kept), stops))

    return record


def _emitted(event: dict) -> set[int]:
    """Canvas positions revealed by this step (first row)."""
    revealed = event.get("revealed")
    if revealed is None:
        return set()
    first = revealed[0]
    if first.dtype == torch_bool():
        return {int(i) + event.get("offset", 0) for i in first.nonzero().flatten()}
    return {int(p) for p in first.tolist() if p >= 0}


def torch_bool():
    import torch

    return torch.bool


def render_canvas(row: list[int], tokenizer, mask_id, fresh: set[int], stops: set[int] = frozenset()) -> str:
    """The sequence as text: masks as '_', tokens revealed this step in [brackets], nothing after EOS."""
    pieces = []
    for position, token in enumerate(row):
        if token in stops and position not in fresh:
            break
        if token == mask_id:
            pieces.append("_")
            continue
        piece = tokenizer.decode([token]) if tokenizer is not None else str(token)
        pieces.append(f"[{piece}]" if position in fresh else piece)
    return "".join(pieces).replace("\n", "⏎")


def _print_stats(out) -> None:
    s = out.stats
    print(f"-- {s.new_tokens} new tokens in {s.wall_time_s:.2f}s ({s.tokens_per_second:.1f} tok/s), "
          f"model calls {s.nfe} (+{s.nfe_draft} draft), tokens/call {s.tokens_per_call:.2f}, "
          f"mean acceptance length {s.mean_acceptance_length:.2f}, "
          f"{'exact' if out.exact else 'approximate'} sampler")


def _demo(args: argparse.Namespace) -> int:
    """The HMM oracle demo: a model whose exact distribution is known, standing in for a real LM."""
    import torch

    import dllm

    oracle = dllm.HMMOracle.random(num_states=4, num_tokens=len(DEMO_ALPHABET), seed=0, stickiness=3.0,
                                   sharpness=2.0)
    prompt = args.prompt if set(args.prompt) <= set(DEMO_ALPHABET) else "abca"
    ids = torch.tensor([[DEMO_ALPHABET.index(c) for c in prompt]])
    model = oracle.as_causal() if args.sampler.startswith("ar") else oracle
    options = dict(parse_option(o) for o in args.option)
    letters = lambda row: "".join("_" if t == oracle.mask_token_id else DEMO_ALPHABET[t] for t in row)  # noqa: E731
    if args.show_steps and not args.json:
        options["callback"] = lambda event: print("  step:", letters(event["x"][0].tolist()))
    out = dllm.generate(model, ids, sampler=args.sampler, max_new_tokens=min(args.max_new_tokens, 32),
                        temperature=args.temperature if args.temperature else 1.0,
                        generator=torch.Generator().manual_seed(args.seed), **options)
    text = letters(out.sequences[0].tolist())
    if args.json:
        print(json.dumps({"model": "hmm-oracle-demo", "sampler": args.sampler, "options": out.options,
                          "text": text, "stats": out.stats.to_dict(), "exact": out.exact}))
        return 0
    print(f"HMM oracle demo (no model files found; exact conditionals), sampler {args.sampler}")
    print(f"{prompt} | {text[len(prompt):]}")
    _print_stats(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
