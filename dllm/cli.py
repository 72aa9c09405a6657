"""The ``dllm`` command line: ``generate``, ``eval``, ``bench``, ``train``, ``plan`` and ``study``."""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from dllm.defaults import DTYPE, DTYPES, LOGPROBS_MODE, LOGPROBS_MODES, MAX_NEW_TOKENS, TEMPERATURE

if TYPE_CHECKING:
    from dllm.stats import StepEvent

WEIGHTS = Path(__file__).resolve().parent / "weights"  # the shipped default models
DEFAULTS = {"diffusion": WEIGHTS / "diffusion", "ar": WEIGHTS / "ar", "drafter": WEIGHTS / "drafter",
            "ar_diffusion_drafter": WEIGHTS / "ar_diffusion_drafter"}
DEMO_ALPHABET = "abcdefgh"
_DEFAULT_PROMPT = "Tom has 3 bags with 4 apples each. How many apples does Tom have?"


USAGE = 2  # bad input (a flag's value, a missing folder), as argparse and `dllm eval` exit
INTERRUPTED = 130  # Ctrl-C, as a shell reports SIGINT
_COMMANDS = {"eval": "dllm.eval.runner", "bench": "dllm.eval.study.bench", "train": "dllm.train",
             "plan": "dllm.eval.study.planner", "study": "dllm.eval.study.real_shape", "serve": "dllm.serve.cli"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = argv[0] if argv and argv[0] in _COMMANDS else "generate"
    return run_guarded(command, lambda: _dispatch(argv))  # imports included: Ctrl-C there is one line too


def _dispatch(argv: list[str]) -> int:
    if argv and argv[0] in _COMMANDS:  # these own their argument parsing
        import importlib

        return importlib.import_module(_COMMANDS[argv[0]]).main(argv[1:])
    from dllm import __version__

    parser = argparse.ArgumentParser(prog="dllm", description="Exact speculative decoding for diffusion LMs.")
    parser.add_argument("--version", action="version", version=f"dllm {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub.add_parser("generate", help="generate text (default: the shipped diffusion model with fef)",
                                 epilog=STATS_HELP, formatter_class=argparse.RawDescriptionHelpFormatter))
    for name, text in [("eval", "evaluate on GSM8K, MATH, HumanEval, MBPP, synthetic"),
                       ("bench", "AR vs diffusion speed study"), ("train", "train the small default models"),
                       ("plan", "the peak memory a model, batch, length and sampler will need (before renting a card)"),
                       ("serve", "an OpenAI-compatible server with continuous batching (pip install -e '.[serve]')"),
                       ("study", "real-shape study: random weights at LLaDA-8B/Dream-7B shapes, memory and time "
                                 "per round (dllm study real-shape)")]:
        sub.add_parser(name, help=text)
    return _generate(parser.parse_args(argv))


def run_guarded(command: str, run: Callable[[], int]) -> int:
    """Run a command; any error ends it with one line ``dllm COMMAND: message`` on stderr and an exit status:
    2 for bad input (UserError and the library's ValueError/TypeError/FileNotFoundError, which name the
    parameter), 1 for anything else, 130 for Ctrl-C (DLLM_DEBUG=1: the traceback instead).

    Errors from below (torch, transformers, the hub) are kept to their message on one line, prefixed by
    their type when that is not a plain bad-input error.
    """
    try:
        with warnings.catch_warnings():
            if not os.environ.get("DLLM_DEBUG"):  # a warning is one line too (a capped window, a cache run uncached)
                warnings.showwarning = functools.partial(_say_warning, command)
            return run()
    except SystemExit:
        raise
    except KeyboardInterrupt:
        if os.environ.get("DLLM_DEBUG"):
            raise
        print(f"dllm {command}: interrupted", file=sys.stderr)
        return INTERRUPTED
    except Exception as error:
        if os.environ.get("DLLM_DEBUG"):
            raise
        print(f"dllm {command}: {_one_line(error)}", file=sys.stderr)
        return USAGE if isinstance(error, _USAGE_ERRORS) else 1


def _say_warning(command: str, message, category, filename, lineno, file=None, line=None) -> None:
    print(f"dllm {command}: warning: {' '.join(str(message).split())}", file=sys.stderr)


