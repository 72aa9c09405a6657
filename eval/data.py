"""Benchmark data: one resolution rule for every task, and records checked for the fields they need.

Order: an explicit `data_file` (JSONL or a JSON array), else the file of the task's name in the folder
named by the environment variable `DLLM_DATA_DIR` (names as in the project's shared/data folder:
gsm8k_test.jsonl, math500_test.jsonl, humaneval.jsonl, ...), else the Hugging Face hub through
`datasets.load_dataset` (imported only then, since it is slow to import and needs a connection).
Problems with the data raise `DataError` naming the file, the line and what is wrong, and a hub that
cannot be reached says how to use local files instead.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["DATA_DIR_ENV", "DataError", "Fields", "HubSource", "check_fields", "load_records", "read_records"]

logger = logging.getLogger(__name__)

DATA_DIR_ENV = "DLLM_DATA_DIR"

# Required fields: each entry a field name, or a tuple of alternatives of which one must be present.
Fields = Sequence[str | tuple[str, ...]]


class DataError(ValueError):
    """Benchmark data that cannot be read or lacks what the task needs (the message says where)."""


@dataclass(frozen=True)
class HubSource:
    """A split of a Hugging Face hub dataset (`load_dataset(path, name, split=split)`)."""

    path: str
    name: str | None = None
    split: str = "test"

    def __str__(self) -> str:
        return f"{self.path}" + (f" ({self.name})" if self.name else "") + f", split {self.split}"


def read_records(path: str | os.PathLike, required: Fields = ()) -> list[dict]:
    """Read a JSONL file, or a JSON file holding one array of objects, each with the `required` fields."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data file {path} does not exist" if not path.exists() else
                                f"data file {path} is not a file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise DataError(f"{path}: not UTF-8 text ({error})") from None
    if text.lstrip().startswith("["):
        try:
            records = json.loads(text)
        except json.JSONDecodeError as error:
            raise DataError(f"{path}, line {error.lineno}: not valid JSON ({error.msg})") from None
        places = [f"record {i + 1}" for i in range(len(records))]
    else:
        records, places = [], []
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as error:
                raise DataError(f"{path}, line {number}: not valid JSON ({error.msg}); expected one JSON "
                                "object per line, or one JSON array") from None
            places.append(f"line {number}")
    for record, place in zip(records, places):
        if not isinstance(record, dict):
            raise DataError(f"{path}, {place}: expected a JSON object, got {type(record).__name__}")
    check_fields(records, required, str(path), places)
    return records


def check_fields(records: Sequence[dict], required: Fields, source: str, places: Sequence[str] | None = None) -> None:
    """Raise DataError naming the source, the record's place and the first required field it lacks."""
    for index, record in enumerate(records):
        for needed in required:
            options = (needed,) if isinstance(needed, str) else tuple(needed)
            if not any(name in record for name in options):
                place = places[index] if places is not None else f"record {index + 1}"
                wanted = " or ".join(repr(name) for name in options)
                names = ", ".join(" or ".join((n,) if isinstance(n, str) else n) for n in required)
                raise DataError(f"{source}, {place}: missing field {wanted} (records need: {names}; "
                                f"this one has: {', '.join(record) or 'no fields'})")


def _load_hub(sources: Sequence[HubSource]) -> list[dict]:
    """Concatenate the rows of hub splits (several for datasets split into per-subject configs)."""
    from datasets import load_dataset

    from dllm.models.loading import check_hub_reachable

    for path in dict.fromkeys(source.path for source in sources):  # one request each, not datasets' five retries
        check_hub_reachable(path, {}, repo_type="dataset", filename="README.md")
    records: list[dict] = []
    for source in sources:
        dataset = load_dataset(source.path, source.name, split=source.split)
        records.extend(dict(row) for row in dataset)
    return records


def load_records(
    filename: str,
    hub: HubSource | Sequence[HubSource],
    data_file: str | os.PathLike | None = None,
    required: Fields = (),
    local_help: str | None = None,
) -> list[dict]:
    """Records of one benchmark file: `data_file` > `$DLLM_DATA_DIR/filename` > the hub source(s).

    `local_help` replaces the default advice, when the hub cannot be reached, on how to read local data.
    """
    if data_file is not None:
        return read_records(data_file, required)
    data_dir = os.environ.get(DATA_DIR_ENV)
    if data_dir:
        path = Path(data_dir) / filename
        if path.is_file():
            return read_records(path, required)
        logger.warning("%s is set but has no %s; loading from the hub", DATA_DIR_ENV, filename)
    sources = [hub] if isinstance(hub, HubSource) else list(hub)
    try:
        records = _load_hub(sources)
    # Offline mode, no connection, a missing repository or an unknown config all leave the user with the
    # same way out (local files), whichever of datasets', huggingface_hub's or httpx's exceptions it is.
    except Exception as error:
        where = f"{DATA_DIR_ENV}={data_dir} has no {filename}" if data_dir else f"{DATA_DIR_ENV} is not set"
        advice = local_help or (f"pass the file as --data-file FILE (Python: data_file=), or set {DATA_DIR_ENV} "
                                f"to a folder holding {filename}")
        raise DataError(f"cannot load {'; '.join(map(str, sources))} from the Hugging Face hub "
                        f"({type(error).__name__}: {error}), and {where}. To use local data, {advice}") from None
    check_fields(records, required, "; ".join(map(str, sources)))
    return records
