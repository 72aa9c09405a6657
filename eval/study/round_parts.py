"""Where a speculative round's time goes: the drafter, the target's call, the verification rule, the rest.

    python -m dllm.eval.study.round_parts                      # ar_spec and fef on the shipped models, batch 1 and 8
    python -m dllm.eval.study.round_parts --batch-size 1 \
        --config "model=ar;sampler=ar_spec;drafter=head;num_draft_tokens=8"

Each part is the wall time inside one mechanism of the round, summed over a run of ``dllm.generate`` on the study's
prompts and divided by the loop's steps (``DecodeStats.steps``: one round of every row together): the functions
the round calls by name are wrapped with a clock (``PARTS``), and the model calls, target's and drafter's apart,
are clocked through ``dllm.counting.ModelClock``. The parts are exclusive: a drafter's model calls are taken out
of its ``propose``, the target's out of the call that builds its inputs. "other" is what no part covers (the
loop, the reveal, stop checks, Python between them). The device is synchronised around every clocked part, so
on a GPU the total is slower than an unclocked run; the shares are what to read. This is a profile, not a
benchmark: speed-ups come from ``dllm bench`` (whose clocked pass gives the same non-model share per run).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import time
from collections import defaultdict

import torch

import dllm
from dllm.counting import CountingModel, ModelClock
from dllm.defaults import resolve_dtype
from dllm.numerics import synchronize

# Each sampler layout's parts: (module, attribute, part). The attribute is looked up where the round calls it.
PARTS = {
    "ar_spec": (("dllm.samplers.ar_spec.decode", "_target_rows", "target call: inputs"),
                ("dllm.samplers.ar_spec.decode", "_tree_rows", "target call: inputs"),
                ("dllm.samplers.ar_spec.decode", "cut_draft", "adaptive k"),
                ("dllm.samplers.ar_spec.decode", "more_candidates", "tree: candidates"),
                ("dllm.samplers.ar_spec.decode", "rejection_sample", "verify rule"),
                ("dllm.samplers.ar_spec.decode", "_keep_features", "target features kept"),
                ("dllm.samplers.ar_spec.decode", "emitted_until_stop", "stops"),
                ("dllm.samplers.ar_spec.decode", "_feature_context", "drafter: context")),
    "two_stream": (("dllm.samplers.fef.two_stream", "_drafts", "drafter: propose"),
                   ("dllm.samplers.fef.two_stream", "_queries", "target call: inputs"),
                   ("dllm.samplers.fef.two_stream", "rejection_sample", "verify rule"),
                   ("dllm.samplers.fef.two_stream", "_store_drafts", "next drafts stored"),
                   ("dllm.samplers.fef.two_stream", "_set_pending", "next drafts stored")),
    "copies": (("dllm.samplers.fef.round", "choose_window", "window"),
               ("dllm.samplers.fef.round", "build_copies", "target call: inputs"),
               ("dllm.samplers.fef.round", "pick_next", "copies' picks"),
               ("dllm.samplers.fef.round", "rejection_sample", "verify rule")),
}

DEFAULT_CONFIGS = (
    "model=ar;sampler=ar_spec;drafter=head;num_draft_tokens=8",
    "model=ar;sampler=ar_spec;drafter=ar_diffusion_drafter;num_draft_tokens=8",
    "model=two_stream;sampler=fef;window=8;draft=head",
    "model=diffusion;sampler=fef;window=4",
)


class PartClock:
    """Wall time per part, exclusive of the model calls inside it (a ``ModelClock`` shared with the models)."""

    def __init__(self, device):
        self.device, self.models = device, ModelClock()
        self.seconds: dict[str, float] = defaultdict(float)
        self._inside: str | None = None

    def wrap(self, function, part: str):
        @functools.wraps(function)
        def clocked(*args, **kwargs):
            if self._inside is not None:  # a part inside another counts in the outer one
                return function(*args, **kwargs)
            synchronize(self.device)
            before = sum(self.models.seconds.values())
            start, self._inside = time.perf_counter(), part
            try:
                return function(*args, **kwargs)
            finally:
                synchronize(self.device)
                self._inside = None
                inside_models = sum(self.models.seconds.values()) - before
                self.seconds[part] += time.perf_counter() - start - inside_models
        return clocked


@contextlib.contextmanager
def clocked_parts(clock: PartClock, layout: str):
    """The layout's ``PARTS`` wrapped with ``clock`` while the block runs (restored after)."""
    saved = []
    try:
        for module_name, attribute, part in PARTS[layout]:
            module = importlib.import_module(module_name)
            saved.append((module, attribute, getattr(module, attribute)))
            setattr(module, attribute, clock.wrap(getattr(module, attribute), part))
        yield
    finally:
        for module, attribute, value in reversed(saved):
            setattr(module, attribute, value)