def _one_line(error: BaseException) -> str:
    message = " ".join(str(error).split()) or "(no message)"
    plain = (ValueError, TypeError, FileNotFoundError, RuntimeError, ImportError)
    return message if isinstance(error, (*plain, UserError)) else f"{type(error).__name__}: {message}"


class UserError(Exception):
    """Bad input found by the command line itself (a flag's value); the message names the flag."""


_USAGE_ERRORS = (UserError, ValueError, TypeError, FileNotFoundError)


def check_device(device: str | None, flag: str = "--device") -> None:
    """Refuse, before any loading, a device that does not parse or is not there (cuda without CUDA)."""
    if device is None or device == "auto":
        return
    import torch

    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError):
        raise UserError(f"{flag} must name a torch device (cpu, cuda, cuda:1, auto), got {device!r}") from None
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError(f"{flag} {device}: CUDA is not available here (torch {torch.__version__}, "
                            f"{'no GPU found' if torch.version.cuda else 'a CPU-only build'}); use --device cpu")
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise UserError(f"{flag} {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif parsed.type != "cpu" and not getattr(getattr(torch, parsed.type, None), "is_available", lambda: True)():
        raise UserError(f"{flag} {device}: {parsed.type} is not available here; use --device cpu")


def load_checkpoint(name: str, flag: str, **load_kwargs):
    """dllm.load with the failures a user can fix said in one line naming the flag (missing folder, hub
    id not reachable or not found)."""
    import dllm

    path = Path(name).expanduser()
    if not path.is_dir() and (path.exists() or name.startswith((".", "/", "~")) or name.count("/") > 1
                              or os.sep in name.rstrip(os.sep) and not _hub_shaped(name)):
        raise UserError(f"{flag} {name}: no such folder (a checkpoint folder or a hub id such as org/model)")
    if path.is_dir():
        return dllm.load(str(path), **load_kwargs)
    if not _hub_shaped(name):
        raise UserError(f"{flag} {name}: no such folder, and not a hub id (org/model)")
    try:
        return dllm.load(name, **load_kwargs)
    except OSError as error:  # huggingface_hub's and transformers' errors for ids they cannot fetch
        from dllm.models.loading import HubUnreachableError

        offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
        why = ("HF_HUB_OFFLINE is set and it is not in the local hub cache" if offline
               else error.reason if isinstance(error, HubUnreachableError) else _one_line(error).split(". ")[0])
        raise UserError(f"{flag} {name}: no such folder, and the hub could not provide it ({why}); "
                        "pass a local checkpoint folder or a reachable hub id") from None


def _hub_shaped(name: str) -> bool:
    """``org/model`` or ``model``: the names the hub accepts (letters, digits, - _ .)."""
    import re

    return re.fullmatch(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?", name) is not None


STATS_HELP = """\
the line after the answer (each field defined in dllm.stats.DecodeStats):
  N new tokens in Ts (X tok/s)  tokens generated, prompt excluded and nothing after the end of the answer;
                                T: the decoding loop's wall time (loading excluded)
  model calls N (+M draft)      forward calls of the model (NFE: one batched call counts once), and of
                                ar_spec's separate drafter model (0 when fef drafts from the model itself
                                or ar_spec from n-grams)
  tokens/call                   new tokens / model calls; a call that only fills a cache (with the
                                prompt) emits nothing, so one-token-per-call samplers (sequential) can
                                sit just below 1
  mean acceptance length        new tokens / rounds, a round being one step of the sampler: speculative
                                samplers (fef, ar_spec) count the accepted drafts plus the round's
                                correction or bonus token; the others (llada, dream, fast_dllm, eb,
                                sequential, ar) draft nothing, and it is the tokens committed per step
  exact / approximate sampler   exact: the output follows exactly the law of the one-token-per-call
                                reference (sequential for diffusion models, ar for causal ones) at this
                                temperature and order; approximate: no such guarantee (llada, dream,
                                fast_dllm, eb, or an approximate cache or verifier)"""


def _add_generate(p: argparse.ArgumentParser) -> None:
    from dllm.models.loading import KINDS
    from dllm.samplers import SAMPLERS

    p.add_argument("prompt", nargs="?", help=f"the text to continue (default: the demo question {_DEFAULT_PROMPT!r}, "
                   "said on stderr)")
    p.add_argument("--model", help="a folder, a hub id, or a shipped model's name (diffusion, ar, two_stream, ...) "
                   "for dllm.load (default: the shipped model for the sampler)")
    p.add_argument("--kind", default="auto",
                   help="dllm.load kind (from dllm.models.loading.KINDS): " + ", ".join(KINDS))
    by_kind = {kind: [name for name, spec in SAMPLERS.items() if spec.model_kind == kind]
               for kind in ("diffusion", "causal", "any")}
    others = ", ".join(name for name in by_kind["diffusion"] if name != "fef")
    p.add_argument("--sampler", default="fef", metavar="SAMPLER",
                   help=f"fef (default), or for diffusion models {others}; for causal models "
                        f"{', '.join(by_kind['causal'])}; for either {', '.join(by_kind['any'])} (the checkpoint's own "
                        "loop)")
    p.add_argument("--drafter", help="ar_spec drafter: 'ngram', 'head', a model folder or a shipped model's name "
                   "(default: the model's own measured default, its sampler_defaults.json: with the shipped AR model "
                   "ar_diffusion_drafter, the shipped diffusion model distilled toward it, 8 drafts per round; else "
                   "'ngram'; the shipped causal drafter is 'drafter')")
    p.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS,
                   help=f"new tokens to generate; a row ends early at a stop token (default {MAX_NEW_TOKENS})")
    p.add_argument("--temperature", type=float, default=TEMPERATURE, help=f"0 is greedy (default {TEMPERATURE})")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling generator (default 0)")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="sampler option, read as the option's type: --option window=4 --option cache=none "
                        "(defaults: README, 'Defaults')")
    p.add_argument("--raw", action="store_true",
                   help="use the prompt as is (the shipped models otherwise get 'Question: ...\\nAnswer:')")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=DTYPE, choices=DTYPES,
                   help="auto (default): bfloat16 on GPUs and CPUs with native bf16, else float32")
    p.add_argument("--show-steps", action="store_true", help="print the canvas after every round")
    p.add_argument("--trace", metavar="FILE", help="write the denoising trajectory as .html or .png")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--logprobs", type=int, metavar="K", help="print each generated token's log-probability and the K "
                   "most likely tokens at its position (0: the token's alone; exact samplers: the probability of "
                   "what was sampled under their chain)")
    p.add_argument("--logprobs-mode", default=LOGPROBS_MODE, choices=LOGPROBS_MODES,
                   help=f"sampled: the law each token was drawn from (temperature applied; default); raw: the "
                        f"model's at temperature 1 (default {LOGPROBS_MODE})")
    p.add_argument("--demo", action="store_true", help="run on the built-in HMM oracle (no model files needed)")


