"""`dllm eval TASK`: decode a benchmark with any model and sampler, score it, and keep resumable results.

    dllm eval gsm8k --model PATH --sampler fef --option window=4 --limit 100 --output runs/gsm8k-fef
    torchrun --nproc_per_node 8 -m dllm.eval.runner gsm8k ...        # the same run, sharded over 8 ranks
    dllm eval report runs/gsm8k-fef runs/gsm8k-llada                  # compare runs (dllm.eval.report)

Output folder (formats in dllm.eval.report):
- `run.json`: the run's identity (task and its options, model, sampler and resolved options, decoding
  settings, seed) and one record per attempt (batch size, device, dtype, versions, git commit). A rerun
  into the folder must have the same identity; `--limit`, `--batch-size` and `--device` may change.
- `samples.jsonl`: one line per (problem, sample): id, sample, prompt, completion, the task's score
  dict (correct, answer, strict, ...), new_tokens, and `batch` (id, rows, seed, exact, its DecodeStats).
  Lines are written a whole batch at a time, then flushed and fsynced; on startup a trailing partial
  line or batch is cut off, so a kill loses at most the batch in flight and never duplicates a row.
- `summary.json`: recomputed from samples.jsonl at the end of every run.
A folder whose run saved no sample (it died before its first batch) is taken over by the next command.
Ctrl-C is held while a batch is being written, so an interrupted run keeps every batch it wrote.

Context: every prompt + --max-new-tokens is checked against the model's `context_length` before the
folder is touched; `--truncate left` keeps each prompt's last (context - max_new_tokens) tokens instead,
as lm-eval's HFLM does (BOS included in what may be cut).

Batches and seeds: work items (problem, sample) are cut into batches in benchmark order, the same way
for any number of ranks. Each batch is decoded by one `generate` call with its own generator, seeded
from (--seed, the first item's problem id and sample index). So with the same --batch-size a run gives
the same completions at any temperature whether it is resumed or sharded; at temperature 0 batching
does not matter at all (generate is batch-invariant there); at T > 0 a sample depends on its batch
mates (one generator serves the batch), and with --batch-size 1 only on (seed, problem id, sample).

Sharding (torchrun / accelerate launch, RANK and WORLD_SIZE set): batch b goes to rank b % WORLD_SIZE
(with --batch-size 1 that is problem i on rank i % WORLD_SIZE). Each rank appends to its own
`shard-RANK.jsonl`; after a gloo barrier rank 0 merges the shards into samples.jsonl and writes the
summary. The output folder must be shared by all ranks (one machine, or a shared file system).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import hashlib
import json
import operator
import os
import platform
import secrets
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

import dllm
from dllm.defaults import DTYPE, DTYPES, EVAL_MAX_NEW_TOKENS, TEMPERATURE, resolve_dtype
from dllm.eval.answers import truncate_at_stop
from dllm.eval.data import DataError
from dllm.eval.presets import PRESETS, get_preset
from dllm.eval.report import RUN_FILE, SAMPLES_FILE, SUMMARY_FILE, load_samples, parse_samples, summarize_folder
from dllm.eval.tasks import TASKS, get_task
from dllm.models.chat import has_chat_template
from dllm.models.loading import KINDS
from dllm.numerics import left_pad
from dllm.protocols import accepts_attention_mask, context_length, is_causal_model, max_prompt_length, padding_refusal
from dllm.samplers import SAMPLERS, parse_options
from dllm.stops import answer_lengths, resolve

__all__ = ["EvalConfig", "EvalError", "batch_seed", "default_model", "left_pad", "main", "model_device", "parse_value",
           "run"]

PACKAGE_DIR = Path(dllm.__file__).resolve().parent
DIST_TIMEOUT = datetime.timedelta(hours=24)  # ranks wait at the final barrier for the slowest one
NOT_IDENTITY = ("limit", "batch_size", "device", "output", "progress")  # may change when resuming
TRUNCATE = ("left",)  # --truncate: how a prompt too long for the model's context is cut (lm-eval's way)
INTERRUPTED = 130  # exit status after Ctrl-C (128 + SIGINT), as shells report it


class EvalError(Exception):
    """A problem with the command or the output folder, reported to the user without a traceback."""


@dataclass(frozen=True)
class EvalConfig:
    """Everything one `dllm eval TASK` run needs (the command line's flags)."""

    task: str
    model: str | None = None  # None: the shipped default for the sampler's model kind
    kind: str = "auto"
    dtype: str | None = DTYPE  # "auto": dllm.defaults.auto_dtype on the run's device; None: the checkpoint's
    device: str | None = None  # None: cuda:LOCAL_RANK when CUDA is available, else CPU
    sampler: str = "fef"
    options: dict[str, Any] = field(default_factory=dict)
    max_new_tokens: int | None = None  # None: EVAL_MAX_NEW_TOKENS, capped at the room the context leaves
    temperature: float = TEMPERATURE
    limit: int | None = None
    batch_size: int = 8
    seed: int = 0
    output: str = "eval_results"
    num_fewshot: int | None = None
    chat: bool = False
    data_file: str | None = None
    subset: str | None = None
    num_samples: int = 1
    progress: bool = True
    truncate: str | None = None  # None: a prompt that does not fit the model's context is an error
    preset: str | None = None  # the family preset these settings came from (eval/presets.py), if any

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise EvalError(f"unknown task {self.task!r}; choose one of {sorted(TASKS)}")
        if self.sampler not in SAMPLERS:
            raise EvalError(f"unknown sampler {self.sampler!r}; choose one of {sorted(SAMPLERS)}")
        for name in ("max_new_tokens", "batch_size", "num_samples", "limit"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise EvalError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        if self.temperature < 0:
            raise EvalError(f"--temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if self.truncate is not None and self.truncate not in TRUNCATE:
            raise EvalError(f"--truncate must be one of {list(TRUNCATE)} (or absent), got {self.truncate!r}")
        if self.data_file is not None and not Path(self.data_file).is_file():
            what = "is not a file" if Path(self.data_file).exists() else "does not exist"
            raise EvalError(f"--data-file {self.data_file} {what}")
        subsets = TASKS[self.task].subsets
        if self.subset is not None and self.subset not in subsets:
            raise EvalError(f"--subset {self.subset!r} is not a subset of {self.task}; choose one of {list(subsets)}"
                            if subsets else f"--subset: task {self.task} has no subsets, got {self.subset!r}")

    def task_options(self) -> dict[str, Any]:
        """The task constructor's keywords that were set on the command line."""
        given = {"num_fewshot": self.num_fewshot, "subset": self.subset, "data_file": self.data_file,
                 "chat": self.chat or None}
        return {k: v for k, v in given.items() if v is not None}


# ------------------------------------------------------------------ command line


def parse_value(text: str) -> Any:
    """An option value from the command line: int, float, bool, None, else the string itself."""
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"none": None, "null": None, "true": True, "false": False}.get(text.lower(), text)


def _parse_options(sampler: str, items: Sequence[str]) -> dict[str, Any]:
    """--option text typed by what each option of the sampler expects (samplers.parse_options)."""
    try:
        return parse_options(sampler, items)
    except ValueError as error:
        raise EvalError(str(error)) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dllm eval", description="Evaluate a model and sampler on a benchmark "
                                "(or `dllm eval report DIR...` to compare runs).")
    p.add_argument("task", choices=sorted(TASKS))
    p.add_argument("--model", help="checkpoint folder or hub id (default: the shipped model for the sampler)")
    p.add_argument("--kind", default="auto", choices=KINDS, help="how dllm.load reads the checkpoint")
    p.add_argument("--dtype", default=DTYPE, choices=DTYPES,
                   help="auto (default: bfloat16 on GPUs and CPUs with native bf16, else float32)")
    p.add_argument("--device", help="e.g. cuda:0 or cpu (default: cuda:LOCAL_RANK when available)")
    p.add_argument("--preset", choices=sorted(PRESETS),
                   help="a family's published decoding (sampler, options, temperature, chat template, answer length: "
                        "eval/presets.py); flags given explicitly win over it")
    p.add_argument("--sampler", default=None, choices=sorted(SAMPLERS), help="default fef (or the preset's)")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="sampler option, repeatable: --option window=4 --option order=confidence; "
                        "--option drafter=PATH loads an ar_spec drafter with dllm.load")
    p.add_argument("--max-new-tokens", type=int,
                   help=f"default {EVAL_MAX_NEW_TOKENS}, or less where the model's context leaves less room after the "
                        "longest prompt (an explicit value is checked strictly)")
    p.add_argument("--temperature", type=float, default=None,
                   help=f"0 is greedy (default {TEMPERATURE}, or the preset's)")
    p.add_argument("--limit", type=int, help="first N problems only")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", help="results folder (default: eval_results/TASK-SAMPLER)")
    p.add_argument("--num-fewshot", type=int, help="few-shot examples (gsm8k, mbpp)")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="zero-shot chat prompts through the tokenizer's template (default off, or the preset's)")
    p.add_argument("--data-file", help="local JSONL/JSON file of the task's problems")
    p.add_argument("--subset", help="task subset: math 500|full, mbpp full|sanitized")
    p.add_argument("--num-samples", type=int, default=1, help="samples per problem (pass@k for code tasks)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--truncate", choices=TRUNCATE, help="cut prompts longer than the model's context minus "
                   "--max-new-tokens from the left, as lm-eval does (default: refuse them before decoding)")
    return p


