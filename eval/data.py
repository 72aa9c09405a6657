"""Benchmark data: one resolution rule for every task.

Order: an explicit `data_file` (JSONL or a JSON array), else the file of the task's name in the folder
named by the environment variable `DLLM_DATA_DIR` (names as in the project's shared/data folder:
gsm8k_test.jsonl, math500_test.jsonl, humaneval.jsonl, ...), else the Hugging Face hub through
`datasets.load_dataset` (imported only then, since it is slow to import and needs a connection).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["DATA_DIR_ENV", "HubSource", "load_records", "read_records"]

logger = logging.getLogger(__name__)

DATA_DIR_ENV = "DLLM_DATA_DIR"


@dataclass(frozen=True)
class HubSource:
    """A split of a Hugging Face hub dataset (`load_dataset(path, name, split=split)`)."""

    path: str
    name: str | None = None
    split: str = "test"


def read_records(path: str | os.PathLike) -> list[dict]:
    """Read a JSONL file, or a JSON file holding one array of objects."""
    text = Path(path).read_text(encoding="utf-8")
    if text.lstrip().startswith("["):
        records = json.loads(text)
    else:
        records = [json.loads(line) for line in text.splitlines() if line.strip()]
    if not all(isinstance(record, dict) for record in records):
        raise ValueError(f"{path}: expected JSON objects, one per line or in one array")
    return records


def _load_hub(sources: Sequence[HubSource]) -> list[dict]:
    """Concatenate the rows of hub splits (several for datasets split into per-subject configs)."""
    from datasets import load_dataset

    records: list[dict] = []
    for source in sources:
        dataset = load_dataset(source.path, source.name, split=source.split)
        records.extend(dict(row) for row in dataset)
    return records


def load_records(
    filename: str,
    hub: HubSource | Sequence[HubSource],
    data_file: str | os.PathLike | None = None,
) -> list[dict]:
    """Records of one benchmark file: `data_file` > `$DLLM_DATA_DIR/filename` > the hub source(s)."""
    if data_file is not None:
        return read_records(data_file)
    data_dir = os.environ.get(DATA_DIR_ENV)
    if data_dir:
        path = Path(data_dir) / filename
        if path.is_file():
            return read_records(path)
        logger.warning("%s is set but has no %s; loading from the hub", DATA_DIR_ENV, filename)
    return _load_hub([hub] if isinstance(hub, HubSource) else list(hub))
