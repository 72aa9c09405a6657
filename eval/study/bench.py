"""``dllm bench``: AR and diffusion samplers side by side on the same prompts, timed in one run.

    dllm bench --output runs/bench                       # the default study on the shipped models
    dllm bench --config "name=fef w4;model=diffusion;sampler=fef;window=4" --config "name=ar;model=ar;sampler=ar"
    dllm bench --config-file configs/bench_fef.toml --prompts synthetic --num-prompts 32
    dllm bench --cost-model --results runs/bench/results.json --output runs/bench   # see dllm.eval.study.cost_model

A configuration is ``key=value`` pairs separated by ``;`` (or a ``[[run]]`` table in a TOML file):
``name``, ``model`` (an alias: ``ar``, ``diffusion``, ``drafter``, ``two_stream``, ``ar_diffusion_drafter``
are the shipped models, ``--model ALIAS=PATH`` adds or replaces one; or a folder), ``sampler``, and
optionally ``temperature`` (default
``--temperature``) and ``tokens_per_step`` (llada/dream: steps = max_new_tokens / tokens_per_step). Every
other key is a sampler option (``dllm.samplers.SAMPLERS``); ar_spec's ``drafter`` is ``ngram`` or a model.
Diffusion samplers default ``block_length`` to the model's ``block_size`` (so the exact block cache applies).

Timing. Every configuration decodes the same prompts in the same batches (sorted by length, left padded)
with the same seeds. One untimed pass per configuration records counters, model-call shapes and
completions and warms up; ``--warmup`` - 1 more untimed passes follow; then ``--repeats`` timed passes,
round-robin over configurations with a rotating start, so drift on a shared machine hits all of them
alike. A pass is the sum over batches of wall time around ``generate`` (device synchronised before and
after on GPUs). Reported: medians and min/max over repeats, and speedups as the median of per-repeat
ratios to the baseline measured in the same repeat (absolute times drift; ratios measured together hold).
A clocked pass per configuration (untimed, after its recorded pass) adds up the wall time inside the target's
and the drafter's model calls (``dllm.counting.ModelClock``, the device synchronised around each call):
``model_share`` (target, draft) and ``non_model_share``, the rest of the pass (draft heads' steps, the
verification rule, the round's bookkeeping and Python), the share a faster round can still cut.
The recorded pass also keeps, for every draft the verification tested (fef, ar_spec), the target's entropy
there and whether the draft was accepted (``dllm.stats.EntropyAcceptance``): results.json's
``acceptance_vs_entropy`` (linear fit, bins), a table in results.md and ``acceptance_entropy.png``; and it
counts the device-to-host synchronisations of its ``generate`` calls (``dllm.syncs``; on a CPU, those the run
would make on a GPU; the recording callback's own are left out): ``syncs_per_step`` is their number divided by
the loop's steps (``DecodeStats.steps``), with ``syncs_by_op``.
Interrupted (Ctrl-C or SIGTERM, e.g. from ``timeout``) after at least one full repeat, the study still
writes its results from the repeats every configuration completed, marks them ``interrupted`` and exits
with status 130.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import operator
import os
import platform
import signal
import statistics
import sys
import threading
import time
import tomllib
from collections import Counter
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch

import dllm
from dllm.cli import UserError, check_device
from dllm.counting import Call, CountingModel, ModelClock
from dllm.defaults import DTYPE, DTYPES, TEMPERATURE, resolve_dtype
from dllm.eval.runner import group_by_length, padding_problem, parse_value
from dllm.eval.study import cost_model
from dllm.eval.study.bench_report import markdown, print_table, write_plots
from dllm.models.loading import shipped_or_path
from dllm.numerics import synchronize
from dllm.samplers import SAMPLERS, typed_options
from dllm.stats import EntropyAcceptance
from dllm.syncs import SyncCount, count_syncs

SHIPPED = Path(dllm.__file__).resolve().parent / "weights"
DEFAULT_MODELS = {name: str(SHIPPED / name) for name in ("ar", "diffusion", "drafter", "two_stream",
                                                         "ar_diffusion_drafter")}
HARNESS_KEYS = ("name", "model", "sampler", "temperature", "tokens_per_step")

# Every sampler family on the shipped models; all greedy except where a temperature is given.
DEFAULT_STUDY = (
    "name=ar greedy;model=ar;sampler=ar",
    "name=ar sampled T1;model=ar;sampler=ar;temperature=1",
    "name=ar_spec drafter-ar k4;model=ar;sampler=ar_spec;drafter=drafter;num_draft_tokens=4",
    "name=ar_spec drafter-diffusion k4;model=ar;sampler=ar_spec;drafter=diffusion;num_draft_tokens=4",
    "name=ar_spec ngram k4;model=ar;sampler=ar_spec;drafter=ngram;num_draft_tokens=4",
    "name=sequential;model=diffusion;sampler=sequential",
    "name=sequential no-cache;model=diffusion;sampler=sequential;cache=none",
    "name=llada 1/step;model=diffusion;sampler=llada;tokens_per_step=1",
    "name=llada 2/step;model=diffusion;sampler=llada;tokens_per_step=2",
    "name=llada 4/step;model=diffusion;sampler=llada;tokens_per_step=4",
    "name=fast_dllm t0.9;model=diffusion;sampler=fast_dllm;threshold=0.9",
    "name=eb g0.01;model=diffusion;sampler=eb;gamma=0.01",
    "name=fef w2;model=diffusion;sampler=fef;window=2",
    "name=fef w4;model=diffusion;sampler=fef;window=4",
    "name=fef w8;model=diffusion;sampler=fef;window=8",
    "name=fef w4 no-cache;model=diffusion;sampler=fef;window=4;cache=none",
    "name=fef w4 stale;model=diffusion;sampler=fef;window=4;draft=stale",
    "name=fef w4 structured;model=diffusion;sampler=fef;window=4;verifier=structured",
    "name=fef w4 T1;model=diffusion;sampler=fef;window=4;temperature=1",
)


# --------------------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunConfig:
    """One configuration of the study: a model, a sampler and its options (validated on construction)."""

    name: str
    model: str
    sampler: str
    options: dict[str, Any] = field(default_factory=dict)
    temperature: float | None = None  # None: the study's temperature
    tokens_per_step: int | None = None  # llada/dream: steps = max_new_tokens / tokens_per_step

    def __post_init__(self):
        for key in ("name", "model"):
            if not isinstance(getattr(self, key), str) or not getattr(self, key).strip():
                raise ValueError(f"configuration {key} must be a non-empty string, got {getattr(self, key)!r}")
        if self.sampler not in SAMPLERS:
            raise ValueError(f"configuration {self.name!r}: sampler must be one of {sorted(SAMPLERS)}, "
                             f"got {self.sampler!r}")
        allowed = SAMPLERS[self.sampler].options
        unknown = sorted(set(self.options) - set(allowed))
        if unknown:
            raise ValueError(f"configuration {self.name!r}: unknown option(s) {unknown} for sampler "
                             f"{self.sampler!r}; allowed: {sorted(allowed) + list(HARNESS_KEYS)}")
        if self.temperature is not None and not _is_number(self.temperature, minimum=0):
            raise ValueError(f"configuration {self.name!r}: temperature must be a number >= 0, "
                             f"got {self.temperature!r}")
        self._check_tokens_per_step(allowed)

    def _check_tokens_per_step(self, allowed) -> None:
        if self.tokens_per_step is None:
            return
        if "steps" not in allowed or "steps" in self.options:
            raise ValueError(f"configuration {self.name!r}: tokens_per_step is for llada/dream without steps=")
        if isinstance(self.tokens_per_step, bool) or not isinstance(self.tokens_per_step, int) \
                or self.tokens_per_step < 1:
            raise ValueError(f"configuration {self.name!r}: tokens_per_step must be an int >= 1, "
                             f"got {self.tokens_per_step!r}")

    @classmethod
    def from_mapping(cls, values: dict[str, Any]) -> RunConfig:
        """Harness keys (name, model, sampler, temperature, tokens_per_step) plus sampler options."""
        missing = [key for key in ("name", "model", "sampler") if key not in values]
        if missing:
            raise ValueError(f"configuration {dict(values)} lacks {missing}")
        harness = {key: _harness_value(key, values[key]) for key in HARNESS_KEYS if key in values}
        options = {k: v for k, v in values.items() if k not in HARNESS_KEYS}
        if values["sampler"] in SAMPLERS:  # text (a --config string, a quoted TOML value) by the option's kind
            try:
                options = typed_options(values["sampler"], options)
            except ValueError as error:
                raise ValueError(f"configuration {values['name']!r}: {error}") from None
        return cls(**harness, options=options)

    @property
    def drafter(self) -> str | None:
        """The drafter model's name (ar_spec with a model drafter), else None."""
        drafter = self.options.get("drafter")
        return drafter if isinstance(drafter, str) and drafter not in ("ngram", "head") else None


