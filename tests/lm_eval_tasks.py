"""Tiny lm-eval tasks over a local JSONL file (lm-eval's `json` loader), for the backend's tests."""

import json
from pathlib import Path


def jsonl_dataset(folder: Path, rows: list[dict]) -> str:
    """Write ``rows`` to folder/data.jsonl; return the task YAML lines that read it as the test split."""
    data = folder / "data.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"


def write_task(folder: Path, file: str, task: str, dataset: str, output_type: str, rest: str) -> None:
    """folder/<file>.yaml: task ``task`` over ``dataset`` (YAML lines), of ``output_type``, then the ``rest``."""
    (folder / f"{file}.yaml").write_text(f"task: {task}\n{dataset}output_type: {output_type}\n{rest}")
