"""MBPP (Austin et al. 2021): short Python tasks checked by three asserts.

Plain prompts are the paper's 3-shot format, with task_ids 2, 3, 4 as the examples:
"You are an expert Python programmer, and here is your task: {text} Your code should pass these
tests:\\n\\n{tests}\\n[BEGIN]\\n{code}\\n[DONE]"; generation stops at `[DONE]`. Problems are the test
split, task_ids 11-510. `subset="full"` reads the original file (text / code / test_list /
test_setup_code), `subset="sanitized"` the hand-verified one (prompt / code / test_imports /
test_list; 257 test problems). The program is the test imports, the solution and the setup code; the
test imports and asserts run apart in the sandbox's launcher, calling into it (`dllm.eval.sandbox`).

Reference solutions that fail their own tests: none in the full test split; see tests/test_eval_code.py.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import cached_property

from dllm.eval.answers import extract_code_block, truncate_at_stop
from dllm.eval.data import HubSource, load_records
from dllm.eval.tasks.base import CodeTask, Message, user_message

__all__ = ["MBPP"]

FEWSHOT_IDS = (2, 3, 4)
TEST_IDS = range(11, 511)
FILES = {"full": "mbpp.jsonl", "sanitized": "mbpp_sanitized.jsonl"}
HUB_REPO = "google-research-datasets/mbpp"
FIELDS = ("task_id", ("text", "prompt"), "code", "test_list")  # full: text; sanitized: prompt


def _normalize_record(record: dict) -> dict:
    """One MBPP record in a common shape, whichever file it came from (field names differ)."""
    return {
        **record,
        "id": f"mbpp/{record['task_id']}",
        "text": record.get("text") or record["prompt"],
        "code": record["code"].replace("\r\n", "\n"),
        "test_setup_code": record.get("test_setup_code", "").replace("\r\n", "\n"),
        "test_imports": list(record.get("test_imports", [])),
    }


def _task_text(problem: dict) -> str:
    """The task statement followed by its tests, as the paper's prompt phrases it."""
    tests = "\n".join(problem["test_list"])
    return (
        f"You are an expert Python programmer, and here is your task: {problem['text']} "
        f"Your code should pass these tests:\n\n{tests}"
    )


class MBPP(CodeTask):
    """MBPP test split (task_ids 11-510), full or sanitized."""

    name = "mbpp"
    plain_stop = ("[DONE]",)
    subsets = tuple(FILES)

    def __init__(
        self,
        *,
        subset: str = "full",
        num_fewshot: int = 3,
        task_ids: Iterable[int] | None = TEST_IDS,
        **kwargs,
    ) -> None:
        if subset not in FILES:
            raise ValueError(f"subset must be one of {sorted(FILES)}, got {subset!r}")
        if not 0 <= num_fewshot <= len(FEWSHOT_IDS):
            raise ValueError(f"num_fewshot must be in 0..{len(FEWSHOT_IDS)}, got {num_fewshot}")
        super().__init__(**kwargs)
        self.subset = subset
        self.num_fewshot = num_fewshot
        self.task_ids = None if task_ids is None else set(task_ids)

    @cached_property
    def _records(self) -> dict[int, dict]:
        """All records of the source by task_id (the hub's prompt split supplies the examples)."""
        hub = [HubSource(HUB_REPO, self.subset, split) for split in ("prompt", "test")]
        records = load_records(FILES[self.subset], hub, self.data_file, FIELDS)
        return {int(r["task_id"]): _normalize_record(r) for r in records}

    def _load(self) -> list[dict]:
        ids = sorted(i for i in self._records if self.task_ids is None or i in self.task_ids)
        return [self._records[i] for i in ids]

    @property
    def fewshot_examples(self) -> list[dict]:
        """The prompt's solved examples (task_ids 2, 3, 4, as in the paper)."""
        wanted = FEWSHOT_IDS[: self.num_fewshot]
        missing = [i for i in wanted if i not in self._records]
        if missing:
            raise ValueError(f"few-shot task_ids {missing} are not in the data; pass num_fewshot=0")
        return [self._records[i] for i in wanted]

    def _plain_prompt(self, problem: dict) -> str:
        shots = [f"{_task_text(s)}\n[BEGIN]\n{s['code']}\n[DONE]\n\n" for s in self.fewshot_examples]
        return "".join(shots) + f"{_task_text(problem)}\n[BEGIN]\n"

    def _chat_prompt(self, problem: dict) -> list[Message]:
        return user_message(f"{_task_text(problem)}\n\nReply with your solution in one ```python code block.")

    def solution(self, problem: dict, completion: str) -> str:
        """The fenced block when there is one, else the completion cut at `[DONE]`."""
        block = extract_code_block(completion)
        if block is not None:
            return block
        code = truncate_at_stop(completion, self.plain_stop).strip("\n")
        return code.removeprefix("[BEGIN]").strip("\n")

    def program(self, problem: dict, solution: str) -> str:
        """Test imports, solution, then the setup code (it may use the solution's classes)."""
        parts = [*problem["test_imports"], solution, problem["test_setup_code"]]
        return "\n".join(part for part in parts if part) + "\n"

    def tests(self, problem: dict) -> str:
        """Test imports, then the asserts (the setup code's objects are the program's, passed by name)."""
        return "\n".join(part for part in [*problem["test_imports"], *problem["test_list"]] if part) + "\n"