def config_from_args(argv: Sequence[str]) -> EvalConfig:
    args = build_parser().parse_args(argv)
    preset = get_preset(args.preset) if args.preset else None
    sampler = args.sampler or (preset.sampler if preset else "fef")
    options = _parse_options(sampler, args.option)
    if preset is not None and sampler == preset.sampler:  # the preset's options, less those given
        options = {**preset.options, **options}
    return EvalConfig(
        task=args.task, model=args.model, kind=args.kind, dtype=args.dtype, device=args.device,
        sampler=sampler, options=options,
        max_new_tokens=args.max_new_tokens if args.max_new_tokens is not None or preset is None
        else preset.max_new_tokens,
        temperature=args.temperature if args.temperature is not None else
        (preset.temperature if preset else TEMPERATURE), limit=args.limit, batch_size=args.batch_size, seed=args.seed,
        output=args.output or f"eval_results/{args.task}-{args.preset or sampler}", num_fewshot=args.num_fewshot,
        chat=args.chat if args.chat is not None else bool(preset and preset.chat), data_file=args.data_file,
        subset=args.subset, num_samples=args.num_samples, progress=not args.no_progress, truncate=args.truncate,
        preset=args.preset,
    )


def main(argv: list[str] | None = None) -> int:
    """`dllm eval TASK ...` or `dllm eval report DIR [DIR...]`; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["report"]:
        from dllm.eval.report import main as report_main

        return report_main(argv[1:])
    config = None
    try:
        config = config_from_args(argv)
        summary = run(config)
    except EvalError as error:
        if os.environ.get("DLLM_DEBUG"):
            raise
        print(f"dllm eval: {' '.join(str(error).split())}", file=sys.stderr)  # one line, even for wrapped messages
        return 2
    except KeyboardInterrupt:
        if os.environ.get("DLLM_DEBUG"):
            raise
        saved = f"; {_saved_samples(Path(config.output))} samples are saved in {config.output}" if config else ""
        print(f"dllm eval: interrupted{saved}; rerun with the same --output to resume", file=sys.stderr)
        return INTERRUPTED
    if summary is not None:
        _print_summary(summary)
    return 0


def _saved_samples(folder: Path) -> int:
    """Complete rows in the folder's samples and shard files (read only: the next run repairs them)."""
    files = [folder / SAMPLES_FILE, *sorted(folder.glob("shard-*.jsonl"))] if folder.is_dir() else []
    return sum(len(load_samples(path)) for path in files)


