"""How many calls lie between `dllm.generate` and a model's forward: the plumbing depth ARCHITECTURE.md
bounds (tests/test_call_depth.py holds it).

    python -m dllm.eval.study.call_depth                 # fef, block cache, on a tiny random block-causal model
    python -m dllm.eval.study.call_depth --cache none --window 3

How it counts: `sys.setprofile` watches every Python call during one `dllm.generate`; each time the
model's forward is entered (a method named in `FORWARDS`, defined on the model's class, with no such
method already on the stack) the stack is read back to `generate`'s frame. The depth is the
number of frames below `generate` down to and including the model's method, counting only the
project's own files (`dllm/`, `samplers/`, `kernels/`, `eval/`): torch's `Module.__call__` machinery
between a `model(x)` and `forward` is torch's, and is shown apart as `torch frames`. Each distinct
chain is printed once, with how often it ran; the reported depth is the longest chain.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from types import CodeType, FrameType

import torch

import dllm
from dllm.models.transformer import TransformerConfig, TransformerLM

# The folders whose frames count as the project's plumbing (they install as dllm.*; see pyproject).
_PROJECT = tuple(str(Path(__file__).resolve().parents[2] / part) for part in ("dllm", "samplers", "kernels", "eval"))


# The model methods that compute logits (`new_cache`, `context_length`, ... are not forwards).
FORWARDS = ("__call__", "forward", "forward_cached", "structured_verify", "native_generate")


@dataclass(frozen=True)
class Chain:
    """One path from `generate` (excluded) to the model's method (included), outermost first."""

    frames: tuple[str, ...]  # "file:function" of each project frame
    torch_frames: int  # frames outside the project on that path (torch's module call machinery)

    @property
    def depth(self) -> int:
        return len(self.frames)


def model_codes(model: torch.nn.Module) -> set[CodeType]:
    """Code objects of the `FORWARDS` defined on the model's own class (and its non-torch base classes)."""
    codes = set()
    for cls in type(model).__mro__:
        if cls.__module__.startswith("torch"):
            continue
        for name, value in vars(cls).items():
            code = getattr(value, "__code__", None)
            if name in FORWARDS and isinstance(code, CodeType):
                codes.add(code)
    return codes


_ROOT = Path(__file__).resolve().parents[2]


def _label(frame: FrameType) -> str:
    """``file:function``, the file relative to the repository (``samplers/fef/round.py:round``)."""
    path = Path(frame.f_code.co_filename).resolve()
    where = path.relative_to(_ROOT) if path.is_relative_to(_ROOT) else Path(path.parent.name, path.name)
    return f"{where.as_posix()}:{frame.f_code.co_name}"


def record_chains(run, model: torch.nn.Module, entry: CodeType = dllm.generate.__code__,
                  project: tuple[str, ...] = _PROJECT) -> Counter[Chain]:
    """Call `run()` and count the chains from the frame running `entry` to each outermost model entry
    (`project`: path prefixes of the files whose frames count)."""
    targets = model_codes(model)
    chains: Counter[Chain] = Counter()

    def profile(frame: FrameType, event: str, arg) -> None:
        if event != "call" or frame.f_code not in targets:
            return
        frames, others, caller = [], 0, frame
        while caller is not None and caller.f_code is not entry:
            if caller is not frame and caller.f_code in targets:
                return  # the model calling itself: not a new entry from the plumbing
            if caller.f_code.co_filename.startswith(project):
                frames.append(_label(caller))
            else:
                others += 1
            caller = caller.f_back
        if caller is not None:  # entered under `entry`
            chains[Chain(tuple(reversed(frames)), others)] += 1

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(previous)
    return chains


def tiny_block_causal(seed: int = 0) -> TransformerLM:
    """A random two-layer block-causal transformer (block 4, vocabulary 40): no weights to download."""
    torch.manual_seed(seed)
    config = TransformerConfig(vocab_size=40, dim=32, n_layers=2, n_heads=2, max_seq_len=64, layout="block_causal",
                               block_size=4, mask_token_id=2, eos_token_id=None)
    return TransformerLM(config).eval()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sampler", default="fef")
    parser.add_argument("--cache", default="block", help="fef's cache option (block, none, auto, ...)")
    parser.add_argument("--window", type=int, default=3)
    parser.add_argument("--draft", default="marginal", help="fef's draft source (marginal, stale, head)")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    args = parser.parse_args(argv)
    model = tiny_block_causal()
    prompt = torch.tensor([[5, 9, 7, 11]])
    options = {"cache": args.cache, "window": args.window, "block_length": 4, "draft": args.draft} \
        if args.sampler == "fef" else {}

    def run():
        with torch.no_grad():
            dllm.generate(model, prompt, sampler=args.sampler, max_new_tokens=args.max_new_tokens, temperature=1.0,
                          generator=torch.Generator().manual_seed(0), eos_token_id=None, **options)

    chains = record_chains(run, model)
    if not chains:
        print("the model was never entered under dllm.generate")
        return 1
    for chain, times in sorted(chains.items(), key=lambda item: -item[0].depth):
        print(f"depth {chain.depth} ({times} calls, {len(set(f.split(':')[0] for f in chain.frames))} files, "
              f"{chain.torch_frames} torch frames): generate -> " + " -> ".join(chain.frames))
    print(f"calls from dllm.generate to the model's forward: at most {max(c.depth for c in chains)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