def _generate(args: argparse.Namespace) -> int:
    import torch

    from dllm.samplers import SAMPLERS, parse_options

    if args.sampler not in SAMPLERS:
        raise UserError(f"--sampler must be one of {sorted(SAMPLERS)}, got {args.sampler!r}")
    options = parse_options(args.sampler, args.option)
    _check_max_new_tokens(args.max_new_tokens)
    if args.logprobs is not None and args.logprobs < 0:
        raise UserError(f"--logprobs must be >= 0 (the alternatives shown per token), got {args.logprobs}")
    check_device(args.device)
    if args.trace:  # before decoding: a missing plotting library must not cost a whole run
        from dllm.eval.study.trace import check_trace_path

        check_trace_path(args.trace)
    causal = SAMPLERS[args.sampler].model_kind == "causal"
    path = args.model or str(DEFAULTS["ar" if causal else "diffusion"])
    if args.demo or (args.model is None and not Path(path).exists()):
        return _demo(args, options, missing=None if args.demo else path)
    started = time.perf_counter()
    model = _load(path, "--model", args.kind, args.device, args.dtype)
    tokenizer = model.tokenizer
    if tokenizer is None:
        raise UserError(f"--model {path}: the checkpoint has no tokenizer, and dllm generate takes text")
    if args.sampler == "ar_spec" and "drafter" not in options and args.drafter is not None:
        # without --drafter, the model's own measured default drafts (its sampler_defaults.json: the shipped AR
        # model names ar_diffusion_drafter with 8 drafts a round), as in generate and dllm bench; else n-grams
        options["drafter"] = _drafter(args)
    elif args.drafter is not None:
        raise UserError(f"--drafter is for --sampler ar_spec, got --sampler {args.sampler}")
    if args.prompt is None:  # said once the model is there to decode it (a failure before stays one line)
        print(f"no prompt given: using the demo question {_DEFAULT_PROMPT!r}", file=sys.stderr)
        args.prompt = _DEFAULT_PROMPT
    from dllm.models.loading import is_shipped

    text = _format_prompt(args, tokenizer, default_model=args.model is None or is_shipped(args.model))
    from dllm.eval.runner import model_device

    ids = torch.tensor([tokenizer(text, add_special_tokens=not args.chat)["input_ids"]], device=model_device(model))
    if not args.json:
        print(f"model {path} ({type(model).__name__}), sampler {args.sampler}, loaded in "
              f"{time.perf_counter() - started:.1f}s", flush=True)
    events: list[StepEvent] = []
    if args.show_steps or args.trace:
        options["callback"] = _recorder(events, tokenizer, model, args.show_steps and not args.json)
    with torch.inference_mode():
        out = _run(model, ids, args, options)
    answer = out.sequences[0, ids.shape[1]:]
    completion = tokenizer.decode(answer[: int(out.stats.new_tokens)], skip_special_tokens=True)
    if args.trace:
        from dllm.eval.study.trace import render_trace
        from dllm.stops import resolve as resolve_stops

        written = render_trace(events, tokenizer, args.trace, prompt_length=ids.shape[1],
                               mask_token_id=getattr(model, "mask_token_id", None),
                               stop_token_ids=resolve_stops(model))  # generate's stops: columns after go
        print(f"trace written to {written.resolve()}", file=sys.stderr)
    tokens = _token_logprobs(out, tokenizer, ids.shape[1]) if args.logprobs is not None else None
    if args.json:
        print(json.dumps({"model": path, "sampler": args.sampler, "options": out.options, "prompt": text,
                          "completion": completion, "exact": out.exact, "stats": out.stats.to_dict(),
                          **({} if tokens is None else {"logprobs_mode": out.logprobs_mode, "tokens": tokens})}))
        return 0
    print(text + completion)
    if tokens is not None:
        _print_logprobs(tokens, out)
    _print_stats(out)
    return 0


