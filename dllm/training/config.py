"""Training settings: a small TOML file mapped onto frozen dataclasses, validated with messages naming the key.

A file has three tables (see ``configs/*.toml``)::

    [model]   TransformerConfig fields (layout, dim, n_layers, ...); vocab_size and the special token ids
              come from the tokenizer and may not be set here
    [data]    problem preset, tokenizer, answer region length
    [train]   seed, steps, batch sizes, optimizer, schedule, evaluation and checkpoint cadence
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dllm.data.synthetic import PRESETS
from dllm.models.transformer import TransformerConfig
from dllm.training.batches import BLOCK_ANCHORS

FROM_TOKENIZER = ("vocab_size", "mask_token_id", "eos_token_id", "pad_token_id")
PRECISIONS = ("bf16", "fp32")


@dataclass(frozen=True)
class DataConfig:
    """Where examples come from and how an answer region is laid out (see ``dllm.training.batches``)."""

    preset: str = "default"  # a key of dllm.data.synthetic.PRESETS
    tokenizer: str = "runs/tokenizer.json"  # trained from the synthetic stream if the file does not exist
    tokenizer_vocab_size: int = 512  # upper bound for BPE (it saturates below ~500 on this corpus)
    tokenizer_corpus: int = 20_000  # synthetic problems the tokenizer is trained on
    answer_length: int = 80  # bidirectional layout: the fixed answer region (answer + EOS padding)

    def __post_init__(self) -> None:
        _one_of("data.preset", self.preset, sorted(PRESETS))
        _typed("data.tokenizer", self.tokenizer, str)
        for name in ("tokenizer_vocab_size", "tokenizer_corpus", "answer_length"):
            _positive_int(f"data.{name}", getattr(self, name))


@dataclass(frozen=True)
class OptimConfig:
    """The training loop: AdamW with linear warmup then cosine decay to ``min_lr_ratio * lr``."""

    seed: int = 0
    steps: int = 1000
    batch_size: int = 64  # problems per optimizer step over all processes
    micro_batch_size: int = 16  # rows per forward (length-sorted, so padding stays small)
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping
    precision: str = "bf16"  # bf16: torch.autocast on CPU with float32 master weights
    log_every: int = 10
    eval_every: int = 200  # held-out loss every N steps (and at the end); 0: only at the end
    eval_problems: int = 64  # held-out problems for the loss
    eval_accuracy_problems: int = 0  # held-out problems decoded greedily at each eval (0: skip)
    checkpoint_every: int = 100
    init_from: str = ""  # a saved model folder whose weights start the run (e.g. a diffusion model from AR)
    suffix_mask_prob: float = 0.0  # diffusion: share of blocks masked as a suffix (left-to-right states)
    block_anchor: str = "answer"  # block_causal: blocks start at the answer, or "absolute" (position 0, as SDAR)

    def __post_init__(self) -> None:
        _typed("train.seed", self.seed, int)
        _typed("train.init_from", self.init_from, str)
        for name in ("steps", "batch_size", "micro_batch_size", "log_every", "eval_problems", "checkpoint_every"):
            _positive_int(f"train.{name}", getattr(self, name))
        for name in ("warmup_steps", "eval_every", "eval_accuracy_problems"):
            _non_negative_int(f"train.{name}", getattr(self, name))
        _in_range("train.lr", self.lr, 0.0, math.inf, low_open=True)
        _in_range("train.min_lr_ratio", self.min_lr_ratio, 0.0, 1.0)
        _in_range("train.suffix_mask_prob", self.suffix_mask_prob, 0.0, 1.0)
        _in_range("train.weight_decay", self.weight_decay, 0.0, math.inf)
        _in_range("train.beta1", self.beta1, 0.0, 1.0, high_open=True)
        _in_range("train.beta2", self.beta2, 0.0, 1.0, high_open=True)
        _in_range("train.grad_clip", self.grad_clip, 0.0, math.inf)
        _one_of("train.precision", self.precision, PRECISIONS)
        _one_of("train.block_anchor", self.block_anchor, BLOCK_ANCHORS)


@dataclass(frozen=True)
class RunConfig:
    """A whole training run: model architecture (sans tokenizer-given fields), data and loop settings."""

    model: dict[str, Any] = field(default_factory=dict)
    data: DataConfig = field(default_factory=DataConfig)
    train: OptimConfig = field(default_factory=OptimConfig)

    def __post_init__(self) -> None:
        given = sorted(set(self.model) & set(FROM_TOKENIZER))
        if given:
            raise ValueError(f"model keys {given} come from the tokenizer; remove them from [model]")
        self.model_config(vocab_size=8, mask_token_id=2, eos_token_id=1, pad_token_id=0)  # validate now
        if self.train.block_anchor != "answer" and self.layout != "block_causal":
            raise ValueError(f"train.block_anchor={self.train.block_anchor!r} is for [model] layout='block_causal', "
                             f"got layout={self.layout!r}")

    @property
    def layout(self) -> str:
        return self.model.get("layout", "causal")

    def model_config(self, vocab_size: int, mask_token_id: int, eos_token_id: int, pad_token_id: int
                     ) -> TransformerConfig:
        """The TransformerConfig of this run once the tokenizer's size and special ids are known."""
        fields = [f.name for f in dataclasses.fields(TransformerConfig) if f.name not in FROM_TOKENIZER]
        unknown = sorted(set(self.model) - set(fields))
        if unknown:
            raise ValueError(f"unknown [model] keys {unknown}; allowed keys: {fields}")
        ids = dict(vocab_size=vocab_size, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                   mask_token_id=None if self.layout == "causal" else mask_token_id)
        try:
            return TransformerConfig(**self.model, **ids)
        except ValueError as exc:
            raise ValueError(f"[model]: {exc}") from None

    def to_dict(self) -> dict[str, Any]:
        return {"model": dict(self.model), "data": dataclasses.asdict(self.data),
                "train": dataclasses.asdict(self.train)}