def _print_summary(summary: dict) -> None:
    metrics = ", ".join(f"{k} {v:.4f}" for k, v in summary["metrics"].items())
    speed, counts = summary["speed"], summary["counts"]
    print(f"{summary['task']} | {summary['sampler']} | {counts['samples']} samples: {metrics}")
    print(f"  {speed['tokens_per_second']:.1f} response tokens/s, NFE {speed['nfe']}, "
          f"{speed['tokens_per_call']:.2f} tokens/call, mean acceptance length "
          f"{speed['mean_acceptance_length']:.2f}, decode time {speed['wall_time_s']:.1f} s")


# ------------------------------------------------------------------ ranks


class _Ranks:
    """This process's rank among RANK/WORLD_SIZE, with a gloo group for barriers and small broadcasts."""

    def __init__(self) -> None:
        self.rank = int(os.environ.get("RANK", 0))
        self.world = int(os.environ.get("WORLD_SIZE", 1))
        self.group, self.owns_group = None, False
        if self.world > 1:
            import torch.distributed as dist

            if not dist.is_initialized():
                dist.init_process_group("gloo", timeout=DIST_TIMEOUT)
                self.owns_group = True
                self.group = dist.group.WORLD
            else:  # e.g. NCCL set up by the caller: barriers go through a CPU group of our own
                self.group = dist.new_group(backend="gloo", timeout=DIST_TIMEOUT)

    def broadcast(self, value: Any) -> Any:
        """Rank 0's value on every rank (also a barrier)."""
        if self.world == 1:
            return value
        import torch.distributed as dist

        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def close(self) -> None:
        if self.owns_group:
            import torch.distributed as dist

            dist.destroy_process_group()


# ------------------------------------------------------------------ the output folder


