"""``python -m dllm.train``: train the small default models, or measure a trained one's held-out accuracy.

    python -m dllm.train --config configs/ar.toml [--output runs/ar] [--resume] [--set train.steps=100]
    accelerate launch --multi_gpu --num_processes 2 -m dllm.train --config configs/tiny.toml  # 2 CPU processes
    python -m dllm.train --eval dllm/weights/ar --limit 500              # greedy ar / sequential
    python -m dllm.train --eval dllm/weights/diffusion --sampler fef --option window=4
    python -m dllm.train --recipe NAME ...                               # another recipe (dllm.training.recipes)

The pieces live in ``dllm.training`` (config, batches, loop, evaluate).
"""

from __future__ import annotations

import argparse
import json
import sys
import tomllib
from pathlib import Path

import torch

from dllm.cli import UserError
from dllm.training import load_config, train

DTYPES = {"bf16": torch.bfloat16, "fp32": None}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and (argv[0] == "--recipe" or argv[0].startswith("--recipe=")):
        from dllm.training.recipes import run_recipe

        if "=" in argv[0]:
            name, rest = argv[0].partition("=")[2], argv[1:]
        else:
            name, rest = (argv[1] if len(argv) > 1 else ""), argv[2:]
        return run_recipe(name, rest)
    parser = argparse.ArgumentParser(prog="dllm train", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", help="TOML file with [model], [data], [train] tables")
    parser.add_argument("--output", help="run folder (default runs/<config name>)")
    parser.add_argument("--resume", action="store_true", help="continue from <output>/checkpoint.pt if present")
    parser.add_argument("--set", action="append", default=[], metavar="TABLE.KEY=VALUE",
                        help="override a config value (TOML syntax), e.g. --set train.steps=100")
    parser.add_argument("--stop-at-step", type=int, help="stop early at this step with a checkpoint")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--eval", metavar="FOLDER", help="evaluate a saved model folder instead of training")
    parser.add_argument("--sampler", help="sampler for --eval (default: ar for causal, sequential otherwise)")
    parser.add_argument("--limit", type=int, default=500, help="held-out problems to decode")
    parser.add_argument("--max-new-tokens", type=int, default=80)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="autocast dtype for --eval")
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE", help="sampler option")
    parser.add_argument("--drafter", metavar="FOLDER", help="a causal model folder as ar_spec's drafter")
    parser.add_argument("--json", metavar="PATH", help="also write the --eval report here")
    args = parser.parse_args(argv)
    if args.eval:
        return _evaluate(args)
    if not args.config:
        parser.error("--config is required (or --eval FOLDER)")
    config = load_config(args.config, _overrides(args.set))
    output = args.output or str(Path("runs") / Path(args.config).stem)
    summary = train(config, output, resume=args.resume, stop_at_step=args.stop_at_step,
                    progress=not args.no_progress)
    print(json.dumps({k: v for k, v in summary.items() if k not in ("history", "config")}))
    return 0


def _overrides(items: list[str]) -> dict[str, dict]:
    """``table.key=value`` strings (value in TOML syntax, bare words as strings) -> nested dict."""
    out: dict[str, dict] = {}
    for item in items:
        name, sep, value = item.partition("=")
        table, dot, key = name.partition(".")
        if not sep or not dot:
            raise UserError(f"--set expects TABLE.KEY=VALUE, got {item!r}")
        try:
            parsed = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            parsed = value
        out.setdefault(table, {})[key] = parsed
    return out


def _evaluate(args: argparse.Namespace) -> int:
    from dllm.data.tokenizer import load_tokenizer
    from dllm.models.transformer import TransformerLM
    from dllm.models.two_stream import TwoStreamLM, is_two_stream_folder
    from dllm.training.evaluate import default_sampler, heldout_accuracy

    folder = Path(args.eval)
    model = (TwoStreamLM if is_two_stream_folder(folder) else TransformerLM).from_pretrained(folder)
    tokenizer = load_tokenizer(folder / "tokenizer.json")
    sampler, options = default_sampler(model)
    if args.sampler and args.sampler != sampler:
        sampler, options = args.sampler, {k: v for k, v in options.items() if k == "block_length"}
    options.update(dict(_option(text) for text in args.option))
    if args.drafter:
        options["drafter"] = TransformerLM.from_pretrained(args.drafter)
    report = heldout_accuracy(model, tokenizer, sampler, limit=args.limit, max_new_tokens=args.max_new_tokens,
                              temperature=args.temperature, seed=args.seed, batch_size=args.batch_size,
                              dtype=DTYPES[args.dtype], progress=sys.stderr.isatty(), **options)
    report["options"] = {k: (v if isinstance(v, int | float | str) else type(v).__name__)
                         for k, v in report["options"].items()}
    report["model"] = str(folder)
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0


def _option(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep:
        raise UserError(f"--option expects KEY=VALUE, got {text!r}")
    for cast in (int, float):
        try:
            return key, cast(value)
        except ValueError:
            pass
    return key, {"none": None, "true": True, "false": False}.get(value.lower(), value)


if __name__ == "__main__":
    sys.exit(main())