@contextlib.contextmanager
def clocked_drafter(clock: PartClock):
    """The drafter ar_spec builds with its ``propose`` and ``rollback`` clocked as parts (``_make_drafter`` is
    wrapped to wrap what it returns)."""
    from dllm.samplers.ar_spec import decode

    make = decode._make_drafter

    def made(*args, **kwargs):
        drafter = make(*args, **kwargs)
        drafter.propose = clock.wrap(drafter.propose, "drafter: propose")
        drafter.rollback = clock.wrap(drafter.rollback, "rollback")
        return drafter

    decode._make_drafter = made
    try:
        yield
    finally:
        decode._make_drafter = make


def layout_of(model, sampler: str) -> str:
    from dllm.protocols import capabilities

    if sampler == "ar_spec":
        return "ar_spec"
    return "two_stream" if capabilities(model).reveal_order_cache else "copies"


def profile(model, prompts: list[list[int]], sampler: str, batch_size: int, max_new_tokens: int,
            drafter_model=None, device: torch.device | None = None, **options) -> dict:
    """One clocked run over ``prompts`` (batches of similar lengths, left padded as ``dllm bench`` makes them;
    greedy) -> {"rounds", "total_s", "parts": {part: seconds}} with the model calls as "target model" / "drafter
    model" and what is left as "other".
    ``drafter_model``: ar_spec's drafter when it is a model (clocked as the drafter's calls)."""
    device = torch.device("cpu") if device is None else device
    clock = PartClock(device)
    layout = layout_of(model, sampler)
    target = CountingModel(model, lambda call: None, clock=clock.models)
    if drafter_model is not None:  # ar_spec's drafter option, a model
        options["drafter"] = CountingModel(drafter_model, lambda call: None, draft=True, clock=clock.models)
    from dllm.eval.study.bench import make_batches

    rounds, total = 0, 0.0
    with clocked_parts(clock, layout), clocked_drafter(clock), torch.inference_mode():
        for batch in make_batches(prompts, batch_size, getattr(model, "pad_token_id", None) or 0, device):
            synchronize(device)
            began = time.perf_counter()
            out = dllm.generate(target, batch.input_ids, sampler=sampler, max_new_tokens=max_new_tokens,
                                temperature=0.0, attention_mask=batch.attention_mask, **options)
            synchronize(device)
            total += time.perf_counter() - began
            rounds += out.stats.steps
    parts = dict(clock.seconds)
    parts["target model"], parts["drafter model"] = clock.models.seconds[False], clock.models.seconds[True]
    parts["other"] = max(0.0, total - sum(parts.values()))
    return {"rounds": rounds, "total_s": total, "parts": parts}


def main(argv: list[str] | None = None) -> int:
    from dllm.eval.study.bench import DEFAULT_MODELS, parse_config
    from dllm.models.loading import load

    parser = argparse.ArgumentParser(prog="python -m dllm.eval.study.round_parts", description=__doc__.split("\n")[0])
    parser.add_argument("--config", action="append", help="a bench configuration (model=...;sampler=...;options)")
    parser.add_argument("--batch-size", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = resolve_dtype(args.dtype, device, "--dtype")
    loaded = {}

    def model(name):
        if name not in loaded:
            loaded[name] = load(DEFAULT_MODELS.get(name, name), dtype=dtype, device=device).eval()
        return loaded[name]

    from dllm.eval import get_task

    task = get_task("synthetic")
    texts = [task.prompt(p, chat=False) for p in task.load(limit=args.num_prompts)]
    for spec in args.config or DEFAULT_CONFIGS:
        config = parse_config(f"name=x;{spec}")
        target = model(config.model)
        prompts = target.tokenizer(texts, add_special_tokens=False)["input_ids"]
        drafter = model(config.drafter) if config.drafter else None  # else "ngram", "head" or none: an option
        options = {k: v for k, v in config.options.items() if not (k == "drafter" and drafter is not None)}
        for batch_size in args.batch_size:
            profile(target, prompts[:2], config.sampler, batch_size, 8, drafter, device, **options)  # warm-up
            found = profile(target, prompts, config.sampler, batch_size, args.max_new_tokens, drafter, device,
                            **options)
            per_round = found["total_s"] / found["rounds"] * 1e3
            print(f"{spec}  batch {batch_size}: {found['rounds']} rounds, {per_round:.2f} ms per round")
            for part, seconds in sorted(found["parts"].items(), key=lambda kv: -kv[1]):
                print(f"  {part:<24} {seconds / found['rounds'] * 1e3:7.2f} ms  {seconds / found['total_s']:6.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