@contextmanager
def _interrupt_deferred():
    """Hold Ctrl-C (SIGINT) until the block ends, then raise it: a batch is never half-written by Ctrl-C."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield  # signal handlers can only be set from the main thread; someone else's handler stays
        return
    caught = []
    previous = signal.signal(signal.SIGINT, lambda number, frame: caught.append(number))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        raise KeyboardInterrupt


def _append_rows(path: Path, rows: Sequence[dict]) -> None:
    """Append rows with one write, then flush and fsync, so a kill leaves at most one partial batch."""
    text = "".join(json.dumps(row, default=str) + "\n" for row in rows)
    with _interrupt_deferred(), open(path, "a", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _repair(path: Path) -> list[dict]:
    """Cut a trailing partial line or batch off a samples file (in place); its complete rows."""
    if not path.is_file():
        return []
    data = path.read_bytes()
    rows, end = parse_samples(data)
    if end < len(data):
        with open(path, "r+b") as f:
            f.truncate(end)
            os.fsync(f.fileno())
    return rows


def _merge_shards(folder: Path) -> None:
    """Move the whole batches of every shard file into samples.jsonl (skipping batches already there)."""
    samples = folder / SAMPLES_FILE
    done = {_key(r) for r in _repair(samples)}
    for shard in sorted(folder.glob("shard-*.jsonl")):
        batches: dict[str, list[dict]] = {}
        for row in _repair(shard):
            batches.setdefault(row["batch"]["id"], []).append(row)
        for rows in batches.values():
            # A crash between appending and deleting the shard leaves batches that are already merged.
            if not any(_key(r) in done for r in rows):
                _append_rows(samples, rows)
                done.update(_key(r) for r in rows)
        shard.unlink()


def _key(row: dict) -> str:
    return f"{row['id']}#{row['sample']}"


def _check_identity(folder: Path, identity: dict, attempt: dict) -> None:
    """Refuse a folder holding another run's samples; record this attempt in run.json."""
    path = folder / RUN_FILE
    identity = json.loads(json.dumps(identity, default=str))  # compare as stored (tuples become lists)
    run = json.loads(path.read_text()) if path.is_file() else {"identity": identity, "attempts": []}
    old = run["identity"]
    # The options as typed are not compared: `--option window=4` and the default window=4 resolve alike.
    diffs = [f"{k}: {old.get(k)!r} in the folder, {identity.get(k)!r} now"
             for k in sorted(set(old) | set(identity)) if k != "options" and old.get(k) != identity.get(k)]
    if diffs and _saved_samples(folder) == 0:
        # A run that died before its first batch (a bad option, a prompt too long) left only run.json:
        # there is nothing to protect, so the corrected command takes the folder over.
        print(f"dllm eval: {folder} holds a run that saved no samples ({'; '.join(diffs)}); replacing it",
              file=sys.stderr)
        run, diffs = {"identity": identity, "attempts": []}, []
    if diffs:
        raise EvalError(f"{folder} holds a different run ({'; '.join(diffs)}); "
                        "use another --output or remove the folder")
    run["attempts"].append(attempt)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(run, indent=2, default=str) + "\n")
    os.replace(tmp, path)  # atomic: run.json is never half-written


def _prepare_folder(folder: Path, identity: dict, attempt: dict) -> str | None:
    """Rank 0's startup: check the identity, cut partial writes, merge shards left by a killed run."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        _check_identity(folder, identity, attempt)
        _merge_shards(folder)
    except EvalError as error:
        return str(error)
    return None


def _resume_notes(folder: Path, job: _Job, batches: list[list[_Item]]) -> list[str]:
    """What a rerun into a folder with samples should tell the user: progress, --limit, batch size at T > 0."""
    done = {_key(r) for r in load_samples(folder / SAMPLES_FILE)}
    if not done:
        return []
    planned = {job.key(i) for items in batches for i in items}
    ours, config = len(planned & done), job.config
    notes = [f"resuming: {ours} of {len(planned)} done" + (" (nothing left to decode)" if ours == len(planned) else "")]
    if len(done) > ours:
        asks = f"this --limit {config.limit} asks for" if config.limit is not None else "this run plans"
        notes.append(f"note: {folder} already holds {len(done)} samples, more than the {len(planned)} {asks}; "
                     f"the summary covers all {len(done)} (use another --output for a run of these problems only)")
    before = {a["batch_size"] for a in json.loads((folder / RUN_FILE).read_text())["attempts"][:-1]}
    if config.temperature > 0 and ours < len(planned) and before - {config.batch_size}:
        notes.append(f"warning: --batch-size {config.batch_size} differs from {sorted(before)} used before in this "
                     f"folder; at temperature {config.temperature:g} a sample depends on its batch mates, so the rest "
                     "will not match an uninterrupted run (rerun with the earlier --batch-size to match it)")
    return notes


def _finish(folder: Path) -> dict:
    """Rank 0's end: merge the shards, then recompute and write the summary."""
    _merge_shards(folder)
    summary = summarize_folder(folder)
    (folder / SUMMARY_FILE).write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return summary


# ------------------------------------------------------------------ model, task and environment