def _harness_value(key: str, value: Any) -> Any:
    """A harness key's value; text (from --config) read as the key's type."""
    if not isinstance(value, str) or key not in ("temperature", "tokens_per_step"):
        return value
    try:
        return float(value) if key == "temperature" else int(value)
    except ValueError:
        raise ValueError(f"{key} expects {'a number' if key == 'temperature' else 'an int'}, got {value!r}") from None


def parse_config(text: str) -> RunConfig:
    """``"name=fef w4;model=diffusion;sampler=fef;window=4"`` -> RunConfig (values typed like TOML scalars)."""
    values = {}
    for item in filter(None, (part.strip() for part in text.split(";"))):
        if "=" not in item:
            raise ValueError(f"--config items are key=value separated by ';', got {item!r} in {text!r}")
        key, value = (s.strip() for s in item.split("=", 1))
        values[key] = value
    return RunConfig.from_mapping(values)


def _is_number(value, minimum: float) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value) and value >= minimum


@dataclass(frozen=True)
class Settings:
    """What the study runs on and how it is timed (CLI flags over a TOML file's [study] over these)."""

    prompts: str = "synthetic"  # a task name (dllm.eval.TASKS), a .jsonl/.json file, or "random"
    data_file: str | None = None  # the task's data (e.g. a local gsm8k_test.jsonl)
    task_options: dict[str, Any] = field(default_factory=dict)  # get_task keyword arguments
    num_prompts: int = 16
    max_new_tokens: int = 64
    batch_size: int = 8
    repeats: int = 3
    warmup: int = 1
    temperature: float = TEMPERATURE
    seed: int = 0
    prompt_length: int = 32  # "random" prompts only
    baseline: str | None = None  # default: "ar greedy" if present, else the first configuration
    dtype: str = DTYPE  # auto: bf16 on GPUs and CPUs with native bf16, float32 elsewhere (dllm.defaults)
    device: str = "auto"
    threads: int | None = None
    output: str = "runs/bench"

    def __post_init__(self):
        for name, minimum in (("num_prompts", 1), ("max_new_tokens", 1), ("batch_size", 1), ("repeats", 1),
                              ("warmup", 1), ("prompt_length", 1), ("seed", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
        if not _is_number(self.temperature, minimum=0):
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {list(DTYPES)}, got {self.dtype!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return resolve_dtype(self.dtype, self.torch_device)

    @property
    def torch_device(self) -> torch.device:
        return torch.device(("cuda" if torch.cuda.is_available() else "cpu") if self.device == "auto" else self.device)


def read_config_file(path: str | Path) -> tuple[dict[str, Any], dict[str, str], list[RunConfig]]:
    """A TOML study file -> ([study] settings, [models] aliases, [[run]] configurations)."""
    data = tomllib.loads(Path(path).read_text())
    unknown = sorted(set(data) - {"study", "models", "run"})
    if unknown:
        raise ValueError(f"{path}: unknown tables {unknown}; allowed: [study], [models], [[run]]")
    study = data.get("study", {})
    known = {f.name for f in fields(Settings)}
    if set(study) - known:
        raise ValueError(f"{path}: unknown [study] keys {sorted(set(study) - known)}; allowed: {sorted(known)}")
    models = {str(k): str(v) for k, v in data.get("models", {}).items()}
    return study, models, [RunConfig.from_mapping(run) for run in data.get("run", [])]


# --------------------------------------------------------------------------------------------------------
# Models and prompts
# --------------------------------------------------------------------------------------------------------


class ModelStore:
    """Loads each model once; a name is an alias (``--model``, [models], the shipped ones) or a folder, and an
    alias's value a folder or a shipped model's bare name (``--model mine=drafter``)."""

    def __init__(self, aliases: dict[str, str], device: torch.device, dtype: torch.dtype, tokenizer=None):
        self.aliases, self.device, self.dtype = aliases, device, dtype
        self.loaded: dict[str, Any] = {}
        self.tokenizer = tokenizer

    def path(self, name: str) -> Path:
        return shipped_or_path(self.aliases.get(name, name))

    def get(self, name: str):
        if name not in self.loaded:
            path = self.path(name)
            if not path.is_dir():
                hint = " (shipped models not there yet? pass --model ALIAS=PATH)" if name in self.aliases else ""
                raise FileNotFoundError(f"model {name!r}: no folder at {path}{hint}")
            model = dllm.load(path, device=self.device, dtype=self.dtype)
            self.loaded[name] = model.eval() if hasattr(model, "eval") else model
            if self.tokenizer is None:
                self.tokenizer = getattr(model, "tokenizer", None)
        return self.loaded[name]


@dataclass
class Prompts:
    """Token ids of every prompt, plus the task and problems when the prompts can be scored."""

    source: str
    ids: list[list[int]]
    task: Any = None
    problems: list[dict] | None = None


def load_prompts(settings: Settings, tokenizer, vocab_size: int, avoid: set[int]) -> Prompts:
    """The study's prompts: a task's problems, a JSONL file's, or random token ids."""
    n, source = settings.num_prompts, settings.prompts
    if source == "random":  # no tokenizer needed: for models without one, and for pure speed runs
        generator = torch.Generator().manual_seed(settings.seed)
        allowed = torch.tensor([t for t in range(vocab_size) if t not in avoid])
        picks = torch.randint(len(allowed), (n, settings.prompt_length), generator=generator)
        return Prompts(source, allowed[picks].tolist())
    if tokenizer is None:
        raise ValueError(f"prompts {source!r} are text but no model has a tokenizer; pass --tokenizer PATH "
                         "or --prompts random")
    from dllm.eval import get_task
    from dllm.eval.data import read_records

    task = problems = None
    if source.endswith((".jsonl", ".json")):
        records = read_records(source)[:n]
        if all("prompt" in r for r in records):
            texts = [r["prompt"] for r in records]
        else:  # question/answer records: scored like the synthetic set (GSM8K format)
            task = get_task("synthetic", data_file=source)
    else:
        task = get_task(source, **({"data_file": settings.data_file} if settings.data_file else {}),
                        **settings.task_options)
    if task is not None:
        problems = task.load(limit=n)
        texts = [task.prompt(p, chat=False) for p in problems]
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    return Prompts(source, ids, task, problems)


@dataclass(frozen=True)
class Batch:
    """Prompts decoded together: their indices, left-padded ids [B, P] and padding mask (None if none)."""

    index: list[int]
    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None


def make_batches(ids: list[list[int]], batch_size: int, pad_id: int, device, pad: bool = True) -> list[Batch]:
    """Batches of similar-length prompts (sorted by length, so little padding), left padded.

    ``pad=False`` (a model of the study cannot honour padding): batches never mix lengths, so none is padded.
    """
    order = sorted(range(len(ids)), key=lambda i: (len(ids[i]), i))
    runs = [order] if pad else group_by_length(order, [len(p) for p in ids])
    batches = []
    for index in (run[start : start + batch_size] for run in runs for start in range(0, len(run), batch_size)):
        width = max(len(ids[i]) for i in index)
        rows = [[pad_id] * (width - len(ids[i])) + list(ids[i]) for i in index]
        mask = torch.tensor([[0] * (width - len(ids[i])) + [1] * len(ids[i]) for i in index], device=device)
        batches.append(Batch(index, torch.tensor(rows, device=device), None if bool(mask.all()) else mask))
    return batches


# --------------------------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------------------------


@dataclass
class Prepared:
    """A configuration bound to its loaded model(s) and generate options (validated before any timing)."""

    config: RunConfig
    model: Any
    options: dict[str, Any]
    temperature: float


def prepare(config: RunConfig, store: ModelStore, settings: Settings) -> Prepared:
    model = store.get(config.model)
    spec = SAMPLERS[config.sampler]
    declared = spec.preferred(model, config.options).get("drafter")
    if isinstance(declared, str) and declared not in ("ngram", "head"):
        # the model's measured default drafter by name (its sampler_defaults.json): loaded by the study like a
        # named one, so its calls are counted and clocked as the drafter's
        config = replace(config, options={**config.options, "drafter": declared})
    options = dict(config.options)
    if config.drafter is not None:
        options["drafter"] = store.get(config.drafter)
    if config.tokens_per_step is not None:
        if settings.max_new_tokens % config.tokens_per_step:
            raise ValueError(f"configuration {config.name!r}: tokens_per_step={config.tokens_per_step} must "
                             f"divide max_new_tokens={settings.max_new_tokens}")
        options["steps"] = settings.max_new_tokens // config.tokens_per_step
    size = getattr(model, "block_size", None)
    if "block_length" in spec.options and "block_length" not in options and size \
            and settings.max_new_tokens % size == 0:
        options["block_length"] = size  # the model's blocks: the exact block cache applies
    try:
        spec.resolve(options, model=model, max_new_tokens=settings.max_new_tokens)
    except (TypeError, ValueError) as error:
        raise ValueError(f"configuration {config.name!r}: {error}") from error
    temperature = settings.temperature if config.temperature is None else config.temperature
    return Prepared(config, model, options, temperature)


class CallLog:
    """What the recording pass records: shapes of every model call ((role, rows, new tokens, cached
    context) -> count) and each tested draft's acceptance against the target's entropy."""

    def __init__(self):
        self.counts: Counter = Counter()
        self.drafts = EntropyAcceptance()
        self.syncs: Counter = Counter()  # synchronising op -> count, over the recorded generate calls
        self.steps = 0  # their loop steps (DecodeStats.steps)
        self.counting: SyncCount | None = None  # the counter of the generate call running now
        self.clocked: tuple[float, dict[bool, float]] | None = None  # the clocked pass: (seconds, in model calls)

    def observe(self, event) -> None:
        """The recording callback: each tested draft's entropy, whose reads are the bench's, not the decode's."""
        with self.counting.paused() if self.counting is not None else contextlib.nullcontext():
            self.drafts(event)

    def count(self, syncs: SyncCount, steps: int) -> None:
        self.syncs.update(syncs.by_op)
        self.steps += steps
        self.counting = None

    @property
    def syncs_per_step(self) -> float | None:
        return sum(self.syncs.values()) / self.steps if self.steps else None

    def record(self, call: Call) -> None:
        self.counts[("draft" if call.draft else "target", call.rows, call.tokens, call.context)] += 1

    def to_list(self) -> list[dict]:
        return [{"role": r, "rows": n, "tokens": t, "context": c, "count": k}
                for (r, n, t, c), k in sorted(self.counts.items())]


def run_pass(run: Prepared, batches: list[Batch], settings: Settings, log: CallLog | None = None, on_batch=None,
             clock: ModelClock | None = None):
    """Decode every batch once -> (seconds summed over the generate calls, outputs).

    Batch i is seeded with seed + i for every configuration and repeat: the same noise everywhere.
    ``on_batch()`` is called after each batch, outside the timed region (progress bars). ``clock``: the time
    inside model calls is added up there (the clocked pass).
    """
    model, options = run.model, dict(run.options)
    if clock is not None:
        model = CountingModel(model, lambda call: None, clock=clock)
        if "drafter" in options and not isinstance(options["drafter"], str):
            options["drafter"] = CountingModel(options["drafter"], lambda call: None, draft=True, clock=clock)
    if log is not None:
        model = CountingModel(model, log.record)
        if run.config.sampler != "native":  # the checkpoint's own loop takes no callback (and verifies nothing)
            options["callback"] = log.observe
        if "drafter" in options and not isinstance(options["drafter"], str):
            options["drafter"] = CountingModel(options["drafter"], log.record, draft=True)
    seconds, outputs = 0.0, []
    for i, batch in enumerate(batches):
        generator = torch.Generator(device=batch.input_ids.device).manual_seed(settings.seed + i)
        synchronize(batch.input_ids.device)
        start = time.perf_counter()
        with torch.inference_mode(), contextlib.ExitStack() as counted:
            if log is not None:  # the recorded pass only: counting slows every torch call
                log.counting = counted.enter_context(count_syncs(as_gpu=batch.input_ids.device.type == "cpu"))
            out = dllm.generate(model, batch.input_ids, sampler=run.config.sampler,
                                max_new_tokens=settings.max_new_tokens, temperature=run.temperature,
                                generator=generator, attention_mask=batch.attention_mask, **options)
        synchronize(batch.input_ids.device)
        seconds += time.perf_counter() - start
        if log is not None:
            log.count(log.counting, out.stats.steps)
        outputs.append(out)
        if on_batch is not None:
            on_batch()
    return seconds, outputs


def progress_bar(total: int, desc: str):
    """Progress over the batches of a pass: a tqdm bar on a terminal (gone when done), else log lines."""
    if sys.stderr.isatty():
        from tqdm.auto import tqdm

        return tqdm(total=total, desc=desc, leave=False, dynamic_ncols=True, file=sys.stderr)
    return LogProgress(total, desc)


class LogProgress:
    """Progress for logs (``gpu_study.sh`` tees them): one line at most every ``interval`` seconds.

    tqdm's carriage returns would fill a log file; a silent long configuration looks hung.
    """

    def __init__(self, total: int, desc: str, interval: float = 30.0, out=None):
        self.total, self.desc, self.interval, self.out = total, desc.strip(), interval, out or sys.stderr
        self.done, self.postfix, self.last = 0, "", time.monotonic()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def set_postfix_str(self, text: str) -> None:
        self.postfix = text

    def update(self, n: int = 1) -> None:
        self.done += n
        if time.monotonic() - self.last >= self.interval and self.done < self.total:
            self.last = time.monotonic()
            at = f" ({self.postfix})" if self.postfix else ""
            print(f"  {self.desc}{at}: batch {self.done}/{self.total}", file=self.out, flush=True)


def time_study(runs: list[Prepared], batches: list[Batch], settings: Settings, progress=print, bar=progress_bar):
    """Recorded pass, warm-up passes, then timed repeats round-robin -> (profiles, seconds per repeat).

    ``bar(total, desc)`` shows progress batch by batch within each configuration's pass (see progress_bar).
    """
    profiles = {}
    for run in runs:
        log = CallLog()
        with bar(len(batches), f"  recording {run.config.name}") as shown:
            seconds, outputs = run_pass(run, batches, settings, log, on_batch=shown.update)
        profiles[run.config.name] = (outputs, log)
        progress(f"  recorded {run.config.name} ({seconds:.2f} s)")
        clock = ModelClock()
        with bar(len(batches), f"  clocking {run.config.name}") as shown:
            seconds, _ = run_pass(run, batches, settings, on_batch=shown.update, clock=clock)
        log.clocked = (seconds, dict(clock.seconds))
    for _ in range(settings.warmup - 1):
        list(_passes(runs, batches, settings, bar, "  warm-up"))
    times: dict[str, list[float]] = {run.config.name: [] for run in runs}
    try:
        for repeat in range(settings.repeats):
            shift = repeat % len(runs)  # rotate the start so no configuration always runs first or last
            order = runs[shift:] + runs[:shift]
            for run, seconds in zip(order, _passes(order, batches, settings, bar,
                                                   f"  repeat {repeat + 1}/{settings.repeats}")):
                times[run.config.name].append(seconds)
            progress(f"  repeat {repeat + 1}/{settings.repeats} done")
    except KeyboardInterrupt:  # also SIGTERM, see run_study: keep the repeats every configuration finished
        done = min(len(t) for t in times.values())
        if done == 0:
            raise
        progress(f"  interrupted: reporting the {done} repeat(s) every configuration completed")
        times = {name: t[:done] for name, t in times.items()}
    return profiles, times


def _passes(runs: list[Prepared], batches: list[Batch], settings: Settings, bar, desc: str):
    """One pass per configuration, in order, under one bar; yields each pass's timed seconds."""
    with bar(len(runs) * len(batches), desc) as shown:
        for run in runs:
            shown.set_postfix_str(run.config.name)
            yield run_pass(run, batches, settings, on_batch=shown.update)[0]


# --------------------------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------------------------


def completions(batches: list[Batch], outputs, tokenizer, stop_ids: set[int]) -> list[str | None]:
    """Each prompt's answer, cut at its first stop token and decoded (None without a tokenizer)."""
    texts: list[str | None] = [None] * sum(len(b.index) for b in batches)
    if tokenizer is None:
        return texts
    for batch, out in zip(batches, outputs):
        for i, row in zip(batch.index, out.sequences[:, batch.input_ids.shape[1] :].tolist()):
            cut = next((k for k, t in enumerate(row) if t in stop_ids), len(row))
            texts[i] = tokenizer.decode(row[:cut], skip_special_tokens=True)
    return texts


def summarize(run: Prepared, outputs, log: CallLog, seconds: list[float], texts, prompts: Prompts) -> dict:
    """One configuration's entry of results.json (speedups are added by ``add_speedups``)."""
    stats = functools.reduce(operator.add, (out.stats for out in outputs))
    tokens, samples = max(stats.new_tokens, 1), len(texts)
    median = statistics.median(seconds)
    scores = None
    if prompts.task is not None and texts[0] is not None:
        scores = [prompts.task.score(p, t)["correct"] for p, t in zip(prompts.problems, texts)]
    options = {**outputs[0].options, **({"drafter": run.config.drafter} if run.config.drafter else {})}
    drafter = run.options.get("drafter")
    needs = {"target": cost_model.needs(run.model, "target", outputs[0].options),  # what the call shapes assume
             "draft": cost_model.needs(drafter, "draft", {}) if run.config.drafter else None}
    return {
        "name": run.config.name, "model": run.config.model, "drafter": run.config.drafter,
        "sampler": run.config.sampler, "options": _jsonable(options), "temperature": run.temperature,
        "exact": all(out.exact for out in outputs),
        "tokens_per_s": tokens / median, "tokens_per_s_min": tokens / max(seconds),
        "tokens_per_s_max": tokens / min(seconds),
        "s_per_token": median / tokens, "s_per_token_min": min(seconds) / tokens,
        "s_per_token_max": max(seconds) / tokens, "relative_spread": (max(seconds) - min(seconds)) / median,
        "s_per_sample": median / samples, "times_s": seconds,
        "num_samples": samples, "new_tokens": stats.new_tokens,
        "nfe": stats.nfe, "nfe_draft": stats.nfe_draft, "row_calls": stats.row_calls,
        "forward_tokens": stats.forward_tokens, "forward_tokens_draft": stats.forward_tokens_draft,
        "forward_tokens_per_token": stats.forward_tokens / tokens,
        "forward_tokens_draft_per_token": stats.forward_tokens_draft / tokens,
        "tokens_per_call": stats.tokens_per_call, "tokens_per_row_call": stats.tokens_per_row_call,
        "mean_acceptance_length": stats.mean_acceptance_length, "tokens_per_draft_round": stats.tokens_per_draft_round,
        "acceptance_rate": stats.acceptance_rate,
        "acceptance_per_position": stats.acceptance_per_position,
        "accuracy": None if scores is None else sum(scores) / len(scores),
        "num_scored": 0 if scores is None else len(scores),
        "examples": texts[:2], "call_shapes": log.to_list(), "needs": needs,
        "acceptance_vs_entropy": log.drafts.fit() if log.drafts.entropy else None,
        "syncs_per_step": log.syncs_per_step, "syncs_by_op": dict(log.syncs.most_common()),
        **_shares(log.clocked),
    }


def _shares(clocked: tuple[float, dict[bool, float]] | None) -> dict:
    """The clocked pass's split of wall time: inside the target's and the drafter's calls, and the rest."""
    if clocked is None or clocked[0] <= 0:
        return {"model_share": None, "non_model_share": None}
    seconds, inside = clocked
    target, draft = inside[False] / seconds, inside[True] / seconds
    return {"model_share": {"target": target, "draft": draft}, "non_model_share": max(0.0, 1.0 - target - draft)}


def _jsonable(options: dict) -> dict:
    return {k: v if isinstance(v, str | int | float | bool | type(None)) else str(v) for k, v in options.items()}


def add_speedups(runs: list[dict], baseline: str) -> None:
    """Speedup over the baseline: the median of per-repeat tokens/s ratios (each pair timed in one repeat)."""
    base = next(r for r in runs if r["name"] == baseline)
    for run in runs:
        ratios = [(run["new_tokens"] / t) / (base["new_tokens"] / b) for t, b in zip(run["times_s"], base["times_s"])]
        run.update(speedup=statistics.median(ratios), speedup_min=min(ratios), speedup_max=max(ratios))


def environment(settings: Settings) -> dict:
    device = settings.torch_device
    return {
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "python": platform.python_version(), "cpu_count": os.cpu_count(), "device": str(device),
                    "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"},
        "dtype": str(settings.torch_dtype).removeprefix("torch."), "torch_version": torch.__version__,
        "threads": torch.get_num_threads(),
    }


# --------------------------------------------------------------------------------------------------------
# The study and the command line
# --------------------------------------------------------------------------------------------------------


def run_study(configs: list[RunConfig], settings: Settings, aliases: dict[str, str], tokenizer=None) -> dict:
    """Run the study, write results.json, results.md and plots to ``settings.output``; return the results."""
    threads = torch.get_num_threads()
    torch.set_num_threads(settings.threads or threads)
    try:
        with _sigterm_as_interrupt():  # `timeout` and schedulers stop runs with SIGTERM: still write results
            return _study(configs, settings, aliases, tokenizer)
    finally:
        torch.set_num_threads(threads)  # callers (tests, notebooks) keep their own setting


@contextlib.contextmanager
def _sigterm_as_interrupt():
    """Turn SIGTERM into KeyboardInterrupt while the study runs (main thread only; restored after)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _study(configs: list[RunConfig], settings: Settings, aliases: dict[str, str], tokenizer) -> dict:
    names = [c.name for c in configs]
    if len(set(names)) != len(names):
        raise ValueError(f"configuration names must be unique, got {names}")
    baseline = settings.baseline or ("ar greedy" if "ar greedy" in names else names[0])
    if baseline not in names:
        raise ValueError(f"baseline {baseline!r} is not a configuration name; names: {names}")
    device = settings.torch_device
    store = ModelStore(aliases, device, settings.torch_dtype, tokenizer)
    runs = [prepare(c, store, settings) for c in configs]
    models = list(store.loaded.values())
    prompts = load_prompts(settings, store.tokenizer, min(m.vocab_size for m in models), _special_ids(models))
    _check_lengths(prompts, models, settings)
    problems = list(dict.fromkeys(filter(None, (padding_problem(m, prompts.ids) for m in models))))
    for problem in problems:  # every configuration gets the same batches, so they stay comparable
        print(f"dllm bench: {problem}: every configuration decodes batches of equal prompt length")
    batches = make_batches(prompts.ids, settings.batch_size, _pad_id(store.tokenizer, models), device,
                           pad=not problems)
    print(f"{len(runs)} configurations x {len(prompts.ids)} prompts ({prompts.source}) on {device}, "
          f"{str(settings.torch_dtype).removeprefix('torch.')}, {torch.get_num_threads()} threads")
    if settings.baseline is None and baseline != "ar greedy":  # a choice made for the user: said, not silent
        print(f"dllm bench: speedups are relative to {baseline!r}, the first configuration (no --baseline given, and "
              "no configuration named 'ar greedy')", file=sys.stderr)
    profiles, times = time_study(runs, batches, settings)
    repeats_done = min(len(t) for t in times.values()) if times else 0
    stops = _special_ids(models, masks=False) | {getattr(store.tokenizer, "eos_token_id", None)}
    entries = []
    for run in runs:
        outputs, log = profiles[run.config.name]
        texts = completions(batches, outputs, store.tokenizer, stops - {None})
        entries.append(summarize(run, outputs, log, times[run.config.name], texts, prompts))
    add_speedups(entries, baseline)
    results = {
        "schema_version": 1, "created": time.strftime("%Y-%m-%dT%H:%M:%S"), **environment(settings),
        "settings": asdict(settings), "baseline": baseline,
        "models": {name: str(store.path(name)) for name in store.loaded},
        "prompts": {"source": prompts.source, "count": len(prompts.ids), "scored": prompts.task is not None,
                    "mean_length": statistics.fmean(len(p) for p in prompts.ids)},
        "timing": "median over repeats of the summed wall time of generate calls; warm-up, the recorded and the "
                  "clocked pass excluded; configurations interleaved round-robin; speedup = median per-repeat ratio; "
                  "model_share and non_model_share from the clocked pass",
        "repeats_completed": repeats_done, "interrupted": repeats_done < settings.repeats,
        "runs": entries,
    }
    _write(results, Path(settings.output))
    return results


def _special_ids(models, masks: bool = True) -> set[int]:
    """Stop ids of every model, plus mask and pad ids (kept out of random prompts)."""
    ids = set()
    for model in models:
        names = ("eos_token_id", "pad_token_id", "mask_token_id") if masks else ("eos_token_id",)
        for name in names:
            value = getattr(model, name, None)
            ids |= set(value) if isinstance(value, list | tuple) else {value}
        ids |= set(getattr(model, "stop_token_ids", None) or ())
    return ids - {None}


def _pad_id(tokenizer, models) -> int:
    """Any id works under the attention mask; the tokenizer's or a model's pad id keeps traces readable."""
    pad = getattr(tokenizer, "pad_token_id", None)
    return pad if pad is not None else next((m.pad_token_id for m in models if getattr(m, "pad_token_id", None)), 0)


def _check_lengths(prompts: Prompts, models, settings: Settings) -> None:
    """Fail before timing when the longest prompt plus the answer (and drafts) exceeds a model's context."""
    longest = max(len(p) for p in prompts.ids) + settings.max_new_tokens  # ar_spec reads no further than ar
    for model in models:
        limit = getattr(getattr(model, "config", None), "max_seq_len", None)
        if isinstance(limit, int) and longest > limit:
            raise ValueError(f"prompts up to {longest - settings.max_new_tokens} tokens + max_new_tokens "
                             f"{settings.max_new_tokens} exceed a model's max_seq_len {limit}; "
                             "lower --max-new-tokens or use shorter prompts")


def _write(results: dict, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    results["plots"] = write_plots(results["runs"], folder)
    (folder / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (folder / "results.md").write_text(markdown(results))
    print_table(results["runs"])
    print(f"wrote {folder / 'results.json'}, results.md and {len(results['plots'])} plots")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dllm bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", action="append", default=[], metavar="SPEC",
                        help='a configuration, e.g. "name=fef w4;model=diffusion;sampler=fef;window=4" (repeatable)')
    parser.add_argument("--config-file", help="TOML file with [study], [models] and [[run]] tables")
    parser.add_argument("--model", action="append", default=[], metavar="ALIAS=PATH",
                        help="model alias: a folder or a shipped model's name (ar, diffusion, drafter, two_stream, "
                        "ar_diffusion_drafter are also aliases of the shipped models)")
    parser.add_argument("--tokenizer", help="tokenizer.json to use instead of the models' own")
    parser.add_argument("--prompts", help="task name (synthetic, gsm8k, ...), a .jsonl file, or 'random'")
    parser.add_argument("--data-file", help="the task's data file")
    parser.add_argument("--task-option", action="append", default=[], metavar="KEY=VALUE",
                        help="task keyword argument, e.g. num_fewshot=0")
    defaults = Settings()
    for name, kind in (("num-prompts", int), ("max-new-tokens", int), ("batch-size", int), ("repeats", int),
                       ("warmup", int), ("temperature", float), ("seed", int), ("prompt-length", int),
                       ("threads", int)):
        default = getattr(defaults, name.replace("-", "_"))
        parser.add_argument(f"--{name}", type=kind,
                            help=f"default: {'torch default' if default is None else default}")
    parser.add_argument("--baseline", help="configuration the speedups are relative to (default: 'ar greedy' when "
                        "there is one, else the first configuration, said on stderr)")
    parser.add_argument("--dtype", help="auto (default: bfloat16 on GPUs and CPUs with native bf16, else float32), "
                        "float32, bfloat16 or float16")
    parser.add_argument("--device", help="auto (default), cpu or cuda")
    parser.add_argument("--output", help="output folder (default runs/bench)")
    cost_model.add_arguments(parser.add_argument_group("cost model (--cost-model)"))
    return parser


def _pairs(items: list[str], flag: str) -> dict[str, str]:
    if any("=" not in item for item in items):
        raise UserError(f"{flag} expects KEY=VALUE, got {items}")
    return dict(item.split("=", 1) for item in items)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.cost_model:
        return cost_model.main(args)
    study, file_models, configs = read_config_file(args.config_file) if args.config_file else ({}, {}, [])
    configs += [parse_config(text) for text in args.config]
    configs = configs or [parse_config(text) for text in DEFAULT_STUDY]
    flags = {f.name: getattr(args, f.name) for f in fields(Settings) if getattr(args, f.name, None) is not None}
    task_options = {k: parse_value(v) for k, v in _pairs(args.task_option, "--task-option").items()}
    settings = Settings(**{**study, **flags, **({"task_options": task_options} if task_options else {})})
    check_device(settings.device)  # before any model loads
    aliases = {**DEFAULT_MODELS, **file_models, **_pairs(args.model, "--model")}
    tokenizer = None
    if args.tokenizer:
        from dllm.data.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(args.tokenizer)
    results = run_study(configs, settings, aliases, tokenizer)
    return 130 if results["interrupted"] else 0  # partial results are written, but the run did not finish


if __name__ == "__main__":
    sys.exit(main())
