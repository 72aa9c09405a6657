"""Optional mixing of real GSM8K *training* problems into the synthetic stream.

GSM8K test must never reach training: a file whose name contains "test", or a Hugging Face split
that mentions "test", is refused with ``ValueError`` before anything is read.
"""

import json
import random
from collections.abc import Iterator, Sequence
from pathlib import Path

from dllm.data.synthetic import PRESETS, ProblemConfig, training_stream


def _refuse_test(label: str, value: str) -> None:
    if "test" in value.lower():
        raise ValueError(f"refusing GSM8K {label} {value!r}: test data must never be used for training; "
                         "pass the train file or split")


def load_gsm8k_train(path: str | Path | None = None, split: str = "train") -> list[dict[str, str]]:
    """GSM8K training records ``{"question", "answer"}`` from a local JSONL, or the hub if ``path`` is None.

    The hub source is ``datasets.load_dataset("openai/gsm8k", "main", split=split)`` (needs a network).
    """
    if path is not None:
        _refuse_test("file", Path(path).name)
        with open(path, encoding="utf-8") as f:
            records = [json.loads(line) for line in f if line.strip()]
    else:
        _refuse_test("split", split)
        import datasets  # imported here: heavy, and only this path needs it

        records = list(datasets.load_dataset("openai/gsm8k", "main", split=split))
    return [{"question": r["question"], "answer": r["answer"]} for r in records]


def mixed_stream(seed: int, gsm8k: Sequence[dict[str, str]], gsm8k_fraction: float,
                 config: ProblemConfig = PRESETS["default"]) -> Iterator[dict[str, str]]:
    """Infinite stream: a uniformly drawn GSM8K record with probability ``gsm8k_fraction``, else synthetic.

    Deterministic given ``seed``; the mixing draws use their own RNG so the synthetic part is exactly
    ``training_stream(seed, config)`` in order.
    """
    if not 0.0 <= gsm8k_fraction <= 1.0:
        raise ValueError(f"gsm8k_fraction must be in [0, 1], got {gsm8k_fraction}")
    if gsm8k_fraction > 0 and not gsm8k:
        raise ValueError("gsm8k_fraction > 0 needs at least one GSM8K record")
    rng = random.Random(f"gsm8k-mix:{seed}")
    synthetic = training_stream(seed, config)
    while True:
        yield rng.choice(gsm8k) if rng.random() < gsm8k_fraction else next(synthetic)