def default_model(sampler: str) -> str:
    """The shipped default checkpoint for the sampler's model kind (dllm/weights/diffusion or ar)."""
    causal = SAMPLERS[sampler].model_kind == "causal"
    folder = PACKAGE_DIR / "weights" / ("ar" if causal else "diffusion")
    if not folder.is_dir():
        raise EvalError(f"no --model given and the shipped default {'AR' if causal else 'diffusion'} model "
                        f"({folder}) is not installed; pass --model PATH_OR_HUB_ID")
    return str(folder)


def _device(config: EvalConfig) -> str | None:
    if config.device is not None:
        return config.device
    return f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if torch.cuda.is_available() else None


def _load(name: str, config: EvalConfig):
    try:
        device = _device(config)
        return dllm.load(name, kind=config.kind, device=device, dtype=resolve_dtype(config.dtype, device, "--dtype"))
    except (OSError, ValueError) as error:  # OSError: transformers' word for a hub id it cannot reach
        raise EvalError(f"cannot load {name}: {error}") from None


def _load_model(config: EvalConfig, name: str):
    model = _load(name, config)
    kind = SAMPLERS[config.sampler].model_kind
    wants_causal = kind == "causal"
    if kind != "any" and wants_causal != is_causal_model(model):
        raise EvalError(f"sampler {config.sampler!r} needs a {'causal' if wants_causal else 'diffusion'} model; "
                        f"{name} loaded as {type(model).__name__}")
    if getattr(model, "tokenizer", None) is None:
        raise EvalError(f"{name} has no tokenizer; evaluation needs one to build prompts and read answers")
    return model


def _sampler_options(config: EvalConfig, model) -> tuple[dict[str, Any], dict[str, Any]]:
    """(options for generate, with a drafter path loaded as a model; the resolved options, JSON-able)."""
    options = dict(config.options)
    drafter = options.get("drafter")
    if isinstance(drafter, str) and drafter != "ngram":
        options["drafter"] = _load(drafter, replace(config, kind="auto"))
    try:
        resolved = SAMPLERS[config.sampler].resolve(options, model=model, max_new_tokens=config.max_new_tokens)
    except (TypeError, ValueError) as error:
        raise EvalError(f"sampler {config.sampler!r}: {error}") from None
    resolved.pop("callback", None)
    if resolved.get("drafter") is not None:
        resolved["drafter"] = config.options.get("drafter", "ngram")  # the path, not the loaded model
    return options, resolved


def _build_task(config: EvalConfig):
    try:
        return get_task(config.task, **config.task_options())
    except TypeError as error:
        raise EvalError(f"task {config.task!r} does not take one of {sorted(config.task_options())}: {error}") \
            from None
    except ValueError as error:  # an option value the task refuses; its message names the option
        raise EvalError(f"task {config.task!r}: {error}") from None