def _token_logprobs(out, tokenizer, start: int) -> list[dict]:
    """The first row's generated tokens with their log-probabilities and top alternatives (up to its stop)."""
    new = int(out.stats.new_tokens)
    ids = out.sequences[0, start : start + new].tolist()
    rows = []
    for j, token in enumerate(ids):
        top = [(tokenizer.decode([t]), round(float(v), 6)) for t, v in
               zip(out.top_token_ids[0, j].tolist(), out.top_logprobs[0, j].tolist()) if t >= 0]
        rows.append({"token": tokenizer.decode([token]), "id": token, "logprob": round(float(out.logprobs[0, j]), 6),
                     "top": top})
    return rows


def _print_logprobs(tokens: list[dict], out) -> None:
    total = sum(t["logprob"] for t in tokens)
    law = "the chain sampled" if out.exact else "the marginals committed from (an approximate sampler)"
    print(f"-- log-probabilities ({out.logprobs_mode}, under {law}; sum {total:.4f}):")
    for t in tokens:
        top = ", ".join(f"{text!r} {value:.3f}" for text, value in t["top"])
        print(f"  {t['token']!r:>12} {t['logprob']:9.4f}" + (f"   top: {top}" if top else ""))


def _check_max_new_tokens(value: int) -> None:
    if value < 1:
        raise UserError(f"--max-new-tokens must be >= 1, got {value}")


def _run(model, ids, args, options):
    import torch

    import dllm

    wanted = {} if args.logprobs is None else {"logprobs": True, "top_logprobs": args.logprobs,
                                                 "logprobs_mode": args.logprobs_mode}
    return dllm.generate(model, ids, sampler=args.sampler, max_new_tokens=args.max_new_tokens,
                         temperature=args.temperature, generator=torch.Generator(ids.device).manual_seed(args.seed),
                         **wanted, **options)


def _load(path: str, flag: str, kind: str, device, dtype):
    from dllm.defaults import resolve_dtype

    model = load_checkpoint(path, flag, kind=kind, device=device, dtype=resolve_dtype(dtype, device, "--dtype"))
    if hasattr(model, "eval"):
        model.eval()
    return model


