"""Synthetic arithmetic: a held-out set in GSM8K's format, shipped as package data.

The file is `dllm/data/synthetic_test.jsonl` (fields `question`, `answer` with a final `#### N` line;
an `id` field is used when present). Prompts are zero-shot `format_qa_prompt` text, the same function
the training code uses to format its data; scoring is GSM8K's.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from dllm.eval.data import read_records
from dllm.eval.tasks.gsm8k import FIELDS, GSM8K, qa_problems

__all__ = ["Synthetic", "synthetic_data_path"]


def synthetic_data_path():
    """Location of the packaged synthetic test set (it may not exist in a given checkout)."""
    return resources.files("dllm") / "data" / "synthetic_test.jsonl"


class Synthetic(GSM8K):
    """The synthetic arithmetic test set: GSM8K's prompts without few-shot examples, and its scoring."""

    name = "synthetic"

    def __init__(self, *, chat: bool = False, data_file: str | None = None) -> None:
        super().__init__(num_fewshot=0, chat=chat, data_file=data_file)

    def _load(self) -> list[dict]:
        path = Path(self.data_file) if self.data_file else synthetic_data_path()
        if not path.is_file():
            raise FileNotFoundError(f"synthetic test set not found at {path}; pass data_file=")
        return qa_problems(read_records(path, FIELDS), self.name)