def _git_commit() -> str | None:
    """The commit of the installed package's checkout, with "-dirty" for local changes; None outside git."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=PACKAGE_DIR, capture_output=True, text=True,
                                timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=PACKAGE_DIR,
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("-dirty" if dirty else "")


def _environment(config: EvalConfig, model, world: int, planned: int) -> dict:
    import transformers

    parameter = next(iter(getattr(model, "parameters", lambda: iter(()))()), None)
    return {
        "started_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "batch_size": config.batch_size,
        "limit": config.limit,
        "planned_samples": planned,
        "world_size": world,
        "device": str(parameter.device) if parameter is not None else str(_device(config) or "cpu"),
        "dtype": str(parameter.dtype).removeprefix("torch.") if parameter is not None else config.dtype,
        "versions": {"dllm": dllm.__version__, "torch": torch.__version__,
                     "transformers": transformers.__version__, "python": platform.python_version()},
        "git_commit": _git_commit(),
    }


def _identity(config: EvalConfig, model_name: str, resolved: dict) -> dict:
    """What must match for a rerun to continue a folder: everything but NOT_IDENTITY."""
    fields = {k: v for k, v in asdict(config).items() if k not in NOT_IDENTITY}
    for name in ("num_fewshot", "subset", "data_file", "chat"):
        fields.pop(name)  # kept once, as the task's options
    return {**fields, "model": model_name, "task_options": config.task_options(), "sampler_options": resolved}


# ------------------------------------------------------------------ decoding


@dataclass(frozen=True)
class _Item:
    """One sample to draw: problem index (in the loaded list) and sample number."""

    problem: int
    sample: int


@dataclass
class _Job:
    """What every batch needs: model, task, problems with their prompts, and the decoding settings."""

    config: EvalConfig
    model: Any
    task: Any
    problems: list[dict]
    prompts: list[str]
    prompt_ids: list[list[int]]
    options: dict[str, Any]
    stop_ids: tuple[int, ...] | None
    run_token: str = field(default_factory=lambda: secrets.token_hex(4))

    def key(self, item: _Item) -> str:
        return f"{self.problems[item.problem]['id']}#{item.sample}"


def _prompt_text(task, problem: dict, tokenizer) -> str:
    prompt = task.prompt(problem)
    if isinstance(prompt, str):
        return prompt
    if not has_chat_template(tokenizer):
        raise EvalError("--chat needs a tokenizer with a chat template; this model's has none")
    return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)


def _encode(config: EvalConfig, model, task) -> tuple[list[dict], list[str], list[list[int]]]:
    """The problems, their prompt texts and prompt token ids."""
    tokenizer = model.tokenizer
    try:
        problems = task.load(config.limit)
        prompts = [_prompt_text(task, p, tokenizer) for p in problems]  # few-shot examples load here
    except (DataError, FileNotFoundError) as error:  # the message names the file, line and field
        raise EvalError(str(error)) from None
    # Chat text already holds the template's special tokens; plain prompts get the tokenizer's (e.g. BOS).
    return problems, prompts, tokenizer(prompts, add_special_tokens=not config.chat)["input_ids"]


def _make_job(config: EvalConfig, model, task, options: dict) -> _Job:
    return _Job(config, model, task, *_encode(config, model, task), options, resolve(model))  # generate's stop ids


def _recorded_max_new(folder: Path) -> int | None:
    """The --max-new-tokens a folder's earlier run used (None: no earlier run), so a default resumes alike."""
    try:
        value = json.loads((folder / RUN_FILE).read_text())["identity"]["max_new_tokens"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return value if isinstance(value, int) and value >= 1 else None


def default_max_new(config: EvalConfig, model, prompt_ids: Sequence[list[int]], model_name: str) -> EvalConfig:
    """Fill an unset --max-new-tokens: EVAL_MAX_NEW_TOKENS, capped at the room the longest prompt leaves in the
    model's context (whole blocks), said in one line; half the context with --truncate left or when a prompt
    cannot fit at all (then _fit_context names it and the fixes). A folder's earlier value is kept when it
    fits, so a resume with another --limit matches. An explicit value is left to _fit_context's strict check."""
    if config.max_new_tokens is not None:
        return config
    new, limit = EVAL_MAX_NEW_TOKENS, context_length(model)
    if limit is None:
        return replace(config, max_new_tokens=new)
    longest = max(map(len, prompt_ids), default=0)
    fits = limit - longest + (1 if is_causal_model(model) else 0)  # max_prompt_length's rule, solved for new
    halved = config.truncate is not None or fits < 1
    room = limit // 2 if halved else fits
    block = config.options.get("block_length")
    block = block if isinstance(block, int) and not isinstance(block, bool) else getattr(model, "block_size", None)
    if isinstance(block, int) and block > 0 and room >= block:
        room -= room % block  # whole blocks: the default block_length stays the model's own
    recorded = _recorded_max_new(Path(config.output))
    if recorded is not None and (config.truncate is not None or recorded <= fits):
        return replace(config, max_new_tokens=recorded)
    if 1 <= room < new:
        why = (f"half of {model_name}'s context of {limit}, the rest for the prompt" if halved else
               f"the longest prompt, {longest} tokens, leaves {room} of {model_name}'s context of {limit}")
        print(f"dllm eval: --max-new-tokens {room} (the default {new} capped: {why})", file=sys.stderr)
        new = room
    return replace(config, max_new_tokens=new)


def _fit_context(job: _Job, model_name: str) -> int:
    """Check every prompt + --max-new-tokens against the model's context before decoding; with
    --truncate left, drop the prompts' oldest tokens instead (lm-eval's rule). Returns how many were cut."""
    limit, new = context_length(job.model), job.config.max_new_tokens
    room = max_prompt_length(job.model, new)  # the rule generate applies (one more token for causal models)
    if room is None or not job.prompt_ids:
        return 0
    if room < 1:
        raise EvalError(f"--max-new-tokens {new} leaves no room for a prompt in {model_name}'s context of {limit} "
                        f"tokens; use --max-new-tokens {new - 1 + room} or fewer")
    long = [i for i, ids in enumerate(job.prompt_ids) if len(ids) > room]
    if not long:
        return 0
    if job.config.truncate == "left":
        for i in long:
            job.prompt_ids[i] = job.prompt_ids[i][-room:]
        print(f"dllm eval: --truncate left: {len(long)} of {len(job.prompt_ids)} prompts cut to their last {room} "
              f"tokens to fit {model_name}'s context of {limit} with --max-new-tokens {new}", file=sys.stderr)
        return len(long)
    first, longest = long[0], max(len(job.prompt_ids[i]) for i in long)
    size = len(job.prompt_ids[first])
    fixes = []
    shots = getattr(job.task, "num_fewshot", 0)
    if shots and not job.config.chat:
        fixes.append(f"fewer few-shot examples (--num-fewshot below {shots})")
    if longest < room + new:
        fixes.append(f"fewer new tokens (--max-new-tokens {room + new - longest} fits every prompt)")
    fixes.append(f"--truncate left, which keeps each prompt's last {room} tokens (as lm-eval does)")
    raise EvalError(f"problem {job.problems[first]['id']}: its prompt is {size} tokens, and with --max-new-tokens "
                    f"{new} needs {size + new} > {limit}, the context of {model_name} ({len(long)} of "
                    f"{len(job.prompt_ids)} prompts do not fit, the longest {longest} tokens); use "
                    + ", or ".join(fixes))


def _batches(job: _Job) -> list[list[_Item]]:
    """Items in benchmark order (a problem's samples together), cut into batches: the same on every rank."""
    items = [_Item(p, s) for p in range(len(job.problems)) for s in range(job.config.num_samples)]
    size = job.config.batch_size
    return [items[i:i + size] for i in range(0, len(items), size)]


def batch_seed(seed: int, first_key: str) -> int:
    """A generator seed from the run's seed and the batch's first item (stable under resume and sharding)."""
    digest = hashlib.sha256(f"{seed}/{first_key}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _pad_id(model) -> int:
    tokenizer = model.tokenizer
    for value in (getattr(model, "pad_token_id", None), tokenizer.pad_token_id, tokenizer.eos_token_id):
        if value is not None:
            return int(value)
    return 0  # padded positions are masked out, so any valid id will do


def model_device(model) -> torch.device:
    """Where the model's weights live (CPU for a model without parameters)."""
    device = getattr(model, "device", None)
    if isinstance(device, torch.device):
        return device
    parameter = next(iter(getattr(model, "parameters", lambda: iter(()))()), None)
    return parameter.device if parameter is not None else torch.device("cpu")


def _completion(tokenizer, answer: list[int], stop_ids, stop_strings) -> str:
    """Answer tokens up to the first stop id, decoded without special tokens, cut at the stop strings."""
    if stop_ids:
        cut = next((i for i, t in enumerate(answer) if t in stop_ids), len(answer))
        answer = answer[:cut]
    return truncate_at_stop(tokenizer.decode(answer, skip_special_tokens=True), stop_strings)


def _decode_batch(job: _Job, items: list[_Item], index: int, rank: int) -> list[dict]:
    """Generate, decode and score one batch; its rows for samples.jsonl."""
    config, model = job.config, job.model
    device = model_device(model)
    seed = batch_seed(config.seed, job.key(items[0]))
    answers, out = _generate_batch(job, items, seed, device)
    lengths = (answer_lengths(answers, job.stop_ids) if job.stop_ids else
               torch.full((len(items),), answers.shape[1])).tolist()
    completions = [_completion(model.tokenizer, row, job.stop_ids, job.task.stop) for row in answers.tolist()]
    problems = [job.problems[i.problem] for i in items]
    scores = job.task.score_many(problems, completions)
    batch = {"id": f"{job.run_token}-r{rank}-b{index}", "rows": len(items), "seed": seed, "exact": out.exact,
             "stats": out.stats.to_dict()}
    return [
        {"id": p["id"], "sample": item.sample, "prompt": job.prompts[item.problem], "completion": completion,
         **{k: v for k, v in score.items() if k != "id"}, "new_tokens": int(length), "batch": batch}
        for item, p, completion, score, length in zip(items, problems, completions, scores, lengths)
    ]


# ------------------------------------------------------------------ models that cannot pad


def group_by_length(index: Sequence[int], lengths: Sequence[int]) -> list[list[int]]:
    """``index`` split into groups of equal ``lengths[i]``, in order of first appearance (order kept inside)."""
    groups: dict[int, list[int]] = {}
    for i in index:
        groups.setdefault(lengths[i], []).append(i)
    return list(groups.values())


def padding_problem(model, rows: Sequence[Sequence[int]]) -> str | None:
    """Why these prompts cannot be left padded for ``model``; None when it pads or all have one length."""
    if accepts_attention_mask(model) or len({len(r) for r in rows}) < 2:
        return None
    return padding_refusal(model)


def _say_unpadded(job: _Job) -> None:
    problem = padding_problem(job.model, job.prompt_ids)
    if problem is not None and int(os.environ.get("RANK", 0)) == 0:
        print(f"dllm eval: {problem}: decoding each batch in groups of equal prompt length", file=sys.stderr)


def _generate_batch(job: _Job, items: list[_Item], seed: int, device) -> tuple[torch.Tensor, Any]:
    """One batch's answers [B, max_new_tokens] (in item order) and its GenerateOutput (stats summed over calls).

    A model that pads gets the batch in one left-padded call. One that cannot gets one call per group of
    equal prompt length, so no padding is needed. The first group starts with the batch's first item and uses
    the batch's seed (a batch of equal lengths decodes exactly as with padding); each further group is seeded
    from its own first item like a batch, so resumed and sharded runs replay the same noise. At T=0 every row
    equals its padded result (generate is batch-invariant there); at T > 0 a row depends on its call's mates.
    """
    config, model = job.config, job.model
    rows = [job.prompt_ids[i.problem] for i in items]
    groups = ([list(range(len(items)))] if accepts_attention_mask(model) else
              group_by_length(range(len(items)), [len(r) for r in rows]))
    answers, outputs = [None] * len(items), []
    for n, group in enumerate(groups):
        input_ids, mask = left_pad([rows[i] for i in group], _pad_id(model), device)
        group_seed = seed if n == 0 else batch_seed(config.seed, job.key(items[group[0]]))
        generator = torch.Generator(device=device).manual_seed(group_seed)
        with torch.inference_mode():  # samplers never need gradients; project models do not switch them off
            out = dllm.generate(model, input_ids, sampler=config.sampler, max_new_tokens=config.max_new_tokens,
                                temperature=config.temperature, generator=generator, attention_mask=mask,
                                **job.options)
        for i, answer in zip(group, out.sequences[:, input_ids.shape[1]:]):
            answers[i] = answer
        outputs.append(out)
    if len(outputs) > 1:
        outputs[0] = replace(outputs[0], stats=functools.reduce(operator.add, (o.stats for o in outputs)),
                             exact=all(o.exact for o in outputs))
    return torch.stack(answers), outputs[0]


def _decode_all(job: _Job, todo: list[tuple[int, list[_Item]]], path: Path, rank: int) -> None:
    """Decode this rank's unfinished batches, appending each to `path` as it completes."""
    from tqdm.auto import tqdm

    total = sum(len(items) for _, items in todo)
    desc = job.config.task if rank == 0 else f"{job.config.task} [rank {rank}]"
    finished = correct = tokens = 0
    seconds = 0.0
    with tqdm(total=total, desc=desc, disable=not job.config.progress, dynamic_ncols=True, position=rank) as bar:
        for index, items in todo:
            rows = _decode_batch(job, items, index, rank)
            _append_rows(path, rows)
            stats = rows[0]["batch"]["stats"]
            finished += len(rows)
            correct += sum(bool(r["correct"]) for r in rows)
            tokens, seconds = tokens + stats["new_tokens"], seconds + stats["wall_time_s"]
            bar.update(len(rows))
            bar.set_postfix(acc=f"{correct / finished:.3f}", tok_s=f"{tokens / max(seconds, 1e-9):.1f}")


def run(config: EvalConfig) -> dict | None:
    """Evaluate; returns the summary on rank 0 (None on other ranks)."""
    task = _build_task(config)
    model_name = config.model or default_model(config.sampler)
    model = _load_model(config, model_name)
    problems, prompts, prompt_ids = _encode(config, model, task)
    config = default_max_new(config, model, prompt_ids, model_name)
    options, resolved = _sampler_options(config, model)
    job = _Job(config, model, task, problems, prompts, prompt_ids, options, resolve(model))  # generate's stop ids
    truncated = _fit_context(job, model_name)
    _say_unpadded(job)
    batches = _batches(job)
    ranks = _Ranks()
    try:
        folder = Path(config.output)
        attempt = _environment(config, model, ranks.world, sum(map(len, batches)))
        if config.truncate is not None:
            attempt["prompts_truncated"] = truncated
        error = _prepare_folder(folder, _identity(config, model_name, resolved), attempt) if ranks.rank == 0 else None
        error = ranks.broadcast(error)
        if error is not None:
            raise EvalError(error)
        if ranks.rank == 0:
            for note in _resume_notes(folder, job, batches):
                print(f"dllm eval: {note}", file=sys.stderr)
        done = {_key(r) for r in load_samples(folder / SAMPLES_FILE)}
        todo = [(b, [i for i in items if job.key(i) not in done]) for b, items in enumerate(batches)
                if b % ranks.world == ranks.rank]
        path = folder / (SAMPLES_FILE if ranks.world == 1 else f"shard-{ranks.rank}.jsonl")
        _decode_all(job, [(b, items) for b, items in todo if items], path, ranks.rank)
        ranks.broadcast(None)  # every rank's shard is complete before rank 0 merges
        return _finish(folder) if ranks.rank == 0 else None
    finally:
        ranks.close()


if __name__ == "__main__":
    sys.exit(main())