def config_from_dict(values: dict[str, Any]) -> RunConfig:
    """Build a RunConfig from parsed TOML, rejecting unknown tables and keys by name."""
    tables = {"model": None, "data": DataConfig, "train": OptimConfig}
    unknown = sorted(set(values) - set(tables))
    if unknown:
        raise ValueError(f"unknown config tables {unknown}; allowed tables: {sorted(tables)}")
    sections = {}
    for name, cls in tables.items():
        table = values.get(name, {})
        if not isinstance(table, dict):
            raise ValueError(f"[{name}] must be a table, got {type(table).__name__}")
        if cls is None:
            sections[name] = dict(table)
            continue
        allowed = [f.name for f in dataclasses.fields(cls)]
        bad = sorted(set(table) - set(allowed))
        if bad:
            raise ValueError(f"unknown [{name}] keys {bad}; allowed keys: {allowed}")
        sections[name] = cls(**table)
    return RunConfig(**sections)


def load_config(path: str | Path, overrides: dict[str, dict[str, Any]] | None = None) -> RunConfig:
    """Read a TOML file (plus ``{table: {key: value}}`` overrides) into a validated RunConfig."""
    with open(path, "rb") as f:
        values = tomllib.load(f)
    for table, entries in (overrides or {}).items():
        values.setdefault(table, {}).update(entries)
    return config_from_dict(values)


def _typed(name: str, value: Any, kind: type) -> None:
    if isinstance(value, bool) or not isinstance(value, kind):
        raise ValueError(f"{name} must be {kind.__name__}, got {value!r}")


def _positive_int(name: str, value: Any) -> None:
    _typed(name, value, int)
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value!r}")


def _non_negative_int(name: str, value: Any) -> None:
    _typed(name, value, int)
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")


def _one_of(name: str, value: Any, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}")


def _in_range(name: str, value: Any, low: float, high: float, *, low_open=False, high_open=False) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if value < low or value > high or (low_open and value == low) or (high_open and value == high):
        interval = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
        raise ValueError(f"{name} must lie in {interval}, got {value!r}")