def _drafter(args):
    if args.drafter in ("ngram", "head"):
        return args.drafter
    return _load(args.drafter, "--drafter", "auto", args.device, args.dtype)


def _format_prompt(args, tokenizer, default_model: bool) -> str:
    if args.chat:
        import dllm

        return dllm.apply_chat_template(tokenizer, args.prompt)
    if default_model and not args.raw:  # the shipped models were trained on this format
        from dllm.data.synthetic import format_example

        return format_example(args.prompt)
    return args.prompt


def _recorder(events: list[StepEvent], tokenizer, model, show: bool):
    """A sampler callback that keeps every step's event and optionally prints the canvas."""
    mask_id = getattr(model, "mask_token_id", None)
    stops = set(getattr(model, "stop_token_ids", None) or [getattr(model, "eos_token_id", None)]) - {None}

    def record(event: StepEvent) -> None:
        kept = event.detached()
        events.append(kept)
        if show:
            row = kept.x[0].tolist()
            print(f"  step {len(events):3d} | " + render_canvas(row, tokenizer, mask_id, _emitted(kept), stops))

    return record


def _emitted(event: StepEvent) -> set[int]:
    """Canvas positions revealed by this step (first row)."""
    if event.revealed is None:
        return set()
    first = event.revealed[0]
    if first.dtype == torch_bool():
        return {int(i) + event.offset for i in first.nonzero().flatten()}
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
    """One line of DecodeStats; what each part counts: STATS_HELP, the epilog of ``dllm generate --help``."""
    s = out.stats
    print(f"-- {s.new_tokens} new tokens in {s.wall_time_s:.2f}s ({s.tokens_per_second:.1f} tok/s), "
          f"model calls {s.nfe} (+{s.nfe_draft} draft), tokens/call {s.tokens_per_call:.2f}, "
          f"mean acceptance length {s.mean_acceptance_length:.2f}, "
          f"{'exact' if out.exact else 'approximate'} sampler")


def _demo(args: argparse.Namespace, options: dict, missing: str | None) -> int:
    """The HMM oracle demo: a model whose exact distribution is known, standing in for a real LM.

    ``missing``: the shipped model folder that was not found (None when ``--demo`` asked for the demo).
    """
    import torch

    import dllm

    oracle = dllm.HMMOracle.random(num_states=4, num_tokens=len(DEMO_ALPHABET), seed=0, stickiness=3.0,
                                   sharpness=2.0)
    if args.prompt is not None and not set(args.prompt) <= set(DEMO_ALPHABET):
        raise UserError(f"the demo's prompt must use only the letters {DEMO_ALPHABET!r}, got {args.prompt!r}")
    prompt = args.prompt or "abca"
    ids = torch.tensor([[DEMO_ALPHABET.index(c) for c in prompt]])
    model = oracle.as_causal() if _model_kind(args.sampler) == "causal" else oracle
    letters = lambda row: "".join("_" if t == oracle.mask_token_id else DEMO_ALPHABET[t] for t in row)  # noqa: E731
    if args.show_steps and not args.json:
        options["callback"] = lambda event: print("  step:", letters(event.x[0].tolist()))
    out = dllm.generate(model, ids, sampler=args.sampler, max_new_tokens=args.max_new_tokens,
                        temperature=args.temperature, generator=torch.Generator().manual_seed(args.seed), **options)
    text = letters(out.sequences[0].tolist())
    if args.json:
        print(json.dumps({"model": "hmm-oracle-demo", "sampler": args.sampler, "options": out.options,
                          "text": text, "stats": out.stats.to_dict(), "exact": out.exact}))
        return 0
    why = f"no model files at {missing}" if missing else "--demo"
    print(f"HMM oracle demo ({why}; exact conditionals), sampler {args.sampler}, temperature {args.temperature}")
    print(f"{prompt} | {text[len(prompt):]}")
    _print_stats(out)
    return 0


def _model_kind(sampler: str) -> str:
    from dllm.samplers import SAMPLERS

    return SAMPLERS[sampler].model_kind


if __name__ == "__main__":  # `python -m dllm.cli`: run the imported module's main, so that its UserError is
    from dllm.cli import main as _main  # the class the commands raise (this __main__ copy has its own)

    sys.exit(_main())
